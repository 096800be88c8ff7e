"""Models out of the daemon's process: a runner that dies fails one request, never the node.

Real components: runner processes (node/models/child.py) holding the generated tiny
qwen35 GGUF in llama-cpp-python, killed with real signals mid-generation; in-process
daemons on loopback for the node's view (a peer's infer task, pings, another peer's
task and a letter meanwhile); daemon processes SIGKILLed and restarted for the durable
view; `psymesh model ps` for what a user sees.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.agent.runtime.api import ModelCrashed, ModelLoadError, ModelSettings
from psymesh.node.control.client import Client
from psymesh.node.core.db import open_db
from psymesh.node.core.home import NodeHome
from psymesh.node.models import ModelRegistry, ModelRunner
from psymesh.node.control.process import DaemonProcess
from psymesh.protocol.errors import ErrorCode, RemoteError
from psymesh.protocol.tasks import TaskState

REPO = Path(__file__).resolve().parent.parent
PROMPT = "<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n"


def _endless(runner: ModelRunner) -> dict[int, float]:
    """A logit bias that keeps the random-weight model writing: no end-of-generation, no stray bytes."""
    return {t: -100.0 for t in [*range(128, 256), *runner.info.eog_token_ids]}


def _settings(model: Path, **kw: object) -> ModelSettings:
    return ModelSettings(path=model, n_ctx=4096, n_threads=1, **kw)  # type: ignore[arg-type]


async def _kill_when_running(runner: ModelRunner, sig: signal.Signals) -> None:
    await wait_until(lambda: runner.running, "a request running in the runner")
    pid = runner.pid
    assert pid is not None
    os.kill(pid, sig)  # the behaviour under test: a kill once the runner has started the request


# --------------------------------------------------------------------------- the runner alone


@pytest.mark.anyio
@pytest.mark.parametrize("sig", [signal.SIGABRT, signal.SIGKILL, signal.SIGSEGV])
async def test_a_runner_killed_mid_generation_fails_that_request_only(tiny_model: Path, sig: signal.Signals) -> None:
    async with ModelRunner(_settings(tiny_model)) as runner:
        first_pid = runner.pid
        async with anyio.create_task_group() as tg:
            tg.start_soon(_kill_when_running, runner, sig)
            with pytest.raises(ModelCrashed) as crashed:
                await runner.complete(PROMPT, max_tokens=3000, logit_bias=_endless(runner), temperature=0)
        assert crashed.value.code is ErrorCode.MODEL_CRASHED
        assert crashed.value.details["signal"] == sig.name
        assert runner.crashes == 1 and not runner.loaded
        # The next request gets a fresh runner (after a short backoff) and succeeds.
        done = await runner.complete(PROMPT, max_tokens=8, logit_bias=_endless(runner), temperature=0)
        assert done.tokens == 8 and runner.pid not in (None, first_pid) and runner.crashes == 0


ABORTING_GRAMMAR = "root ::= <[245]> <[128]> <[128]> <[128]>"  # token literals after a partial UTF-8 lead


@pytest.mark.anyio
async def test_llama_cpp_aborting_on_a_request_fails_it_with_its_last_words(tiny_model: Path) -> None:
    """A real abort: token literals that leave llama.cpp's grammar with no token it accepts
    make it throw a C++ exception through ctypes (std::terminate, SIGABRT). The request
    fails `model_crashed` with what llama.cpp said; this process, and the model, live on."""
    async with ModelRunner(_settings(tiny_model)) as runner:
        with pytest.raises(ModelCrashed) as crashed:
            await runner.complete(PROMPT, max_tokens=8, grammar=ABORTING_GRAMMAR, temperature=0)
        assert crashed.value.details["signal"] == "SIGABRT"
        assert "grammar" in crashed.value.details["log"], crashed.value.details
        assert (await runner.complete(PROMPT, max_tokens=3, temperature=0, logit_bias=_endless(runner))).tokens == 3


@pytest.mark.anyio
async def test_requests_queued_behind_a_crash_run_on_the_fresh_runner(tiny_model: Path) -> None:
    async with ModelRunner(_settings(tiny_model)) as runner:
        results: dict[str, object] = {}

        async def ask(tag: str, tokens: int) -> None:
            try:
                results[tag] = (await runner.complete(PROMPT, max_tokens=tokens, logit_bias=_endless(runner),
                                                      temperature=0)).tokens
            except ModelCrashed as exc:
                results[tag] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "running", 3000)
            await wait_until(lambda: runner.running, "the first request running")
            tg.start_soon(ask, "queued-1", 5)
            tg.start_soon(ask, "queued-2", 6)
            await wait_until(lambda: runner.pending == 3, "two requests queued behind it")
            os.kill(runner.pid, signal.SIGABRT)  # type: ignore[arg-type]
        assert isinstance(results["running"], ModelCrashed)
        assert results["queued-1"] == 5 and results["queued-2"] == 6


@pytest.mark.anyio
async def test_a_cancelled_request_leaves_the_runner_ready(tiny_model: Path) -> None:
    async with ModelRunner(_settings(tiny_model)) as runner:
        pid = runner.pid
        with anyio.move_on_after(0.3):
            await runner.complete(PROMPT, max_tokens=3000, logit_bias=_endless(runner), temperature=0)
        done = await runner.complete(PROMPT, max_tokens=4, temperature=0, logit_bias=_endless(runner))
        assert done.tokens == 4 and runner.pid == pid and runner.crashes == 0


@pytest.mark.anyio
async def test_an_idle_runner_leaves_after_keep_alive_and_the_next_request_loads_it(tiny_model: Path) -> None:
    async with ModelRunner(_settings(tiny_model, keep_alive_s=0.5)) as runner:
        pid = runner.pid
        assert runner.status().loaded and runner.status().rss_bytes
        await runner.complete(PROMPT, max_tokens=2, temperature=0)
        await wait_until(lambda: not runner.loaded, "the runner to leave after keep_alive_s", timeout=20)
        assert runner.status().rss_bytes is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # type: ignore[arg-type]  # gone (and reaped), its memory back with the system
        done = await runner.complete(PROMPT, max_tokens=3, temperature=0, logit_bias=_endless(runner))
        assert done.tokens == 3 and runner.loaded and runner.pid != pid


@pytest.mark.anyio
async def test_a_memory_cap_turns_a_runaway_into_a_clean_error(tiny_model: Path) -> None:
    """RLIMIT_AS far below what llama.cpp maps for a 32k context: the runner cannot load it,
    and says so (a load refusal or a crash while loading), the caller's process lives on."""
    runner = ModelRunner(ModelSettings(path=tiny_model, n_ctx=32768, n_threads=1, memory_limit_mb=200))
    with pytest.raises((ModelCrashed, ModelLoadError)) as failed:
        await runner.start()
    await runner.aclose()
    assert failed.value.code in (ErrorCode.MODEL_CRASHED, ErrorCode.UNAVAILABLE), failed.value


