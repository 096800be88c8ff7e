"""Wake whoever waits on a key (a task id): attached followers, local watchers; `first_of` events."""
from __future__ import annotations

import anyio


class _Waiters:
    __slots__ = ("event", "count")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.count = 0


class Notifier:
    """Call `wait(key)` right after reading the state you wait on, with no await in
    between: the node runs one trio task at a time, so no change can slip in and
    no wake-up is lost. An entry exists only while someone waits, so the tasks a
    long-lived node has served leave nothing behind in memory.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, _Waiters] = {}

    async def wait(self, key: str) -> None:
        waiters = self._waiting.get(key)
        if waiters is None:
            waiters = self._waiting[key] = _Waiters()
        waiters.count += 1
        try:
            await waiters.event.wait()
        finally:
            waiters.count -= 1
            if not waiters.count and self._waiting.get(key) is waiters:
                del self._waiting[key]

    def notify(self, key: str) -> None:
        waiters = self._waiting.pop(key, None)
        if waiters is not None:
            waiters.event.set()

    def __len__(self) -> int:
        return len(self._waiting)


async def first_of(*events: anyio.Event) -> None:
    """Return as soon as any of `events` is set (wrap in `move_on_after` for a timeout)."""
    if any(event.is_set() for event in events):
        return
    async with anyio.create_task_group() as tg:
        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)
