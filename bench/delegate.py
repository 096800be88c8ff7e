"""Delegated tasks: what a script pays per task, and how fast tokens stream back.

1. Latency of a no-op tool task, SDK `delegate()` -> `result()`, through two real
   daemons (phone -> home) on 127.0.0.1, against two baselines measured in the same
   run: a plain HTTP/1.1 request to a local server running the same no-op
   (keep-alive, TCP_NODELAY on both ends: the fair baseline; without NODELAY HTTP
   pays ~40 ms of delayed ACK), and psymesh's own round trip on the open session
   between the same two daemons (`psymesh ping`, timed inside the phone daemon).
   The task figure is everything a task is: the control socket, a durable outbox
   row (its WAL sync overlaps the hand-over), the request on the session, the door
   (admission, audit row), the executor's SQLite log (accepted/working/result) and
   its WAL sync before `task.accepted` (the worker runs meanwhile), the events
   mirrored on the phone, and the final event on the control socket (with the answer
   to `delegate()` when the task ended during its acceptance, as a no-op does; else
   `result()` waits for it, `control.task_wait`); the acks follow off the critical path. docs/architecture.md ("What a request costs") lists the SQLite
   statements and transactions a task costs each side. Beside the latencies: the CPU
   each daemon and this script spent a timed task (/proc, every thread, 10 ms ticks over
   the whole loop), steadier than latency on a shared machine; bench/task_profile.py
   counts the same task's Python calls, scheduler turns and SQLite work in one process.
2. Streamed tokens: an infer task on a tiny random-weight qwen35 model; the rate of
   `token` events (and characters) the phone's app receives, and the first token's
   latency against the same model called in process (`agent.runtime.generate`, no mesh).
   The executor sends the first token at once, then batches deltas into one event
   per `token_flush_s` (50 ms); an in-process pair with batching off shows what the
   event pipeline itself carries.

The no-op tool is a plugin (`bench.noop`), installed for the child daemons the way
pip would (a dist-info with an entry point, on PYTHONPATH).

Usage: .venv/bin/python bench/delegate.py [--runs N] [--tokens N]
Every loop is bounded by --runs / --tokens; the whole run takes well under 2 minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from _common import DurableFloor, SyncTrace, cpu_ms, spawn_server, summarize

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 20
PARAMS = {"ban_bytes": True, "seed": 1, "temperature": 0}

PLUGIN = textwrap.dedent('''
    from psymesh.agent.acting.tools import tool_from_function

    async def noop() -> dict:
        """Do nothing (async: no worker-thread hop), for latency benchmarks."""
        return {}

    TOOL = tool_from_function(noop, "bench.noop")
''')

HTTP_SERVER = textwrap.dedent("""
    import json, socket
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def noop():
        return {}

    class Tool(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"      # keep-alive
        disable_nagle_algorithm = True      # TCP_NODELAY on the server side
        def do_POST(self):
            call = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert call["tool"] == "bench.noop"
            body = json.dumps({"result": noop()}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a): pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Tool)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
