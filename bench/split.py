"""Split-model benchmark: a BotPsy-shaped model whole, and split across processes on llama.cpp's RPC.

One run measures, on the same random-weight model with BotPsy-0.8B's exact shapes:

* **unsplit**: the model in one runner process (node/models/runner.py), the baseline;
* **plain RPC**: the same runner with its layers cut in three even parts (agent/runtime/rpc.py's
  ``split_layers``): the first third on its own CPU, a third on each of two llama.cpp RPC servers
  (``rpc.serve``), each its own process, the runner connecting to their TCP ports directly, as
  llama.cpp's ``--rpc`` does;
* **over psymesh streams**: the same split, each server a worker daemon's (`psymesh worker
  start`), the bytes carried from the owner node to it on `/psymesh/rpc/1.0.0` streams through
  its door (:func:`psymesh_stream_endpoints`), as a split model added with `--split` runs.

For each: the time to load (runner start to ready: for a split model, every offloaded weight is
sent to its server), the first token's latency and tokens/s as the caller of the runner sees
them (bench/inference.py's ``bench_stream``), each with its ratio to the unsplit run of this same
run. On one machine the split cannot be faster (the parts run one after another and the bytes
between them cross loopback sockets); what it shows is the cost of the split itself.

    .venv/bin/python bench/split.py                  # Q4_K_M, 2 threads, 5 runs
    .venv/bin/python bench/split.py --model tiny.gguf --runs 1 --gen-tokens 8   # a smoke run

Every loop is bounded by --runs and --gen-tokens; the servers are stopped at the end.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio

from _common import model_arguments
from inference import bench_stream
from psymesh.agent.runtime import rpc
from psymesh.agent.runtime.api import ModelSettings
from psymesh.agent.runtime.testmodel import make_botpsy_shaped_gguf
from psymesh.node.compute.split import block_count

ROOT = Path(__file__).resolve().parent.parent
LISTEN_DEADLINE_S = 60.0


@dataclass
class Row:
    label: str
    load_s: float
    first_s: list[float]
    rate: list[float]

    @property
    def first(self) -> float:
        return statistics.median(self.first_s)

    @property
    def tps(self) -> float:
        return statistics.median(self.rate)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def plain_rpc_servers(n: int, threads: int) -> Iterator[list[str]]:
    """`n` llama.cpp RPC servers (rpc.serve), each its own process on a loopback port."""
    procs: list[subprocess.Popen[bytes]] = []
    endpoints = []
    try:
        for _ in range(n):
            endpoint = f"127.0.0.1:{_free_port()}"
            procs.append(subprocess.Popen(
                [sys.executable, "-c", f"from psymesh.agent.runtime.rpc import serve; serve({endpoint!r}, threads={threads})"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            endpoints.append(endpoint)
        for proc, endpoint in zip(procs, endpoints):
            host, port = endpoint.rsplit(":", 1)
            deadline = time.monotonic() + LISTEN_DEADLINE_S
            while True:  # bounded: the server listens within the deadline, or the bench stops
                if proc.poll() is not None:
                    raise RuntimeError(f"the RPC server on {endpoint} exited ({proc.returncode})")
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the RPC server on {endpoint} did not listen") from None
                    time.sleep(0.05)
        yield endpoints
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


async def measure(label: str, model: Path, endpoints: list[str], args: argparse.Namespace) -> Row:
    """Load `model` in a runner, split over `endpoints` (none: whole), and time `args.runs` generations.

    The one function every row goes through, whatever carries the RPC bytes: give it the
    endpoints ("host:port") the runner's llama.cpp should connect to."""
    from psymesh.node.models import ModelRunner

    n_gpu_layers, split = rpc.split_layers(args.layers, [1.0] * (len(endpoints) + 1))
    settings = ModelSettings(path=model, n_ctx=4096, n_threads=args.threads, keep_alive_s=None,
                             rpc_servers=tuple(endpoints), n_gpu_layers=n_gpu_layers, tensor_split=split)
    runner = ModelRunner(settings)
    try:
        t0 = time.perf_counter()
        info = await runner.start()
        load_s = time.perf_counter() - t0
        no_eog = {t: float("-inf") for t in info.eog_token_ids}
        firsts, rates = [], []
        for _ in range(args.runs):
            rate, first, _wall = await bench_stream(runner, args.gen_tokens, no_eog)
            firsts.append(first)
            rates.append(rate)
        return Row(label, load_s, firsts, rates)
    finally:
        await runner.aclose()


