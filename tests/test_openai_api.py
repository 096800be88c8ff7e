"""The OpenAI-compatible endpoint, driven by the official `openai` client.

Real components throughout: in-process daemons talking libp2p on 127.0.0.1, hypercorn
serving the endpoint on 127.0.0.1 (port 0) inside the phone's task group, and
llama-cpp-python decoding the generated tiny qwen35 GGUF. What an app relies on: it
lists the models (this node's, and `home/tiny` for the paired home that granted
task.infer), gets a completion whole or streamed with honest usage counts, gets a
tool call back as OpenAI `tool_calls` (grammar-constrained with tool_choice required
or named, so random weights still produce a valid call), gets the same from the
paired home by naming `home/tiny`, and gets OpenAI-shaped errors: 401 without the
key, 400 for a request we cannot take, 404 for a model nobody has, 403 when the home
did not grant inference. What a web page cannot do to it is tests/test_web_page.py.

The client is synchronous and runs on a worker thread (the endpoint shares the test's
trio loop). The tiny model has one token per character; one thread (see
test_agent_node.py for why).
"""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import openai
import pytest

from conftest import pair, run_nodes, serving_openai
from psymesh.agent.runtime.testmodel import tiny_model_path
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.core.home import NodeHome
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.tasks import TaskKind, TaskState
from waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
MODEL = {"n_ctx": 16384, "n_threads": 1}
KEY = "sk-test-psymesh-0123456789"
# ban_bytes keeps the random-weight model to ASCII, so every reply is valid UTF-8.
EXTRA = {"ban_bytes": True}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
ASK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]

T = TypeVar("T")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory.getbasetemp() / "models")


@asynccontextmanager
async def mesh(tmp_path: Path, tiny_model: Path, *, key: bool = True) -> AsyncIterator[dict[str, Node]]:
    """home (has tiny) and phone (has tiny, serves the endpoint), paired with the phone preset.
    `key`: KEY in a file of our own (api_key_file); else the key the phone made in its home."""
    key_file = None
    if key:
        key_file = tmp_path / "openai.key"
        key_file.write_text(KEY + "\n")
        key_file.chmod(0o600)
    serving_openai(tmp_path / "phone", "phone", "phone", key_file)
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        for node in nodes.values():
            node.models.registry.add("tiny", tiny_model, **MODEL)
        yield nodes


def client(node: Node, key: str | None = None) -> openai.OpenAI:
    """The official client with `key`, by default the endpoint's own."""
    assert node.openai is not None and node.openai.url is not None
    return openai.OpenAI(base_url=node.openai.url + "/v1", api_key=key or node.openai.key.value, max_retries=0,
                         timeout=120)


async def off_loop(fn: Callable[[], T]) -> T:
    """The synchronous client on a worker thread: the endpoint runs on this trio loop."""
    with anyio.fail_after(180):
        return await anyio.to_thread.run_sync(fn)


# --------------------------------------------------------------------------- this node's model


@pytest.mark.anyio
async def test_models_completion_and_stream_through_the_official_client(tmp_path: Path, tiny_model: Path) -> None:
    async with mesh(tmp_path, tiny_model) as nodes:
        api = client(nodes["phone"])
        models = await off_loop(lambda: [m.id for m in api.models.list()])
        one = await off_loop(lambda: api.models.retrieve("home/tiny"))

        def ask(**kw: Any) -> Any:
            return api.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, temperature=0, seed=7,
                                               extra_body=EXTRA, **kw)

        whole = await off_loop(ask)
        chunks = await off_loop(lambda: list(ask(stream=True, stream_options={"include_usage": True})))
        short = await off_loop(lambda: api.chat.completions.create(
            model="tiny", messages=ASK, max_completion_tokens=3, seed=7, extra_body=EXTRA))
        shaped = await off_loop(lambda: api.chat.completions.create(  # llama.cpp's `grammar` extension
            model="tiny", messages=ASK, max_tokens=40, seed=7, extra_body={"grammar": 'root ::= [a-c]{6} "."'}))

    assert models == ["tiny", "home/tiny"]  # ours, then the paired home's (its grant covers task.infer)
    assert one.id == "home/tiny" and one.owned_by == "home"

    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-") and whole.model == "tiny"
    assert choice.message.role == "assistant" and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 10 and 1 <= whole.usage.completion_tokens <= 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    # The stream: a role chunk, content deltas, the finish reason, the usage chunk; then [DONE].
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content  # same seed, greedy: the same reply, token for token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed

    assert short.usage.completion_tokens <= 3  # max_completion_tokens held
    assert re.fullmatch(r"[a-c]{6}\.", shaped.choices[0].message.content or "")
    assert short.choices[0].finish_reason in ("stop", "length")


