"""Reaching home from anywhere: this node's use of circuit relays, and its addresses that
follow it (protocol/relay.py, protocol/addresses.py). The relaying itself, both ends of a
circuit included, is node/net/circuit.py's; this module decides when and where.

    Relaying.run()
      ├── _keep(relay)   one per `[relay] relays` entry: a reservation held there (dialed at
      │                  the relay's stored addresses), renewed halfway through its time,
      │                  taken again as soon as it lapses or the connection to the relay drops
      └── _paths()       at each change of connections (every second only while a paired
                         peer is reached through a relay): such a peer is dialed
                         at its direct addresses (every `direct_retry_s`, and at once when it
                         tells us new ones); with `hole_punch` on, a peer that came to us
                         through a relay is first asked for a hole punch (DCUtR: the spec's
                         `B`, the side a circuit reached, starts it; both ends then dial at
                         once, so each NAT has let its own SYN out when the other's arrives).
                         Beside a direct connection, a relayed one is closed as soon as it
                         carries no stream, after `overlap_s` at the latest. New sessions
                         take the direct connection (node/net/session.py).
    Relaying.receive(call)   a peer's `addrs.push` (the door admitted it): kept in the trust
                             store; its direct addresses tried at once if it is relayed

Our own addresses are told to our peers by node/reach/resync.py (on every new connection,
and whenever they change).

Nothing here is lost when a path changes: a session that dies with its connection fails
its open requests with a NetworkError and the durable machinery (node/tasks/submitter.py,
node/messaging/service.py) sends them again, exactly once.
"""
from __future__ import annotations

import logging
import math
import random
import time

import anyio
import anyio.abc

from ..core.notify import first_of
from ..net.p2p import P2PNode
from ..net.session import Call
from ..door.trust import Peer, TrustStore
from ...protocol.addresses import AddrsOk, AddrsPush
from ...protocol.errors import PsymeshError
from ...protocol.messages import Message
from ...protocol.relay import RelaySettings

log = logging.getLogger("psymesh.relay")

TICK_S = 1.0
BACKOFF_FIRST_S = 1.0     # a relay that refused or could not be reached is asked again after this,
BACKOFF_MAX_S = 30.0      # doubling up to this
DIRECT_DIAL_TIMEOUT_S = 5.0
CIRCUIT = "/p2p-circuit"


class Relaying:
    def __init__(self, settings: RelaySettings, p2p: P2PNode, trust: TrustStore) -> None:
        self.settings = settings
        self.p2p = p2p
        self.trust = trust
        self._retry_at: dict[str, float] = {}        # peer id -> when to dial it directly again
        self._direct_since: dict[str, float] = {}    # peer id -> when a direct connection joined a relayed one
        self._wake = anyio.Event()       # _paths: a peer told us new addresses, or a peer was paired
        trust.on_change(self._peers_changed)

    def _peers_changed(self) -> None:
        self._wake.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if self.settings.hole_punch:
            self.p2p.enable_hole_punch()
        async with anyio.create_task_group() as tg:
            for relay in self.settings.relays:
                tg.start_soon(self._keep, relay)
            tg.start_soon(self._paths)
            task_status.started()

    # -- our reservations ----------------------------------------------------------------
    async def _keep(self, name: str) -> None:
        failures = 0
        renew_at = 0.0
        while True:
            try:
                relay = self.trust.resolve(name)
                relay.refuse_if_revoked_us()
                changes = self.p2p.changes()
                if self.p2p.reservation(relay.peer_id) is None or time.time() >= renew_at:
                    now = time.time()
                    expires = await self.p2p.reserve(relay.peer_id, relay.addrs)
                    renew_at = now + (expires - now) / 2
                    if failures:
                        log.info("relay %s holds a reservation for this node", self.trust.label(relay.peer_id,
                                                                                                fingerprint=True))
                    changes = self.p2p.changes()
                failures = 0
                with anyio.move_on_after(max(0.0, renew_at - time.time())):  # or its connection drops
                    await changes.wait()
            except PsymeshError as exc:
                delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(failures, 10)) * (1 - random.random() / 4)
                failures += 1
                log.log(logging.INFO if failures == 1 else logging.DEBUG,  # each message names the relay
                        "no reservation: %s; next try in %.0f s", exc.message, delay)
                await anyio.sleep(delay)

    # -- which path to a peer ------------------------------------------------------------------
    async def _paths(self) -> None:
        """Asleep while every connected peer is reached directly and alone: woken by a change
        of connections, or a peer's new addresses; ticks (TICK_S) only while a peer is reached
        through a relay (a direct dial is due every `direct_retry_s`) or has both paths."""
        while True:
            changes = self.p2p.changes()
            tick = False
            for peer in self._connected_peers():
                tick |= await self._check_path(peer)
            with anyio.move_on_after(TICK_S if tick else math.inf):
                await first_of(changes, self._wake)
            self._wake = anyio.Event()

    async def _check_path(self, peer: Peer) -> bool:
        """Act on how `peer` is reached; True while that needs looking at again soon."""
        now = time.monotonic()
        path = self.p2p.path(peer.peer_id)
        if path == "relayed":
            self._direct_since.pop(peer.peer_id, None)
            if now >= self._retry_at.get(peer.peer_id, 0.0):
                self._retry_at[peer.peer_id] = now + self.settings.direct_retry_s
                if self.settings.hole_punch and self.p2p.relayed_inbound(peer.peer_id):
                    if await self.p2p.hole_punch(peer.peer_id):
                        log.info("%s is reached directly now: hole punched through its NAT and ours", peer.name)
                        return True
                await self._dial_direct(peer)
            return True
        if path == "direct" and self.p2p.path_relayed_too(peer.peer_id):
            since = self._direct_since.setdefault(peer.peer_id, now)
            if await self.p2p.drop_relayed(peer.peer_id, idle_only=now - since < self.settings.overlap_s):
                log.info("closed the relayed connection to %s: it is reached directly now", peer.name)
            return True
        self._direct_since.pop(peer.peer_id, None)
        return False

    async def _dial_direct(self, peer: Peer) -> None:
        for addr in [a for a in peer.addrs if CIRCUIT not in a]:
            try:
                with anyio.fail_after(DIRECT_DIAL_TIMEOUT_S):
                    await self.p2p.connect(addr if "/p2p/" in addr else f"{addr}/p2p/{peer.peer_id}")
            except (PsymeshError, TimeoutError) as exc:
                log.debug("%s is not reachable directly at %s: %s", peer.name, addr, exc)
                continue
            log.info("%s is reached directly at %s now", peer.name, addr)
            return

    # -- a peer's addresses ---------------------------------------------------------------------
    async def receive(self, call: Call) -> Message:
        """A paired peer's own addresses (the door checked the record is its own, signed)."""
        request = call.request
        assert isinstance(request, AddrsPush)
        record = request.record
        if self.trust.set_own_addrs(call.peer_id, list(record.addrs), record.seq):
            log.debug("%s is at %s", call.peer_id, " ".join(record.addrs))
            if self.p2p.path(call.peer_id) == "relayed":
                self._retry_at.pop(call.peer_id, None)  # its new addresses may reach it directly
                self._wake.set()
        return AddrsOk(seq=record.seq)

    def _connected_peers(self) -> list[Peer]:
        peers = [self.trust.get(p["peer_id"]) for p in self.p2p.connected_peers()]
        return [p for p in peers if p is not None and not p.revoked]
