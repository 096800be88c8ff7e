"""`[serve.a2a]`: the node's agent as an A2A agent, driven by the official a2a-sdk client.

Real components: an in-process daemon with the endpoint on 127.0.0.1 port 0 (a2a-sdk's
server under uvicorn on its own asyncio thread), its real AgentTaskRunner and tools,
the generated tiny GGUF loaded as the model's worker; only the agent's replies are
scripted (ScriptedModel, as tests/test_agent_node.py does), so every run calls a tool
and answers the same way. The client is a2a-sdk's, on asyncio, on a worker thread
(the daemon has the test's trio loop), as an app in another process would be.

What an A2A client relies on: the card names the node, its agent and tools, the
bearer scheme and the URL; a message runs the agent (a tool call, then the answer as
an artifact); the task can be read back; a stream shows working -> completed; a
missing or wrong key is 401 (the rest of the door: tests/test_web_page.py); a task
can be canceled (the run stops on the node); irreversible tools are refused; the 0.3
method names work; the node stops cleanly with the thread joined, even with a run in
flight.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import pytest
from a2a.client import A2ACardResolver, A2AClientError, ClientConfig, create_client
from a2a.types import a2a_pb2 as a2a

from conftest import run_nodes
from psymesh.agent.acting.loop import ScriptedModel, tool_call_text
from psymesh.agent.acting.tools import tool_from_function
from psymesh.node.models import agents
from psymesh.node.bridges.a2a import STATES, THREAD_NAME
from psymesh.node.core.bridgeconfig import A2AServe, ServeSettings
from psymesh.node.daemon import Node
from psymesh.node.core.home import NodeHome
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.tasks import TaskState
from waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
MODEL = {"n_ctx": 16384, "n_threads": 1}
KEY = "a2a-test-key-0123456789"
GOAL = "What is this machine?"
CALL = tool_call_text("system.info")
ANSWER = "A home node running psymesh."

T = TypeVar("T")


@asynccontextmanager
async def a2a_node(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                   replies: list[str]) -> AsyncIterator[tuple[Node, ScriptedModel]]:
    """`home`, serving A2A on 127.0.0.1 port 0 with KEY, its agent's replies scripted."""
    key_file = tmp_path / "a2a.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    serve = ServeSettings(a2a=A2AServe(enabled=True, port=0, api_key_file=str(key_file)))
    model = ScriptedModel(replies)
    monkeypatch.setattr(agents, "llama_model", lambda worker, params: model)
    async with run_nodes(tmp_path, "home", configs={"home": {"serve": serve}}) as nodes:
        node = nodes["home"]
        node.models.registry.add("tiny", tiny_model, **MODEL)
        yield node, model
    assert not any(t.name == THREAD_NAME for t in threading.enumerate()), "the A2A thread outlived the node"


def url_of(node: Node) -> str:
    assert node.a2a is not None and node.a2a.url is not None
    return node.a2a.url


async def on_asyncio(fn: Callable[[httpx.AsyncClient], Awaitable[T]], key: str | None = KEY) -> T:
    """`fn` with an httpx client carrying the key, on a fresh asyncio loop on a worker thread."""

    async def go() -> T:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(headers=headers, timeout=60) as http:
            return await fn(http)

    with anyio.fail_after(120):
        return await anyio.to_thread.run_sync(lambda: asyncio.run(go()))


def message(text: str, **metadata: Any) -> a2a.SendMessageRequest:
    msg = a2a.Message(role=a2a.ROLE_USER, message_id=str(uuid.uuid4()), parts=[a2a.Part(text=text)])
    if metadata:
        msg.metadata.update(metadata)
    return a2a.SendMessageRequest(message=msg)


async def client(http: httpx.AsyncClient, url: str, *, streaming: bool, polling: bool = False) -> Any:
    card = await A2ACardResolver(http, url).get_agent_card()
    return await create_client(card, client_config=ClientConfig(httpx_client=http, streaming=streaming,
                                                                polling=polling))


def answer(task: a2a.Task) -> str:
    return "".join(p.text for artifact in task.artifacts for p in artifact.parts)


