"""Choosing a home for a task: ask every candidate what it offers at once, remember who answered.

    choose(peers, fits) ─┬─ task.caps ──> peer A ──┐  answers as they come; the first that
                         ├─ task.caps ──> peer B   ├─ fits ends the wait (its peers that fit by
                         └─ task.caps ──> peer C ──┘  then, least busy first, are the choice)

A probe runs in the submitter's task group, not the caller's: one that outlives the choice
(a frozen peer's, up to `timeout_s`) still ends and is remembered, and a second choice while
it is in flight waits on it instead of asking again. A peer that did not answer within
`timeout_s` is *quiet* for `quiet_s`: choices then ask it only if no other candidate fits.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import anyio.abc

from ...protocol.errors import ErrorCode, PsymeshError, RemoteError
from ...protocol.tasks import TaskCapsReply

log = logging.getLogger("psymesh.tasks")

Offers = Callable[[str], Awaitable[TaskCapsReply]]
Fits = Callable[[TaskCapsReply], bool]

PROBE_TIMEOUT_S = 5.0   # a probe's bound (dial included)
QUIET_S = 30.0          # a peer that let a probe time out is asked last for this long


@dataclass
class _Answer:
    serial: int = 0                    # answers are numbered as they come
    caps: TaskCapsReply | None = None  # None: the peer failed or timed out
    refused: RemoteError | None = None


class HomeChooser:
    """Probes candidate homes concurrently (`choose`) and remembers their last answers."""

    def __init__(self, *, on_refused: Callable[[str, RemoteError], None],
                 timeout_s: float = PROBE_TIMEOUT_S, quiet_s: float = QUIET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`on_refused(peer, error)`: a peer answered a probe with a refusal (unknown_peer: it
        revoked us)."""
        self.on_refused = on_refused
        self.timeout_s, self.quiet_s, self.clock = timeout_s, quiet_s, clock
        self.probes = 0                                  # probes started (for tests and status)
        self._last: dict[str, _Answer] = {}              # each peer's last answer
        self._quiet_since: dict[str, float] = {}         # peers whose last probe timed out
        self._inflight: set[str] = set()
        self._answers = 0                                # answers so far (the last one's serial)
        self._changed = anyio.Event()                    # set (and replaced) when a probe ends

    def quiet(self, peer: str) -> bool:
        since = self._quiet_since.get(peer)
        return since is not None and self.clock() - since < self.quiet_s

    async def choose(self, tg: anyio.abc.TaskGroup, peers: list[str], fits: Fits, offers: Offers) -> list[str]:
        """The peers of `peers` whose answer fits, least busy first, as soon as one does:
        peers quiet lately are asked only once none of the others fits. Empty if none fits."""
        loud = [p for p in peers if not self.quiet(p)]
        quiet = [p for p in peers if self.quiet(p)]
        for group in (loud, quiet):
            if group:
                chosen = await self._first_fit(tg, group, fits, offers)
                if chosen:
                    return chosen
        return []

    async def _first_fit(self, tg: anyio.abc.TaskGroup, peers: list[str], fits: Fits, offers: Offers) -> list[str]:
        asked_after = self._answers
        for peer in peers:
            if peer not in self._inflight:  # else its answer is on its way: wait for that one
                self._inflight.add(peer)
                self.probes += 1
                tg.start_soon(self._probe, peer, offers)
        while True:
            changed = self._changed
            fresh = {p: a for p in peers if (a := self._last.get(p)) is not None and a.serial > asked_after}
            scored = sorted((a.caps.queue_depth, i, p) for i, (p, a) in enumerate(fresh.items())
                            if a.caps is not None and fits(a.caps))
            if scored:
                return [p for _, _, p in scored]
            if all(p in fresh and p not in self._inflight for p in peers):
                return []
            await changed.wait()

    async def _probe(self, peer: str, offers: Offers) -> None:
        answer = _Answer()
        try:
            with anyio.fail_after(self.timeout_s):
                answer.caps = await offers(peer)
            self._quiet_since.pop(peer, None)
        except RemoteError as exc:
            answer.refused = exc
            self._quiet_since.pop(peer, None)
        except TimeoutError:
            self._quiet_since[peer] = self.clock()
        except PsymeshError:
            pass  # down or unhealthy now: not quiet (a refused dial is quick), just not a home this time
        except Exception:  # a bug, not the peer's doing: it must not take the submitter down with it
            log.exception("probing %s for its offers failed", peer)
        finally:
            self._answers += 1
            answer.serial = self._answers
            self._last[peer] = answer
            self._inflight.discard(peer)
            self._changed.set()
            self._changed = anyio.Event()
        if answer.refused is not None and answer.refused.code is ErrorCode.UNKNOWN_PEER:
            self.on_refused(peer, answer.refused)
