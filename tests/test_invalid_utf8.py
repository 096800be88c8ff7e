"""A model that writes invalid UTF-8 never aborts the process (issue 18, item 4).

Byte-level BPE vocabularies have a token for every byte, so a model can write bytes
that are not UTF-8: the random-weight test model often does, and a real one can, one
byte token at a time. llama.cpp's tokenizer aborted on some of them: its lenient
decoder reads a lead byte F5-F7 (or F4 and then 90-BF) with three continuation bytes
as a code point above U+10FFFF, and its BPE pre-tokenizer then throws
``std::invalid_argument("invalid codepoint")`` through the C API: std::terminate,
SIGABRT, exit 134. The worker handed it such bytes when it checked whether a reply was
a canonical tokenisation (``ModelWorker._canonical``), after every generation.

Because the failure aborts the process, every generation that used to crash runs in a
child process (a ModelWorker script, the CLI, a daemon), and the test asserts how the
child ended. Nothing here sets ``ban_bytes``: the product's defaults are what a user
gets.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import httpx
import pytest

from conftest import pair
from test_agent_node import _register_model
from psymesh.node.control.client import Client
from psymesh.node.core.home import NodeHome
from psymesh.node.control.process import DaemonProcess
from psymesh.protocol.tasks import TaskState
from waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")

# The child: one ModelWorker on the tiny model (token id == byte value for ids 0-255).
# A grammar admitting exactly one non-ASCII character, then "ok", and a logit bias that
# ranks the wanted bytes first, make greedy decoding write exactly those bytes and then
# "ok": the grammar turns the ranking into a sequence (a lead byte only where a
# character starts, continuation bytes only after one; so a character's continuation
# bytes are all one byte here). It prints each reply's text.
_CHILD = r"""
import json, sys
from pathlib import Path
import anyio
from psymesh.agent.runtime.worker import ModelSettings, ModelWorker

PROMPT = "<|im_start|>user\nwrite one character<|im_end|>\n<|im_start|>assistant\n"

async def main() -> None:
    settings = ModelSettings(path=Path(sys.argv[1]), n_ctx=512, n_threads=1)
    texts = []
    async with ModelWorker(settings) as worker:
        for hexed in sys.argv[2:]:
            wanted = bytes.fromhex(hexed)
            bias = {b: 1000.0 - 100 * i for i, b in enumerate(dict.fromkeys(wanted))}
            done = await worker.complete(PROMPT, max_tokens=16, temperature=0, logit_bias=bias,
                                         grammar='root ::= [^\\x00-\\x7F] "ok"\n')
            texts.append(done.text)
        again = await worker.complete(PROMPT + "ok", max_tokens=4, temperature=0)  # still serving
        texts.append(again.finish_reason)
    print(json.dumps(texts))

