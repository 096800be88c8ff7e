"""Wake whoever waits on a key (a task id): attached followers, local watchers; `first_of`
events; and, with a Pulse, whoever waits for anything at all to happen (the dashboard's open pages)."""
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
        self.pulse: Pulse | None = None  # fired at every notify, whoever waits on the key

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
        if self.pulse is not None:
            self.pulse.fire()
        waiters = self._waiting.pop(key, None)
        if waiters is not None:
            waiters.event.set()

    def __len__(self) -> int:
        return len(self._waiting)


class Pulse:
    """Wakes every waiter at each `fire()`: "something happened" (a task event, a letter,
    an audit row), for views that re-read what they show. A reader notes `count` before
    it reads, then waits with `wait(after=count)`: a fire while it read (awaiting, say, a
    control handler) is not lost. Costs one Event per fire."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self.count = 0

    def fire(self) -> None:
        self.count += 1
        self._event.set()
        self._event = anyio.Event()

    async def wait(self, after: int) -> None:
        """Return once fired more than `after` times in all (at once if it already was)."""
        while self.count <= after:
            await self._event.wait()


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