""")


def install_plugin(where: Path) -> None:
    """Make `bench.noop` visible to daemons started from here on (they inherit PYTHONPATH)."""
    dist = where / "bench_noop-1.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (where / "bench_noop.py").write_text(PLUGIN)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bench-noop\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[psymesh.tools]\nnoop = bench_noop:TOOL\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))



# --------------------------------------------------------------------------- HTTP baseline


def bench_http(runs: int) -> list[float]:
    proc, port = spawn_server(HTTP_SERVER)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = json.dumps({"tool": "bench.noop", "args": {}}).encode()
        out = []
        for i in range(runs + WARMUP):
            t = time.perf_counter()
            conn.request("POST", "/tool", body=body, headers={"Content-Type": "application/json"})
            assert json.loads(conn.getresponse().read()) == {"result": {}}
            if i >= WARMUP:
                out.append((time.perf_counter() - t) * 1000)
        conn.close()
        return out
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- psymesh


@dataclass
class MeshFigures:
    accepted_ms: list[float]   # delegate() returned: the home holds the task durably
    result_ms: list[float]     # result() returned
    rtt_ms: list[float] = field(default_factory=list)  # ping round trips on the open session
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU per timed task: phone, home, the script
    floor_ms: list[float] = field(default_factory=list)  # one durable SQLite commit on the daemons' disk, between tasks
    floor_sync_ms: list[float] = field(default_factory=list)  # ... its fdatasync alone
    first_token_ms: float = 0.0
    token_events: int = 0
    token_chars: int = 0
    completion_tokens: int = 0
    stream_s: float = 0.0


@contextlib.asynccontextmanager
async def daemons(tmp: Path, model: Path) -> AsyncIterator[tuple[object, object]]:
    from psymesh.node.core.db import open_db
    from psymesh.node.models import ModelRegistry
    from psymesh.node.control.process import DaemonProcess, pair_homes
    from psymesh.protocol.limits import Limits

    home = DaemonProcess(tmp / "home", name="home")
    phone = DaemonProcess(tmp / "phone", profile="phone", name="phone")
    await home.start()
    await phone.start()
    try:
        await pair_homes(home.home, phone.home, grant="phone")
        async with home.client() as h:  # the phone preset allows 60 requests/min; a bench needs more
            await h.grant("phone", ["tool:bench.*", "task.infer"],
                          limits=Limits(requests_per_minute=1_000_000, concurrent_tasks=64))
        conn = open_db(home.home / "node.db")
        ModelRegistry(conn).add("tiny", model, n_ctx=8192, n_threads=1)
        conn.close()
        yield home, phone
    finally:
        await phone.stop()
        await home.stop()


async def stream_tokens(client, max_tokens: int, figures: MeshFigures) -> None:  # type: ignore[no-untyped-def]
    from psymesh.protocol.tasks import EventKind

    start = time.perf_counter()
    task = await client.delegate("home", infer="Count.", model="tiny", max_tokens=max_tokens, params=PARAMS)
    first = last = 0.0
    async for ev in task.events():
        if ev.kind is EventKind.TOKEN:
            last = time.perf_counter()
            first = first or last
            figures.token_events += 1
            figures.token_chars += len(ev.data["text"])
    result = await task.result()
    figures.first_token_ms = (first - start) * 1000
    figures.completion_tokens = result.usage.completion_tokens
    figures.stream_s = last - first


async def bench_mesh(runs: int, max_tokens: int, model: Path, tmp: Path) -> MeshFigures:
    figures = MeshFigures([], [])
    async with daemons(tmp, model) as (home, phone):
        pids = {"phone": phone.proc.pid, "home": home.proc.pid}  # type: ignore[attr-defined]
        floor = DurableFloor(tmp / "floor.db")  # beside the daemons' homes
        floor_cpu_ms = 0.0
        async with phone.client() as c:  # type: ignore[attr-defined]
            for i in range(runs + WARMUP):
                if i == WARMUP:
                    cpu = {name: cpu_ms(pid) for name, pid in pids.items()} | {"script": time.process_time() * 1000}
                t = time.perf_counter()
                task = await c.delegate("home", tool="bench.noop")
                accepted = time.perf_counter()
                assert await task.result() == {}
                if i >= WARMUP:
                    figures.accepted_ms.append((accepted - t) * 1000)
                    figures.result_ms.append((time.perf_counter() - t) * 1000)
                    # the floor, interleaved: the same disk under the same load, off the timed path
                    # (and out of the script's CPU figure)
                    before = time.process_time()
                    floor.sample()
                    floor_cpu_ms += (time.process_time() - before) * 1000
            spent = {name: cpu_ms(pid) for name, pid in pids.items()} | {"script": time.process_time() * 1000
                                                                         - floor_cpu_ms}
            figures.cpu_ms = {name: (spent[name] - cpu[name]) / runs for name in spent}
            figures.floor_ms, figures.floor_sync_ms = floor.samples_ms, floor.sync_ms
            floor.close()
            figures.rtt_ms = (await c.ping("home", count=min(1000, runs * 5))).rtts_ms
            await stream_tokens(c, 64, MeshFigures([], []))  # load the model first
            await stream_tokens(c, max_tokens, figures)
    return figures


async def first_token_in_process(max_tokens: int, model: Path) -> float:
    """Time to the first token with the same model called here, no mesh: the floor."""
    from psymesh.agent.formats.chatformat import ChatMessage
    from psymesh.agent.runtime.generate import GenerationParams, TextDelta, generate
    from psymesh.agent.runtime.api import ModelSettings
    from psymesh.agent.runtime.worker import ModelWorker

    worker = ModelWorker(ModelSettings(path=model, n_ctx=8192, n_threads=1))
    await worker.start()
    params = GenerationParams(max_tokens=max_tokens, **PARAMS)
    try:
        samples = []
        for _ in range(6):  # the first run loads and warms up, as the daemon's did
            start = time.perf_counter()
            async for piece in generate(worker, [ChatMessage.user("Count.")], params=params):
                if isinstance(piece, TextDelta) and piece.text:
                    samples.append((time.perf_counter() - start) * 1000)
                    break
        return statistics.median(samples[1:])
    finally:
        await worker.aclose()


async def trace_syncs(runs: int, tmp: Path) -> dict[str, tuple[float, float]]:
    """The WAL fsyncs a no-op task waits for, each side (SyncTrace): in-process nodes on the
    same disk, their fsync seams timed; `runs` tasks after the warm-up."""
    from psymesh.node.control.client import Client
    from psymesh.node.control.process import pair_homes
    from psymesh.node.core.bridgeconfig import UiServe
    from psymesh.node.core.home import NodeHome
    from psymesh.node.daemon import Node
    from psymesh.protocol.limits import Limits

    trace = SyncTrace(answerer="home")
    async with anyio.create_task_group() as tg:
        nodes = {}
        for name in ("home", "phone"):
            home = NodeHome(tmp / name)
            home.init(profile=name, name=name)  # type: ignore[arg-type]
            config = home.load_config().model_copy(update={"listen": ["/ip4/127.0.0.1/tcp/0"], "ui": UiServe(port=0)})
            nodes[name] = Node(home, config, fsync=trace.fsync(name))
            await tg.start(nodes[name].run)
        await pair_homes(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        async with Client(nodes["home"].home.path) as h:
            await h.grant("phone", ["tool:bench.*"], limits=Limits(requests_per_minute=1_000_000, concurrent_tasks=64))
        async with Client(nodes["phone"].home.path) as c:
            for i in range(runs + WARMUP):
                start = time.perf_counter()
                assert await (await c.delegate("home", tool="bench.noop")).result() == {}
                if i >= WARMUP:
                    trace.timed(start, time.perf_counter())
        tg.cancel_scope.cancel()
    return trace.per_task()


async def bench_unbatched(max_tokens: int, model: Path, tmp: Path) -> MeshFigures:
    """The same token stream from in-process nodes with batching off: one event per token."""
    from psymesh.node.control.client import Client
    from psymesh.node.daemon import Node
    from psymesh.node.core.home import NodeHome
    from psymesh.node.control.process import pair_homes
    from psymesh.node.tasks.executor import ExecutorLimits

    figures = MeshFigures([], [])
    async with anyio.create_task_group() as tg:
        nodes = {}
        for name, profile in (("home", "home"), ("phone", "phone")):
            home = NodeHome(tmp / name)
            home.init(profile=profile, name=name)  # type: ignore[arg-type]
            nodes[name] = Node(home)
            await tg.start(nodes[name].run)
        nodes["home"].executor.limits = ExecutorLimits(token_flush_s=0.0)
        nodes["home"].models.registry.add("tiny", model, n_ctx=8192, n_threads=1)
        await pair_homes(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        async with Client(nodes["phone"].home.path) as c:
            await stream_tokens(c, 64, MeshFigures([], []))
            await stream_tokens(c, max_tokens, figures)
        tg.cancel_scope.cancel()
    return figures


# --------------------------------------------------------------------------- report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300, help="no-op tasks (and HTTP requests x10) to time")
    ap.add_argument("--tokens", type=int, default=4000, help="max_tokens of the streamed infer task")
    args = ap.parse_args()

    from psymesh.agent.runtime.testmodel import tiny_model_path

    with tempfile.TemporaryDirectory(prefix="psymesh-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        model = tiny_model_path(ROOT / ".bench")
        install_plugin(tmp / "site")
        sys.path.insert(0, str(tmp / "site"))  # and for the in-process nodes of trace_syncs
        http_ms = bench_http(args.runs * 10)
        mesh = anyio.run(bench_mesh, args.runs, args.tokens, model, tmp / "daemons", backend="trio")
        syncs = anyio.run(trace_syncs, min(args.runs, 300), tmp / "traced", backend="trio")
        raw = anyio.run(bench_unbatched, args.tokens, model, tmp / "inproc", backend="trio")
        floor_ms = anyio.run(first_token_in_process, args.tokens, model, backend="trio")

    http_, rtt = summarize(http_ms), summarize(mesh.rtt_ms)
    accepted, result = summarize(mesh.accepted_ms), summarize(mesh.result_ms)
    print(f"No-op tool task, 127.0.0.1, {args.runs} psymesh tasks / {len(http_ms)} HTTP requests / "
          f"{len(mesh.rtt_ms)} session round trips, sequential\n")
    print(f"{'path':<56}{'median ms':>11}{'p99 ms':>10}")
    print(f"{'HTTP/1.1 keep-alive POST, TCP_NODELAY both ends':<56}{http_[0]:>11.3f}{http_[1]:>10.3f}")
    print(f"{'psymesh round trip on the open session (ping)':<56}{rtt[0]:>11.3f}{rtt[1]:>10.3f}")
    print(f"{'psymesh delegate() returns (home holds it durably)':<56}{accepted[0]:>11.3f}{accepted[1]:>10.3f}")
    print(f"{'psymesh delegate() -> result()':<56}{result[0]:>11.3f}{result[1]:>10.3f}")
    print(f"\ndelegate() -> result()  / session round trip   median {result[0] / rtt[0]:5.1f}x   (target <= 3x)")
    print(f"delegate() -> result()  / HTTP request         median {result[0] / http_[0]:5.1f}x   (target <= 10x)")
    print(f"delegate() accepted     / session round trip   median {accepted[0] / rtt[0]:5.1f}x   (target <= 1.5x)")
    print(f"delegate() -> result()  p99 / median                  {result[1] / result[0]:5.1f}x   (target <= 2x)")
    print("CPU a task (ms; /proc ticks, all threads): " + ", ".join(f"{k} {v:.2f}" for k, v in mesh.cpu_ms.items()))

    # The durability floor: what the syncs on the task's critical path cost on this disk now.
    floor = summarize(mesh.floor_ms)
    waited = sum(on_path for _, on_path in syncs.values())
    rest = max(0.0, result[0] - waited * floor[0])
    print(f"\none durable SQLite commit here (synchronous=NORMAL + fdatasync of the WAL, {len(mesh.floor_ms)} "
          f"between the tasks): median {floor[0]:.3f} ms (the fdatasync {summarize(mesh.floor_sync_ms)[0]:.3f}), "
          f"p99 {floor[1]:.3f} ms")
    print("WAL fsyncs a task (in-process trace): " + ", ".join(
        f"{name} {total:.2f} ({on_path:.2f} on the critical path)" for name, (total, on_path) in syncs.items()))
    print(f"{'delegate() -> result()':<40}{result[0]:8.3f} ms  = {waited:.2f} fsyncs x {floor[0]:.3f} ms "
          f"({waited * floor[0]:.3f} ms) + {rest:.3f} ms")
    print(f"without the fsync floor                 {rest:8.3f} ms  = {rest / rtt[0]:5.1f}x the session round trip, "
          f"{rest / http_[0]:5.1f}x HTTP")
    bare = max(0.0, result[0] - waited * summarize(mesh.floor_sync_ms)[0])
    print(f"... the fdatasyncs alone taken out      {bare:8.3f} ms  = {bare / rtt[0]:5.1f}x the session round trip, "
          f"{bare / http_[0]:5.1f}x HTTP (the floor's commit is CPU here, as a task's own commits are)")

    print(f"\nStreamed tokens, infer task on the tiny qwen35 model (max_tokens {args.tokens}, 1 thread)\n")
    print(f"{'pipeline':<40}{'token events/s':>15}{'tokens/s':>10}{'chars/s':>10}{'1st token ms':>14}")
    for name, f in (("daemons, 50 ms batching (default)", mesh), ("in-process nodes, batching off", raw)):
        span = max(f.stream_s, 1e-9)
        print(f"{name:<40}{f.token_events / span:>15.0f}{f.completion_tokens / span:>10.0f}"
              f"{f.token_chars / span:>10.0f}{f.first_token_ms:>14.1f}")
    print(f"{'the model called in process, no mesh':<40}{'':>15}{'':>10}{'':>10}{floor_ms:>14.1f}")
    print(f"\nfirst token through two daemons - in process: {mesh.first_token_ms - floor_ms:+.1f} ms (target <= +5 ms)")
    print(f"({mesh.token_events} events carried {mesh.completion_tokens} tokens with batching, "
          f"{raw.token_events} events for {raw.completion_tokens} tokens without)")

if __name__ == "__main__":
    main()