@pytest.mark.anyio
async def test_tool_calls_come_back_as_openai_tool_calls(tmp_path: Path, tiny_model: Path) -> None:
    async with mesh(tmp_path, tiny_model) as nodes:
        api = client(nodes["phone"])

        def call(**kw: Any) -> Any:
            return api.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=400,
                                               seed=1, extra_body=EXTRA, **kw)

        required = await off_loop(lambda: call(tool_choice="required"))
        named = await off_loop(lambda: call(tool_choice={"type": "function", "function": {"name": "get_time"}}))
        chunks = await off_loop(lambda: list(call(tool_choice="required", stream=True)))
        # The app runs the tool and sends its result back: the conversation goes on.
        made = required.choices[0].message.tool_calls[0]
        follow_up = await off_loop(lambda: api.chat.completions.create(
            model="tiny", max_tokens=8, seed=1, extra_body=EXTRA, tools=[WEATHER, TIME], tool_choice="none",
            messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
                      {"role": "tool", "tool_call_id": made.id, "content": '{"temp_c": 18}'}]))

    for reply, names in ((required, {"get_weather", "get_time"}), (named, {"get_time"})):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        [tool_call] = choice.message.tool_calls
        assert tool_call.type == "function" and tool_call.id.startswith("call_")
        assert tool_call.function.name in names
        arguments = json.loads(tool_call.function.arguments)  # a JSON string, as OpenAI sends it
        assert arguments in ({"city": "Paris"}, {"city": "Oslo"}, {"zone": "UTC"}, {"zone": "CET"})
        assert reply.usage.completion_tokens > 0
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"

    deltas = [c.choices[0].delta for c in chunks]
    assert not any("<tool_call>" in (d.content or "") for d in deltas)  # the call's XML is not content
    [streamed_calls] = [d.tool_calls for d in deltas if d.tool_calls]
    assert streamed_calls[0].index == 0 and streamed_calls[0].function.name in ("get_weather", "get_time")
    json.loads(streamed_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    assert follow_up.choices[0].message.tool_calls is None  # tool_choice none: a plain answer
    assert follow_up.choices[0].finish_reason in ("stop", "length")


# --------------------------------------------------------------------------- a paired home's model


@pytest.mark.anyio
async def test_a_model_of_the_paired_home_by_name(tmp_path: Path, tiny_model: Path) -> None:
    async with mesh(tmp_path, tiny_model) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        phone.models.registry.remove("tiny")  # so nothing can run here by mistake
        api = client(phone)
        models = await off_loop(lambda: [m.id for m in api.models.list()])
        whole = await off_loop(lambda: api.chat.completions.create(
            model="home/tiny", messages=ASK, max_tokens=16, temperature=0, seed=3, extra_body=EXTRA))
        chunks = await off_loop(lambda: list(api.chat.completions.create(
            model="home/tiny", messages=ASK, max_tokens=16, temperature=0, seed=3, extra_body=EXTRA, stream=True)))
        tools = await off_loop(lambda: api.chat.completions.create(
            model="home/tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=400, seed=1, extra_body=EXTRA,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}))
        ran_there = home.executor.store.list(limit=10)

        # Home takes inference away: the phone no longer lists it, and a request is refused there.
        async with Client(home.home.path) as h:
            await h.grant("phone", ["tool:system.info"])

        def granted() -> bool:
            peer = phone.trust.resolve("home")
            return peer.received is not None and len(peer.received.capabilities) == 1

        await wait_until(granted, "the phone holds home's new grant")
        after = await off_loop(lambda: [m.id for m in api.models.list()])
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await off_loop(lambda: api.chat.completions.create(model="home/tiny", messages=ASK, max_tokens=4))
        with pytest.raises(openai.NotFoundError) as unknown:
            await off_loop(lambda: api.chat.completions.create(model="nowhere/tiny", messages=ASK, max_tokens=4))

    assert models == ["home/tiny"]
    assert whole.model == "home/tiny" and whole.choices[0].finish_reason in ("stop", "length")
    assert 1 <= whole.usage.completion_tokens <= 16 and whole.usage.prompt_tokens > 10
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content  # token events relayed as deltas, in order
    assert tools.choices[0].finish_reason == "tool_calls"
    assert tools.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert json.loads(tools.choices[0].message.tool_calls[0].function.arguments)["city"] in ("Paris", "Oslo")
    # Each ran on home as a delegated infer task the phone submitted.
    infer = [r for r in ran_there if r.kind is TaskKind.INFER]
    assert len(infer) == 3 and all(r.state is TaskState.COMPLETED and r.submitter == phone.identity.peer_id
                                   for r in infer)
    assert after == []
    assert refused.value.status_code == 403 and refused.value.body["code"] == "forbidden"
    assert unknown.value.status_code == 404 and unknown.value.body["code"] == "model_not_found"


@pytest.mark.anyio
async def test_a_grant_naming_models_by_pattern_lists_the_models_it_allows(tmp_path: Path, tiny_model: Path) -> None:
    """The README's grant, `-task.infer +task.infer:models=botpsy*`, allows no request that
    names no model; GET /v1/models still lists each model home offers that the pattern
    covers (issue 22: it listed none), and not the others."""
    async with mesh(tmp_path, tiny_model) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        phone.models.registry.remove("tiny")
        home.models.registry.add("other", tiny_model, **MODEL)
        async with Client(home.home.path) as h:
            await h.grant("phone", remove=["task.infer"], add=["task.infer:models=ti*"])

        def narrowed() -> bool:
            peer = phone.trust.resolve("home")
            return peer.received is not None and "task.infer:models=ti*" in peer.received.grants()

        await wait_until(narrowed, "the phone holds home's grant naming models")
        api = client(phone)
        models = await off_loop(lambda: [m.id for m in api.models.list()])
        one = await off_loop(lambda: api.models.retrieve("home/tiny"))
        with pytest.raises(openai.NotFoundError):
            await off_loop(lambda: api.models.retrieve("home/other"))
    assert models == ["home/tiny"]
    assert one.owned_by == "home"


# --------------------------------------------------------------------------- refusals


def _openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.anyio
async def test_a_wrong_or_missing_key_is_401(tmp_path: Path, tiny_model: Path) -> None:
    async with mesh(tmp_path, tiny_model) as nodes:
        phone = nodes["phone"]
        with pytest.raises(openai.AuthenticationError) as wrong:
            await off_loop(lambda: client(phone, "sk-wrong").models.list())
        assert phone.openai is not None and phone.openai.url is not None
        async with httpx.AsyncClient(base_url=phone.openai.url) as http:
            missing = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK})
            not_bearer = await http.get("/v1/models", headers={"Authorization": f"Basic {KEY}"})
            right = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})

    assert wrong.value.status_code == 401 and wrong.value.body["code"] == "invalid_api_key"
    assert _openai_error(missing, 401)["code"] == "invalid_api_key"
    assert _openai_error(not_bearer, 401)["type"] == "invalid_request_error"
    assert right.status_code == 200 and right.json()["object"] == "list"