# --------------------------------------------------------------------------- the card, a run, a stream


@pytest.mark.anyio
async def test_card_send_get_and_stream_through_the_official_client(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with a2a_node(tmp_path, tiny_model, monkeypatch, [CALL, ANSWER, CALL, ANSWER]) as (node, model):
        url = url_of(node)

        async def card_without_key(http: httpx.AsyncClient) -> a2a.AgentCard:
            return await A2ACardResolver(http, url).get_agent_card()

        async def send_then_get(http: httpx.AsyncClient) -> tuple[a2a.Task, a2a.Task]:
            c = await client(http, url, streaming=False)
            [response] = [r async for r in c.send_message(message(GOAL))]
            return response.task, await c.get_task(a2a.GetTaskRequest(id=response.task.id))

        async def stream(http: httpx.AsyncClient) -> list[a2a.StreamResponse]:
            c = await client(http, url, streaming=True)
            return [r async for r in c.send_message(message(GOAL))]

        card = await on_asyncio(card_without_key, key=None)  # the card is public
        task, again = await on_asyncio(send_then_get)
        events = await on_asyncio(stream)

    assert card.name == "home" and "home" in card.description
    assert [i.url for i in card.supported_interfaces] == [url, url]
    assert {i.protocol_version for i in card.supported_interfaces} == {"1.0", "0.3"}
    assert card.security_schemes["bearer"].http_auth_security_scheme.scheme == "bearer"
    assert "bearer" in card.security_requirements[0].schemes
    skills = {s.id: s for s in card.skills}
    assert "agent" in skills and "system.info" in skills["agent"].description
    assert "tool.system.info" in skills and card.capabilities.streaming

    # One run: the agent called system.info (for real, on this node) and answered.
    assert task.status.state == a2a.TASK_STATE_COMPLETED and answer(task) == ANSWER
    assert "".join(p.text for p in task.status.message.parts) == ANSWER
    calls = task.status.message.metadata["result"]["tool_calls"]
    assert [(c["name"], c["status"]) for c in calls] == [("system.info", "ok")]
    assert '{"tool": "system.info", "ok": true' in model.prompts[1]  # the real result went back to the model
    assert '"profile": "home"' in model.prompts[1]
    assert again.id == task.id and again.status.state == a2a.TASK_STATE_COMPLETED and answer(again) == ANSWER

    # The stream: the task (submitted), working (with what the agent does), the answer artifact, completed.
    assert events[0].HasField("task") and events[0].task.status.state == a2a.TASK_STATE_SUBMITTED
    states = [r.status_update.status.state for r in events if r.HasField("status_update")]
    texts = ["".join(p.text for p in r.status_update.status.message.parts) for r in events
             if r.HasField("status_update")]
    assert states[0] == a2a.TASK_STATE_WORKING and states[-1] == a2a.TASK_STATE_COMPLETED
    assert set(states[:-1]) == {a2a.TASK_STATE_WORKING}
    assert any(t.startswith("calling system.info") for t in texts) and "system.info: ok" in texts
    artifacts = [r.artifact_update.artifact for r in events if r.HasField("artifact_update")]
    assert ["".join(p.text for p in a.parts) for a in artifacts] == [ANSWER]


def test_our_states_map_onto_a2a_states() -> None:
    assert set(STATES) == set(TaskState)
    assert {a2a.TaskState.Name(v) for v in STATES.values()} == {
        f"TASK_STATE_{s.value.upper().replace('-', '_')}" for s in TaskState}


# --------------------------------------------------------------------------- the key


@pytest.mark.anyio
async def test_a_missing_or_wrong_key_is_401(tmp_path: Path, tiny_model: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    async with a2a_node(tmp_path, tiny_model, monkeypatch, [ANSWER]) as (node, model):
        url = url_of(node)
        body = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "nope"}}

        async def raw(http: httpx.AsyncClient) -> httpx.Response:
            return await http.post(url, json=body, headers={"A2A-Version": "1.0"})

        async def sdk_refused(http: httpx.AsyncClient) -> str:
            c = await client(http, url, streaming=False)
            with pytest.raises(A2AClientError) as caught:
                [r async for r in c.send_message(message(GOAL))]
            return str(caught.value)

        missing = await on_asyncio(raw, key=None)
        wrong = await on_asyncio(raw, key="sk-wrong")
        refused = await on_asyncio(sdk_refused, key="sk-wrong")
        right = await on_asyncio(raw)

    assert missing.status_code == wrong.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert "API key" in wrong.json()["error"]["message"]
    assert "401" in refused
    assert right.status_code == 200 and "error" in right.json()  # past the door: no such task
    assert model.remaining == 1  # no agent ran for a refused request


