"""How late a letter to a sleeping phone arrives: what a phone that lets its CPU sleep gives up.

A paired phone and home as real daemons on 127.0.0.1, the session open. For each sleep length S the
phone daemon is stopped (SIGSTOP: a CPU asleep runs none of its threads, its sockets still take what
arrives, as a radio holds packets for a dozing phone), home sends it a letter (`send()` returns once the
letter is durable in home's outbox), and after S seconds the phone is let go (SIGCONT). Printed per S:
the time from the phone waking to the letter in its inbox, and whether home still held its connection
to the phone as it woke (past 2 x `liveness_probe_s`, 40 s, of silence under the open request it gives
the connection up: then the letter comes over a new one, dialed by home or, undialable, by the phone,
node/reach/keep.py). The baseline is a letter to the phone awake, in the same run.

With --undialable the phone is as on cellular, behind a NAT: nobody can open a connection to it, it
can only dial out (the bench runs in a network namespace of its own, `unshare -n`, where nftables drops
every new connection to the phone's port; the one it opened to home stays up).

Usage: .venv/bin/python bench/asleep.py [--sleeps 5,45,120] [--undialable]
Bounded: one letter per sleep, each waited for at most S + 120 s.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

WAIT_AFTER_WAKE_S = 120.0
IN_NETNS = "PSYMESH_ASLEEP_NETNS"


@dataclass(frozen=True)
class Late:
    slept_s: float
    after_wake_s: float   # SIGCONT -> the letter read from the phone's inbox
    still_connected: bool  # home still held its connection to the phone as the phone woke


def refuse_dials_to(port: int) -> None:
    """In this network namespace, drop every new TCP connection to `port` (established ones pass)."""
    for rule in (["add", "table", "inet", "asleep"],
                 ["add", "chain", "inet", "asleep", "in", "{ type filter hook input priority 0; }"],
                 ["add", "rule", "inet", "asleep", "in", "tcp", "dport", str(port), "ct", "state", "new", "drop"]):
        subprocess.run(["nft", *rule], check=True)


async def bench(sleeps: list[float], undialable: bool) -> tuple[float, list[Late]]:
    from psymesh.node.control.process import DaemonProcess, pair_homes
    from psymesh.node.reach.dialback import tcp_ports

    with tempfile.TemporaryDirectory(prefix="psymesh-asleep-") as tmp:
        home = DaemonProcess(Path(tmp) / "home", name="home")
        phone = DaemonProcess(Path(tmp) / "phone", profile="phone", name="phone")
        await home.start()
        await phone.start()
        got: list[Late] = []
        try:
            await pair_homes(home.home, phone.home)  # the phone grants home messaging
            assert phone.proc is not None
            async with phone.client() as p, home.client() as h:
                await p.ping("home", count=1)
                if undialable:
                    refuse_dials_to(tcp_ports((await p.status()).addrs)[0])
                inbox = p.inbox()
                start = time.perf_counter()
                await h.send("phone", "awake")
                assert (await inbox.__anext__()).text == "awake"
                awake_ms = (time.perf_counter() - start) * 1000
                for i, slept in enumerate(sleeps):
                    phone.proc.send_signal(signal.SIGSTOP)
                    try:
                        await h.send("phone", f"asleep {i}")
                        await anyio.sleep(slept)
                        connected = any(c.name == "phone" for c in (await h.status()).connected_peers)
                    finally:
                        phone.proc.send_signal(signal.SIGCONT)
                    woke = time.perf_counter()
                    print(f"slept {slept:.0f} s, home still connected: {connected}", file=sys.stderr)
                    with anyio.fail_after(WAIT_AFTER_WAKE_S):
                        letter = await inbox.__anext__()
                    arrived = time.perf_counter()
                    assert letter.text == f"asleep {i}", letter.text
                    got.append(Late(slept, arrived - woke, connected))
                await inbox.aclose()
        finally:
            await phone.stop()
            await home.stop()
        return awake_ms, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sleeps", default="5,45,120", help="seconds the phone sleeps, comma-separated")
    ap.add_argument("--undialable", action="store_true", help="nobody can dial the phone (as behind a NAT)")
    args = ap.parse_args()
    if args.undialable and not os.environ.get(IN_NETNS):  # again, in a network namespace of its own
        script = f"ip link set lo up && exec {sys.executable} {' '.join(map(repr, sys.argv))}"
        sys.exit(subprocess.run(["unshare", "-n", "sh", "-c", script], env={**os.environ, IN_NETNS: "1"}).returncode)
    sleeps = [float(s) for s in args.sleeps.split(",")]
    awake_ms, got = anyio.run(bench, sleeps, args.undialable, backend="trio")
    print("a letter from home to a phone whose CPU sleeps (SIGSTOP) while it is sent"
          + (", the phone undialable (as behind a NAT)" if args.undialable else "") + "\n")
    print(f"phone awake: sent -> in its inbox {awake_ms:.1f} ms\n")
    print(f"{'phone slept':>12}{'woke -> letter in inbox':>26}{'home still connected':>22}")
    for late in got:
        print(f"{late.slept_s:>10.0f} s{late.after_wake_s * 1000:>23.0f} ms{'yes' if late.still_connected else 'no':>22}")


if __name__ == "__main__":
    main()