@pytest.mark.anyio
async def test_bad_requests_get_openai_shaped_errors(tmp_path: Path, tiny_model: Path) -> None:
    bad_bodies: list[tuple[Any, str | None]] = [
        ({"messages": ASK}, "model"),
        ({"model": "tiny"}, "messages"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"model": "tiny", "messages": ASK, "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "messages": ASK, "temperature": "hot"}, "temperature"),
        ({"model": "tiny", "messages": ASK, "n": 2}, "n"),
        ({"model": "tiny", "messages": ASK, "logprobs": True}, "logprobs"),
        ({"model": "tiny", "messages": ASK, "response_format": {"type": "json_object"}}, "response_format"),
        ({"model": "tiny", "messages": ASK, "tools": [WEATHER],
          "tool_choice": {"type": "function", "function": {"name": "launch"}}}, None),
        ({"model": "tiny", "messages": ASK, "tool_choice": "required"}, None),
        ({"model": "tiny", "messages": ASK, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "array"}}}]}, None),
        ({"model": "tiny", "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
         "messages.2.tool_calls.0.function.arguments"),
        ([1, 2, 3], None),
    ]
    async with mesh(tmp_path, tiny_model, key=False) as nodes:
        phone = nodes["phone"]
        assert phone.openai is not None and phone.openai.url is not None
        auth = {"Authorization": f"Bearer {phone.openai.key.value}"}
        async with httpx.AsyncClient(base_url=phone.openai.url, timeout=60, headers=auth) as http:
            answers = [await http.post("/v1/chat/completions", json=body) for body, _ in bad_bodies]
            json_type = {"Content-Type": "application/json"}
            not_json = await http.post("/v1/chat/completions", content=b"{nope", headers=json_type)
            huge = await http.post("/v1/chat/completions", content=b"x" * (4 * 1024 * 1024 + 1), headers=json_type)
            no_model = await http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": ASK})
            no_route = await http.get("/v1/engines")
            wrong_method = await http.get("/v1/chat/completions")
            still_fine = await http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": ASK, "max_tokens": 2, **EXTRA})

    for (body, param), answer in zip(bad_bodies, answers):
        error = _openai_error(answer, 400)
        assert error["type"] == "invalid_request_error", body
        if param is not None:
            assert error["param"] == param, (body, error)
    assert _openai_error(not_json, 400)["code"] == "invalid_json"
    assert _openai_error(huge, 413)["code"] == "request_too_large"
    missing = _openai_error(no_model, 404)
    assert missing["code"] == "model_not_found" and missing["param"] == "model" and "tiny" in missing["message"]
    assert _openai_error(no_route, 404)["code"] == "not_found"
    _openai_error(wrong_method, 405)
    assert still_fine.status_code == 200  # the node kept serving through all of it


