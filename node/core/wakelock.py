"""A wake lock held only while work is in flight (Android under Termux; issue 23 item 2).

Android suspends the CPU of a phone whose screen is off unless an app holds a wake lock;
under Termux that is `termux-wake-lock` / `termux-wake-unlock` (Termux:API not needed:
they are Termux's own). A lock held for good keeps the CPU out of its sleep states all day,
whatever the daemon does. So the daemon takes it itself, while there is work a suspend would
stall (`held()` around it: a task run here, a task delegated and not yet finished, letters
to deliver), and lets it go `linger_s` after the last ends. Otherwise the phone may sleep:
it wakes for its peers' traffic (the radio's own wake-ups deliver packets to an open
socket) and for Android's maintenance windows; what a user gives up is in docs/deploy.md.

    WakeLock.run()   the one task that runs the commands: asleep on an event while the
                     wanted state is the held one; no timer but the linger after work ends
    WakeLock.held()  a context manager: counts the work in flight (any task, no await)

`commands=None` (not on Termux): `held()` only counts; nothing runs.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import anyio
import anyio.abc

log = logging.getLogger("psymesh.wakelock")

LINGER_S = 2.0  # after the last work ends, before the lock goes: a burst of tasks takes it once


@dataclass(frozen=True)
class WakeCommands:
    lock: Sequence[str]
    unlock: Sequence[str]


def termux_commands(environ: Mapping[str, str] = os.environ) -> WakeCommands | None:
    """Termux's commands, when this node runs under Termux (and they are on PATH)."""
    if "TERMUX_VERSION" not in environ or shutil.which("termux-wake-lock", path=environ.get("PATH")) is None:
        return None
    return WakeCommands(("termux-wake-lock",), ("termux-wake-unlock",))


class WakeLock:
    def __init__(self, commands: WakeCommands | None, *, linger_s: float = LINGER_S) -> None:
        self.commands = commands
        self.linger_s = linger_s
        self.in_flight = 0
        self.is_held = False
        self._changed: anyio.Event | None = None  # made by run(): a WakeLock may be built outside an event loop

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock (when on Termux) while the body runs."""
        self.in_flight += 1
        if self.in_flight == 1:
            self._wake()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if self.commands is None:
            return
        self._changed = anyio.Event()
        try:
            while True:
                changed = self._changed
                if self.in_flight and not self.is_held:
                    self.is_held = True  # from the moment the command starts: a stop meanwhile lets it go
                    await self._run(self.commands.lock)
                    continue
                if not self.in_flight and self.is_held:
                    with anyio.move_on_after(self.linger_s):
                        await changed.wait()
                    if not self.in_flight:
                        await self._run(self.commands.unlock)
                        self.is_held = False
                    continue
                await changed.wait()
        finally:
            if self.is_held:  # a clean stop lets the phone sleep
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await self._run(self.commands.unlock)
                self.is_held = False

    async def _run(self, command: Sequence[str]) -> None:
        try:
            result = await anyio.run_process(list(command), check=False)
        except OSError as exc:
            log.warning("%s failed: %s", command[0], exc)
            return
        if result.returncode != 0:
            log.warning("%s exited with %d", command[0], result.returncode)
