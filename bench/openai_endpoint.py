"""The OpenAI-compatible endpoint: does serving a model over HTTP cost streaming speed?
(Not named openai.py: run as a script, it would shadow the `openai` package it uses.)

One home daemon (a real process) holds a model with BotPsy-0.8B's exact shapes
(random weights, the real cost per token) and serves `[serve.openai]` on 127.0.0.1.
In the same run, interleaved, the same model streams the same reply (greedy, fixed
seed, same prompt, same token budget, the same grammar so that random weights write
letters) three ways:

1. endpoint: the official `openai` client, `stream=True`, server-sent events from
   the home daemon's endpoint (hypercorn on trio, `agent.runtime.generate.generate()`);
2. sdk: `psymesh.Client.delegate(infer=...)` from a paired phone daemon: the same
   model worker in the same home daemon, the tokens as task events over libp2p,
   mirrored by the phone and watched over its control socket;
3. local: `agent.runtime.generate.generate()` on a ModelWorker in this process (no node):
   the floor, what the model itself does.

Decode rate: completion tokens after the first, over the time from the first piece
of text to the last one received (so prompt evaluation is out of it); end-to-end:
all completion tokens over the time from the request to the last piece. The target
is endpoint / sdk >= 0.95x (the issue's fair comparison: the same model through the
SDK); endpoint / local is printed too.

    .venv/bin/python bench/openai_endpoint.py                  # Q4_K_M, 1 thread, 96 tokens, 3 runs
    .venv/bin/python bench/openai_endpoint.py --runs 5 --tokens 128

The model is generated once into .bench/. Every loop is bounded by --runs and
--tokens; on 2 cores a run takes a few minutes.
"""
from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "Tell me a long story about a robot who learns to paint."}]
SEED = 11


def grammar(max_tokens: int) -> str:
    """Lowercase letters and spaces, more of them than `max_tokens` tokens can write: random
    weights would otherwise mostly pick padding tokens, which are no text at all, and each
    path would stop at the token budget anyway. The same grammar on all three paths."""
    return f"root ::= [a-z ]{{{4 * max_tokens}}}"


@dataclass(frozen=True)
class Run:
    tokens: int           # completion tokens the model produced
    decode_tps: float     # (tokens - 1) / (last piece - first piece)
    e2e_tps: float        # tokens / (last piece - request)


def _run(tokens: int, start: float, first: float | None, last: float | None) -> Run:
    assert first is not None and last is not None and tokens > 1, "the model produced no text"
    return Run(tokens, (tokens - 1) / max(last - first, 1e-9), tokens / max(last - start, 1e-9))