def test_an_endpoint_always_has_a_key_made_private_in_the_home(tmp_path: Path) -> None:
    """No key configured, not even on loopback or on a LAN bind: the node makes one,
    0600 in its home, and `serve openai --show-key` prints that same key."""
    home = NodeHome(tmp_path / "open")
    home.init()
    config = home.load_config()
    wide = config.serve.model_copy(update={"openai": config.serve.openai.model_copy(
        update={"enabled": True, "host": "0.0.0.0"})})
    node = Node(home, config.model_copy(update={"serve": wide}), environ={})  # built, never run: nothing binds
    assert node.openai is not None
    key_file = home.path / "openai.key"
    assert node.openai.key.source == str(key_file) and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert len(node.openai.key.value) >= 40 and node.openai.key.value not in repr(node.openai.key)
    shown = subprocess.run([sys.executable, "-m", "psymesh", "serve", "openai", "--home", str(home.path),
                            "--show-key", "--json"], cwd=REPO, capture_output=True, text=True, check=False,
                           env={k: v for k, v in os.environ.items() if k != "PSYMESH_OPENAI_API_KEY"})
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == {"key": node.openai.key.value, "source": str(key_file)}
    again = Node(home, config.model_copy(update={"serve": wide}), environ={})
    assert again.openai is not None and again.openai.key.value == node.openai.key.value  # made once