anyio.run(main)
"""

# (bytes the model writes, why they matter)
_WRITES = [
    ("f5808080", "lead F5: llama.cpp decodes U+140000 and aborted"),
    ("f4909090", "F4 then 90: U+110410, above U+10FFFF, aborted"),
    ("eda0a0", "a UTF-16 surrogate (U+D820): llama.cpp re-encodes it, Python refuses it"),
    ("e28282", "valid UTF-8 (subscript two), kept as written"),
]


def test_a_reply_in_invalid_utf8_does_not_abort_the_worker(tiny_model: Path) -> None:
    child = subprocess.run([sys.executable, "-c", _CHILD, str(tiny_model), *(w for w, _ in _WRITES)],
                           cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, f"exit {child.returncode} (-6/134: SIGABRT)\n{child.stderr[-2000:]}"
    texts = json.loads(child.stdout)
    # The text is what the bytes decode to with replacement characters; the worker goes on.
    assert texts[:-1] == [bytes.fromhex(w).decode("utf-8", errors="replace") + "ok" for w, _ in _WRITES]
    assert texts[-1] in ("stop", "length")


# --------------------------------------------------------------------------- what a user runs


# Seeds with which each of these aborted before the fix (the README's own command: 5 of 6).
CRASHED_SEEDS = (1, 2, 4)


@pytest.mark.anyio
async def test_the_readme_agent_run_finishes(tmp_path: Path, tiny_model: Path) -> None:
    """`psymesh agent run "turn on wifi" --model tiny --delegate never`, default settings."""
    phone = tmp_path / "phone"
    _register_model(phone, tiny_model, "phone")
    for seed in (*CRASHED_SEEDS, None):  # None: a fresh seed, as a user runs it
        args = ["agent", "run", "turn on wifi", "--model", "tiny", "--delegate", "never", "--json"]
        args += ["--seed", str(seed)] if seed is not None else []
        with anyio.fail_after(240):
            done = await anyio.run_process([sys.executable, "-m", "psymesh", *args, "--home", str(phone)],
                                           cwd=REPO, check=False)
        assert done.returncode == 0, f"seed {seed}: exit {done.returncode}\n{done.stderr.decode()[-2000:]}"
        assert json.loads(done.stdout)["stopped"] in ("final", "max_steps")


async def _unless_dead(daemon: DaemonProcess, wait: Callable[[], Awaitable[T]]) -> T:
    """`wait()`, failing at once if the daemon dies meanwhile (a crashed home would
    leave a delegated task waiting for its restart)."""
    result: list[T] = []
    async with anyio.create_task_group() as tg:
        async def waiting() -> None:
            result.append(await wait())
            tg.cancel_scope.cancel()

        tg.start_soon(waiting)
        await wait_until(lambda: not daemon.running, "the request to end", timeout=240)
        raise AssertionError(f"the home daemon died (exit {daemon.proc.returncode}):\n{daemon.log_tail(40)}")
    return result[0]


def _serve_openai(home: Path) -> None:
    node_home = NodeHome(home)
    config = node_home.load_config()
    served = config.serve.openai.model_copy(update={"enabled": True, "port": 0})
    node_home.save_config(config.model_copy(update={"serve": config.serve.model_copy(update={"openai": served})}))


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.anyio
async def test_the_home_daemon_survives_delegated_goals_and_required_tool_calls(tmp_path: Path,
                                                                              tiny_model: Path) -> None:
    """A phone's `task send --goal "turn on wifi"` and an OpenAI request with
    tool_choice="required", both run by the home daemon's model: each ends (any
    outcome), and the daemon stays up and answers."""
    home = DaemonProcess(tmp_path / "home", name="home")
    phone = DaemonProcess(tmp_path / "phone", profile="phone", name="phone")
    _register_model(home.home, tiny_model, "home")
    _serve_openai(home.home)
    await home.start()
    await phone.start()
    try:
        await pair(home.home, phone.home, grant="phone")
        async with Client(phone.home) as client:  # the seeds that crashed it, through the phone's daemon
            for seed in CRASHED_SEEDS:
                handle = await client.delegate("home", goal="turn on wifi", params={"seed": seed})
                outcome = await _unless_dead(home, handle.outcome)
                assert outcome.state is TaskState.COMPLETED, outcome
        args = ["task", "send", "--to", "home", "--goal", "turn on wifi", "--wait", "--json"]  # as a user does
        with anyio.fail_after(240):
            done = await anyio.run_process([sys.executable, "-m", "psymesh", *args, "--home", str(phone.home)],
                                           cwd=REPO, check=False)
        assert home.running, f"the home daemon died on a delegated goal:\n{home.log_tail(40)}"
        assert done.returncode == 0, done.stderr.decode()[-2000:]

        found: list[str] = []

        def listening() -> bool:
            found[:] = re.findall(r"OpenAI-compatible endpoint at (http://127\.0\.0\.1:\d+)/v1",
                                  home.log_path.read_text(errors="replace"))
            return bool(found)

        await wait_until(listening, "the endpoint's URL in the daemon's log", timeout=30)
        key = (home.home / "openai.key").read_text().strip()  # made 0600 when the endpoint was enabled
        async with httpx.AsyncClient(base_url=found[0], timeout=240,
                                     headers={"Authorization": f"Bearer {key}"}) as api:
            for seed in (*CRASHED_SEEDS, None):
                body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                        "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200}
                if seed is not None:
                    body["seed"] = seed
                reply = await _unless_dead(home, lambda: api.post("/v1/chat/completions", json=body))
                assert reply.status_code == 200, reply.text
        async with Client(home.home) as client:
            assert (await client.status()).name == "home"
    finally:
        await phone.stop()
        stopped = await home.stop()
    assert stopped == 0, home.log_tail(40)  # and it shuts down cleanly
