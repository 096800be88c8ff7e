"""What the bench scripts share: a baseline server in its own process, and percentiles."""
from __future__ import annotations

import statistics
import subprocess
import sys


def spawn_server(code: str) -> tuple[subprocess.Popen[str], int]:
    """Run `code` (which prints its listening port, then serves) in a new Python process."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def summarize(samples_ms: list[float]) -> tuple[float, float]:
    """(median, p99) of a list of latencies."""
    ordered = sorted(samples_ms)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
