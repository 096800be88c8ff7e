"""Keeping the connection open to the peers that deliver to this node.

A phone on cellular, behind a NAT, cannot be dialed: a letter or a task's news reaches it only over a
connection it opened itself. So when that connection ends (the home PC gave it up while the phone
slept through a liveness ping, Wi-Fi gave way to cellular, the home PC restarted), the phone dials
again at once, and with a back-off while the peer stays unreachable (protocol/backoff.py: 1 s
doubling to 5 minutes). The peer, seeing the connection open, hands over what waits for us at once
(node/messaging/service.py nudges its courier; node/net/host.py gives up a dial of ours it was
stuck in). Which peers: on the `phone` profile every paired `home` peer, and on any profile the
`mailbox` peer.

Nothing here polls: it waits for a change of connections (P2PNode.changes) or of the trust store, or
for a retry that is due. On a connection that carried nothing for `keep_alive_s` (25 minutes by
default; 0: never) one ping keeps the NAT's binding: carriers drop idle TCP bindings after tens of
minutes, and a binding they dropped unseen would leave the phone "connected" and unreachable.
"""
from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import Protocol

import anyio
import anyio.abc

from ..core.notify import first_of
from ..door.trust import TrustStore
from ..net.session import Links, SessionPool
from ...protocol.backoff import backoff_s
from ...protocol.common import Ping, Pong
from ...protocol.errors import PsymeshError

log = logging.getLogger("psymesh.reach")

DIAL_TIMEOUT_S = 30.0   # one dial (TCP, Noise, yamux, the session's stream; a relay's circuit)


class Reacher(Protocol):
    """Open a session to a peer (dialing it at its stored addresses, or through a relay), ping
    it on that session, and say how long it has been silent (`PoolReacher`)."""

    async def open(self, peer_id: str) -> None: ...

    async def ping(self, peer_id: str) -> None: ...

    def quiet_for(self, peer_id: str, now: float) -> float: ...


class PoolReacher:
    """A `Reacher` on the node's session pool."""

    def __init__(self, sessions: SessionPool) -> None:
        self.sessions = sessions

    async def open(self, peer_id: str) -> None:
        await self.sessions.session(peer_id)

    async def ping(self, peer_id: str) -> None:
        await self.sessions.request(peer_id, Ping(seq=0), Pong)

    def quiet_for(self, peer_id: str, now: float) -> float:
        """How long our session to it has heard nothing; with no session (it dialed us, or the
        connection came from pairing), as long as can be: the keeper counts from when it saw the
        connection open instead, so a new connection costs no ping."""
        heard = self.sessions.last_heard(peer_id)
        return math.inf if heard is None else now - heard


def kept_peers(trust: TrustStore, *, profile: str, mailbox: str | None) -> set[str]:
    """The peer ids this node keeps connected: paired, not revoked either way; on a phone the
    home PCs; on any node its mailbox."""
    out: set[str] = set()
    for peer in trust.list(include_revoked=False):
        if peer.revoked_us_at is not None:
            continue
        if (profile == "phone" and peer.role == "home") or mailbox in (peer.name, peer.peer_id):
            out.add(peer.peer_id)
    return out


class KeepConnected:
    def __init__(self, wanted: Callable[[], set[str]], links: Links, reacher: Reacher, *,
                 keep_alive_s: float, label: Callable[[str], str] = str,
                 backoff: Callable[[int, float], float] = backoff_s,
                 jitter: Callable[[], float] = random.random) -> None:
        """`backoff(failures, jitter)`: seconds before the next dial after `failures` in a row."""
        self.wanted = wanted
        self.links = links
        self.reacher = reacher
        self.keep_alive_s = keep_alive_s
        self.label = label
        self.backoff = backoff
        self.jitter = jitter
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._dialing: set[str] = set()
        self._seen_since: dict[str, float] = {}  # peer id -> since when we see it connected (or pinged it)
        self._poke = anyio.Event()   # a dial ended, or the trust store changed

    @property
    def busy(self) -> bool:
        """A dial or a keep-alive ping is under way."""
        return bool(self._dialing)

    def poke(self) -> None:
        """Look again now (the trust store changed: a peer was paired or revoked)."""
        self._poke.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                changed = self.links.changes()  # taken before reading, so no change is missed
                self._poke = anyio.Event()
                now = anyio.current_time()
                wake_at = math.inf
                for peer_id in self.wanted():
                    if peer_id in self._dialing:
                        continue
                    if self.links.path(peer_id) is None:
                        self._seen_since.pop(peer_id, None)
                        due = self._retry_at.get(peer_id, 0.0)
                        if due <= now:
                            self._dialing.add(peer_id)
                            tg.start_soon(self._dial, peer_id)
                        else:
                            wake_at = min(wake_at, due)
                    elif self.keep_alive_s > 0:
                        seen = self._seen_since.setdefault(peer_id, now)
                        quiet = min(self.reacher.quiet_for(peer_id, now), now - seen)
                        if quiet >= self.keep_alive_s:
                            self._dialing.add(peer_id)
                            tg.start_soon(self._keep_alive, peer_id)
                        else:
                            wake_at = min(wake_at, now + self.keep_alive_s - quiet)
                with anyio.move_on_after(max(0.0, wake_at - now)):
                    await first_of(changed, self._poke)

    async def _dial(self, peer_id: str) -> None:
        try:
            with anyio.fail_after(DIAL_TIMEOUT_S):
                await self.reacher.open(peer_id)
        except (PsymeshError, TimeoutError) as exc:
            failures = self._failures.get(peer_id, 0)
            delay = self.backoff(failures, self.jitter())
            self._failures[peer_id] = failures + 1
            self._retry_at[peer_id] = anyio.current_time() + delay
            log.log(logging.INFO if failures == 0 else logging.DEBUG,
                    "keeping %s connected: unreachable (%s); next try in %.0f s", self.label(peer_id),
                    "no answer" if isinstance(exc, TimeoutError) else exc, delay)
        else:
            if self._failures.pop(peer_id, 0):
                log.info("keeping %s connected: reachable again", self.label(peer_id))
            self._retry_at.pop(peer_id, None)
        finally:
            self._dialing.discard(peer_id)
            self._poke.set()

    async def _keep_alive(self, peer_id: str) -> None:
        self._seen_since[peer_id] = anyio.current_time()  # quiet counts from the ping, session or not
        try:
            with anyio.fail_after(DIAL_TIMEOUT_S):
                await self.reacher.ping(peer_id)
        except (PsymeshError, TimeoutError) as exc:  # the session died: the next look redials
            log.debug("keep-alive ping to %s: %s", self.label(peer_id), exc)
        finally:
            self._dialing.discard(peer_id)
            self._poke.set()
