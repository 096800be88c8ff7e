"""Run a node daemon as a child process: used by the demo, the chaos tests and the benches.

A real process (not an in-process Node) so that SIGTERM, SIGKILL and restarts behave
exactly as they do for a user's daemon.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import anyio

from .client import Client, DaemonNotRunning
from ..core.paths import private_opener
from ...protocol.control import StatusReply
from ...protocol.errors import ErrorCode, PsymeshError


class DaemonProcess:
    def __init__(
        self,
        home: str | os.PathLike[str],
        *,
        profile: str = "home",
        name: str | None = None,
        listen: list[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.home = Path(home)
        self.profile = profile
        self.name = name or profile
        self.listen = listen or ["/ip4/127.0.0.1/tcp/0"]
        self.log_path = Path(log_path) if log_path else self.home / "daemon.log"
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "psymesh", "node", "start", "--home", str(self.home),
               "--profile", self.profile, "--name", self.name, *self.extra_args]
        for addr in self.listen:
            cmd += ["--listen", addr]
        return cmd

    async def start(self, timeout: float = 30.0) -> StatusReply:
        """Spawn the daemon and return its status once its control socket answers."""
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._log = open(self.log_path, "ab", opener=private_opener)
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        with anyio.move_on_after(timeout):
            while True:
                if self.proc.poll() is not None:
                    raise PsymeshError(f"daemon exited with status {self.proc.returncode} during start; "
                                       f"log: {self.log_path}\n{self.log_tail()}", code=ErrorCode.UNAVAILABLE)
                try:
                    async with Client(self.home) as client:
                        return await client.status()
                except DaemonNotRunning:
                    await anyio.sleep(0.05)
        self.kill()
        raise PsymeshError(f"daemon did not answer within {timeout} s; log: {self.log_path}",
                           code=ErrorCode.TIMEOUT)

    def client(self) -> Client:
        return Client(self.home)

    async def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit status (0 = clean shutdown)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(timeout):
            while self.proc.poll() is None:
                await anyio.sleep(0.02)
        if self.proc.poll() is None:
            self.kill()
        self._close_log()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as when a phone's OS kills the app or the PC loses power."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


async def pair_homes(inviter_home: str | os.PathLike[str], joiner_home: str | os.PathLike[str], *,
                     grant: str = "phone", grant_back: str | None = "messaging"):
    """Pair two running daemons through their control sockets, as `psymesh pair` does
    (used by tests, benches and scripts that set up a mesh unattended)."""
    async with Client(inviter_home) as inviter, Client(joiner_home) as joiner:
        invite = await inviter.pair_invite(grant=grant)
        return await joiner.pair_join(invite.invite, grant=grant_back)
