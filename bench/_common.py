"""What the bench scripts share: a baseline server in its own process, percentiles, CPU ticks, and
the durability floor (one durable SQLite commit on this disk) with a trace of the WAL syncs a task waits for."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def spawn_server(code: str) -> tuple[subprocess.Popen[str], int]:
    """Run `code` (which prints its listening port, then serves) in a new Python process."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark on the BotPsy-shaped model (or another GGUF)."""
    p.add_argument("--model", type=Path, default=None, help="a GGUF to use instead of the BotPsy-shaped one")
    p.add_argument("--wtype", default="Q4_K_M", choices=["Q4_K_M", "Q8_0", "Q4_0", "Q6_K", "F16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)


def summarize(samples_ms: list[float]) -> tuple[float, float]:
    """(median, p99) of a list of latencies."""
    ordered = sorted(samples_ms)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def cpu_ms(pid: int) -> float:
    """CPU time a process used so far, all its threads: utime + stime from /proc (10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / CLK_TCK


class DurableFloor:
    """What one durable SQLite write costs on `db_path`'s file system, done the way node/core/db.py
    does it: a `synchronous=NORMAL` commit (open_db's settings) of a row about a task spec's size,
    then WalSync's fdatasync of the WAL (`SYNC_FILE`). The floor under every answer that promises
    durability; measured beside the daemons, on the disk their homes are on. The WAL is
    checkpointed after each sample, outside the timing (as the daemon's checkpointer does after a
    burst): a sample overwrites the WAL in place, as a daemon's commits mostly do."""

    def __init__(self, db_path: Path) -> None:
        from psymesh.node.core.db import open_db

        self.path = db_path
        self.conn = open_db(db_path, background_checkpoints=True)
        self.conn.execute("CREATE TABLE IF NOT EXISTS floor (id INTEGER PRIMARY KEY, spec TEXT NOT NULL)")
        self.samples_ms: list[float] = []   # commit + fdatasync
        self.sync_ms: list[float] = []      # the fdatasync alone

    def sample(self) -> float:
        from psymesh.node.core.db import SYNC_FILE, transaction

        start = time.perf_counter()
        with transaction(self.conn):
            self.conn.execute("INSERT INTO floor (spec) VALUES (?)", ("x" * 256,))
        fd = os.open(f"{self.path}-wal", os.O_RDONLY)
        try:
            committed = time.perf_counter()
            SYNC_FILE(fd)
        finally:
            os.close(fd)
        end = time.perf_counter()
        took = (end - start) * 1000
        self.samples_ms.append(took)
        self.sync_ms.append((end - committed) * 1000)
        self.conn.execute("DELETE FROM floor")  # bounded: the file stays one page
        self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        return took

    def close(self) -> None:
        self.conn.close()


class SyncTrace:
    """Which WAL fsyncs a task waits for: each node's fsync seam (`Node(fsync=...)`) timed, and
    each task's window (`timed(start, end)`), on one clock (nodes in this process).

    A side's sync counts for a task if it ended inside the task's window. It is on the critical
    path if the answer waited for it: the home's always (`task.accepted` leaves after it); the
    phone's only if it ended after the home's (before that, no answer could have come back, so
    the phone waited on the round trip, not on its disk): an upper bound, as the answer still
    had a frame to cross."""

    def __init__(self, answerer: str = "home") -> None:
        self.answerer = answerer
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.windows: list[tuple[float, float]] = []

    def fsync(self, name: str):  # type: ignore[no-untyped-def]
        from psymesh.node.core.db import SYNC_FILE

        spans = self.spans.setdefault(name, [])

        def traced(fd: int) -> None:
            start = time.perf_counter()
            SYNC_FILE(fd)
            spans.append((start, time.perf_counter()))
        return traced

    def timed(self, start: float, end: float) -> None:
        self.windows.append((start, end))

    def per_task(self) -> dict[str, tuple[float, float]]:
        """{node: (syncs a task, syncs on the critical path a task)} over the tasks timed."""
        counts = {name: [0, 0] for name in self.spans}
        for start, end in self.windows:
            ends = {name: [e for s, e in spans if start <= e <= end] for name, spans in self.spans.items()}
            answered = max(ends.get(self.answerer) or [start])
            for name, these in ends.items():
                counts[name][0] += len(these)
                counts[name][1] += sum(1 for e in these if name == self.answerer or e > answered)
        n = max(1, len(self.windows))
        return {name: (total / n, waited / n) for name, (total, waited) in counts.items()}
