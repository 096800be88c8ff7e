"""CLI start-up: wall time of `psymesh status` against a running daemon, beside `python -c pass`.

Scripts call the CLI in loops and a phone CPU is 3-4x slower than this machine, so the
time a command takes before it does anything is felt on every call. Each sample is one
new process, timed from spawn to exit (what a user waits for), and its CPU time (what it
costs, steadier than the wall time when other work shares the machine); the medians of
--count runs are shown, with `import psymesh` alone and `psymesh --help` for where the time
goes (`--help` imports every command group's module; a command imports only its own, see
node/cli/__init__.py). `status` asks with the blocking one-shot client
(node/control/oneshot.py): no event loop, no models. Two floors, without a line of psymesh:
what `status` cannot do without (click, msgpack, a Unix socket, and rich to print for
people), and what a command that asks through the SDK cannot (click, pydantic with one model
built and validated, anyio on asyncio), beside the same request made by a script through
the SDK (`psymesh.Client` on asyncio). Each row's wall median is also shown as a ratio to
`python -c pass` measured in the same run, the steadier figure on a machine other work shares.
Target (issue 22): `psymesh status` <= 150 ms median wall here.

Usage: .venv/bin/python bench/cli.py [--count N]
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from _common import summarize

from psymesh.node.control.process import DaemonProcess


# As installed: bytecode cached (an environment with PYTHONDONTWRITEBYTECODE=1 would compile
# every psymesh module again on every run, which no user's install does).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
# what `psymesh status` cannot do without: its CLI framework, the frames' codec, the socket, and
# (for people) rich's console and table
ONESHOT_FLOOR = ("import click, msgpack, socket\nimport rich.console, rich.table")
# what a command that asks through the SDK cannot do without: its CLI framework, its models (one
# built and validated, as a reply is) and its event loop, run once
FLOOR = ("import anyio, click\nfrom pydantic import BaseModel\nclass A(BaseModel):\n x: int\nA(x=1)\n"
         "anyio.run(anyio.sleep, 0, backend='asyncio')")

# the same request from a script, through the SDK
SDK_SCRIPT = ("import anyio, psymesh\nasync def go():\n async with psymesh.Client({home!r}) as n:\n"
              "  await n.status()\nanyio.run(go, backend='asyncio')")


def run_once(cmd: list[str]) -> tuple[float, float]:
    """Wall and CPU (user + system) milliseconds of one run. On a shared machine the wall time
    swings with the load; the CPU time is what the command itself costs."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=ENV)
    wall = (time.perf_counter() - t0) * 1000
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000


def timed_ms(cmds: list[list[str]], count: int) -> list[tuple[list[float], list[float]]]:
    """Each command's wall and CPU milliseconds, after one run each to warm the caches; the
    commands take turns (one run of each per round), so a change in the load falls on all alike."""
    for cmd in cmds:
        run_once(cmd)
    samples: list[tuple[list[float], list[float]]] = [([], []) for _ in cmds]
    for _ in range(count):
        for cmd, (walls, cpus) in zip(cmds, samples):
            wall, cpu = run_once(cmd)
            walls.append(wall)
            cpus.append(cpu)
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
                ("floor: click, msgpack, rich", [py, "-c", ONESHOT_FLOOR]),
                ("floor: click, pydantic, asyncio", [py, "-c", FLOOR]),
                ("psymesh --help", [py, "-m", "psymesh", "--help"]),
                ("psymesh status", [py, "-m", "psymesh", "status", "--home", str(daemon.home)]),
                # what scripts call: no rich (node/cli/output.py makes its consoles on first use)
                ("psymesh status --json", [py, "-m", "psymesh", "status", "--json", "--home", str(daemon.home)]),
                ("script: Client.status() asyncio", [py, "-c", SDK_SCRIPT.format(home=str(daemon.home))]),
            ]
            print(f"{'command':32} {'wall median':>12} {'wall p99':>9} {'cpu median':>11} {'x pass':>7}"
                  f"   ({count} runs each, ms)")
            baseline = None
            for (label, _cmd), (walls, cpus) in zip(rows, timed_ms([cmd for _, cmd in rows], count)):
                (med, p99), (cpu, _) = summarize(walls), summarize(cpus)
                baseline = baseline or med
                print(f"{label:32} {med:12.1f} {p99:9.1f} {cpu:11.1f} {med / baseline:7.2f}")
            print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
        finally:
            await daemon.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20)
    anyio.run(main, parser.parse_args().count, backend="trio")
