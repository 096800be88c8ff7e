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
