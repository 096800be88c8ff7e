"""What one session round trip costs in work, not time: Python calls and turns of trio's scheduler.

Two real daemons (home, phone) in this one process, paired on 127.0.0.1; the phone pings
home on its open session (`/psymesh/session/1.0.0`, through home's door, as bench/rtt.py
does between two processes). Counted over `--count` pings, both ends together:

- Python calls a round trip (cProfile; its own overhead makes its timings no latency), and
  where the time goes, by package;
- task steps, turns of the run loop and tasks spawned a round trip (a trio instrument);
- the unprofiled in-process round trip (median, p99), for scale only: both ends share one
  core here, and the load of other work moves it.

Calls and steps do not move with the machine's load; docs/architecture.md ("What a request
costs") quotes them. Usage: .venv/bin/python bench/rtt_profile.py [--count N] [--top N]
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import anyio
import trio
from _common import summarize

PAYLOAD = b"x" * 32


class _Turns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps = self.turns = self.spawned = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1

    def before_io_wait(self, timeout: float) -> None:
        self.turns += 1

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


def _where(stats: pstats.Stats) -> list[tuple[str, float, int]]:
    """(package or file, share of the time, calls) by where the functions live."""
    time_by: collections.Counter[str] = collections.Counter()
    calls_by: collections.Counter[str] = collections.Counter()
    root = str(Path(__file__).resolve().parent.parent) + "/"
    for (file, _line, _name), (_cc, calls, own, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "site-packages/" in file:
            key = file.split("site-packages/")[1].split("/")[0]
        elif file.startswith(root):
            key = file[len(root):]
        elif file == "~":
            key = "(C functions)"
        else:
            key = "(stdlib)"
        time_by[key] += own
        calls_by[key] += calls
    total = sum(time_by.values()) or 1.0
    return [(key, own / total, calls_by[key]) for key, own in time_by.most_common()]


async def main(count: int, top: int) -> None:
    from psymesh.node.control.client import Client
    from psymesh.node.control.process import pair_homes
    from psymesh.node.core.bridgeconfig import UiServe
    from psymesh.node.core.home import NodeHome
    from psymesh.node.daemon import Node
    from psymesh.protocol.common import Ping, Pong
    from psymesh.protocol.limits import Limits

    with tempfile.TemporaryDirectory(prefix="psymesh-bench-") as tmp:
        async with anyio.create_task_group() as tg:
            nodes = {}
            for name in ("home", "phone"):
                home = NodeHome(Path(tmp) / name)
                home.init(profile="phone" if name == "phone" else "home", name=name)
                config = home.load_config().model_copy(update={"listen": ["/ip4/127.0.0.1/tcp/0"],
                                                               "ui": UiServe(port=0)})
                nodes[name] = Node(home, config)
                await tg.start(nodes[name].run)
            home, phone = nodes["home"], nodes["phone"]
            await pair_homes(home.home.path, phone.home.path)
            async with Client(home.home.path) as h:  # the phone preset allows 60 requests/min
                await h.grant("phone", ["tool:system.info"], limits=Limits(requests_per_minute=1_000_000))
            home_id = home.identity.peer_id

            async def ping(seq: int) -> None:
                await phone.sessions.request(home_id, Ping(seq=seq, payload=PAYLOAD), Pong)

            for seq in range(300):  # warm: the session, the window's tuning, the door's memos
                await ping(seq)
            profile = cProfile.Profile()
            profile.enable()
            for seq in range(count):
                await ping(seq)
            profile.disable()
            turns = _Turns()
            trio.lowlevel.add_instrument(turns)
            try:
                for seq in range(count):
                    await ping(seq)
            finally:
                trio.lowlevel.remove_instrument(turns)
            rtts: list[float] = []
            for seq in range(count):
                start = time.perf_counter()
                await ping(seq)
                rtts.append((time.perf_counter() - start) * 1000)
            tg.cancel_scope.cancel()
    print(f"session ping round trips, both daemons in one process, {count} each\n")
    report(pstats.Stats(profile), turns, count, "a round trip", "round trip", rtts, top)


def report(stats: pstats.Stats, turns: _Turns, count: int, each: str, what: str, latencies: list[float],
           top: int, extra: list[str] | None = None) -> None:
    """Calls, steps, turns and tasks spawned per `each` (of `count`), `extra` lines, the unprofiled
    in-process `what` latency, and where the time goes: shared with bench/task_profile.py."""
    calls = sum(row[1] for row in stats.stats.values())  # type: ignore[attr-defined]
    print(f"{'Python calls ' + each:<30}{calls / count:8.0f}")
    print(f"{'task steps ' + each:<30}{turns.steps / count:8.1f}")
    print(f"{'run-loop turns ' + each:<30}{turns.turns / count:8.1f}")
    print(f"{'tasks spawned ' + each:<30}{turns.spawned / count:8.1f}")
    for line in extra or []:
        print(line)
    median, p99 = summarize(latencies)
    print(f"{'in-process ' + what:<30}{median:8.3f} ms median, {p99:.3f} ms p99 (for scale only)\n")
    print(f"{'where (own time, profiled)':<52}{'share':>7}{'calls/' + each.split()[-1]:>12}")
    for key, share, n in _where(stats)[:top]:
        print(f"{key:<52}{share * 100:6.1f}%{n / count:12.0f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    anyio.run(main, args.count, args.top, backend="trio")
