"""What one web query through an exit costs the phone daemon in work, not time: instructions, Python calls.

Real daemons in their own processes on 127.0.0.1, paired: an exit that holds the page in its
cache (so it answers at once and leaves the machine to the phone; `--uncached`: it fetches and
extracts every time, as in bench/web.py's "one hop"), the phone, and with `--hops 2` a relay.
The asker (this process) runs `Client.web_fetch(url, via="exit", hops=1)` (or `relay="relay"`)
`--count` times in a row, and one of:

- the default: the phone runs under valgrind's callgrind with its instrumentation off until
  the loop starts (`callgrind_control -i on`) and off again after it: instructions the phone
  executed a query, all threads. Load-independent (it counts, it does not time): three runs of
  the same code differ by under 1%, so a cut of a few percent is told from noise, which /proc
  ticks on this shared 2-core machine cannot do. `--top N` also prints callgrind's N
  functions with the most inclusive instructions (C level: the interpreter, pydantic-core,
  msgpack, OpenSSL).
- `--cprofile`: the phone runs under cProfile with `time.thread_time` as its clock, enabled
  and dumped by signals around the loop: Python calls a query and the top functions by own
  and by cumulative time (cProfile's own overhead inflates every figure; read the shares).
- `--ticks`: nothing attached; the phone's user and system CPU a query from /proc.
  `--pin PHONE,EXIT,ASKER` puts each on a CPU of its own choosing first.

`--save PATH` keeps the profile. Usage:
    .venv/bin/python bench/web_profile.py [--count N] [--hops 2] [--uncached] [--cprofile | --ticks] [--top N]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import anyio
from _common import spawn_server
from web import PAGE_SERVER

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")

# The phone's daemon under cProfile: SIGUSR1 starts it, SIGUSR2 stops it and writes the stats.
PROFILED = textwrap.dedent("""
    import cProfile, signal, sys, time
    from psymesh.node.cli import main
    out = sys.argv.pop(1)
    prof = cProfile.Profile(time.thread_time)
    signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
    def dump(*_):
        prof.disable()
        prof.dump_stats(out)
    signal.signal(signal.SIGUSR2, dump)
    sys.argv[0] = "psymesh"
    main()
""")


def _times(pid: int) -> tuple[float, float]:
    """(user, system) CPU ms of process `pid` so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) * TICK_MS, int(fields[12]) * TICK_MS


