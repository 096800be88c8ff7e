"""CLI start-up: wall time of `psymesh status` against a running daemon, beside `python -c pass`.

Scripts call the CLI in loops and a phone CPU is 3-4x slower than this machine, so the
time a command takes before it does anything is felt on every call. Each sample is one
new process, timed from spawn to exit (what a user waits for); the median of --count runs
is shown, with `import psymesh` alone and `psymesh --help` for where the time goes.
Target (issue 22): `psymesh status` <= 150 ms median wall here.

Usage: .venv/bin/python bench/cli.py [--count N]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from _common import summarize

from psymesh.node.process import DaemonProcess


def wall_ms(cmd: list[str], count: int) -> list[float]:
    samples = []
    for _ in range(count):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        samples.append((time.perf_counter() - t0) * 1000)
    return samples


async def main(count: int) -> None:
    with tempfile.TemporaryDirectory(prefix="psy-bench-cli-") as tmp:
        daemon = DaemonProcess(Path(tmp) / "home", name="home")
        await daemon.start()
        try:
            py = sys.executable
            rows = [
                ("python -c pass", [py, "-c", "pass"]),
                ("python -c 'import psymesh'", [py, "-c", "import psymesh"]),
                ("psymesh --help", [py, "-m", "psymesh", "--help"]),
                ("psymesh status", [py, "-m", "psymesh", "status", "--home", str(daemon.home)]),
            ]
            print(f"{'command':32} {'median ms':>10} {'p99 ms':>8}   ({count} runs each)")
            for label, cmd in rows:
                med, p99 = summarize(wall_ms(cmd, count))
                print(f"{label:32} {med:10.1f} {p99:8.1f}")
        finally:
            await daemon.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20)
    anyio.run(main, parser.parse_args().count, backend="trio")