# --------------------------------------------------------------------------- the command and the example


@pytest.mark.anyio
async def test_serve_openai_command_and_the_example_client(tmp_path: Path, tiny_model: Path) -> None:
    """`psymesh serve openai` runs a node with the endpoint (the URL in its log), its key
    from the environment (not on its command line, which every local user can read), and
    examples/openai_client.py, the official client pointed at it, gets answers."""
    home = tmp_path / "desk"
    done = subprocess.run([sys.executable, "-m", "psymesh", "model", "add", "tiny", str(tiny_model), "--home",
                           str(home), "--ctx", str(MODEL["n_ctx"]), "--threads", "1"],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "psymesh", "serve", "openai", "--home", str(home),
                                 "--port", "0"], env={**os.environ, "PSYMESH_OPENAI_API_KEY": KEY},
                                cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    try:
        found: list[str] = []

        def listening() -> bool:
            found[:] = re.findall(r"OpenAI-compatible endpoint at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
            return bool(found) or proc.poll() is not None

        await wait_until(listening, "the endpoint's URL in the log", timeout=60)
        assert found, log.read_text()
        assert KEY.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert "its key: $PSYMESH_OPENAI_API_KEY" in log.read_text()
        # No --model: the example takes the first model the endpoint lists.
        example = await anyio.run_process(
            [sys.executable, str(REPO / "examples" / "openai_client.py"), "--base-url", found[0] + "/v1",
             "--max-tokens", "16"],
            env={**os.environ, "OPENAI_API_KEY": KEY}, cwd=REPO, check=False)
        wrong = await anyio.run_process(
            [sys.executable, str(REPO / "examples" / "openai_client.py"), "--base-url", found[0] + "/v1",
             "--model", "home/tiny"], env={**os.environ, "OPENAI_API_KEY": "sk-wrong"}, cwd=REPO, check=False)
        absent = await anyio.run_process(
            [sys.executable, str(REPO / "examples" / "openai_client.py"), "--base-url", found[0] + "/v1",
             "--model", "home/tiny"], env={**os.environ, "OPENAI_API_KEY": KEY}, cwd=REPO, check=False)
    finally:
        proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            while proc.poll() is None:
                await anyio.sleep(0.05)
    out = example.stdout.decode()
    assert example.returncode == 0, example.stderr.decode()
    assert "models: tiny" in out and "model: tiny (the first listed" in out
    assert "finish_reason: " in out and "tool call: get_weather" in out
    # A refusal is the endpoint's one line and exit status 1, not the client's traceback.
    for refused, status in ((wrong, 401), (absent, 404)):
        said = refused.stderr.decode().strip()
        assert refused.returncode == 1 and "Traceback" not in said, said
        assert len(said.splitlines()) == 1 and said.startswith(f"error {status}: "), said
    assert proc.returncode == 0, log.read_text()


@pytest.mark.anyio
async def test_a_port_in_use_is_one_clear_error(tmp_path: Path) -> None:
    import socket

    home = NodeHome(tmp_path / "busy")
    home.init()
    config = home.load_config()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        served = config.serve.model_copy(update={"openai": config.serve.openai.model_copy(
            update={"enabled": True, "port": taken.getsockname()[1]})})
        node = Node(home, config.model_copy(update={"serve": served}))
        with pytest.raises(BaseException) as failed:
            await node.run()
    errors = [failed.value]
    while isinstance(errors[0], BaseExceptionGroup):
        errors = list(errors[0].exceptions)
    assert isinstance(errors[0], PsymeshError) and errors[0].code is ErrorCode.UNAVAILABLE
    assert "cannot listen on 127.0.0.1:" in errors[0].message and "choose another port" in errors[0].message
