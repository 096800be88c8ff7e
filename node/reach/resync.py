"""What each paired peer must hold from us, told again until it has it (docs/protocol.md §5.11).

Three things we hand a paired peer are ours to keep it up to date with: the grant we issued it
(`manifest.push`), our addresses (`addrs.push`) and, on an exit, our exit key (`web.key`).
Each push alone is best effort: a peer that was stopped, offline or out of reach when its
grant changed, our addresses moved or our key rotated would never hear of it. So each is a
*tiding* with a current value per peer, and a peer is owed a tiding

    - on every new session to it (a new connection: it may have restarted, or come back
      from anywhere; telling costs one small request each, and the receiver keeps only the
      newest: the highest serial, the largest `seq`, the newest key), and
    - whenever the value changes (a grant edited, an address gained, a key rotated).

    Resync.run()             asleep until connections change (P2PNode.changes), something
                             owed changes (`poke`: a pairing, a grant, a new key) or a retry
                             is due; then each paired peer owed something is told: on its
                             current session if connected, else by dialing it (so a peer
                             that only ever dials us, or that restarted at the same address,
                             hears of it without anyone asking). A peer not reached is tried
                             again after protocol/backoff.py's wait (1 s doubling to 5 min),
                             at once when a connection to it opens.
    Resync.tell(peer, what)  one tiding now, dialing if needed (`psymesh peer grant` reports
                             whether it was delivered).

A refusal is an answer: the peer is not asked again for that value on that session.
"""
from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.abc

from ..core.home import Identity
from ..core.notify import first_of
from ..door.trust import Peer, TrustStore
from ..net.p2p import P2PNode
from ..net.session import OutboundSession, SessionPool
from ...protocol.addresses import MAX_ADDRS, AddrRecord, AddrsOk, AddrsPush
from ...protocol.backoff import backoff_s
from ...protocol.errors import ErrorCode, NetworkError, PsymeshError
from ...protocol.manifest import ManifestOk, ManifestPush
from ...protocol.messages import Message
from ...protocol.oblivious import ExitKey
from ...protocol.web import WebKeyOk, WebKeyPush

log = logging.getLogger("psymesh.resync")

TELL_TIMEOUT_S = 10.0  # one tiding, dialing included


class Tiding(Protocol):
    """One thing a paired peer must hold from us."""

    what: str              # for logs: "its grant", "our addresses", "our exit key"
    reply: type[Message]   # the answer that says it took it

    def due(self, peer: Peer) -> Hashable | None:
        """What `peer` should hold now (compared with what it took); None: nothing to tell it."""

    def message(self, peer: Peer) -> Message:
        """The request that tells `peer` what `due` returned."""


class GrantTiding:
    what = "its grant"
    reply: type[Message] = ManifestOk

    def due(self, peer: Peer) -> Hashable | None:
        return None if peer.granted is None or peer.revoked else peer.granted.serial

    def message(self, peer: Peer) -> Message:
        assert peer.granted is not None
        return ManifestPush(manifest=peer.granted)