# ------------------------------------------------------------------ over psymesh streams
@asynccontextmanager
async def psymesh_stream_endpoints(args: argparse.Namespace) -> AsyncIterator[list[str]]:
    """Two worker daemons (each its own process, `psymesh worker start`: llama.cpp's RPC server in
    its child, behind the door) paired with an owner node run in this process (as a daemon's
    event loop, it carries every byte), each granting it `compute.rpc`; the owner's link
    endpoints ("127.0.0.1:PORT", one per worker), which carry llama.cpp's RPC bytes on
    `/psymesh/rpc/1.0.0` streams over libp2p (Noise, yamux) on loopback."""
    from psymesh.node.control.client import Client
    from psymesh.node.control.process import DaemonProcess, pair_homes
    from psymesh.node.core.bridgeconfig import UiServe
    from psymesh.node.core.home import NodeHome, WorkerSettings
    from psymesh.node.daemon import Node

    with tempfile.TemporaryDirectory(prefix="psymesh-split-") as tmp:
        base = Path(tmp)
        home = NodeHome(base / "owner")
        home.init(profile="home", name="owner")
        config = home.load_config().model_copy(update={"listen": ["/ip4/127.0.0.1/tcp/0"], "ui": UiServe(port=0)})
        owner = Node(home, config)
        workers = [DaemonProcess(base / f"worker{i}", name=f"worker{i}") for i in (1, 2)]
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            try:
                ids = []
                for w in workers:
                    lender = NodeHome(w.home)
                    lender.init(profile="home", name=w.name)
                    lender.save_config(lender.load_config().model_copy(
                        update={"worker": WorkerSettings(enabled=True, threads=args.threads), "ui": UiServe(port=0)}))
                    status = await w.start()
                    async with Client(w.home) as c:
                        await c.worker("start")
                    await pair_homes(w.home, home.path, grant="messaging", grant_back=None)
                    async with Client(w.home) as c:
                        await c.grant("owner", add=["compute.rpc"])
                    ids.append(status.peer_id)
                yield [await owner.rpc_links.endpoint(peer_id) for peer_id in ids]
            finally:
                with anyio.CancelScope(shield=True):
                    for w in workers:
                        await w.stop()
                tg.cancel_scope.cancel()


def _row_text(row: Row, base: Row) -> str:
    return (f"load {row.load_s:6.2f} s ({row.load_s / base.load_s:4.2f}x)   "
            f"first token {row.first * 1000:7.1f} ms ({row.first / base.first:4.2f}x)   "
            f"{row.tps:6.2f} tok/s ({row.tps / base.tps:4.2f}x)   "
            f"runs: {', '.join(f'{r:.2f}' for r in row.rate)}")


async def run(args: argparse.Namespace) -> None:
    if not rpc.rpc_available():
        sys.exit("this llama-cpp-python has no RPC backend: run scripts/bootstrap.sh")
    t0 = time.perf_counter()
    model = args.model or make_botpsy_shaped_gguf(ROOT / ".bench", wtype=args.wtype, n_threads=args.threads)
    args.layers = block_count(model)
    print(f"model: {model.name} ({model.stat().st_size / 1e9:.2f} GB, {args.layers} layers), ready in "
          f"{time.perf_counter() - t0:.1f} s; {args.threads} threads each; {rpc.engine_build()}")
    counts = rpc.layer_counts(args.layers, [1.0, 1.0, 1.0])
    rows = [await measure("unsplit", model, [], args)]
    with plain_rpc_servers(2, args.threads) as endpoints:
        rows.append(await measure(f"plain RPC {'+'.join(map(str, counts))}", model, endpoints, args))
    async with psymesh_stream_endpoints(args) as streams:
        rows.append(await measure(f"psymesh {'+'.join(map(str, counts))}", model, streams, args))
    width = max(len(r.label) for r in rows)
    print()
    for row in rows:
        print(f"{row.label:<{width}}  {_row_text(row, rows[0])}")
    plain, ours = rows[1], rows[2]  # the goal: psymesh's carrying against llama.cpp's own TCP
    print(f"\npsymesh / plain RPC: tok/s {ours.tps / plain.tps:.2f}x (goal >= 0.80x), first token "
          f"{ours.first / plain.first:.2f}x ({(ours.first - plain.first) * 1000:+.1f} ms), "
          f"load {ours.load_s / plain.load_s:.2f}x ({ours.load_s - plain.load_s:+.2f} s)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    model_arguments(p)
    args = p.parse_args(argv)
    anyio.run(run, args, backend="trio")


if __name__ == "__main__":
    sys.exit(main())
