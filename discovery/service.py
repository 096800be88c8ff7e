"""The discovery service: which nodes are around, and where paired peers are now.

    Discovery.run()
      ├── Mdns.run          announce, browse (config `mdns = true`; off by default)
      ├── StaticPeers.run   dial and keep connected the config's `static_peers`
      └── _follow           prove, then store, a paired peer's new addresses

Every node seen lands in one bounded table (discovery/table.py), paired or not, which
`psymesh discover` lists with fingerprints so a person can check a device before pairing.

**Addresses follow the peer.** When a paired peer announces an address the trust store
does not hold (its DHCP lease changed, it roamed, it restarted on another port), the
node stores it first in the peer's list, so the next request goes there without pairing
again, but only once the peer is proven to be there: an announcement is unauthenticated,
anyone on the LAN can claim any peer id. Without a connection to the peer, the node
dials the announced addresses until the Noise handshake at one proves the peer's key.
With one open, its remote IP vouches if it is an announced address's (the peer
authenticated from there); a connection from elsewhere is left over from the old
address, or the announcement lies, so the node pings the peer on it and drops it (then
dials the new addresses) only if no answer comes in `PROBE_TIMEOUT_S`: a live connection
is never dropped on an announcement's word. A check that did not move the peer is
repeated `RETRY_S` later, at most `MAX_CHECKS` times per announcement. Older addresses
stay behind the new ones (at most `MAX_STORED`), so a lie can cost a failed dial but
never push out an address that works.

This package imports nothing of node/: the daemon hands it the p2p host, the trust
store and a way to ping a peer, which fit the small protocols below.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.abc

from .records import dialable, without_peer_id
from .static import Dialer, StaticPeers, check_static_peers
from .table import SeenTable, Sighting
from ..protocol.control import DiscoverReply, SeenNode
from ..protocol.errors import network_kind
from ..protocol.errors import PsymeshError
from ..protocol.identity import is_peer_id, peer_fingerprint

if TYPE_CHECKING:  # .mdns brings zeroconf (~5 MB): imported only when mDNS is on
    from .mdns import Mdns, MdnsEvent

log = logging.getLogger("psymesh.discovery")

FOLLOW_S = 1.0         # how often pending address changes of paired peers are looked at again
RETRY_S = 10.0         # after a check that did not move the peer, wait this long before the next
MAX_CHECKS = 6         # then wait for the peer's next announcement
PROOF_TIMEOUT_S = 5.0  # one dial that proves a paired peer at an announced address
PROBE_TIMEOUT_S = 5.0  # a paired peer's answer on a connection the announcement says is stale
MAX_PROOFS = 4         # announced addresses tried per attempt
MAX_STORED = 8         # addresses kept per paired peer


class Host(Dialer, Protocol):
    """What discovery needs of the p2p host (node/net/host.py P2PNode)."""

    def addrs(self) -> tuple[str, ...]: ...

    async def disconnect(self, peer_id: str) -> None: ...


class Probe(Protocol):
    """One request to a paired peer over its session (the daemon sends a `ping`): returns
    if the peer answered, even with a refusal; raises if the network failed."""

    async def __call__(self, peer_id: str) -> object: ...


class KnownPeer(Protocol):
    """A paired peer as the trust store holds it (node/door/trust.py Peer)."""

    @property
    def name(self) -> str: ...

    @property
    def addrs(self) -> tuple[str, ...]: ...

    @property
    def revoked(self) -> bool: ...


class PeerBook(Protocol):
    """The trust store (node/door/trust.py TrustStore), as far as addresses go."""

    def get(self, peer_id: str) -> KnownPeer | None: ...

    def set_addrs(self, peer_id: str, addrs: list[str]) -> None: ...


class Discovery:
    def __init__(self, peer_id: str, *, mdns: bool, static_peers: Sequence[str], host: Host, peers: PeerBook,
                 probe: Probe, clock: Callable[[], float] = time.time) -> None:
        """BAD_REQUEST for a static peer that is not a dialable multiaddr with a peer id."""
        self.peer_id = peer_id
        self.host = host
        self.peers = peers
        self.probe = probe
        self.clock = clock
        self.table = SeenTable()
        self.mdns: Mdns | None = None
        if mdns:
            from .mdns import Mdns

            self.mdns = Mdns(peer_id, host.addrs)
        self.static = StaticPeers(check_static_peers(static_peers, peer_id), host, self._reached)
        self._pending: set[str] = set()   # paired peers whose announced addresses are not followed yet
        self._retry_at: dict[str, float] = {}
        self._checks: dict[str, int] = {}     # checks that did not move a pending peer, per announcement
        self._wake = anyio.Event()
        self._seen = anyio.Event()            # set (and replaced) whenever a node is seen

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Reports started at once: mDNS probing takes seconds and the node need not wait for it."""
        async with anyio.create_task_group() as tg:
            if self.mdns is not None:
                await tg.start(self.mdns.run, self._on_mdns)
                tg.start_soon(self._follow)
            await tg.start(self.static.run)
            task_status.started()

    # -- what is seen ----------------------------------------------------------------
    def _on_mdns(self, event: MdnsEvent) -> None:
        from .mdns import Left  # loaded already: mDNS is on

        if isinstance(event, Left):
            self.table.forget(event.peer_id, "mdns")
            return
        peer_id = event.announcement.peer_id
        if peer_id == self.peer_id:
            return  # our own announcement, heard back
        self.table.saw(peer_id, event.announcement.addrs, "mdns", self.clock())
        self._saw()
        self._pending.add(peer_id)
        self._retry_at.pop(peer_id, None)  # a new announcement deserves new tries
        self._checks.pop(peer_id, None)
        self._wake.set()

    def _reached(self, peer_id: str, addr: str) -> None:
        """A static peer answered at `addr`: the dial proved it, so a paired one is stored there."""
        self.table.saw(peer_id, (addr,), "static", self.clock())
        self._saw()
        peer = self.peers.get(peer_id)
        if peer is not None and not peer.revoked and without_peer_id(addr) not in {without_peer_id(a) for a in peer.addrs}:
            self._store(peer_id, peer, addr, [addr])

    # -- addresses follow the peer ----------------------------------------------------
    async def _follow(self) -> None:
        while True:
            with anyio.move_on_after(FOLLOW_S):
                await self._wake.wait()
            self._wake = anyio.Event()
            for peer_id in sorted(self._pending):
                if await self._follow_one(peer_id):
                    self._pending.discard(peer_id)
                    self._retry_at.pop(peer_id, None)
                    self._checks.pop(peer_id, None)

    async def _follow_one(self, peer_id: str) -> bool:
        """True when there is nothing (more) to do for `peer_id`'s latest announcement."""
        seen = self.table.get(peer_id)
        peer = self.peers.get(peer_id)
        if seen is None or peer is None or peer.revoked:
            return True  # gone, or not paired: nothing to follow
        stored = {without_peer_id(a) for a in peer.addrs}
        new = [a for a in seen.addrs if dialable(a)]
        if not new or all(without_peer_id(a) in stored for a in new):
            return True
        ip = self.host.remote_ip(peer_id)
        if ip is not None:  # connected: the connection's own address may vouch for the announcement
            vouched = [a for a in new if a.split("/")[2] == ip]
            if vouched:
                self._store(peer_id, peer, vouched[0], new)
                return True
        if self.clock() < self._retry_at.get(peer_id, 0.0):
            return False
        if ip is not None:  # connected elsewhere: stale (the peer moved), or the announcement lies
            if await self._answers(peer_id):
                return self._later(peer_id, peer.name)
            log.info("%s announced %s and no longer answers on its connection from %s; dropping that connection",
                     peer.name, " ".join(new), ip)
            await self.host.disconnect(peer_id)
        for addr in new[:MAX_PROOFS]:
            try:
                with anyio.fail_after(PROOF_TIMEOUT_S):
                    await self.host.connect(addr)  # Noise proves the key behind `addr` is the peer's
            except (PsymeshError, TimeoutError) as exc:
                log.info("%s announced %s, which did not prove it: %s", peer.name, addr, exc)
                continue
            self._store(peer_id, peer, addr, new)
            return True
        return self._later(peer_id, peer.name)

    def _later(self, peer_id: str, name: str) -> bool:
        """Check `peer_id`'s announcement again in RETRY_S; after MAX_CHECKS, only once it changes."""
        self._checks[peer_id] = checks = self._checks.get(peer_id, 0) + 1
        self._retry_at[peer_id] = self.clock() + RETRY_S
        if checks < MAX_CHECKS:
            return False
        log.info("%s is not where it announced itself after %d checks; waiting for a new announcement", name, checks)
        return True

    async def _answers(self, peer_id: str) -> bool:
        """Whether `peer_id` answers on its open connection within PROBE_TIMEOUT_S."""
        try:
            with anyio.fail_after(PROBE_TIMEOUT_S):
                await self.probe(peer_id)
        except TimeoutError:
            return False
        except PsymeshError as exc:
            return network_kind(exc) is None  # a refusal is an answer too
        return True

    def _store(self, peer_id: str, peer: KnownPeer, proven: str, announced: list[str]) -> None:
        """The proven address first, then the rest of the announcement, then what was stored
        before (a stale one costs a failed dial after the new ones; a lie cannot push out
        a good one), at most MAX_STORED."""
        addrs: dict[str, str] = {}
        for addr in (proven, *announced, *peer.addrs):
            addrs.setdefault(without_peer_id(addr), addr)
        self.peers.set_addrs(peer_id, list(addrs.values())[:MAX_STORED])
        log.info("%s (%s) is now at %s", peer.name, peer_id, " ".join(announced))

    # -- the owner's view ---------------------------------------------------------------
    def _saw(self) -> None:
        self._seen.set()
        self._seen = anyio.Event()

    def seen(self) -> list[SeenNode]:
        """Every node seen, most recent first (as `discovered` lists them, now)."""
        return [self._view(s) for s in self.table.all()]

    async def discovered(self, wait_s: float = 0.0) -> DiscoverReply:
        """Every node seen, most recent first. `wait_s`: with none seen yet, listen until the
        first one is (or that many seconds passed); with some seen, or discovery off (no mDNS,
        no static peers: nothing could be seen), answer at once."""
        searching = self.mdns is not None or bool(self.static.peers)
        if wait_s > 0 and searching and not self.table.all():
            with anyio.move_on_after(wait_s):
                await self._seen.wait()
        return DiscoverReply(mdns=self.mdns is not None, announced=self.mdns.announced if self.mdns else [],
                             static_peers=len(self.static.peers), nodes=self.seen())

    def _view(self, seen: Sighting) -> SeenNode:
        peer = self.peers.get(seen.peer_id)
        paired = peer is not None and not peer.revoked
        return SeenNode(peer_id=seen.peer_id,
                        fingerprint=peer_fingerprint(seen.peer_id) if is_peer_id(seen.peer_id) else None,
                        addrs=list(seen.addrs), source=seen.source, first_seen=seen.first_seen,
                        last_seen=seen.last_seen, paired=paired, name=peer.name if paired and peer else None)
