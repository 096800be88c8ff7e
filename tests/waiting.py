"""The one way tests wait: on a condition, with a deadline (never a fixed sleep)."""
from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

import anyio

POLL_S = 0.02


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 15.0) -> None:
    """Poll `predicate` (a plain or an async function) until it holds; fail naming `what`
    after `timeout` seconds."""

    async def holds() -> bool:
        value = predicate()
        return bool(await value) if inspect.isawaitable(value) else bool(value)

    try:
        with anyio.fail_after(timeout):
            while not await holds():
                await anyio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for: {what}") from None


async def wait_until_no_timer_within(seconds: float, what: str, polls: int = 200, poll_s: float = 0.25) -> None:
    """Wait until no timer of this trio run fires within `seconds` (everything asleep on an
    event: an idle node). Bounded by `polls` polls, not a deadline: a deadline would be a
    timer itself. Fails naming `what`."""
    import trio

    for _ in range(polls):
        if trio.lowlevel.current_statistics().seconds_to_next_deadline > seconds:
            return
        await anyio.sleep(poll_s)
    left = trio.lowlevel.current_statistics().seconds_to_next_deadline
    raise AssertionError(f"{what}: a timer still fires in {left:.1f} s after {polls * poll_s:.0f} s")
