"""The wake lock (node/core/wakelock.py): taken when work starts, let go `linger_s` after the
last ends, once for a burst, and on a clean stop; nothing runs while nothing is in flight."""
from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest

from waiting import wait_until
from psymesh.node.core.wakelock import WakeCommands, WakeLock, termux_commands

pytestmark = pytest.mark.anyio


def recording(log: Path) -> WakeCommands:
    """Commands that append `lock` / `unlock` to `log` (Termux's would tell Android)."""
    def say(word: str) -> tuple[str, ...]:
        return (sys.executable, "-c", f"open({str(log)!r}, 'a').write({word + chr(10)!r})")

    return WakeCommands(lock=say("lock"), unlock=say("unlock"))


def said(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


async def test_held_only_while_work_is_in_flight(tmp_path: Path) -> None:
    log = tmp_path / "wake.log"
    wake = WakeLock(recording(log), linger_s=0.2)
    async with anyio.create_task_group() as tg:
        await tg.start(wake.run)
        assert said(log) == []  # idle: no lock
        done = anyio.Event()

        async def work() -> None:
            with wake.held():
                await done.wait()

        for _ in range(3):  # a burst: one lock
            tg.start_soon(work)
        await wait_until(lambda: said(log) == ["lock"] and wake.is_held, "the lock taken")
        done.set()
        await wait_until(lambda: said(log) == ["lock", "unlock"] and not wake.is_held, "the lock let go")
        with wake.held():  # work again: taken again; a stop lets it go
            await wait_until(lambda: said(log) == ["lock", "unlock", "lock"], "the lock taken again")
            tg.cancel_scope.cancel()
    assert said(log) == ["lock", "unlock", "lock", "unlock"]


def test_termux_commands_only_under_termux(tmp_path: Path) -> None:
    assert termux_commands({"PATH": str(tmp_path)}) is None
    tool = tmp_path / "termux-wake-lock"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert termux_commands({"PATH": str(tmp_path)}) is None  # not Termux
    assert termux_commands({"PATH": str(tmp_path), "TERMUX_VERSION": "0.118.0"}) == WakeCommands(
        ("termux-wake-lock",), ("termux-wake-unlock",))
