"""What "acknowledged means on disk" costs: one accepted task, one 64-letter batch.

Two in-process nodes (phone -> home) on 127.0.0.1, twice over in one run, rounds
interleaved so both see the same load: home syncing its WAL before each durable answer
(fdatasync, as shipped), and home with the sync made a no-op (what `synchronous=NORMAL`
alone gave: an answer after a commit only). Measured from the phone's session:
`task.submit` -> `task.accepted` (a no-op tool task, not followed), and `msg.send_many` of
64 signed letters -> `msg.receipts` (64 stored). Also printed: home's sync calls (no-ops in
the second mode).

Usage: .venv/bin/python bench/durable.py [--tasks N] [--batches N] [--rounds N]
Bounded by those counts; the run takes well under a minute on an idle machine.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.core.db import SYNC_FILE
from psymesh.node.core.home import NodeHome
from psymesh.node.control.process import pair_homes
from psymesh.protocol.messaging import Letter, MsgReceipts, MsgSendMany
from psymesh.protocol.tasks import TaskAccepted, TaskSpec, TaskSubmit


def node(path: Path, name: str, profile: str, fsync) -> Node:
    home = NodeHome(path)
    home.init(profile=profile, name=name)  # type: ignore[arg-type]
    config = home.load_config().model_copy(update={"listen": ["/ip4/127.0.0.1/tcp/0"]})
    return Node(home, config, fsync=fsync)


async def measure(workdir: Path, tasks: int, batches: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    modes = {"synced before the answer": SYNC_FILE, "no sync (before)": lambda fd: None}
    out: dict[str, dict[str, list[float]]] = {m: {"task": [], "batch": [], "syncs": []} for m in modes}
    async with anyio.create_task_group() as tg:
        pairs = {}
        for i, (mode, fsync) in enumerate(modes.items()):
            home = node(workdir / f"home{i}", "home", "home", fsync)
            phone = node(workdir / f"phone{i}", "phone", "phone", SYNC_FILE)
            await tg.start(home.run)
            await tg.start(phone.run)
            await pair_homes(home.home.path, phone.home.path)
            async with Client(home.home.path) as h:
                await h.grant("phone", ["tool:system.info", "msg.send"],
                              set_limits={"requests_per_minute": 1_000_000, "concurrent_tasks": 10_000})
            pairs[mode] = (home, phone)
        seq = {mode: 0 for mode in modes}
        for r in range(rounds):
            for mode, (home, phone) in pairs.items():
                to = home.identity.peer_id
                syncs = home.wal.syncs
                for i in range(tasks):
                    spec = TaskSpec(id=f"bench-{r}-{i}", kind="tool", tool="system.info")
                    start = time.perf_counter()
                    await phone.sessions.request(to, TaskSubmit(spec=spec, follow=False), TaskAccepted)
                    out[mode]["task"].append((time.perf_counter() - start) * 1000)
                for b in range(batches):
                    letters = []
                    for _ in range(64):
                        seq[mode] += 1
                        letters.append(Letter(id=f"b-{seq[mode]}", sender=phone.identity.peer_id, recipient=to,
                                              thread="bench", tseq=seq[mode], text="x" * 100,
                                              at=int(time.time() * 1000)).sign(phone.identity.private_key))
                    start = time.perf_counter()
                    reply = await phone.sessions.request(to, MsgSendMany(letters=letters), MsgReceipts)
                    out[mode]["batch"].append((time.perf_counter() - start) * 1000)
                    assert all(result.code is None for result in reply.results), reply
                out[mode]["syncs"].append(home.wal.syncs - syncs)
        tg.cancel_scope.cancel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=50, help="tasks per round and mode")
    ap.add_argument("--batches", type=int, default=10, help="64-letter batches per round and mode")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="psy-durable-") as tmp:
        out = anyio.run(measure, Path(tmp), args.tasks, args.batches, args.rounds, backend="trio")
    print(f"{'home answers':<28}{'task accepted ms':>18}{'p90':>8}{'64-letter batch ms':>20}{'p90':>8}"
          f"{'sync calls':>12}")
    for mode, figures in out.items():
        task, batch = sorted(figures["task"]), sorted(figures["batch"])
        print(f"{mode:<28}{statistics.median(task):>18.2f}{task[int(len(task) * 0.9)]:>8.2f}"
              f"{statistics.median(batch):>20.2f}{batch[int(len(batch) * 0.9)]:>8.2f}{sum(figures['syncs']):>12}")
    print(f"({args.rounds} rounds x {args.tasks} tasks and {args.batches} batches per mode, sequential; "
          "one sync per answer when they come one at a time)")


if __name__ == "__main__":
    main()