def via_endpoint(url: str, key: str, max_tokens: int) -> Run:
    """The official client's stream (runs on a worker thread)."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
    start = time.perf_counter()
    first = last = None
    tokens = 0
    for chunk in client.chat.completions.create(
            model="botpsy", messages=PROMPT, max_tokens=max_tokens, temperature=0, seed=SEED, stream=True,
            stream_options={"include_usage": True}, extra_body={"grammar": grammar(max_tokens)}):
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return _run(tokens, start, first, last)


async def via_sdk(phone_home: Path, max_tokens: int) -> Run:
    from psymesh.node.control.client import Client
    from psymesh.protocol.tasks import EventKind

    async with Client(phone_home) as phone:
        start = time.perf_counter()
        task = await phone.delegate("home", infer=PROMPT, model="botpsy", max_tokens=max_tokens,
                                    params={"temperature": 0, "seed": SEED, "grammar": grammar(max_tokens)})
        first = last = None
        async for event in task.events():
            if event.kind is EventKind.TOKEN and event.data["text"]:
                last = time.perf_counter()
                first = first or last
        result = await task.result()
    return _run(result.usage.completion_tokens, start, first, last)


async def via_local(worker: object, max_tokens: int) -> Run:
    from contextlib import aclosing

    from psymesh.agent.formats.chatformat import ChatMessage
    from psymesh.agent.runtime.generate import Generation, GenerationParams, generate

    params = GenerationParams(max_tokens=max_tokens, temperature=0, seed=SEED, grammar=grammar(max_tokens))
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with aclosing(generate(worker, [ChatMessage.user(PROMPT[0]["content"])], params=params)) as pieces:  # type: ignore[arg-type]
        async for piece in pieces:
            if isinstance(piece, Generation):
                tokens = piece.usage.completion_tokens
            elif piece.text:
                last = time.perf_counter()
                first = first or last
    return _run(tokens, start, first, last)


async def bench(model: Path, args: argparse.Namespace, tmp: Path) -> dict[str, list[Run]]:
    from psymesh.agent.runtime.api import ModelSettings
    from psymesh.agent.runtime.worker import ModelWorker
    from psymesh.node.core.db import open_db
    from psymesh.node.core.home import NodeHome
    from psymesh.node.models import ModelRegistry
    from psymesh.node.control.process import DaemonProcess, pair_homes

    home_dir = tmp / "home"
    home = NodeHome(home_dir)
    home.init(profile="home", name="home")
    config = home.load_config()
    served = config.serve.openai.model_copy(update={"enabled": True, "port": 0})
    home.save_config(config.model_copy(update={"serve": config.serve.model_copy(update={"openai": served})}))
    conn = open_db(home.db_path)
    try:
        ModelRegistry(conn).add("botpsy", model, n_ctx=4096, n_threads=args.threads)
    finally:
        conn.close()
    home_daemon = DaemonProcess(home_dir, name="home")
    phone_daemon = DaemonProcess(tmp / "phone", profile="phone", name="phone")
    runs: dict[str, list[Run]] = {"endpoint": [], "sdk": [], "local": []}
    await home_daemon.start()
    await phone_daemon.start()
    try:
        await pair_homes(home_dir, phone_daemon.home, grant="phone")
        found = re.findall(r"OpenAI-compatible endpoint at (http://[\d.]+:\d+)/v1", home_daemon.log_path.read_text())
        assert found, home_daemon.log_tail()
        url = found[0]
        key = (home_dir / "openai.key").read_text().strip()  # made by the daemon when the endpoint came on
        async with ModelWorker(ModelSettings(path=model, n_ctx=4096, n_threads=args.threads)) as worker:
            # Warm-up: each path loads / touches the model once, untimed.
            await anyio.to_thread.run_sync(via_endpoint, url, key, 8)
            await via_sdk(phone_daemon.home, 8)
            await via_local(worker, 8)
            for i in range(args.runs):  # interleaved, so drift on a shared machine hits all three alike
                runs["endpoint"].append(await anyio.to_thread.run_sync(via_endpoint, url, key, args.tokens))
                runs["sdk"].append(await via_sdk(phone_daemon.home, args.tokens))
                runs["local"].append(await via_local(worker, args.tokens))
                print(f"run {i + 1}/{args.runs}: " + "  ".join(
                    f"{k} {v[-1].decode_tps:6.2f} tok/s ({v[-1].tokens} tokens)" for k, v in runs.items()),
                    flush=True)
    finally:
        await phone_daemon.stop()
        await home_daemon.stop()
    return runs


def main() -> None:
    from psymesh.agent.runtime.testmodel import make_botpsy_shaped_gguf

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wtype", default="Q4_K_M")
    parser.add_argument("--threads", type=int, default=1)  # 2 on a shared 2-core machine: llama.cpp's spinning barrier makes noise
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    model = make_botpsy_shaped_gguf(ROOT / ".bench", wtype=args.wtype)
    with tempfile.TemporaryDirectory(prefix="psymesh-bench-openai-") as tmp:
        runs = anyio.run(bench, model, args, Path(tmp), backend="trio")

    med = {k: (statistics.median(r.decode_tps for r in v), statistics.median(r.e2e_tps for r in v))
           for k, v in runs.items()}
    print(f"\nBotPsy-shaped {args.wtype}, {args.threads} threads, {args.tokens} tokens, {args.runs} runs (medians)")
    print(f"{'path':<44}{'decode tok/s':>14}{'end-to-end tok/s':>18}")
    names = {"endpoint": "OpenAI endpoint (openai client, SSE)", "sdk": "SDK delegate(infer) phone -> home",
             "local": "generate() in process (no node)"}
    for key, (decode, e2e) in med.items():
        print(f"{names[key]:<44}{decode:>14.2f}{e2e:>18.2f}")
    print(f"\nendpoint / sdk     decode {med['endpoint'][0] / med['sdk'][0]:.3f}x   "
          f"end-to-end {med['endpoint'][1] / med['sdk'][1]:.3f}x   (target >= 0.95x)")
    print(f"endpoint / local   decode {med['endpoint'][0] / med['local'][0]:.3f}x   "
          f"end-to-end {med['endpoint'][1] / med['local'][1]:.3f}x")


if __name__ == "__main__":
    main()
