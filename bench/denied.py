"""Denied requests: what a paired peer's flood of refusals costs the node's disk.

A real home daemon grants a peer the `messaging` preset (msg.send, msg.ask; 30 requests a
minute). The peer (an in-process node on 127.0.0.1) then sends `task.submit` for a tool
it was not granted, from --lanes concurrent loops, for --seconds; each answer is a
refusal (`forbidden`, then `rate_limited` once its refusals pass their own budget).
Meanwhile it sends one allowed request (`ping`, charged to its grant's rate) every
--ping-every seconds and counts how many were served. Printed: refusals sent, pings
served, and the growth of home's node.db + node.db-wal during the flood and after it
settles (the daemon's checkpoints restart the WAL once the writes stop).

Usage: .venv/bin/python bench/denied.py [--seconds 30] [--lanes 8] [--ping-every 2.5]
Bounded by --seconds (and a per-request timeout); the run takes about --seconds + 15 s.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio

from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.core.home import NodeHome
from psymesh.node.control.process import DaemonProcess, pair_homes
from psymesh.protocol.common import Ping, Pong
from psymesh.protocol.errors import PsymeshError
from psymesh.protocol.tasks import TaskAccepted, TaskSpec, TaskSubmit


def db_bytes(home: Path) -> int:
    """node.db and its WAL, as the disk holds them."""
    return sum(p.stat().st_size for p in (home / "node.db", home / "node.db-wal") if p.exists())


async def flood(workdir: Path, seconds: float, lanes: int, ping_every: float) -> dict[str, float]:
    home = DaemonProcess(workdir / "home", name="home")
    await home.start()
    try:
        peer_home = NodeHome(workdir / "peer")
        peer_home.init(profile="phone", name="peer")
        config = peer_home.load_config().model_copy(update={"listen": ["/ip4/127.0.0.1/tcp/0"]})
        peer = Node(peer_home, config)
        async with anyio.create_task_group() as tg:
            await tg.start(peer.run)
            await pair_homes(home.home, peer_home.path, grant="messaging", grant_back=None)
            async with Client(home.home) as h:
                home_id = (await h.status()).peer_id
            await peer.sessions.request(home_id, Ping(seq=0), Pong)  # the session is open
            await anyio.sleep(1.0)  # let the pairing's writes settle into the WAL
            before = db_bytes(home.home)
            counts = {"refused": 0, "accepted": 0, "errors": 0, "pings": 0, "pings_served": 0}
            deadline = time.monotonic() + seconds

            async def lane(n: int) -> None:
                i = 0
                while time.monotonic() < deadline:
                    i += 1
                    spec = TaskSpec(id=f"deny-{n}-{i}", kind="tool", tool="files.read", args={"path": "x"})
                    try:
                        await peer.sessions.request(home_id, TaskSubmit(spec=spec), TaskAccepted, timeout=10)
                        counts["accepted"] += 1
                    except PsymeshError as exc:
                        counts["refused" if exc.code.value in ("forbidden", "rate_limited") else "errors"] += 1

            async def pinger() -> None:
                seq = 0
                while time.monotonic() < deadline:
                    seq += 1
                    counts["pings"] += 1
                    try:
                        await peer.sessions.request(home_id, Ping(seq=seq), Pong, timeout=10)
                        counts["pings_served"] += 1
                    except PsymeshError:
                        pass
                    await anyio.sleep(ping_every)

            started = time.monotonic()
            async with anyio.create_task_group() as flood_tg:
                for n in range(lanes):
                    flood_tg.start_soon(lane, n)
                flood_tg.start_soon(pinger)
            took = time.monotonic() - started
            during = db_bytes(home.home)
            await anyio.sleep(8.0)  # the checkpointer works after the writes stop
            after = db_bytes(home.home)
            tg.cancel_scope.cancel()
    finally:
        await home.stop()
    return {**counts, "seconds": took, "before": before, "during": during, "after": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--ping-every", type=float, default=2.5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="psy-denied-") as tmp:
        r = anyio.run(flood, Path(tmp), args.seconds, args.lanes, args.ping_every, backend="trio")
    mb = 1024 * 1024
    print(f"denied flood: {r['refused']} refusals in {r['seconds']:.1f} s ({r['refused'] / r['seconds']:.0f}/s), "
          f"{r['accepted']} accepted, {r['errors']} other errors")
    print(f"allowed pings served meanwhile: {r['pings_served']}/{r['pings']}")
    print(f"node.db + WAL: {r['before'] / mb:.2f} MB before, {r['during'] / mb:.2f} MB at the flood's end "
          f"(+{(r['during'] - r['before']) / mb:.2f} MB), {r['after'] / mb:.2f} MB 8 s later "
          f"(+{(r['after'] - r['before']) / mb:.2f} MB)")


if __name__ == "__main__":
    main()