def test_a_runner_outlives_the_thread_that_started_it(tiny_model: Path) -> None:
    """trio starts a process from a worker thread and retires that thread after 10 s idle; a
    runner that asked for PR_SET_PDEATHSIG died with the thread (the kernel counts a thread's
    exit as the parent's death): every runner was SIGKILLed ~10 s after it started, and a
    generation longer than that failed `model_crashed` (found in a full run). Here a thread
    starts a runner, waits for it to be ready, and ends; the runner still answers."""
    from psymesh.node.models.runner import runner_command
    from psymesh.protocol.channel import Channel
    from psymesh.protocol.messages import Message
    from psymesh.protocol.runner import MAX_RUNNER_FRAME, Load, Ready, Tokenize, Tokens

    channel = Channel(max_frame_size=MAX_RUNNER_FRAME)

    def next_frame(proc: subprocess.Popen[bytes]) -> Message | None:
        assert proc.stdout is not None
        while (msg := channel.next_message()) is None:
            data = proc.stdout.read1(65536)
            if not data:
                return None  # its output ended: the runner is gone
            channel.receive_data(data)
        return msg

    started: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        proc = subprocess.Popen(runner_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        started.append(proc)
        assert proc.stdin is not None
        proc.stdin.write(channel.send(Load(settings=ModelSettings(path=tiny_model, n_ctx=256,
                                                                  n_threads=1).model_dump_json())))
        proc.stdin.flush()
        assert isinstance(next_frame(proc), Ready)

    starter = threading.Thread(target=start)
    starter.start()
    starter.join(timeout=120)
    [proc] = started
    assert proc.stdin is not None
    try:
        proc.stdin.write(channel.send(Tokenize(id=1, text="hi")))
        proc.stdin.flush()
        frames = [next_frame(proc), next_frame(proc)]  # runner.started, then the tokens
        assert isinstance(frames[-1], Tokens), (frames, proc.poll())
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0  # and it leaves when its stdin closes, as it should


# --------------------------------------------------------------------------- the node


LONG = 120_000  # tokens a delegated generation asks for: seconds of work even on a quiet machine (the tiny
# model writes ~30k tokens a second there), so a kill lands in the middle of it


def _register(home: NodeHome, model: Path, n_ctx: int = 4096, **kw: object) -> None:
    conn = open_db(home.db_path)
    try:
        ModelRegistry(conn).add("tiny", model, n_ctx=n_ctx, n_threads=1, **kw)  # type: ignore[arg-type]
    finally:
        conn.close()


@pytest.mark.anyio
async def test_a_crash_in_a_peers_task_leaves_the_node_serving(tmp_path: Path, tiny_model: Path) -> None:
    """A phone's infer task whose runner aborts fails `model_crashed` (the phone sees why);
    meanwhile home answers pings, runs another peer's task and takes a letter, and the next
    infer task runs on a fresh runner."""
    async with run_nodes(tmp_path, "home", "phone", "tablet",
                         profiles={"phone": "phone", "tablet": "phone"}) as nodes:
        _register(nodes["home"].home, tiny_model, n_ctx=LONG + 1024)
        await pair(tmp_path / "home", tmp_path / "phone")
        await pair(tmp_path / "home", tmp_path / "tablet")
        async with Client(tmp_path / "phone") as phone, Client(tmp_path / "tablet") as tablet:
            handle = await phone.delegate("home", infer="Count to a thousand.", model="tiny", max_tokens=LONG,
                                          params={"temperature": 0, "ban_bytes": True})
            models = nodes["home"].models
            await wait_until(lambda: any(s.running for s in models.ps()), "the runner working")  # started: a crash
            # before that resends the request to a fresh runner (a full run once caught that race)
            os.kill(next(s.pid for s in models.ps() if s.pid), signal.SIGABRT)
            outcome = await handle.outcome()
            assert outcome.state is TaskState.FAILED and outcome.code == ErrorCode.MODEL_CRASHED.value, outcome
            assert "SIGABRT" in outcome.message
            # The node never noticed: a ping, another peer's task, a letter.
            assert len((await phone.ping("home", count=2)).rtts_ms) == 2
            assert (await (await tablet.delegate("home", tool="system.info")).result())
            sent = await tablet.send("home", "still there?")
            assert (await tablet.letter(sent.id, wait=True)).state == "delivered"
            again = await phone.delegate("home", infer="Hi", model="tiny", max_tokens=4,
                                         params={"temperature": 0, "ban_bytes": True})
            assert (await again.result()).usage.completion_tokens >= 1
            # A peer cannot drive llama.cpp into that abort itself: token literals are refused.
            refused = await phone.delegate("home", infer="Hi", model="tiny", max_tokens=4,
                                           params={"grammar": ABORTING_GRAMMAR})
            outcome = await refused.outcome()
            assert outcome.code == ErrorCode.BAD_REQUEST.value and "token references" in outcome.message


@pytest.mark.anyio
async def test_an_ask_and_an_a2a_message_run_the_real_model_to_an_end(tmp_path: Path, tiny_model: Path) -> None:
    """The README's `msg ask` and an A2A `message/send` from the key holder, on the tiny
    model with default settings (no ban_bytes): each ends with an answer, whatever the
    random weights write, and the node serves on (tests/test_invalid_utf8.py does the same
    for `agent run`, a delegated goal and tool_choice="required")."""
    import asyncio
    import uuid

    from a2a.types import a2a_pb2 as a2a
    import httpx
    from a2a.client import A2ACardResolver, ClientConfig, create_client

    from psymesh.node.core.bridgeconfig import A2AServe, ServeSettings

    key_file = tmp_path / "a2a.key"
    key_file.write_text("runner-test-key-0123456789\n")
    key_file.chmod(0o600)
    serve = ServeSettings(a2a=A2AServe(enabled=True, port=0, api_key_file=str(key_file)))
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"},
                         configs={"home": {"serve": serve}}) as nodes:
        nodes["home"].models.registry.add("tiny", tiny_model, n_ctx=16384, n_threads=1)
        await pair(tmp_path / "home", tmp_path / "phone")
        async with Client(tmp_path / "phone") as phone:
            for seed in (1, 2):
                answer = await phone.ask("home", "turn on wifi", params={"seed": seed, "max_steps": 2},
                                         timeout=240)
                assert answer.sender_name == "home" and "ok" in answer.body, answer
        url = nodes["home"].a2a.url  # type: ignore[union-attr]

        async def send() -> a2a.Task:
            async with httpx.AsyncClient(headers={"Authorization": "Bearer runner-test-key-0123456789"},
                                         timeout=240) as http:
                card = await A2ACardResolver(http, url).get_agent_card()
                c = await create_client(card, client_config=ClientConfig(httpx_client=http, streaming=False))
                msg = a2a.Message(role=a2a.ROLE_USER, message_id=str(uuid.uuid4()),
                                  parts=[a2a.Part(text="turn on wifi")])
                msg.metadata.update({"max_steps": 2})
                [response] = [r async for r in c.send_message(a2a.SendMessageRequest(message=msg))]
                return response.task

        with anyio.fail_after(300):
            task = await anyio.to_thread.run_sync(lambda: asyncio.run(send()))
        assert task.status.state in (a2a.TASK_STATE_COMPLETED, a2a.TASK_STATE_FAILED,
                                     a2a.TASK_STATE_INPUT_REQUIRED), task.status
        async with Client(tmp_path / "phone") as phone:
            assert len((await phone.ping("home", count=1)).rtts_ms) == 1


