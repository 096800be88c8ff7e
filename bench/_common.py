"""What the bench scripts share: a baseline server in its own process, and percentiles."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def spawn_server(code: str) -> tuple[subprocess.Popen[str], int]:
    """Run `code` (which prints its listening port, then serves) in a new Python process."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def summarize(samples_ms: list[float]) -> tuple[float, float]:
    """(median, p99) of a list of latencies."""
    ordered = sorted(samples_ms)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def cpu_ms(pid: int) -> float:
    """CPU time a process used so far, all its threads: utime + stime from /proc (10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / CLK_TCK
