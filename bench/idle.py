"""What an idle node costs: CPU, wakeups (context switches of all threads) and memory.

Two real daemons (home, phone: `--profile phone`), paired, the phone's session to home
open (one ping), mDNS off, then `--seconds` (60) of nothing. For each process, read from
/proc over the window:

- CPU ms: the scheduler's run time of each thread (/proc/PID/task/TID/schedstat, in ns;
  a thread that starts during the window counts from zero), and, beside it, utime + stime
  of the whole process (every thread, living or gone; in clock ticks of 10 ms).
- wakeups: voluntary + involuntary context switches summed over its threads (a thread
  that starts during the window counts from zero; one that ends during it is lost).
- RSS MB at the end.

Beside them, a bare `python -c "import time; time.sleep(N)"` measured the same way: the
floor of a Python process that does nothing.

Usage: .venv/bin/python bench/idle.py [--seconds 60]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
from _common import cpu_ms



@dataclass(frozen=True)
class Sample:
    cpu_ms: float             # utime + stime, all threads (10 ms ticks)
    run_ns: dict[int, int]    # tid -> time on a CPU (schedstat)
    switches: dict[int, int]  # tid -> voluntary + involuntary context switches
    rss_mb: float


def sample(pid: int) -> Sample:
    switches: dict[int, int] = {}
    run_ns: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            run_ns[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:  # the thread ended while we read
            continue
        n = 0
        for line in status.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                n += int(line.split()[1])
        switches[int(task.name)] = n
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("VmRSS"))
    return Sample(cpu_ms(pid), run_ns, switches, rss_kb / 1024)


@dataclass(frozen=True)
class Idle:
    cpu_ms: float    # schedstat, all threads
    tick_ms: float   # utime + stime (10 ms resolution)
    wakeups: int
    threads: int
    rss_mb: float


def over(before: Sample, after: Sample) -> Idle:
    wakeups = sum(n - before.switches.get(tid, 0) for tid, n in after.switches.items())
    run_ns = sum(n - before.run_ns.get(tid, 0) for tid, n in after.run_ns.items())
    return Idle(run_ns / 1e6, after.cpu_ms - before.cpu_ms, wakeups, len(after.switches), after.rss_mb)


async def measure(pids: dict[str, int], seconds: float) -> dict[str, Idle]:
    before = {name: sample(pid) for name, pid in pids.items()}
    await anyio.sleep(seconds)
    return {name: over(before[name], sample(pid)) for name, pid in pids.items()}


async def bench(seconds: float) -> dict[str, Idle]:
    from psymesh.node.control.process import DaemonProcess, pair_homes

    with tempfile.TemporaryDirectory(prefix="psymesh-idle-") as tmp:
        home, phone = DaemonProcess(Path(tmp) / "home"), DaemonProcess(Path(tmp) / "phone", profile="phone")
        bare = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds + 30})"])
        await home.start()
        await phone.start()
        try:
            await pair_homes(Path(tmp) / "home", Path(tmp) / "phone")
            async with phone.client() as c:
                await c.ping("home", count=1)  # the session is open; now nothing
            await anyio.sleep(2)  # let start-up's last writes and checkpoints settle
            assert home.proc is not None and phone.proc is not None
            return await measure({"phone": phone.proc.pid, "home": home.proc.pid, "bare python": bare.pid},
                                 seconds)
        finally:
            bare.kill()
            bare.wait()
            await phone.stop()
            await home.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    got = anyio.run(bench, args.seconds, backend="trio")
    per_min = 60 / args.seconds
    print(f"idle for {args.seconds:.0f} s: a paired phone and home (session open, mDNS off), and a bare python\n")
    print(f"{'process':<14}{'CPU ms/min':>12}{'(ticks)':>9}{'wakeups/min':>13}{'threads':>9}{'RSS MB':>9}")
    for name, idle in got.items():
        print(f"{name:<14}{idle.cpu_ms * per_min:>12.2f}{idle.tick_ms * per_min:>9.0f}{idle.wakeups * per_min:>13.1f}"
              f"{idle.threads:>9}{idle.rss_mb:>9.1f}")
    phone, bare = got["phone"], got["bare python"]
    print(f"\nphone beyond bare python: CPU {(phone.cpu_ms - bare.cpu_ms) * per_min:+.2f} ms/min, "
          f"wakeups {(phone.wakeups - bare.wakeups) * per_min:+.1f}/min, RSS {phone.rss_mb - bare.rss_mb:+.1f} MB")
    print("targets (phone): <= 20 ms CPU a minute, <= 12 wakeups a minute, RSS <= 100 MB")


if __name__ == "__main__":
    main()
