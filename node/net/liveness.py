"""Liveness: notice a peer that went silent under our open requests.

A home PC that loses power leaves a half-open TCP connection that neither side closes
for many minutes, and a request waiting on it (a follower waiting for a task's next
event) would wait as long. While requests are open on a session, a peer that has
sent nothing for `probe_s` is pinged on that session; if the ping gets no answer in
`probe_s` more, the session is taken for dead and the connection dropped, so every
request on it fails with ConnectionLost and its owner redials.

One watcher per session: a phone following many quiet tasks on one home (say, all
waiting for input) sends one ping per quiet period, not one per task.
"""
from __future__ import annotations

import logging
from typing import Protocol

import anyio

from ..core.notify import first_of
from .session import OutboundSession
from ...protocol.common import Ping
from ...protocol.errors import NetworkError

log = logging.getLogger("psymesh.liveness")


class DropConnection(Protocol):
    async def __call__(self, peer_id: str) -> None: ...


class Liveness:
    def __init__(self, probe_s: float, drop_connection: DropConnection) -> None:
        self.probe_s = probe_s
        self.drop_connection = drop_connection

    async def watch(self, session: OutboundSession) -> None:
        """Run beside `session` until it ends. Asleep while no request is open on it: a quiet
        session with nothing pending costs no timer and no traffic."""
        idle_since = session.last_heard
        while session.alive:
            if session.open_requests == 0:  # nobody waits on it: nothing to check until someone does
                await first_of(session.next_request(), session.closed)
                idle_since = anyio.current_time()
                continue
            quiet_until = max(session.last_heard, idle_since) + self.probe_s
            with anyio.move_on_after(max(0.0, quiet_until - anyio.current_time())):
                await session.closed.wait()
            now = anyio.current_time()
            if not session.alive or now - max(session.last_heard, idle_since) < self.probe_s:
                continue
            if session.open_requests == 0:
                continue
            if not await self._answers(session):
                log.info("%s did not answer a liveness ping; dropping the connection", session.peer_id)
                session.kill("no answer to a liveness ping")
                with anyio.move_on_after(5, shield=True):
                    await self.drop_connection(session.peer_id)
                return

    async def _answers(self, session: OutboundSession) -> bool:
        try:
            with anyio.fail_after(self.probe_s):
                async with session.open(Ping(seq=0)) as replies:
                    async for reply in replies:
                        del reply  # a pong, or even a refusal: it is alive
                        return True
        except (NetworkError, TimeoutError):
            return False
        return session.alive
