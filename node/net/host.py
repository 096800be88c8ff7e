"""`P2PNode`: psymesh's libp2p host (pinned 0.8.1), a Noise + yamux host over TCP: listening,
the lifecycle, admission of inbound connections and streams, dialing, streams, peers.

Everything else in psymesh sees `P2PNode` and `P2PStream` (a `node.net.framed.ByteStream`),
speaks anyio, and catches only psymesh errors: libp2p types and exceptions stop in node/net/.
The network failing is mapped here to `NetworkError`s (as httpcore maps its transport's errors):
a peer that cannot be dialed, or a stream that cannot be opened, is a `ConnectError`; a
stream that dies under a write is `ConnectionLost`. Codes stay `unavailable`.
libp2p is trio-native, so this runs on anyio's trio backend only. What libp2p 0.8.1 gets
wrong and what the host does about each is net/patches.py's numbered list; the relay and
hole-punching parts are net/circuit.py and net/dcutr.py, mixed into this class.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal

import anyio
import anyio.abc
import sniffio
from libp2p import new_host
from libp2p.abc import IMuxedConn, INetConn, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair as ed25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.basic_host import BasicHost
from libp2p.network.config import ConnectionConfig
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.rcmgr import Direction
from libp2p.rcmgr.graceful_degradation import GracefulDegradation
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from ...protocol.circuit import Hop
from ...protocol.errors import ConnectError, ErrorCode, ProtocolError, PsymeshError, cause_of
from ...protocol.relay import DCUTR, STOP, RelayBook
from ...protocol.strangers import StrangerLimits, fair_share
from .addrs import (
    _check_port_free,
    _is_circuit,
    _is_relayed,
    _is_wildcard,
    _parse_multiaddr,
    _parse_peer_id,
    _peer_info,
    _relay_of,
    _watch_local_addresses,
    _with_peer_id,
    expand_wildcard,
    local_ipv4_addresses,
)
from .circuit import Relaying, _Held, RelayAdmit
from .dcutr import HolePunching
from .patches import (
    MAX_PROPOSALS,
    MULTISTREAM,
    NEGOTIATE_TIMEOUT_S,
    _Changes,
    _Host,
    _MuxerSelect,
    _muxer,
    _NegotiationFailed,
    _NoAutoConnect,
    _PeerFilteringNoise,
    _QuietRecovery,
    _read_multistream_message,
    _remote_ip,
    _Swarm,
    _write_multistream_message,
)
from .stream import Handler, P2PStream, _close_quietly, _reason, _reset_quietly, dial_failure, nobody_listens
from .strangers import PAIRED_STREAMS, CircuitFilter, PeerFilter, PunchFilter, StreamFilter, _Admission

log = logging.getLogger(__name__)

# How long disconnect()/shutdown wait for sockets to close (a GO_AWAY write to a peer that
# stopped reading can block); past it, shutdown cancels the rest.
CLOSE_TIMEOUT_S = 2.0
# How long opening a stream (yamux SYN + multistream-select) may take on an open connection
# before the connection is taken for dead (13).
STREAM_OPEN_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 5.0
DIRECT_FIRST_TIMEOUT_S = 5.0  # a direct address tried before a relayed one (open_stream_any)

Path = Literal["direct", "relayed"]


class P2PNode(Relaying, HolePunching):
    """A libp2p host with psymesh's settings and fixes; see the module docstring."""

    def __init__(
        self,
        seed: bytes,
        listen_addrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        *,
        allow_peer: PeerFilter | None = None,
        label: Callable[[str], str] = str,
    ) -> None:
        """`seed`: the node's 32-byte Ed25519 private seed. `allow_peer(peer_id)`: None allows all.
        `label(peer_id)`: how the messages it writes name a peer (the daemon's trust store names a
        paired one: `friend (MFZW-IZLT-OQQG-S3TL)`); its bare id by default."""
        if not isinstance(seed, bytes | bytearray) or len(seed) != 32:
            raise PsymeshError("an Ed25519 seed is 32 bytes", code=ErrorCode.BAD_REQUEST)
        self._listen = [_parse_multiaddr(a) for a in listen_addrs]
        self._allow_peer = allow_peer
        self._label = label
        self._admission = _Admission()
        self._open_streams: Counter[IMuxedConn] = Counter()  # (17) inbound streams per connection
        key_pair = ed25519_key_pair(bytes(seed))
        self._host = new_host(
            key_pair=key_pair,
            # (1) Noise only: the default also accepts plaintext, secio and TLS.
            sec_opt={TProtocol(NOISE_PROTOCOL_ID): _PeerFilteringNoise(key_pair, self._connection_allowed)},
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
            # (2) one connection per peer: dial_peer returns at once instead of waiting 250 ms.
            connection_config=ConnectionConfig(max_connections_per_peer=1),
            listen_addrs=self._listen,
            enable_mDNS=False,
        )
        if type(self._host) is not BasicHost:
            raise RuntimeError(f"node/net/host.py is written against libp2p 0.8.1's BasicHost, not {type(self._host)!r}")
        self._host.__class__ = _Host  # (18) no identify of the peers we dial
        swarm = self._host.get_network()
        if type(swarm) is not Swarm:
            raise RuntimeError(f"node/net/host.py is written against libp2p 0.8.1's Swarm, not {type(swarm)!r}")
        swarm.__class__ = _Swarm  # (4) same object and state, fixed inbound handler
        swarm.admission = self._admission  # (15)
        swarm.auto_connector = _NoAutoConnect(swarm)  # (9)
        degradation = getattr(swarm._resource_manager, "graceful_degradation", None)
        if type(degradation) is GracefulDegradation:
            degradation.__class__ = _QuietRecovery  # (26) no 30 s timer while nothing is degraded
        muxers = swarm.upgrader.muxer_multistream
        muxers.__class__ = _MuxerSelect  # (14) every new yamux connection becomes a _BoundedYamux
        muxers.admission = self._admission
        self._swarm: _Swarm = swarm
        # (3, 7, 16, 17, 18) one choke point for every inbound stream: peer filter, stream cap,
        # bounded negotiation, who may open what, exception containment
        swarm.set_stream_handler(self._on_inbound_stream)
        self.peer_id = str(self._host.get_id())
        # circuit relay v2: reservations we hold at relays (relay id -> what it told us), and,
        # once `serve_relay()` is called, our own relay's book and its gate
        self._held: dict[str, _Held] = {}
        self._book: RelayBook | None = None
        self._relay_admit: RelayAdmit | None = None
        self._hop: Hop | None = None  # the relay's HOP machine (protocol/circuit.py), with the book
        self._host.set_stream_handler(TProtocol(STOP), self._serve_stop)
        # hole punching (DCUtR), once `enable_hole_punch()` is called: our addresses as each
        # relay sees them (relay id -> transport multiaddr), told in its answers to us
        self._hole_punch = False
        self._observed: dict[str, str] = {}
        self._tg: anyio.abc.TaskGroup | None = None  # set while serving
        self._listening = anyio.Event()
        self._stop = anyio.Event()
        self._ran = False
        self._changes = anyio.Event()  # (26) set and replaced at each change of connections or addresses
        swarm.register_notifee(_Changes(self._changed))

    # -- lifecycle -------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, report started, serve until cancelled, then shut down promptly and completely."""
        if sniffio.current_async_library() != "trio":
            raise PsymeshError("the libp2p host needs anyio's trio backend", code=ErrorCode.INTERNAL)
        if self._ran:
            raise PsymeshError("a P2PNode runs only once; make a new one", code=ErrorCode.CONFLICT)
        self._ran = True
        for addr in self._listen:
            _check_port_free(addr)  # (12)
        try:
            async with anyio.create_task_group() as tg:
                # Not `tg.start()`: cancelled while starting, trio would wait for the shielded
                # host task to finish, and it waits for `_stop`.
                tg.start_soon(self._host_lifetime)
                try:
                    await self._listening.wait()
                    if any(_is_wildcard(a) for a in self._listen):  # addrs() follows the interfaces
                        tg.start_soon(_watch_local_addresses, self._changed)
                    task_status.started()
                    await anyio.sleep_forever()
                finally:  # cancelled (or failed to listen): _host_lifetime shuts down in order
                    self._stop.set()
        except BaseExceptionGroup as group:  # e.g. cannot listen: raise it as itself
            if isinstance(sole := _sole_exception(group), PsymeshError):
                raise sole from None
            raise

    async def _host_lifetime(self) -> None:
        # libp2p's service tasks live in the nursery of `host.run()`. Cancelled from outside,
        # they would tear down in no order and race our shutdown (half-closed connections,
        # sockets left open), so the host runs shielded and `run()` asks it to stop instead.
        # The shield's own deadline bounds the shutdown.
        with anyio.CancelScope(shield=True) as lifetime:
            async with anyio.create_task_group() as background:  # libp2p's slow close tails
                async with self._host.run(listen_addrs=self._listen):
                    if not self._swarm.listeners:  # host.run() ignores listen() failing
                        raise PsymeshError(f"cannot listen on {' '.join(map(str, self._listen))}",
                                           code=ErrorCode.UNAVAILABLE)
                    self._tg = background
                    self._listening.set()
                    await self._stop.wait()
                    lifetime.deadline = anyio.current_time() + SHUTDOWN_TIMEOUT_S
                    try:
                        await self._shutdown()
                    finally:
                        self._tg = None
                background.cancel_scope.cancel()

    async def _shutdown(self) -> None:
        """(6) Close all connections at once, not 200 ms each, and cut their closes short once
        the sockets are closed (the rest is pauses and bookkeeping for a host that is going
        away). Then listeners, transports and libp2p's tasks."""
        async with anyio.create_task_group() as closing:
            await self._close_connections(self._live_connections(), closing)
            closing.cancel_scope.cancel()
        await self._host.close()

    # -- admission -------------------------------------------------------------------
    def set_admission(self, *, is_paired: PeerFilter, may_open: StreamFilter, limits: StrangerLimits,
                      may_punch: PunchFilter | None = None, take_circuit: CircuitFilter | None = None) -> None:
        """Who is a stranger (`is_paired` says no), which protocols each peer may open
        (`may_open`, asked for every inbound stream, libp2p's own protocols included; it
        records its refusals), and how much strangers together may cost (14-18). Call
        before `run()`. Until then every peer counts as paired and may open anything.
        `may_punch(peer, relayed)`, if given, decides DCUtR streams instead of `may_open`,
        knowing whether the stream's connection is relayed; `take_circuit(relay, reserved)`
        whether a circuit a relay brings on STOP is taken (default: only with a reservation
        there). Both record their refusals (the daemon's gate)."""
        self._admission.is_paired = is_paired
        self._admission.may_open = may_open
        self._admission.limits = limits
        self._admission.may_punch = may_punch
        if take_circuit is not None:
            self._admission.take_circuit = take_circuit

    def _connection_allowed(self, peer_id: str, ip: str | None) -> bool:
        """Asked when Noise has proved an inbound peer's key (7, 17)."""
        if not self._peer_allowed(peer_id):
            log.info("refused a connection from %s (peer not allowed)", peer_id)
            return False
        if self._admission.paired(peer_id):
            return True
        limits = self._admission.limits
        strangers = [c for c in self._live_connections()
                     if c.direction == Direction.INBOUND and not self._admission.paired(str(c.muxed_conn.peer_id))]
        held = Counter(_remote_ip(c.muxed_conn) or "?" for c in strangers)
        verdict = fair_share(held, ip or "?", limits)
        if verdict is False:
            log.info("refused a connection from %s at %s: %d unpaired connections open (%d from there)",
                     peer_id, ip, held.total(), held[ip or "?"])
            return False
        if isinstance(verdict, str) and self._tg is not None:  # all taken: the address holding most gives one up
            victim = next(c for c in strangers if (_remote_ip(c.muxed_conn) or "?") == verdict)
            log.info("closing an unpaired connection from %s (it holds %d) to let one from %s in",
                     verdict, held[verdict], ip)
            self._tg.start_soon(_close_quietly, victim)
        return True

    # -- handlers --------------------------------------------------------------------
    def set_handler(self, protocol: str, handler: Handler) -> None:
        """Serve `protocol`. The stream is closed when `handler` returns and reset if it raises;
        an exception is logged and goes no further. Refused peers never reach `handler`."""

        async def serve(stream: INetStream) -> None:
            p2p_stream = P2PStream(stream, protocol)
            await handler(p2p_stream)
            await p2p_stream.aclose()

        self._host.set_stream_handler(TProtocol(protocol), serve)

    async def _on_inbound_stream(self, stream: INetStream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        if not self._peer_allowed(peer):
            log.info("refused a stream from %s (peer not allowed); disconnecting it", peer)
            await _reset_quietly(stream)
            await self.disconnect(peer)
            return
        conn = stream.muxed_conn
        cap = PAIRED_STREAMS if self._admission.paired(peer) else self._admission.limits.streams
        if self._open_streams[conn] >= cap:  # (17) refused, never queued
            log.debug("reset a stream from %s: %d streams already open on its connection", peer, cap)
            await _reset_quietly(stream)
            return
        self._open_streams[conn] += 1
        try:
            await self._negotiate_and_handle(stream, peer)
        except _NegotiationFailed as exc:
            log.debug("reset a stream from %s: %s", peer, exc)
            await _reset_quietly(stream)
        except Exception:
            log.exception("handler for %s from %s failed; the stream is reset", stream.get_protocol(), peer)
            await _reset_quietly(stream)
        finally:
            self._open_streams[conn] -= 1
            if not self._open_streams[conn]:
                del self._open_streams[conn]

    async def _negotiate_and_handle(self, stream: INetStream, peer: str) -> None:
        """(16, 18) multistream-select, listener side, bounded; then the protocol's handler.
        A protocol we serve but `peer` may not open is answered like one we do not serve."""
        handlers = self._host.get_mux().handlers
        with anyio.move_on_after(NEGOTIATE_TIMEOUT_S) as negotiation:
            await _write_multistream_message(stream, MULTISTREAM)
            if await _read_multistream_message(stream) != MULTISTREAM:
                raise _NegotiationFailed("not multistream-select 1.0")
            for _ in range(MAX_PROPOSALS):
                proposal = await _read_multistream_message(stream)
                handler = handlers.get(TProtocol(proposal))
                if handler is not None and self._may_open(stream, peer, proposal):
                    await _write_multistream_message(stream, proposal)
                    break
                await _write_multistream_message(stream, "na")
            else:
                raise _NegotiationFailed(f"no protocol agreed after {MAX_PROPOSALS} proposals")
        if negotiation.cancelled_caught:
            raise _NegotiationFailed(f"no protocol agreed within {NEGOTIATE_TIMEOUT_S:.0f} s")
        stream.set_protocol(TProtocol(proposal))
        await handler(stream)

    def _may_open(self, stream: INetStream, peer: str, protocol: str) -> bool:
        """The door's answer for `protocol` from `peer` on `stream`'s connection."""
        if protocol == DCUTR and self._admission.may_punch is not None:
            return self._admission.may_punch(peer, _is_relayed(stream.muxed_conn))
        return self._admission.may_open(peer, protocol)

    def remote_ip(self, peer_id: str) -> str | None:
        """The IP address of `peer_id`'s open connection (None without one)."""
        for conn in self._swarm.get_connections(_parse_peer_id(peer_id)):
            if not conn.is_closed and (ip := _remote_ip(conn.muxed_conn)) is not None:
                return ip
        return None

    def _peer_allowed(self, peer_id: str) -> bool:
        if self._allow_peer is None:
            return True
        try:
            return bool(self._allow_peer(peer_id))
        except Exception:
            log.exception("allow_peer(%s) failed; refusing the peer", peer_id)
            return False

    # -- outbound --------------------------------------------------------------------
    def addrs(self) -> list[str]:
        """Dialable multiaddrs with the real port and `/p2p/<id>` (empty before `run()` listens).
        A wildcard listen address (0.0.0.0) is listed once per local IPv4 address, LAN first,
        so that invites carry addresses a phone can actually dial. Then, for each relay that
        holds a reservation for us, our addresses through it (`.../p2p/RELAY/p2p-circuit/p2p/US`)."""
        own = expand_wildcard([str(a) for a in self._host.get_addrs()], local_ipv4_addresses())
        return own + self.relayed_addrs()

    def relayed_addrs(self) -> list[str]:
        """Our addresses through the relays holding a live reservation for us."""
        now = time.time()
        return [f"{addr}/p2p-circuit/p2p/{self.peer_id}" for relay, held in self._held.items()
                if held.expires > now and self._connections(relay, direct=True) for addr in held.addrs]

    def changes(self) -> anyio.Event:
        """An event set at the next change of this node's connections or addresses (a peer
        connected or left, a listener opened or closed, a relay took a reservation): read
        the state, take this event, wait on it, read again. So nothing here needs a timer
        to notice a path or an address change."""
        return self._changes

    def _changed(self) -> None:
        self._changes.set()
        self._changes = anyio.Event()

    def path(self, peer_id: str) -> Path | None:
        """How we are connected to `peer_id` now: `direct` if any open connection is (new
        streams take it), `relayed` if only through a relay, None if not at all."""
        if self._connections(peer_id, direct=True):
            return "direct"
        return "relayed" if self._connections(peer_id, direct=False) else None

    def path_relayed_too(self, peer_id: str) -> bool:
        """Whether a connection to `peer_id` through a relay is open (beside a direct one, say)."""
        return bool(self._connections(peer_id, direct=False))

    def _connections(self, peer_id: str, *, direct: bool) -> list[INetConn]:
        try:
            conns = self._swarm.get_connections(ID.from_base58(peer_id))
        except Exception:
            return []
        return [c for c in conns if not c.is_closed and _is_relayed(c) is not direct]

    async def connect(self, addr: str) -> str:
        """Connect to `addr` (a multiaddr ending in /p2p/<id>); returns the peer id."""
        info = _peer_info(addr)
        await self._dial(info, addr)
        return str(info.peer_id)

    async def open_stream(self, peer: str, protocol: str) -> P2PStream:
        """A new stream speaking `protocol` to `peer`: a peer id, or a multiaddr with /p2p/ (dials if needed)."""
        if peer.startswith("/"):
            info = _peer_info(peer)
            await self._dial(info, peer)
            peer_id = info.peer_id
        else:
            peer_id = _parse_peer_id(peer)
            self._require_running()
            self._swarm.prepare_dial(peer_id)  # (8, 10)
        try:
            with anyio.fail_after(STREAM_OPEN_TIMEOUT_S):
                stream = await self._host.new_stream(peer_id, [TProtocol(protocol)])
        except Exception as exc:
            reason = "no answer" if isinstance(exc, TimeoutError) else _reason(exc)
            if isinstance(exc, TimeoutError) or "timed out" in reason:
                # (13) The connection is open but the peer does not answer: it lost power or
                # its network, and TCP will not notice for many minutes. Drop the connection
                # so the next attempt dials afresh instead of waiting on it again.
                await self.disconnect(str(peer_id))
            raise ConnectError(f"cannot open {protocol} to {peer_id}: {reason}") from exc
        return P2PStream(stream, protocol)

    async def open_stream_any(self, peer_id: str, addrs: Sequence[str], protocol: str, *,
                              who: str | None = None) -> P2PStream:
        """Open `protocol` to `peer_id` through the first of `addrs` that works (with no
        addresses: an open connection or the peerstore's). The ConnectError names `who` and why.
        An open connection is used first; then direct addresses are dialed before addresses
        through a relay, each for at most DIRECT_FIRST_TIMEOUT_S when a relay is there to fall
        back on (a phone away from home would otherwise wait minutes for a LAN address's SYNs).
        A relayed connection is upgraded by `connect()`ing a direct address."""
        targets = sorted((_with_peer_id(a, peer_id) for a in addrs), key=_is_circuit) or [peer_id]
        if targets[0] != peer_id and self.path(peer_id) is not None:
            targets.insert(0, peer_id)
        fallback = any(map(_is_circuit, targets))
        asked: set[str] = set()  # relays that answered: their other addresses would say the same
        last: PsymeshError | None = None
        direct: ConnectError | None = None  # a direct address where nothing listens: the one to tell
        for target in targets:
            relay = _relay_of(target)
            if relay in asked:
                continue
            bounded = fallback and relay is None and target != peer_id
            try:
                with anyio.fail_after(DIRECT_FIRST_TIMEOUT_S if bounded else math.inf):
                    if target == peer_id:
                        return await self.open_stream(target, protocol)
                    return await self._dial_unless_met(target, peer_id, protocol)
            except TimeoutError:
                last = ConnectError(f"no answer at {target} within {DIRECT_FIRST_TIMEOUT_S:g} s")
            except PsymeshError as exc:
                last = exc
            if relay is None and direct is None and isinstance(last, ConnectError) and last.nobody_listens:
                direct = last
            if relay is not None and self._connections(relay, direct=True):
                asked.add(relay)
        # A peer that is down is refused at its own address ("connection refused at ..."); that is
        # said first, before what a relay answered after it (no reservation, no grant for the
        # circuit), which alone would send the user looking for a missing grant.
        if last is None:
            cause = "no address to dial"
        elif direct is not None and direct is not last:
            cause = f"{cause_of(direct)}; through a relay: {cause_of(last)}"
        else:
            cause = cause_of(last)
        raise ConnectError(f"{who or peer_id} is unreachable: {cause}", cause=cause)

    async def _dial_unless_met(self, target: str, peer_id: str, protocol: str) -> P2PStream:
        """`open_stream(target)`, unless `peer_id` connects to us while we dial: then on the
        connection it opened. A phone behind a NAT cannot be dialed, so our SYNs to its old
        address go unanswered for minutes (no answer is no refusal) while the phone, awake
        again, has dialed us itself (node/reach/keep.py): what waits for it goes at once."""
        opened: P2PStream | None = None
        failed: Exception | None = None
        async with anyio.create_task_group() as tg:
            async def dial() -> None:
                nonlocal opened, failed
                try:
                    opened = await self.open_stream(target, protocol)
                except Exception as exc:  # raised below, outside the task group
                    failed = exc
                tg.cancel_scope.cancel()

            async def met() -> None:
                while True:
                    changed = self.changes()
                    if self.path(peer_id) is not None:
                        tg.cancel_scope.cancel()
                        return
                    await changed.wait()

            tg.start_soon(dial)
            tg.start_soon(met)
        if opened is not None:
            return opened
        if failed is not None and self.path(peer_id) is None:
            raise failed
        return await self.open_stream(peer_id, protocol)  # on the connection it opened (or ours)

    async def _dial(self, info: PeerInfo, addr: str) -> None:
        self._require_running()
        if str(info.peer_id) == self.peer_id:
            raise ProtocolError("cannot connect to ourselves", code=ErrorCode.BAD_REQUEST)
        if _is_circuit(addr):
            if self.path(str(info.peer_id)) is None:  # any open connection will do
                await self._dial_circuit(info.peer_id, addr)
            return
        self._swarm.prepare_dial(info.peer_id, new_address=True)  # (8, 10, 11)
        try:
            if self.path(str(info.peer_id)) == "relayed":  # the swarm would reuse that: dial this address
                await self._swarm.dial_addr(info.addrs[0], info.peer_id)
            else:
                await self._host.connect(info)
        except Exception as exc:
            log.debug("dialing %s failed: %s", addr, _reason(exc))  # libp2p's whole text, for the log
            cause = dial_failure(exc) or f"cannot connect to {addr}: {_reason(exc)}"
            raise ConnectError(cause, nobody_listens=nobody_listens(exc)) from exc

    # -- peers -----------------------------------------------------------------------
    def connected_peers(self) -> list[dict[str, Any]]:
        """[{"peer_id": ..., "addrs": [transport multiaddrs]}] for peers with an open connection."""
        peers = []
        for peer_id, conns in self._swarm.connections.items():
            live = [c for c in conns if not c.is_closed]
            if live:
                addrs = sorted({str(a) for c in live for a in c.get_transport_addresses()})
                peers.append({"peer_id": str(peer_id), "addrs": addrs})
        return peers

    async def disconnect(self, peer_id: str) -> None:
        """Close every connection to `peer_id` now (revocation). Its open streams end at once."""
        conns = self._swarm.get_connections(_parse_peer_id(peer_id))
        if conns and self._tg is not None:
            await self._close_connections(conns, self._tg)

    def _live_connections(self) -> list[INetConn]:
        return [c for conns in self._swarm.connections.values() for c in conns if not c.is_closed]

    async def _close_connections(self, conns: Sequence[INetConn], tg: anyio.abc.TaskGroup) -> None:
        """(6) Close `conns` concurrently and return once their sockets are closed. libp2p's
        close goes on in `tg`: it pauses 200 ms before its last bookkeeping (resetting the
        connection's streams, which releases their resource-manager slots; notifications)."""
        for conn in conns:
            tg.start_soon(_close_quietly, conn)
        with anyio.move_on_after(CLOSE_TIMEOUT_S):
            for conn in conns:
                await _muxer(conn).event_closed.wait()
        for conn in conns:  # forget them now, so a new dial is not handed a dead connection
            self._swarm.remove_conn(conn)

    def _require_running(self) -> None:
        if self._tg is None or self._stop.is_set():
            raise PsymeshError("the p2p node is not running", code=ErrorCode.UNAVAILABLE)


def _sole_exception(group: BaseExceptionGroup) -> BaseException | None:
    """The one exception inside (nested) groups, or None if there are several."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else None
