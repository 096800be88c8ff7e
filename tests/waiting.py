"""The one way tests wait: on a condition, with a deadline (never a fixed sleep)."""
from __future__ import annotations

from collections.abc import Callable

import anyio

POLL_S = 0.02


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout` seconds."""
    try:
        with anyio.fail_after(timeout):
            while not predicate():
                await anyio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for: {what}") from None