async def _cli(home: Path, *args: str) -> tuple[int, str, str]:
    done = await anyio.run_process([sys.executable, "-m", "psymesh", *args, "--home", str(home)], check=False,
                                   cwd=REPO)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.mark.anyio
async def test_model_ps_shows_a_model_loaded_then_unloaded_after_keep_alive(tmp_path: Path,
                                                                            tiny_model: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        _register(nodes["home"].home, tiny_model, keep_alive_s=8.0)
        await pair(tmp_path / "home", tmp_path / "phone")
        async with Client(tmp_path / "phone") as phone, Client(tmp_path / "home") as home:
            code, out, err = await _cli(tmp_path / "home", "model", "ps", "--json")
            assert code == 0, err
            # not loaded yet, it shows the keep-alive it will load with (not "forever")
            assert [(m["name"], m["loaded"], m["pid"], m["keep_alive_s"]) for m in json.loads(out)] == [
                ("tiny", False, None, 8.0)]
            code, text, err = await _cli(tmp_path / "home", "model", "ps")
            assert "8s" in text and "forever" not in text, text

            async def infer() -> None:
                task = await phone.delegate("home", infer="Hi", model="tiny", max_tokens=4,
                                            params={"temperature": 0, "ban_bytes": True})
                await task.result()

            await infer()
            code, out, err = await _cli(tmp_path / "home", "model", "ps", "--json")
            [row] = json.loads(out)
            assert row["loaded"] and row["pid"] and row["rss_bytes"] > 0 and row["jobs_served"] >= 1, row
            assert row["keep_alive_s"] == 8.0 and row["n_ctx"] == 4096
            code, text, err = await _cli(tmp_path / "home", "model", "ps")
            assert "tiny" in text and "loaded" in text, text

            async def unloaded() -> bool:
                return not (await home.models_ps())[0].loaded

            await wait_until(unloaded, "the model to unload after its keep-alive", timeout=40)
            code, out, err = await _cli(tmp_path / "home", "model", "ps", "--json")
            assert [(m["loaded"], m["pid"]) for m in json.loads(out)] == [(False, None)]
            await infer()  # and it loads again on the next request
            assert (await home.models_ps())[0].loaded


@pytest.mark.anyio
async def test_a_task_that_crashed_its_runner_stays_failed_across_daemon_kills(tmp_path: Path,
                                                                              tiny_model: Path) -> None:
    home = DaemonProcess(tmp_path / "home", name="home")
    phone = DaemonProcess(tmp_path / "phone", profile="phone", name="phone")
    NodeHome(home.home).init(name="home")
    _register(NodeHome(home.home), tiny_model, n_ctx=LONG + 1024)
    await home.start()
    await phone.start()
    try:
        await pair(home.home, phone.home)
        async with Client(phone.home) as c:
            handle = await c.delegate("home", infer="Count to a thousand.", model="tiny", max_tokens=LONG,
                                      params={"temperature": 0, "ban_bytes": True})

            async def runner_pid() -> int | None:
                async with Client(home.home) as h:
                    return next((m.pid for m in await h.models_ps() if m.pid and m.running), None)

            await wait_until(runner_pid, "home's runner working on the task", timeout=30)
            os.kill(await runner_pid(), signal.SIGABRT)  # type: ignore[arg-type]
            outcome = await handle.outcome()
            assert outcome.code == ErrorCode.MODEL_CRASHED.value
        for _ in range(2):  # the behaviour under test: the node killed and restarted twice
            home.kill()
            await home.start()
        async with Client(home.home) as h:
            # Never run again: failed, or purged at a restart as a finished task the phone had
            # fetched to its end (the phone redials home when it comes back, and acks it then);
            # a task queued again is neither.
            mine = [t for t in (await h.tasks()).executing if t.task_id == handle.id]
            assert [t.state for t in mine] in ([TaskState.FAILED], [])
            assert (await h.status()).peer_id
    finally:
        await phone.stop()
        await home.stop()
