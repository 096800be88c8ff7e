"""Network namespaces the tests make for themselves (root only), and daemons run inside them.

Traffic in them never leaves the machine: each namespace has only its loopback and the
veth links a test adds between its own namespaces, with no route anywhere else.
"""
from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from psymesh.node.control.process import DaemonProcess


@functools.cache
def netns_refusal() -> str | None:
    """Why this machine cannot give the tests network namespaces, or None if it can."""
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    probe = f"psyprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"the kernel refused a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Namespaces:
    """The namespaces of one test: `add()` makes one (loopback up), `link()` joins two by a
    veth pair, each end with its own /24 address. All are deleted with the fixture."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.made: list[str] = []

    def add(self, name: str) -> str:
        ns = f"psy{self.tag}{name}"
        ip("netns", "add", ns)
        self.made.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def link(self, a: str, a_ip: str, b: str, b_ip: str) -> None:
        """A veth pair between namespaces `a` and `b` (devices named after the other side)."""
        dev_a, dev_b = f"to{b[-8:]}", f"to{a[-8:]}"
        ip("link", "add", dev_a, "netns", a, "type", "veth", "peer", "name", dev_b, "netns", b)
        for ns, dev, addr in ((a, dev_a, a_ip), (b, dev_b, b_ip)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")

    def remove(self) -> None:
        for ns in self.made:  # veth pairs go with them
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    if (reason := netns_refusal()) is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    made = Namespaces()
    try:
        yield made
    finally:
        made.remove()


class NetnsDaemon(DaemonProcess):
    """A daemon process inside network namespace `netns`, listening on every address there.
    Its control socket is a file, so the test (outside) drives it as usual."""

    def __init__(self, netns: str, home: Path, name: str, *, profile: str = "home") -> None:
        super().__init__(home, profile=profile, name=name, listen=["/ip4/0.0.0.0/tcp/0"])
        self.netns = netns

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *super().command()]


@contextlib.asynccontextmanager
async def daemons(*procs: DaemonProcess) -> AsyncIterator[None]:
    """Start `procs` at once; stop those running on the way out."""
    async with anyio.create_task_group() as tg:
        for proc in procs:
            tg.start_soon(proc.start)
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True):
            for proc in procs:
                if proc.running:
                    await proc.stop()