def test_an_agent_always_has_a_key_and_the_card_says_so(tmp_path: Path) -> None:
    """No key configured, even on a LAN bind: the node makes one 0600 in its home."""
    home = NodeHome(tmp_path / "home")
    home.init(profile="home", name="home")
    serve = ServeSettings(a2a=A2AServe(enabled=True, host="0.0.0.0", port=0))
    config = home.load_config().model_copy(update={"serve": serve, "listen": ["/ip4/127.0.0.1/tcp/0"]})
    node = Node(home, config, environ={})  # built, never run: nothing binds
    assert node.a2a is not None and node.a2a.key.source == str(home.path / "a2a.key")
    assert (home.path / "a2a.key").stat().st_mode & 0o777 == 0o600
    assert (home.path / "a2a.key").read_text().strip() == node.a2a.key.value


# --------------------------------------------------------------------------- cancel, refusals, shutdown


class _Waits:
    """A tool that runs until cancelled, and remembers that it was."""

    def __init__(self) -> None:
        self.started = False
        self.cancelled = False

    async def wait(self) -> dict:
        """Wait for something that never comes."""
        self.started = True
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise
        return {}


@pytest.mark.anyio
async def test_cancel_stops_the_run_on_the_node(tmp_path: Path, tiny_model: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    waits = _Waits()
    async with a2a_node(tmp_path, tiny_model, monkeypatch, [tool_call_text("slow.wait"), ANSWER]) as (node, model):
        node.tools.register(tool_from_function(waits.wait, "slow.wait"))
        url = url_of(node)

        async def start(http: httpx.AsyncClient) -> a2a.Task:
            c = await client(http, url, streaming=False, polling=True)  # return_immediately
            [response] = [r async for r in c.send_message(message(GOAL))]
            return response.task

        async def cancel(task_id: str) -> tuple[a2a.Task, a2a.Task]:
            async def go(http: httpx.AsyncClient) -> tuple[a2a.Task, a2a.Task]:
                c = await client(http, url, streaming=False)
                canceled = await c.cancel_task(a2a.CancelTaskRequest(id=task_id))
                return canceled, await c.get_task(a2a.GetTaskRequest(id=task_id))
            return await on_asyncio(go)

        task = await start_and_wait(start, lambda: waits.started)
        canceled, read = await cancel(task.id)
        await wait_until(lambda: waits.cancelled, "the tool sees the run cancelled")

    assert task.status.state in (a2a.TASK_STATE_SUBMITTED, a2a.TASK_STATE_WORKING)
    assert canceled.status.state == read.status.state == a2a.TASK_STATE_CANCELED
    assert model.remaining == 1  # it never got to answer


async def start_and_wait(start: Callable[[httpx.AsyncClient], Awaitable[a2a.Task]],
                         started: Callable[[], bool]) -> a2a.Task:
    task = await on_asyncio(start)
    await wait_until(started, "the agent's tool is running")
    return task


@pytest.mark.anyio
async def test_the_node_stops_with_a_run_in_flight_and_joins_the_thread(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    waits = _Waits()
    async with a2a_node(tmp_path, tiny_model, monkeypatch, [tool_call_text("slow.wait"), ANSWER]) as (node, model):
        node.tools.register(tool_from_function(waits.wait, "slow.wait"))
        url = url_of(node)

        async def start(http: httpx.AsyncClient) -> a2a.Task:
            c = await client(http, url, streaming=False, polling=True)
            [response] = [r async for r in c.send_message(message(GOAL))]
            return response.task

        await start_and_wait(start, lambda: waits.started)
        assert any(t.name == THREAD_NAME for t in threading.enumerate())
    # a2a_node asserted the thread is gone; the run was cancelled with the node, not left behind.
    assert waits.cancelled


@pytest.mark.anyio
async def test_irreversible_tools_are_refused_over_a2a(tmp_path: Path, tiny_model: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []

    def send(text: str) -> dict:
        """Send a note to the family (cannot be undone)."""
        sent.append(text)
        return {"sent": text}

    replies = [tool_call_text("notes.send", {"text": "home by 6"}), "I could not send it."]
    async with a2a_node(tmp_path, tiny_model, monkeypatch, replies) as (node, model):
        node.tools.register(tool_from_function(send, "notes.send", irreversible=True))

        async def go(http: httpx.AsyncClient) -> a2a.Task:
            c = await client(http, url_of(node), streaming=False)
            [response] = [r async for r in c.send_message(message("Tell the family I am home by 6."))]
            return response.task

        task = await on_asyncio(go)

    assert sent == []  # never ran
    assert task.status.state == a2a.TASK_STATE_COMPLETED and answer(task) == "I could not send it."
    calls = task.status.message.metadata["result"]["tool_calls"]
    assert [(c["name"], c["status"]) for c in calls] == [("notes.send", "unconfirmed")]


@pytest.mark.anyio
async def test_a_message_without_a_goal_is_rejected_and_bad_params_fail(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with a2a_node(tmp_path, tiny_model, monkeypatch, [ANSWER]) as (node, model):
        async def go(http: httpx.AsyncClient) -> tuple[a2a.Task, a2a.Task, a2a.Task]:
            c = await client(http, url_of(node), streaming=False)
            no_text = message("")
            del no_text.message.parts[:]
            no_text.message.parts.add().data.struct_value.update({"goal": "in the wrong place"})
            [rejected] = [r async for r in c.send_message(no_text)]
            [failed] = [r async for r in c.send_message(message(GOAL, params={"max_steps": 0}))]
            [fine] = [r async for r in c.send_message(message(GOAL, params={"max_steps": 1}))]
            return rejected.task, failed.task, fine.task

        rejected, failed, fine = await on_asyncio(go)

    assert rejected.status.state == a2a.TASK_STATE_REJECTED
    assert "text part" in "".join(p.text for p in rejected.status.message.parts)
    assert failed.status.state == a2a.TASK_STATE_FAILED
    assert "bad_request: bad agent params: max_steps" in "".join(p.text for p in failed.status.message.parts)
    assert fine.status.state == a2a.TASK_STATE_COMPLETED and answer(fine) == ANSWER  # the node lives on
    assert model.remaining == 0


# --------------------------------------------------------------------------- A2A 0.3 names, the example


@pytest.mark.anyio
async def test_the_0_3_method_names_work(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with a2a_node(tmp_path, tiny_model, monkeypatch, [CALL, ANSWER]) as (node, model):
        url = url_of(node)

        async def go(http: httpx.AsyncClient) -> tuple[dict, dict]:
            v03 = {"A2A-Version": "0.3"}  # required: the SDK would take a missing one as 0.3, a web page's too
            sent = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {
                "message": {"kind": "message", "role": "user", "messageId": str(uuid.uuid4()),
                            "parts": [{"kind": "text", "text": GOAL}]}}}, headers=v03)
            task = sent.json()["result"]
            got = await http.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tasks/get",
                                             "params": {"id": task["id"]}}, headers=v03)
            return task, got.json()["result"]

        task, got = await on_asyncio(go)

    assert task["kind"] == "task" and task["status"]["state"] == "completed"
    assert got["id"] == task["id"] and got["status"]["state"] == "completed"
    assert [p["text"] for a in got["artifacts"] for p in a["parts"]] == [ANSWER]


@pytest.mark.anyio
async def test_the_example_client(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with a2a_node(tmp_path, tiny_model, monkeypatch, [CALL, ANSWER, CALL, ANSWER]) as (node, model):
        with anyio.fail_after(120):
            done = await anyio.run_process([sys.executable, str(REPO / "examples" / "a2a_client.py"),
                                            url_of(node).rstrip("/"), GOAL], check=False,
                                           env={**os.environ, "A2A_API_KEY": KEY})
    assert done.returncode == 0, done.stderr.decode()
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert lines[0]["card"] == "home" and "agent" in lines[0]["skills"] and lines[0]["security"] == ["bearer"]
    assert lines[1]["state"] == "TASK_STATE_COMPLETED" and lines[1]["answer"] == ANSWER
    statuses = [line["status"] for line in lines if "status" in line]
    assert statuses[0] == "TASK_STATE_WORKING" and statuses[-1] == "TASK_STATE_COMPLETED"
    assert {"artifact": ANSWER} in lines


@pytest.mark.anyio
async def test_the_example_client_exits_1_when_the_task_fails(tmp_path: Path, tiny_model: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A task that fails (here: the model has nothing to say) is a failure of the script: status 1
    and one line saying how it ended, not a 0 a script would take for success."""
    async with a2a_node(tmp_path, tiny_model, monkeypatch, []) as (node, model):
        with anyio.fail_after(120):
            done = await anyio.run_process([sys.executable, str(REPO / "examples" / "a2a_client.py"),
                                            url_of(node).rstrip("/"), GOAL], check=False,
                                           env={**os.environ, "A2A_API_KEY": KEY})
    assert done.returncode == 1, (done.stdout.decode(), done.stderr.decode())
    assert "error: the task ended TASK_STATE_FAILED" in done.stderr.decode()
    assert "Traceback" not in done.stderr.decode()


# --------------------------------------------------------------------------- the command


@pytest.mark.anyio
async def test_serve_a2a_command_serves_the_card_and_stops_cleanly(tmp_path: Path) -> None:
    """`psymesh serve a2a` runs a node with the endpoint (its URL in the log); SIGTERM
    stops it with exit status 0."""
    home = tmp_path / "desk"
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "psymesh", "serve", "a2a", "--home", str(home),
                                 "--port", "0", "--api-key-file", str(key_file)],
                                cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    try:
        found: list[str] = []

        def listening() -> bool:
            found[:] = re.findall(r"A2A agent at (http://127\.0\.0\.1:\d+/)", log.read_text())
            return bool(found) or proc.poll() is not None

        await wait_until(listening, "the A2A URL in the log", timeout=60)
        assert found, log.read_text()

        async def card_and_refusal(http: httpx.AsyncClient) -> tuple[a2a.AgentCard, int]:
            card = await A2ACardResolver(http, found[0]).get_agent_card()
            refused = await http.post(found[0], json={"jsonrpc": "2.0", "id": 1, "method": "GetTask",
                                                      "params": {"id": "x"}})
            return card, refused.status_code

        card, status = await on_asyncio(card_and_refusal, key=None)
    finally:
        proc.send_signal(signal.SIGTERM)
        await wait_until(lambda: proc.poll() is not None, "the node to exit", timeout=30)
    assert card.name == NodeHome(home).load_config().name and card.supported_interfaces[0].url == found[0] and status == 401
    assert proc.returncode == 0, log.read_text()


@pytest.mark.anyio
async def test_a_port_in_use_is_one_clear_error(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "busy")
    home.init()
    config = home.load_config()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        serve = ServeSettings(a2a=A2AServe(enabled=True, port=taken.getsockname()[1]))
        node = Node(home, config.model_copy(update={"serve": serve, "listen": ["/ip4/127.0.0.1/tcp/0"]}))
        with pytest.raises(BaseException) as failed:
            await node.run()
    errors = [failed.value]
    while isinstance(errors[0], BaseExceptionGroup):
        errors = list(errors[0].exceptions)
    assert isinstance(errors[0], PsymeshError) and errors[0].code is ErrorCode.UNAVAILABLE
    assert "cannot listen on 127.0.0.1:" in errors[0].message and "[serve.a2a] port" in errors[0].message