def _daemon_class():
    from psymesh.node.control.process import DaemonProcess

    class Wrapped(DaemonProcess):
        """A daemon whose command line is prefixed (valgrind) or run through PROFILED."""

        def __init__(self, *args, prefix: list[str], stats: Path | None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.prefix, self.stats = prefix, stats

        def command(self) -> list[str]:
            cmd = super().command()
            if self.stats is not None:  # [python, -m, psymesh, ...] -> [python, -c, PROFILED, out, ...]
                cmd = [cmd[0], "-c", PROFILED, str(self.stats), *cmd[3:]]
            return [*self.prefix, *cmd]

    return Wrapped


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


async def run(tmp: Path, url: str, count: int, mode: str, save: Path | None, cache: bool,
              pinned: str | None, hops: int) -> None:
    from psymesh.node.control.process import DaemonProcess, pair_homes
    from psymesh.node.core.home import NodeHome
    from psymesh.node.core.websettings import WebSettings
    from psymesh.node.web.exit import ExitSettings
    from psymesh.protocol.limits import Limits

    home = NodeHome(tmp / "exit")
    home.init(name="exit")
    settings = ExitSettings(enabled=True, allow_loopback=True, cache_entries=8 if cache else 0,
                            requests_per_minute=100_000)
    home.save_config(home.load_config().model_copy(update={"web": WebSettings(exit=settings)}))
    exit_ = DaemonProcess(tmp / "exit", name="exit")
    relay = DaemonProcess(tmp / "relay", name="relay") if hops == 2 else None
    stats = tmp / "phone.prof" if mode == "cprofile" else None
    out = tmp / "callgrind.out"
    prefix = ([] if mode != "callgrind" else
              ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"])
    phone = _daemon_class()(tmp / "phone", name="phone", profile="phone", prefix=prefix, stats=stats)
    roomy = Limits(requests_per_minute=1_000_000)
    await exit_.start()
    if relay is not None:
        await relay.start()
    await phone.start(timeout=600)
    try:
        await pair_homes(exit_.home, phone.home, grant="messaging")
        async with exit_.client() as e:
            await e.grant("phone", ["web.fetch"], limits=roomy)
        if relay is not None:
            await pair_homes(exit_.home, relay.home, grant="messaging")
            await pair_homes(relay.home, phone.home, grant="messaging")
            async with exit_.client() as e, relay.client() as r:
                await e.grant("relay", ["web.fetch"], limits=roomy)
                await r.grant("phone", ["web.relay"], limits=roomy)

        def query():
            return client.web_fetch(url, via="exit", hops=1) if relay is None else \
                client.web_fetch(url, via="exit", relay="relay")

        async with phone.client() as client:
            for _ in range(20):
                await query()
            assert phone.proc is not None and exit_.proc is not None
            pid = phone.proc.pid
            if pinned:
                phone_cpu, exit_cpu, asker_cpu = (int(x) for x in pinned.split(","))
                pin(pid, {phone_cpu})
                pin(exit_.proc.pid, {exit_cpu})
                os.sched_setaffinity(0, {asker_cpu})
            before = _times(pid)
            if mode == "cprofile":
                os.kill(pid, signal.SIGUSR1)
            elif mode == "callgrind":
                subprocess.run(["callgrind_control", "-i", "on", str(pid)], check=True, capture_output=True)
            for _ in range(count):
                await query()
            user, system = (b - a for a, b in zip(before, _times(pid)))
            if mode == "cprofile":
                os.kill(pid, signal.SIGUSR2)
                with anyio.fail_after(60):
                    while not stats.exists():
                        await anyio.sleep(0.05)
            elif mode == "callgrind":
                subprocess.run(["callgrind_control", "-i", "off", str(pid)], check=True, capture_output=True)
    finally:
        await phone.stop(timeout=120)
        if relay is not None:
            await relay.stop()
        await exit_.stop()
    what = f"{'one' if hops == 1 else 'two'}-hop web queries"
    if mode == "cprofile":
        report_cprofile(stats, count, what)
    elif mode == "callgrind":
        report_callgrind(out, count, what)
    else:
        print(f"phone daemon, {count} {what}: {user / count:.3f} ms user + {system / count:.3f} ms"
              f" system CPU a query (/proc ticks), load {os.getloadavg()[0]:.2f}")
    if save is not None:
        for f in ([stats] if mode == "cprofile" else sorted(out.parent.glob(out.name + "*"))):
            shutil.copy(f, save.parent / (save.name + f.name[len(out.name):] if mode != "cprofile" else save.name))


TOP = 25


def report_cprofile(stats_path: Path, count: int, what: str) -> None:
    import pstats

    stats = pstats.Stats(str(stats_path))
    total_calls = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(f"phone daemon, {count} {what}: {total_calls / count:.0f} Python calls a query,"
          f" {stats.total_tt * 1000 / count:.3f} ms thread time a query (profiled)")  # type: ignore[attr-defined]
    for key in ("tottime", "cumulative"):
        print(f"\n-- by {key}")
        stats.sort_stats(key).print_stats(TOP)


def report_callgrind(out: Path, count: int, what: str) -> None:
    files = sorted(out.parent.glob(out.name + "*"))
    total = 0
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
                break
    print(f"phone daemon, {count} {what}: {total / count / 1e6:.3f} M instructions a query"
          f" (callgrind, all threads)")
    if TOP and shutil.which("callgrind_annotate"):
        shown = subprocess.run(["callgrind_annotate", "--inclusive=yes", f"--threshold=99", *map(str, files)],
                               capture_output=True, text=True).stdout.splitlines()
        print("\n".join(shown[:TOP + 25]))


def main() -> None:
    global TOP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=300, help="queries to count over")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the phone instead of counting instructions")
    ap.add_argument("--ticks", action="store_true", help="neither: the phone's user and system CPU from /proc")
    ap.add_argument("--hops", type=int, choices=(1, 2), default=1,
                    help="2: sealed through a relay (a third daemon), as bench/web.py's 'two hops'")
    ap.add_argument("--pin", help="PHONE,EXIT,ASKER: the CPU each runs on")
    ap.add_argument("--uncached", action="store_true",
                    help="the exit fetches and extracts every query (bench/web.py's 'one hop') instead of answering"
                         " from its cache")
    ap.add_argument("--top", type=int, default=TOP, help="functions to list")
    ap.add_argument("--save", type=Path, help="keep the profile (cProfile stats, or callgrind's output) here")
    args = ap.parse_args()
    TOP = args.top
    mode = "cprofile" if args.cprofile else "ticks" if args.ticks else "callgrind"
    if mode == "callgrind" and shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind): the phone's /proc ticks instead")
        mode = "ticks"
    server, port = spawn_server(PAGE_SERVER)
    try:
        with tempfile.TemporaryDirectory(prefix="psymesh-bench-webprof-") as tmp:
            anyio.run(run, Path(tmp), f"http://127.0.0.1:{port}/ferries", args.count,
                      mode, args.save, not args.uncached, args.pin, args.hops,
                      backend="trio")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
