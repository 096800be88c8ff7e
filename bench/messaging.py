"""Messages between agents: how many letters a second, how long one takes, and how long
one takes to reach a group of 20.

1. Two real daemons (phone -> home) on 127.0.0.1, driven through the SDK as an app
   would (the phone's control socket to send, home's to read its inbox):
   a. throughput: N letters sent as fast as one SDK connection sends them (each
      `send()` returns once the letter is durable in the phone's outbox), timed from the
      first send to the last letter read from home's inbox stream;
   b. latency: one letter at a time, `send()` on the phone -> the letter read from home's
      inbox stream (p50 / p99);
   c. psymesh's own round trip on the open session between the same daemons (`ping`,
      timed inside the phone daemon), in the same run, as the yardstick for (b).
   Home grants the phone high limits for this (the messaging preset allows 30 a minute).
2. Fan-out: a sender daemon and 20 in-process nodes (one process, so the two cores
   split sender and receivers), each a member of one group; `group_send()` of one
   letter, timed until all 20 nodes hold it in their inbox. The first send includes
   dialing 20 peers; the rest go over open sessions.

Every letter is checked at the end: each arrived exactly once, in order.

   With --senders K, K SDK connections send the burst at once, each in its own thread (as
   K agents on the phone would): one connection waits a control round trip per letter, so
   it measures send() as much as delivery.

Usage: .venv/bin/python bench/messaging.py [--letters N] [--latency N] [--senders K] [--rounds N] [--members N]
Every loop is bounded by these counts and by deadlines; the run takes about a minute.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from _common import summarize

DEADLINE_S = 300.0  # any one part of the bench
ROOMY = {"requests_per_minute": 1_000_000, "max_payload_bytes": 1 << 20}


@dataclass
class Figures:
    letters: int = 0
    send_s: float = 0.0          # all send() calls returned
    all_in_s: float = 0.0        # the last letter read from home's inbox
    latency_ms: list[float] = field(default_factory=list)
    rtt_ms: list[float] = field(default_factory=list)
    fanout_cold_ms: float = 0.0
    fanout_ms: list[float] = field(default_factory=list)
    members: int = 0


@contextlib.asynccontextmanager
async def two_daemons(tmp: Path) -> AsyncIterator[tuple[object, object]]:
    from psymesh.node.control.process import DaemonProcess, pair_homes
    from psymesh.protocol.limits import Limits

    home = DaemonProcess(tmp / "home", name="home")
    phone = DaemonProcess(tmp / "phone", profile="phone", name="phone")
    await home.start()
    await phone.start()
    try:
        await pair_homes(home.home, phone.home, grant="phone")
        async with home.client() as h:
            await h.grant("phone", ["msg.send"], limits=Limits(**ROOMY))
        yield home, phone
    finally:
        await phone.stop()
        await home.stop()


async def bench_pair(tmp: Path, letters: int, latency_runs: int, figures: Figures, senders: int = 1) -> None:
    async with two_daemons(tmp) as (home, phone):
        async with phone.client() as p, home.client() as h:  # type: ignore[attr-defined]
            figures.rtt_ms = (await p.ping("home", count=min(1000, max(latency_runs, 100)))).rtts_ms
            inbox = h.inbox()
            # (a) throughput: `senders` SDK connections, each its own thread, sending at once
            share = [letters // senders + (k < letters % senders) for k in range(senders)]
            got: list[object] = []
            async with contextlib.AsyncExitStack() as stack:
                clients = [p] + [await stack.enter_async_context(phone.client()) for _ in range(senders - 1)]
                start = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    async def read() -> None:
                        async for m in inbox:
                            got.append(m)
                            if len(got) == letters:
                                return

                    async def send(k: int) -> None:
                        for i in range(share[k]):
                            await clients[k].send("home", f"letter {i}", thread=f"burst{k}")

                    tg.start_soon(read)
                    async with anyio.create_task_group() as sending:
                        for k in range(senders):
                            sending.start_soon(send, k)
                    figures.send_s = time.perf_counter() - start
                figures.all_in_s = time.perf_counter() - start
            figures.letters = len(got)
            for k in range(senders):
                check_once_in_order([m for m in got if m.thread == f"burst{k}"],  # type: ignore[attr-defined]
                                    [f"letter {i}" for i in range(share[k])])
            # (b) latency, one letter at a time
            for i in range(latency_runs + 20):
                t = time.perf_counter()
                await p.send("home", f"ping {i}", thread="latency")
                m = await inbox.__anext__()
                if i >= 20:  # warm-up done
                    figures.latency_ms.append((time.perf_counter() - t) * 1000)
                assert m.text == f"ping {i}", m.text  # type: ignore[attr-defined]
            await inbox.aclose()


def check_once_in_order(got: list[object], expected: list[str]) -> None:
    texts = [m.text for m in got]  # type: ignore[attr-defined]
    ids = [m.id for m in got]  # type: ignore[attr-defined]
    assert texts == expected, "letters lost, duplicated or out of order"
    assert len(set(ids)) == len(ids)


async def bench_fanout(tmp: Path, members: int, rounds: int, figures: Figures) -> None:
    """One sender daemon; `members` nodes in this process, all in group `all`."""
    from psymesh.node.daemon import Node
    from psymesh.node.core.home import NodeHome
    from psymesh.node.control.process import DaemonProcess, pair_homes
    from psymesh.node.control.client import Client
    from psymesh.protocol.limits import Limits

    sender = DaemonProcess(tmp / "sender", name="sender")
    await sender.start()
    try:
        async with anyio.create_task_group() as tg:
            nodes: list[Node] = []
            for i in range(members):
                home = NodeHome(tmp / f"m{i:02d}")
                home.init(profile="phone", name=f"m{i:02d}")
                node = Node(home)
                await tg.start(node.run)
                nodes.append(node)
            for node in nodes:  # each member lets the sender write to it
                await pair_homes(node.home.path, sender.home, grant="messaging")
                async with Client(node.home.path) as m:
                    await m.grant("sender", ["msg.send"], limits=Limits(**ROOMY))
            figures.members = len(nodes)
            # The 20 members share this interpreter (each is a device of its own in life):
            # keep their startup objects out of its full collections, as a daemon does.
            gc.collect()
            gc.freeze()
            async with sender.client() as s:
                await s.group_create("all", [n.config.name for n in nodes])
                for r in range(rounds + 1):
                    took = await one_fanout(s, nodes, r)
                    if r == 0:
                        figures.fanout_cold_ms = took
                    else:
                        figures.fanout_ms.append(took)
            for node in nodes:
                check_once_in_order([x.letter for x in node.messaging.store.released_after(0, limit=10_000)],
                                    [f"round {r}" for r in range(rounds + 1)])
            tg.cancel_scope.cancel()
    finally:
        await sender.stop()


async def one_fanout(sender, nodes, r: int) -> float:  # type: ignore[no-untyped-def]
    """ms from group_send() to the last of `nodes` holding the letter."""
    arrived: list[float] = []
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        async def wait_for(node) -> None:  # type: ignore[no-untyped-def]
            async for received in node.messaging.follow(node.messaging.store.last_released()):
                if received.letter.text == f"round {r}":
                    arrived.append(time.perf_counter())
                    return

        for node in nodes:  # (started before the send: each follows from its inbox's end)
            tg.start_soon(wait_for, node)
        await sender.group_send("all", f"round {r}")
    assert len(arrived) == len(nodes)
    return (max(arrived) - start) * 1000


async def run(args: argparse.Namespace, tmp: Path) -> Figures:
    figures = Figures()
    with anyio.fail_after(DEADLINE_S):
        await bench_pair(tmp / "pair", args.letters, args.latency, figures, args.senders)
    with anyio.fail_after(DEADLINE_S):
        await bench_fanout(tmp / "fanout", args.members, args.rounds, figures)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--letters", type=int, default=2000, help="letters in the throughput burst")
    ap.add_argument("--latency", type=int, default=300, help="letters timed one at a time")
    ap.add_argument("--senders", type=int, default=1,
                    help="SDK connections sending the burst at once (each its own thread)")
    ap.add_argument("--rounds", type=int, default=20, help="group sends timed (after a first, cold one)")
    ap.add_argument("--members", type=int, default=20, help="group members (in-process nodes)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="psymesh-bench-") as tmp_dir:
        f = anyio.run(run, args, Path(tmp_dir), backend="trio")

    rtt, lat = summarize(f.rtt_ms), summarize(f.latency_ms)
    print(f"Letters between two daemons (phone -> home), 127.0.0.1, through the SDK on both ends"
          f" ({args.senders} sending connection(s))\n")
    print(f"throughput: {f.letters} letters in {f.all_in_s:.2f} s = {f.letters / f.all_in_s:,.0f} letters/s "
          f"end to end   (target >= 2,000/s)")
    print(f"            send() calls alone: {f.letters / f.send_s:,.0f} letters/s (durable in the outbox)\n")
    print(f"{'path':<56}{'median ms':>11}{'p99 ms':>10}")
    print(f"{'psymesh round trip on the open session (ping)':<56}{rtt[0]:>11.3f}{rtt[1]:>10.3f}")
    print(f"{'one letter: send() -> read from the inbox stream':<56}{lat[0]:>11.3f}{lat[1]:>10.3f}"
          f"   (target p99 <= 10 ms)")
    print(f"\none letter / session round trip   median {lat[0] / rtt[0]:5.1f}x   p99 {lat[1] / rtt[1]:5.1f}x")
    fan = summarize(f.fanout_ms)
    print(f"\nOne letter to a group of {f.members} nodes (sender daemon -> {f.members} in-process nodes), "
          f"until all hold it\n")
    print(f"first send (dials {f.members} peers): {f.fanout_cold_ms:8.1f} ms")
    print(f"over open sessions, {len(f.fanout_ms)} sends: median {fan[0]:.1f} ms, p99 {fan[1]:.1f} ms, "
          f"max {max(f.fanout_ms):.1f} ms   (target <= 50 ms)")
    print(f"\nnothing lost or duplicated: every letter arrived once, in order "
          f"({f.letters + len(f.latency_ms) + 20} between the pair, {f.members} x {len(f.fanout_ms) + 1} in the group)")


if __name__ == "__main__":
    main()
