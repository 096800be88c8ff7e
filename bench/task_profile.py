"""What one delegated task costs in work, not time: Python calls, trio's scheduler, SQLite, fsyncs.

Two real daemons (home, phone) and the SDK's client in this one process, paired on 127.0.0.1;
the script delegates a no-op tool task (`bench.noop`, the plugin bench/delegate.py installs)
and waits for its result, `delegate()` -> `result()`, `--count` times one after another, as
bench/delegate.py does between processes. Counted per task, all three together:

- Python calls (cProfile; its own overhead makes its timings no latency), and where the time
  goes, by package or file;
- task steps, turns of the run loop and tasks spawned (a trio instrument);
- SQLite statements and transactions on each daemon's connection (`Node.db_tally`) and WAL
  fsyncs (`WalSync.syncs`), and how many of those the task waited for (`SyncTrace`, on the
  timed tasks: the fsync seam of each node timed);
- the unprofiled in-process `delegate()` -> `result()` (median, p99), for scale only: all
  three share one core here, and the load of other work moves it.

The counts do not move with the machine's load as latencies do; docs/architecture.md ("What a
request costs") quotes them. Usage: .venv/bin/python bench/task_profile.py [--count N] [--top N]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import anyio
import trio
from delegate import install_plugin
from _common import SyncTrace
from rtt_profile import _Turns, report

WARMUP = 50


async def main(count: int, top: int, dump: str | None = None) -> None:
    from psymesh.node.control.client import Client
    from psymesh.node.control.process import pair_homes
    from psymesh.node.core.bridgeconfig import UiServe
    from psymesh.node.core.home import NodeHome
    from psymesh.node.daemon import Node
    from psymesh.protocol.limits import Limits

    with tempfile.TemporaryDirectory(prefix="psymesh-bench-") as tmp:
        install_plugin(Path(tmp) / "site")
        sys.path.insert(0, str(Path(tmp) / "site"))  # this process's tool registry, not only children's
        trace = SyncTrace(answerer="home")
        async with anyio.create_task_group() as tg:
            nodes = {}
            for name in ("home", "phone"):
                home = NodeHome(Path(tmp) / name)
                home.init(profile=name, name=name)  # type: ignore[arg-type]
                config = home.load_config().model_copy(update={"listen": ["/ip4/127.0.0.1/tcp/0"],
                                                               "ui": UiServe(port=0)})
                nodes[name] = Node(home, config, fsync=trace.fsync(name))
                await tg.start(nodes[name].run)
            await pair_homes(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
            async with Client(nodes["home"].home.path) as h:  # the phone preset allows 60 requests/min
                await h.grant("phone", ["tool:bench.*"],
                              limits=Limits(requests_per_minute=1_000_000, concurrent_tasks=64))

            async with Client(nodes["phone"].home.path) as client:
                async def task() -> None:
                    handle = await client.delegate("home", tool="bench.noop")
                    assert await handle.result() == {}

                for _ in range(WARMUP):
                    await task()
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(count):
                    await task()
                profile.disable()
                if dump:
                    profile.dump_stats(dump)
                turns = _Turns()
                statements = {name: node.db_tally.statements for name, node in nodes.items()}
                transactions = {name: node.db_tally.transactions for name, node in nodes.items()}
                syncs = {name: node.wal.syncs for name, node in nodes.items()}
                trio.lowlevel.add_instrument(turns)
                try:
                    for _ in range(count):
                        await task()
                finally:
                    trio.lowlevel.remove_instrument(turns)
                await anyio.sleep(0.2)  # the last batch of acks (ACK_DELAY_S) belongs to these tasks
                sql = {name: ((node.db_tally.statements - statements[name]) / count,
                              (node.db_tally.transactions - transactions[name]) / count,
                              (node.wal.syncs - syncs[name]) / count) for name, node in nodes.items()}
                latencies: list[float] = []
                for _ in range(count):
                    start = time.perf_counter()
                    await task()
                    latencies.append((time.perf_counter() - start) * 1000)
                    trace.timed(start, time.perf_counter())
            tg.cancel_scope.cancel()
    print(f"no-op tool tasks, delegate() -> result(), both daemons and the SDK in one process, {count} each\n")
    report(pstats.Stats(profile), turns, count, "a task", "task", latencies, top,
           [f"{name + ' SQLite':<30}{stmts:8.1f} statements, {txns:.1f} transactions, {fsyncs:.2f} WAL fsyncs "
            f"({trace.per_task()[name][1]:.2f} on the critical path)" for name, (stmts, txns, fsyncs) in sql.items()])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--dump", help="also write the profile here (pstats format), to read with pstats")
    args = ap.parse_args()
    anyio.run(main, args.count, args.top, args.dump, backend="trio")