class AddressTiding:
    what = "our addresses"
    reply: type[Message] = AddrsOk

    def __init__(self, identity: Identity, p2p: P2PNode) -> None:
        self.identity = identity
        self.p2p = p2p

    def due(self, peer: Peer) -> Hashable | None:
        return tuple(self.p2p.addrs()[:MAX_ADDRS])

    def message(self, peer: Peer) -> Message:
        record = AddrRecord(peer_id=self.identity.peer_id, addrs=tuple(self.p2p.addrs()[:MAX_ADDRS]),
                            seq=time.time_ns() // 1_000_000)
        return AddrsPush(record=record.sign(self.identity.private_key))


class ExitKeyTiding:
    what = "our exit key"
    reply: type[Message] = WebKeyOk

    def __init__(self, key: Callable[[], ExitKey | None]) -> None:
        self.key = key  # node/web/serve.py WebServer.key: None unless this node is an exit

    def due(self, peer: Peer) -> Hashable | None:
        key = self.key()
        return None if key is None else (key.key_id, key.public_key, key.not_after)

    def message(self, peer: Peer) -> Message:
        key = self.key()
        assert key is not None
        return WebKeyPush(key=key)


@dataclass(frozen=True)
class _Retry:
    at: float          # anyio's clock
    failures: int
    connected: bool    # it failed while a connection was open (else a new connection retries at once)


class Resync:
    def __init__(self, trust: TrustStore, p2p: P2PNode, sessions: SessionPool, tidings: list[Tiding], *,
                 revoked_by: Callable[[str, str], None] = lambda peer_id, reason: None) -> None:
        """`revoked_by(peer_id, reason)`: a peer answered `unknown_peer` (it revoked us and we
        missed its notice): what the node does then (node/tasks/submitter.py `revoked_by`)."""
        self.trust = trust
        self.revoked_by = revoked_by
        self.p2p = p2p
        self.sessions = sessions
        self.tidings = tidings
        # (peer id, what) -> (the value it took, the session it took it on)
        self._took: dict[tuple[str, str], tuple[Hashable, OutboundSession]] = {}
        self._retry: dict[str, _Retry] = {}
        self._poked = anyio.Event()
        trust.on_change(self.poke)

    def poke(self) -> None:
        """Something a peer may be owed changed (a pairing, a grant, our exit key): look again."""
        self._poked.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            changes = self.p2p.changes()
            self._poked = anyio.Event()
            connected = {p["peer_id"] for p in self.p2p.connected_peers()}
            now = anyio.current_time()
            wake_at = math.inf
            due: list[tuple[Peer, list[Tiding]]] = []
            for peer in self._peers():
                owed = self._owed(peer, peer.peer_id in connected)
                if not owed:
                    self._retry.pop(peer.peer_id, None)
                    continue
                retry = self._retry.get(peer.peer_id)
                if retry is None or retry.at <= now or (peer.peer_id in connected and not retry.connected):
                    due.append((peer, owed))
                else:
                    wake_at = min(wake_at, retry.at)
            async with anyio.create_task_group() as tg:
                for peer, owed in due:
                    tg.start_soon(self._sync, peer, owed)
            wake_at = min([wake_at, *(self._retry[p.peer_id].at for p, _ in due if p.peer_id in self._retry)])
            self._forget_unpaired()
            with anyio.move_on_after(max(0.0, wake_at - anyio.current_time())):
                await first_of(changes, self._poked)

    async def tell(self, peer_id: str, tiding: Tiding) -> bool:
        """Tell `peer_id` one tiding now (dialing it if needed), within TELL_TIMEOUT_S; True once
        it answered. A peer not reached is left to `run`, which tries again."""
        peer = self.trust.get(peer_id)
        try:
            if peer is None or tiding.due(peer) is None:
                return False
            with anyio.move_on_after(TELL_TIMEOUT_S):  # dialing included, as a single request
                return await self._sync(peer, [tiding])
            return False
        finally:
            self.poke()

    def _peers(self) -> list[Peer]:
        return [p for p in self.trust.list(include_revoked=False) if p.revoked_us_at is None]

    def _owed(self, peer: Peer, connected: bool) -> list[Tiding]:
        """The tidings `peer` has not taken: a value it never took; and, connected, any it did
        not take on the session open to it now (a new connection: it may have forgotten)."""
        session = self.sessions.live(peer.peer_id) if connected else None
        owed = []
        for tiding in self.tidings:
            value = tiding.due(peer)
            if value is None:
                continue
            took = self._took.get((peer.peer_id, tiding.what))
            if took is None or took[0] != value or (connected and took[1] is not session):
                owed.append(tiding)
        return owed

    async def _sync(self, peer: Peer, owed: list[Tiding]) -> bool:
        """Tell `peer` each of `owed` on one session (opened, dialing, if there is none)."""
        try:
            with anyio.fail_after(TELL_TIMEOUT_S):
                session = await self.sessions.session(peer.peer_id)
            for tiding in owed:
                value = tiding.due(peer)
                try:
                    with anyio.fail_after(TELL_TIMEOUT_S):
                        await session.request(tiding.message(peer), tiding.reply)
                except NetworkError:
                    raise
                except PsymeshError as exc:  # it answered: not asked again for this value here
                    log.info("%s did not take %s: %s", peer.name, tiding.what, exc.message)
                    if exc.code is ErrorCode.UNKNOWN_PEER:  # it revoked us: ask it nothing more
                        self.revoked_by(peer.peer_id, f"{peer.name} refused this node: {exc.message}")
                        return True
                self._took[(peer.peer_id, tiding.what)] = (value, session)
        except (PsymeshError, TimeoutError) as exc:  # not reached (or cannot be dialed now): later
            failures = self._retry[peer.peer_id].failures + 1 if peer.peer_id in self._retry else 1
            wait = backoff_s(failures - 1, random.random())
            self._retry[peer.peer_id] = _Retry(anyio.current_time() + wait, failures,
                                               connected=self.p2p.path(peer.peer_id) is not None)
            log.log(logging.INFO if failures == 1 else logging.DEBUG,
                    "could not tell %s %s: %s; next try in %.0f s", peer.name,
                    " and ".join(t.what for t in owed), exc, wait)
            return False
        if self._retry.pop(peer.peer_id, None) is not None:
            log.info("told %s %s", peer.name, " and ".join(t.what for t in owed))
        return True

    def _forget_unpaired(self) -> None:
        """Forget what peers no longer paired (revoked, or that revoked us) took."""
        paired = {p.peer_id for p in self._peers()}
        for key in [k for k in self._took if k[0] not in paired]:
            del self._took[key]
        for peer_id in [p for p in self._retry if p not in paired]:
            del self._retry[peer_id]
