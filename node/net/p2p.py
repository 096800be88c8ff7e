"""psymesh's only contact with py-libp2p (pinned 0.8.1): a Noise + yamux host over TCP.

Everything else in psymesh sees `P2PNode` and `P2PStream` (a `node.framed.ByteStream`),
speaks anyio, and catches only psymesh errors: libp2p types and exceptions stop here. The
network failing is mapped here to `NetworkError`s (as httpcore maps its transport's errors):
a peer that cannot be dialed, or a stream that cannot be opened, is a `ConnectError`; a
stream that dies under a write is `ConnectionLost`. Codes stay `unavailable`.
libp2p is trio-native, so this module runs on anyio's trio backend only.

libp2p 0.8.1 defects measured on this machine, and what this module does about each
(tests/test_p2p.py has one regression test per item):

1. `new_host()` also accepts *plaintext* (and secio, TLS) unless told otherwise, so an
   attacker could ask for an unencrypted session. We pass `sec_opt` with Noise only.
2. Dialing waits 250 ms before returning (`Swarm.dial_peer` "happy eyeballs": after
   starting a dial it sleeps `_HAPPY_EYEBALLS_DELAY` unless the dial already reached
   `max_connections_per_peer`, default 3). We set `max_connections_per_peer=1`:
   connect + Noise handshake on loopback drops from ~260 ms to ~10 ms.
3. An exception escaping a stream handler propagates into the connection's task, and
   libp2p's service manager then cancels the whole swarm: one bad request kills the node.
   Every inbound stream goes through `P2PNode._on_inbound_stream`, which catches and logs
   the exception and resets only that stream (libp2p's own identify/ping handlers too).
4. After 250 inbound connections the host refuses all new ones, for good. Each inbound
   connection holds a slot of `Swarm._inbound_limiter` (max - min connections = 250) until
   `_do_handle_inbound_connection` returns, and that task ends with
   `await self.manager.wait_finished()`: it waits for the *whole swarm* to stop, not for
   its connection to close (it must stay alive while the connection is open, because
   `trio.serve_listeners` closes the socket when the handler returns). So one trio task
   and one slot leak per inbound connection. `_Swarm` overrides that method so it waits
   for *its own* connection to close: the task ends and the slot comes back.
5. gossipsub drops bursts silently (10 msg/s per peer per topic, outbound queue 32).
   Contained by design: psymesh uses no pubsub; every message travels on a direct,
   flow-controlled yamux stream (`open_stream`), which loses nothing.
6. `close()` is slow: `SwarmConn.close()` sends GO_AWAY and closes the socket within
   milliseconds, then pauses 100 ms in `Yamux.close` and 100 ms in `SwarmConn._cleanup`,
   and the swarm closes its connections one after another (200 ms x N peers). We close
   all connections at once and return as soon as their sockets are closed; libp2p's
   remaining bookkeeping (the pauses, then disconnect notifications) finishes in the node's
   own task group, or is cut short at shutdown. And libp2p's tasks are never cancelled from
   outside (they would race the orderly close and leave sockets open): `run()` shields the
   host and stops it in order. It returns in milliseconds, port closed, no task left behind.
7. libp2p's connection gater filters IP addresses only. `allow_peer(peer_id)` is asked on
   every inbound connection right after the Noise handshake proves the peer id (a refused
   peer never gets a muxer) and again before every inbound stream (so a peer revoked while
   connected is refused and disconnected). `disconnect()` closes a peer's connections now.
8. (found while writing this) A dial that fails puts the peer on a 60 s "negative cache":
   every dial in that minute fails at once, even after the peer is back. `connect()` and
   `open_stream()` are explicit requests, so they clear that entry before dialing (`_Swarm.prepare_dial`).
9. (found while writing this) The swarm's auto-connector dials *every* peer in the
   peerstore (anyone who ever connected, revoked peers too) whenever the node has fewer
   than 100 connections, i.e. always. psymesh dials only whom it is asked to dial:
   `_NoAutoConnect` replaces it.
10. (found while writing this) A connection the *peer* closed stays listed for ~100 ms
   (Yamux.close pauses before the swarm forgets it). A dial in that window "succeeds"
   without dialing (`BasicHost.connect` sees the dead connection) and the stream then fails
   with "No valid connections". Before every dial we drop listed connections that are closed.
11. (found while writing this) `BasicHost.connect(peer_info)` adds the given address to the
   peerstore, but the dialer tries only one address per transport (`MAX_ADDRS_PER_PEER`), which
   may be an older, dead one: connecting to a peer's new address kept failing. When the caller
   gives an address and no connection is open, it replaces the remembered ones.
12. (found while writing this) Listening sockets get SO_REUSEPORT (for TCP hole punching),
   so a second node on the same fixed port starts fine and the kernel splits incoming
   connections between the two. `run()` first checks that the port is free.
13. A peer that loses power leaves a half-open TCP connection that neither side closes for
   many minutes; every stream opened on it waits for libp2p's 10 s negotiation timeout, and
   the next one picks the same dead connection. `open_stream()` gives up after
   `STREAM_OPEN_TIMEOUT_S` and drops that connection, so the next attempt dials afresh
   (tests/test_liveness.py freezes a relayed connection to check).

Found in an adversarial pass by an unpaired stranger (items 14-18). A *stranger* is a
peer that `set_admission`'s `is_paired` says no to; fresh keys cost nothing, so every
limit on strangers counts all of them together (and per IP address), never per peer id.
`psymesh.protocol.strangers.StrangerLimits` holds the numbers (config.toml `[strangers]`).

14. yamux does not enforce its own receive window: data past it is logged ("peer exceeded
   receive window") and buffered anyway, and a DATA frame of up to 16 MiB is read whole
   before anything looks at it. A stream nobody reads (its protocol negotiation pending,
   or its handler busy) grows without bound: 2 connections x 10 such streams took a node
   past 1 GB. And `muxer_opt` cannot replace yamux: `MuxerMultistream.new_conn` builds
   libp2p's own `Yamux` whatever it is given. `_MuxerSelect` (swapped onto the upgrader)
   turns each new Yamux into `_BoundedYamux`, which refuses, *before reading it*, a DATA
   frame that would take the connection's unread bytes over its budget (a stranger's
   `buffer_bytes`, a paired peer's `PAIRED_BUFFER_BYTES`) and closes the connection, as
   go-yamux does on a window violation. It also drops a reset stream's unread data at once
   (libp2p kept it 60-90 s for a reader that can never come).
15. Before a connection's muxer runs, multistream-select reads a message of whatever length
   the peer announces (a varint), in up to 101 reads of up to that many bytes each, for up
   to 10 s; anyone who reaches the port, no key needed, made a node grow by 130 MB with one
   TCP connection. `_HandshakeBudget` caps what a new inbound connection may send before its
   muxer exists (`HANDSHAKE_BYTES`; a real handshake is ~2 KiB), and inbound connections
   still handshaking are capped (`handshakes`, `handshakes_per_ip`): excess ones are closed.
16. The same unbounded read negotiates every inbound *stream* (10 s, then the handler), and
   its bytes leave yamux's buffers for the reader's, so (14) does not bound them. Inbound
   streams are negotiated here instead (`_negotiate`): messages of at most
   `MAX_NEGOTIATION_MESSAGE` bytes, at most `MAX_PROPOSALS` proposals, `NEGOTIATE_TIMEOUT_S`.
   `ls` is answered `na`: nobody is told the list of protocols.
17. Nothing caps the streams a peer opens on one connection: yamux accepts every SYN and the
   swarm starts a task for each; the resource manager's only stream limit (10,000 for the
   whole node) *queues* the excess on a semaphore, so one peer could starve all others.
   `_on_inbound_stream` resets a stream at once when its connection already has `streams`
   open (a stranger) or `PAIRED_STREAMS` (a paired peer). Unpaired inbound connections are
   capped too (`connections`, `connections_per_ip`), checked when Noise has proved the key,
   before any muxer exists (concurrent handshakes can overshoot by at most `handshakes`),
   and closed once they have been open `connection_s` without pairing.
18. libp2p serves its own identify (every listen address, every protocol id, the version),
   identify push and ping to anyone. Every inbound stream's protocol, libp2p's own
   included, is now put to `may_open(peer_id, protocol)` (the daemon's one rule, which also
   audits refusals) and answered `na` when refused. And libp2p *runs* identify on every
   connection it dials (in a trio system task, outside any task group): psymesh needs none
   of what it learns, so `_Host` does not, and a psymesh peer is never asked for it.

Found while making a delegated task cost fewer round trips (19):

19. yamux sends a WINDOW_UPDATE frame after *every* read that returns data
   (`PY_YAMUX_RELEASE_ON_READ` defaults on), not when half the window is used as go-yamux
   does: for small request/response traffic that is one extra encrypted frame, and one
   more for the peer to process, per message. This module sets the variable off (unless
   the environment already says otherwise), which restores go-yamux's hysteresis: on a
   session, ~12% less CPU per delegated task and 0.72 -> 0.62 ms per in-process round trip.

20. (the stranger pass, continued) Every disconnect is recorded in the auto-connector's
   backoff table (peer id -> time), which only the auto-connector's own loop prunes, and
   (9) removed that loop: a stranger with a fresh key per connection grew the node for
   good, one entry per key. `_NoAutoConnect` records nothing: it dials nobody.

Circuit relay v2 (protocol/relay.py: a paired node relays for peers it granted `relay`).
psymesh uses libp2p's relay *wire format* (its HOP/STOP protobufs, length-delimited) and runs
Noise + yamux over a relayed stream exactly as over a socket (the swarm's own upgrade), but
not its relay *service* (`CircuitV2Protocol`) or *transport* (`CircuitV2Transport`, which also
brings relay discovery, a DHT client and a performance tracker): the hop, the stop side and
the dialing are `serve_relay()`, `reserve()`, `_serve_stop()` and `_dial_circuit()` here. Read
in libp2p 0.8.1's relay source while building this (items 21-24; each test checks ours):

21. The hop side takes the reserving peer's id from the RESERVE message's optional `peer`
   field, not from the connection: any peer can make or refresh a reservation in another's
   name. Ours takes the id Noise proved, and puts every reservation and circuit to the
   daemon's gate (`RelayAdmit`), which decides and audits it.
22. It keeps open circuits in one dict keyed by peer id (`_active_relays[source]` and
   `[destination]`): a second circuit to the same peer overwrites the first's entry, and
   whichever ends first closes the other's streams. Ours: each circuit owns its two streams.
23. Its circuit duration is checked between reads only, so an idle circuit outlives it for
   good. Ours: one deadline around the whole circuit and one byte budget for both ways.
24. It takes the end of a yamux stream for an unexpected error (it catches mplex's EOF only):
   every circuit's end is logged as an ERROR after three reads 0.2 and 0.4 s apart. Ours
   passes an end on as a half-close and frees the circuit at once.

Found in a later adversarial pass (25):

25. libp2p's resource manager limits new connections per *peer id* (10 a second, burst 50),
   which it learns only once the Noise handshake, the costly part, has run: with a fresh key
   per connection anyone who reaches the port gets handshakes without end. `_Admission`
   counts new inbound connections per IP address *before* the handshake (a burst of
   `handshake_burst_per_ip`, then `handshakes_per_ip_per_minute`) and closes the excess at
   once. And the unpaired slots are shared per address (`fair_share`): when all are taken, a
   connection from an address holding at least two fewer than another takes one of that
   address's, so 8 addresses holding 2 each no longer keep a new one out.

Found while making an idle node sleep (issue 23: a phone's CPU should reach its deep idle
states between peers' messages):

26. yamux pings every connection every 30 s (`_measure_rtt_loop`, `RTT_MEASURE_INTERVAL`),
   both ends, only to tune its receive window, and sweeps its streams every 30 s
   (`_stale_stream_sweeper`) whether any stream closed or not: on an idle paired phone
   these were 6 of its ~2 wakeups a second (with our own 1 s loops, since made event-driven).
   `_BoundedYamux` measures the RTT once, when the connection starts, and sweeps only
   while a closed stream may await reclaiming (woken by a stream's close); and its resource
   manager's recovery timer (30 s, `run_periodic_recovery`) runs only once something was
   degraded (`_QuietRecovery`). Keeping a NAT
   binding or noticing a dead peer is not their job: liveness (node/net/liveness.py) pings
   only while requests wait on a session. Ours also looked again every `connection_s`
   (60 s) whether a paired peer's inbound connection was still paired, for its life: now
   only an unpaired one has that timer. P2PNode's `changes()` (the swarm's notifee) wakes
   what follows connections and addresses, instead of a 1 s poll.

Hole punching (DCUtR, `enable_hole_punch()`, config `[relay] hole_punch`): likewise libp2p's
wire format (its `HolePunch` protobuf on `/libp2p/dcutr`) and its swarm's source-bound dials
(`dial_with_source`, `dial_addr_as_responder`), not its `DCUtRProtocol` service (which brings
its own polling loop and would open the stream to any peer). `hole_punch()` is the spec's `B`,
`_serve_dcutr()` its `A`. Each side's address behind its NAT is what a relay tells it: a psymesh
relay puts the address it sees a peer's connection come from in the `peer` field of its OK to
RESERVE and CONNECT (identify, which carries observed addresses elsewhere, is off: 18), and a
node with hole punching on dials its relays from its listening port, so that this is the
mapping of the port the punch leaves from.

Kept as is: libp2p's resource manager allows each peer 10 new connections per second
(burst 50); connections over that are closed right after the handshake, so the dialer's
`connect()` may succeed and its first stream fail (UNAVAILABLE). It keeps a token bucket
per peer id for that, at most 1,000 of them (least recently used go first): bounded.
Outbound connections (ones this node dials, such as a joiner's to an inviter) get (14)
but not (15): they are to a peer we chose.
"""
from __future__ import annotations
from . import lean_import  # noqa: F401  (27) first: libp2p imports only what the host uses (lean_import.py)

import logging
import ipaddress
import math
import os
import socket
import struct
from collections import Counter
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import anyio
import anyio.abc
import multiaddr
import sniffio
import trio
from libp2p import new_host
from libp2p.abc import IMuxedConn, INetConn, INetStream, INetwork, INotifee, IRawConnection, ISecureConn, ReadWriteCloser
from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair as ed25519_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as x25519_key_pair
from libp2p.host.basic_host import BasicHost
from libp2p.custom_types import TProtocol
from libp2p.network.auto_connector import AutoConnector
from libp2p.network.config import ConnectionConfig
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.io.exceptions import IOException
from libp2p.io.utils import read_exactly
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.rcmgr import Direction
from libp2p.rcmgr.graceful_degradation import GracefulDegradation
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Limit, StopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeer
from libp2p.relay.circuit_v2.pb.circuit_pb2 import Reservation as CircuitReservation
from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.security.exceptions import HandshakeFailure
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import (
    _STALE_STREAM_GRACE_SECONDS,
    FLAG_SYN,
    TYPE_PING,
    YAMUX_HEADER_FORMAT,
    Yamux,
    YamuxStream,
)
from libp2p.utils.varint import encode_uvarint, read_varint_prefixed_bytes_limited

from ...protocol.errors import ConnectError, ConnectionLost, ErrorCode, ProtocolError, PsymeshError
from ...protocol.relay import CONNECT, DCUTR, HOP, RESERVE, STOP, RelayBook, RelaySettings
from ...protocol.limits import RateLimiter
from ...protocol.strangers import StrangerLimits, fair_share

log = logging.getLogger(__name__)
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")  # (19) read by libp2p's yamux at call time

READ_CHUNK = 65536
# How long disconnect()/shutdown wait for sockets to close (a GO_AWAY write to a peer that
# stopped reading can block); past it, shutdown cancels the rest.
CLOSE_TIMEOUT_S = 2.0
# How long opening a stream (yamux SYN + multistream-select) may take on an open connection
# before the connection is taken for dead (13).
STREAM_OPEN_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 5.0
# What a paired peer's connection may hold (14, 17): generous, it is trusted with tasks.
PAIRED_STREAMS = 1024
PAIRED_BUFFER_BYTES = 64 * 1024 * 1024
# (15) Bytes a new inbound connection may send before its muxer runs.
HANDSHAKE_BYTES = 64 * 1024
# (16) Inbound stream negotiation (multistream-select 1.0, listener side).
MULTISTREAM = "/multistream/1.0.0"
MAX_NEGOTIATION_MESSAGE = 512
MAX_PROPOSALS = 8
NEGOTIATE_TIMEOUT_S = 5.0
# Circuit relay v2 (protocol/relay.py): how long one step (a HOP or STOP message, opening
# the relay's stream) may take.
RELAY_STEP_TIMEOUT_S = 10.0
DIRECT_FIRST_TIMEOUT_S = 5.0  # a direct address tried before a relayed one (open_stream_any)
MAX_RELAY_ADDRS = 4  # relay addresses kept from one reservation (each makes one address of ours)
# DCUtR (hole punching): the spec's message cap and attempts per exchange; how long one round's
# dials may take (a SYN the far NAT dropped is sent again after 1 s and 3 s); addresses sent
# and tried per round; and the whole exchange's bound.
MAX_DCUTR_MESSAGE = 4096
HOLE_PUNCH_ATTEMPTS = 3
HOLE_PUNCH_DIAL_TIMEOUT_S = 5.0
MAX_PUNCH_ADDRS = 8
PUNCH_POLL_S = 0.02  # how often a round looks for a direct connection that came in by the listener
HOLE_PUNCH_TIMEOUT_S = HOLE_PUNCH_ATTEMPTS * (RELAY_STEP_TIMEOUT_S + HOLE_PUNCH_DIAL_TIMEOUT_S)

PeerFilter = Callable[[str], bool]
StreamFilter = Callable[[str, str], bool]  # (peer id, protocol) -> may that peer open it?
Path = Literal["direct", "relayed"]


class RelayAdmit(Protocol):
    def __call__(self, peer_id: str, what: str) -> None:
        """Return if `peer_id` may `what` (RESERVE, CONNECT of protocol/relay.py) at this relay;
        else raise the PsymeshError that says why (the daemon's gate decides and audits)."""


class P2PStream:
    """One libp2p stream as a `node.framed.ByteStream`: bytes in, bytes out, b"" at the end."""

    def __init__(self, stream: INetStream, protocol: str) -> None:
        self._stream = stream
        self.protocol = protocol
        self.remote_peer_id = str(stream.muxed_conn.peer_id)
        self._closed = False

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        """Up to `max_bytes`; b"" once the peer closed or reset the stream (or the connection died)."""
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        try:
            return await self._stream.read(max_bytes)
        except Exception as exc:  # StreamEOF, StreamReset, StreamError, muxer errors: all mean "no more"
            log.debug("stream %s from %s ended: %r", self.protocol, self.remote_peer_id, exc)
            return b""

    async def send_all(self, data: bytes) -> None:
        if not data:
            return
        if self._closed:
            raise ConnectionLost(f"stream {self.protocol} to {self.remote_peer_id} is closed")
        try:
            await self._stream.write(data)
        except Exception as exc:
            raise ConnectionLost(f"stream {self.protocol} to {self.remote_peer_id} is gone: {_reason(exc)}") from exc

    async def aclose(self) -> None:
        """Half-close gracefully (the peer reads EOF after what we sent). Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stream.close()
        except Exception as exc:
            log.debug("closing stream %s to %s: %r", self.protocol, self.remote_peer_id, exc)

    async def reset(self) -> None:
        """Abort: the peer's reads end at once and unsent data is dropped."""
        self._closed = True
        await _reset_quietly(self._stream)


Handler = Callable[[P2PStream], Awaitable[None]]


class P2PNode:
    """A libp2p host with psymesh's settings and fixes; see the module docstring."""

    def __init__(
        self,
        seed: bytes,
        listen_addrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        *,
        allow_peer: PeerFilter | None = None,
    ) -> None:
        """`seed`: the node's 32-byte Ed25519 private seed. `allow_peer(peer_id)`: None allows all."""
        if not isinstance(seed, bytes | bytearray) or len(seed) != 32:
            raise PsymeshError("an Ed25519 seed is 32 bytes", code=ErrorCode.BAD_REQUEST)
        self._listen = [_parse_multiaddr(a) for a in listen_addrs]
        self._allow_peer = allow_peer
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
            raise RuntimeError(f"node/net/p2p.py is written against libp2p 0.8.1's BasicHost, not {type(self._host)!r}")
        self._host.__class__ = _Host  # (18) no identify of the peers we dial
        swarm = self._host.get_network()
        if type(swarm) is not Swarm:
            raise RuntimeError(f"node/net/p2p.py is written against libp2p 0.8.1's Swarm, not {type(swarm)!r}")
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
    def set_admission(self, *, is_paired: PeerFilter, may_open: StreamFilter, limits: StrangerLimits) -> None:
        """Who is a stranger (`is_paired` says no), which protocols each peer may open
        (`may_open`, asked for every inbound stream, libp2p's own protocols included; it
        records its refusals), and how much strangers together may cost (14-18). Call
        before `run()`. Until then every peer counts as paired and may open anything."""
        self._admission.is_paired = is_paired
        self._admission.may_open = may_open
        self._admission.limits = limits

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
                if handler is not None and self._admission.may_open(peer, proposal):
                    await _write_multistream_message(stream, proposal)
                    break
                await _write_multistream_message(stream, "na")
            else:
                raise _NegotiationFailed(f"no protocol agreed after {MAX_PROPOSALS} proposals")
        if negotiation.cancelled_caught:
            raise _NegotiationFailed(f"no protocol agreed within {NEGOTIATE_TIMEOUT_S:.0f} s")
        stream.set_protocol(TProtocol(proposal))
        await handler(stream)

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
        for target in targets:
            relay = _relay_of(target)
            if relay in asked:
                continue
            bounded = fallback and relay is None and target != peer_id
            try:
                with anyio.fail_after(DIRECT_FIRST_TIMEOUT_S if bounded else math.inf):
                    return await self.open_stream(target, protocol)
            except TimeoutError:
                last = ConnectError(f"no answer at {target} within {DIRECT_FIRST_TIMEOUT_S:g} s")
            except PsymeshError as exc:
                last = exc
            if relay is not None and self._connections(relay, direct=True):
                asked.add(relay)
        raise ConnectError(f"{who or peer_id} is unreachable: {last.message if last else ''}")

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
            raise ConnectError(f"cannot connect to {addr}: {_reason(exc)}") from exc

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

    # -- circuit relay v2 (protocol/relay.py) ------------------------------------------
    def serve_relay(self, settings: RelaySettings, admit: RelayAdmit) -> None:
        """Relay for the peers `admit` lets through (the daemon's gate: paired, granted `relay`;
        it audits every decision), within `settings`. Call before `run()`."""
        self._book = RelayBook(settings)
        self._relay_admit = admit
        self._host.set_stream_handler(TProtocol(HOP), self._serve_hop)

    async def reserve(self, relay: str, addrs: Sequence[str]) -> float:
        """Hold a reservation at `relay` (a peer id, dialed directly at one of `addrs` unless
        connected), so that peers reach us through it; returns its expiry (wall time): renew
        before then. It also lapses when our connection to the relay closes. A refusal raises
        the PsymeshError for it (forbidden: the relay has not granted us `relay`; busy: it is
        full); an unreachable relay a ConnectError."""
        relay_id = _parse_peer_id(relay)
        self._require_running()
        failures: list[str] = []
        for addr in [_with_peer_id(a, relay) for a in addrs if not _is_circuit(a)]:
            if self._connections(relay, direct=True):
                break
            try:
                await self._dial_relay(_peer_info(addr), addr)
            except PsymeshError as exc:
                failures.append(exc.message)
        if not self._connections(relay, direct=True):
            raise ConnectError(f"relay {relay} is unreachable: {'; '.join(failures) or 'no direct address'}")
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                stream = await self._host.new_stream(relay_id, [TProtocol(HOP)])
                try:
                    await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                    reply = await read_delimited_msg(stream, HopMessage)
                finally:
                    await _close_quietly(stream)
        except Exception as exc:
            raise ConnectError(f"relay {relay} did not answer the reservation: {_reason(exc)}") from exc
        if reply.status != StatusCode.OK:
            raise _refusal(reply.status, f"relay {relay} refused the reservation")
        relay_addrs = [a for a in map(_bytes_to_addr, reply.reservation.addrs)
                       if a is not None and a.endswith(f"/p2p/{relay}") and not _is_circuit(a)]
        self._held[relay] = _Held(float(reply.reservation.expire), tuple(relay_addrs[:MAX_RELAY_ADDRS]))
        self._changed()
        self._note_observed(relay, reply)
        log.info("reservation at relay %s until %s", relay, time.strftime("%H:%M:%S", time.localtime(reply.reservation.expire)))
        return float(reply.reservation.expire)

    def reservation(self, relay: str) -> float | None:
        """When our reservation at `relay` expires; None if we hold none (or it lapsed, or
        our connection to the relay closed, which ends it too)."""
        held = self._held.get(relay)
        if held is None or held.expires <= time.time() or not self._connections(relay, direct=True):
            return None
        return held.expires

    async def drop_relayed(self, peer_id: str, *, idle_only: bool) -> bool:
        """Close the relayed connections to `peer_id` when a direct one is open: only those
        carrying no stream (`idle_only`), or all. True if any was closed."""
        if not self._connections(peer_id, direct=True):
            return False
        relayed = [c for c in self._connections(peer_id, direct=False) if not (idle_only and c.get_streams())]
        if relayed and self._tg is not None:
            await self._close_connections(relayed, self._tg)
        return bool(relayed)

    # -- hole punching (DCUtR, libp2p/specs relay/DCUtR.md) ----------------------------
    def enable_hole_punch(self) -> None:
        """Take part in hole punching (config `[relay] hole_punch`): answer DCUtR from peers we
        reached through a relay, and dial relays from our listening port, so that the address
        a relay sees us at (and tells us) is that port's mapping in our NAT."""
        self._hole_punch = True
        self._host.set_stream_handler(TProtocol(DCUTR), self._serve_dcutr)

    def relayed_inbound(self, peer_id: str) -> bool:
        """True if `peer_id` reached us through a relay: DCUtR's `B`, the side that starts it."""
        return any(c.direction == Direction.INBOUND for c in self._connections(peer_id, direct=False))

    async def hole_punch(self, peer_id: str) -> bool:
        """DCUtR's inbound side (`B`) with a peer connected to us only through a relay: over the
        circuit, send CONNECT with our addresses, time the peer's CONNECT (the circuit's RTT),
        send SYNC, wait half the RTT (the SYNC is then arriving: the peer dials as it reads it)
        and dial the peer's addresses from our listening port. Up to HOLE_PUNCH_ATTEMPTS rounds
        on the same stream. True once a direct connection to the peer is open; False (logged)
        when every round failed, or the peer does not speak DCUtR."""
        if not self._hole_punch or self.path(peer_id) != "relayed":
            return False
        peer = _parse_peer_id(peer_id)
        stream: INetStream | None = None
        try:
            with anyio.fail_after(HOLE_PUNCH_TIMEOUT_S):
                stream = await self._host.new_stream(peer, [TProtocol(DCUTR)])
                for attempt in range(1, HOLE_PUNCH_ATTEMPTS + 1):
                    sent = time.monotonic()
                    await _send_punch(stream, HolePunch.CONNECT, self._punch_addrs())
                    theirs = await _read_punch(stream, HolePunch.CONNECT)
                    rtt = time.monotonic() - sent
                    await _send_punch(stream, HolePunch.SYNC)
                    await anyio.sleep(rtt / 2)
                    if await self._punch(peer, theirs, responder=True):
                        log.info("hole punched to %s (attempt %d, relayed RTT %.1f ms)", peer_id, attempt, rtt * 1000)
                        return True
                    log.info("hole punch to %s: attempt %d found no way through (%s)", peer_id, attempt,
                             " ".join(theirs) or "it sent no address")
        except Exception as exc:
            log.info("hole punch to %s failed: %s", peer_id, _reason(exc))
        finally:
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await _close_quietly(stream)
        return self.path(peer_id) == "direct"

    async def _serve_dcutr(self, stream: INetStream) -> None:
        """DCUtR's outbound side (`A`, we dialed the circuit): answer each CONNECT with ours and
        dial the peer's addresses the moment its SYNC arrives. Only over a relayed connection
        that we dialed (so the peer is `B`, and the roles on the punched connection agree; the
        gate admitted and audited the stream: paired peers only)."""
        peer = stream.muxed_conn.peer_id
        ours = [c for c in self._connections(str(peer), direct=False) if c.muxed_conn is stream.muxed_conn]
        if not ours or ours[0].direction != Direction.OUTBOUND:
            await _reset_quietly(stream)
            return
        try:
            for _ in range(HOLE_PUNCH_ATTEMPTS):
                with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                    theirs = await _read_punch(stream, HolePunch.CONNECT)
                    await _send_punch(stream, HolePunch.CONNECT, self._punch_addrs())
                    await _read_punch(stream, HolePunch.SYNC)
                if await self._punch(peer, theirs, responder=False):
                    log.info("hole punched to %s", peer)
                    return
        except Exception as exc:  # the peer gave up (closed the stream), or broke the exchange
            log.debug("DCUtR with %s ended: %s", peer, _reason(exc))
        finally:
            await _close_quietly(stream)

    def _punch_addrs(self) -> list[str]:
        """What we ask a peer to dial (DCUtR's ObsAddrs): each address a relay sees us at, and
        beside it the same IP with our listening port (a NAT that keeps ports maps that port
        there, even if the relay saw a connection from another one); then our own addresses,
        loopback ones only when we have no other (the peer would dial itself)."""
        source = self._listen_source()
        out: list[str] = []
        for addr in self._observed.values():
            out.append(addr)
            endpoint = _tcp_endpoint(addr)
            if source is not None and endpoint is not None:
                out.append(f"/{addr.split('/')[1]}/{endpoint[0]}/tcp/{source[1]}")
        own = [a.partition("/p2p/")[0] for a in self.addrs() if _tcp_endpoint(a) is not None]
        out += [a for a in own if not _is_loopback(a)] or own
        return list(dict.fromkeys(out))[:MAX_PUNCH_ADDRS]

    async def _punch(self, peer: ID, addrs: Sequence[str], *, responder: bool) -> bool:
        """Dial `peer` at all of `addrs` at once, each from our listening port (so each SYN
        leaves through the NAT mapping the peer was told about); the first connection ends the
        other dials. A simultaneous open gives both sides a connected socket, so the roles on
        it are DCUtR's, not the socket's: the peer that dialed the circuit runs Noise as the
        initiator, the one it reached (`responder`) as the responder, whichever SYN won. With
        no NAT in the way (or one that lets it in) the peer's SYN may reach our listener
        first: our own dial then fails (the four-tuple is taken) and the connection arrives as
        an inbound one, in the same roles; so a round also ends when any direct connection
        to the peer is open, and lasts until HOLE_PUNCH_DIAL_TIMEOUT_S otherwise."""
        source = self._listen_source()
        if source is None:
            return False
        family = "ip6" if ":" in source[0] else "ip4"
        local = ipaddress.ip_address(source[0]).is_loopback
        targets = [multiaddr.Multiaddr(f"{a}/p2p/{peer}") for a in addrs
                   if a.split("/")[1] == family and (local or not _is_loopback(a))]
        if not targets:
            return False
        self._swarm.prepare_dial(peer)  # (8, 10)

        async def dial(target: multiaddr.Multiaddr, done: anyio.CancelScope) -> None:
            try:
                with anyio.fail_after(HOLE_PUNCH_DIAL_TIMEOUT_S):
                    if responder:
                        await self._swarm.dial_addr_as_responder(target, peer, source)
                    else:
                        await self._swarm._dial_addr_single_attempt(target, peer, source)
            except Exception as exc:
                log.debug("hole punch dial to %s: %s", target, _reason(exc))
                return
            done.cancel()

        async def direct(done: anyio.CancelScope) -> None:
            while self.path(str(peer)) != "direct":
                await anyio.sleep(PUNCH_POLL_S)
            done.cancel()

        with anyio.move_on_after(HOLE_PUNCH_DIAL_TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(direct, tg.cancel_scope)
                for target in targets:
                    tg.start_soon(dial, target, tg.cancel_scope)
        return self.path(str(peer)) == "direct"

    def _listen_source(self) -> tuple[str, int] | None:
        """The (ip, port) our TCP listener is bound to: where hole punching dials leave from."""
        for addr in self._host.get_addrs():
            if (endpoint := _tcp_endpoint(str(addr))) is not None:
                return endpoint
        return None

    def _note_observed(self, relay: str, reply: HopMessage) -> None:
        """Keep the address `relay` says it sees us at (a psymesh relay puts it in the `peer`
        field of its OK to RESERVE and CONNECT; other relays leave it out)."""
        if not reply.HasField("peer") or bytes(reply.peer.id) != self._host.get_id().to_bytes():
            return
        addrs = [a for a in map(_bytes_to_addr, reply.peer.addrs[:1]) if a is not None and _tcp_endpoint(a)]
        if addrs:
            self._observed[relay] = addrs[0]

    async def _dial_relay(self, info: PeerInfo, addr: str) -> None:
        """Dial a relay. With hole punching on, from our listening port first, so that what the
        relay sees (and tells us) is that port's NAT mapping; if that fails (the same four-tuple
        still in TIME_WAIT, say), from any port."""
        source = self._listen_source() if self._hole_punch else None
        if source is not None and _tcp_endpoint(addr) is not None:
            self._require_running()
            self._swarm.prepare_dial(info.peer_id, new_address=True)  # (8, 10, 11)
            try:
                with anyio.fail_after(HOLE_PUNCH_DIAL_TIMEOUT_S):
                    await self._swarm._dial_addr_single_attempt(info.addrs[0], info.peer_id, source)
                return
            except Exception as exc:
                log.debug("dialing relay %s from port %d: %s; trying any port", info.peer_id, source[1], _reason(exc))
        await self._dial(info, addr)

    def _circuit_limit(self) -> Limit:
        assert self._book is not None
        return Limit(duration=self._book.settings.circuit_duration_s, data=self._book.settings.circuit_bytes)

    async def _serve_hop(self, stream: INetStream) -> None:
        """One HOP request (RESERVE or CONNECT), answered with the spec's STATUS. The peer is
        the one Noise proved (the message's own `peer` field is not asked who it is: 21)."""
        peer = str(stream.muxed_conn.peer_id)
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                request = await read_delimited_msg(stream, HopMessage)
        except Exception as exc:
            log.debug("a HOP request from %s failed: %s", peer, _reason(exc))
            await _reset_quietly(stream)
            return
        try:
            if _is_relayed(stream.muxed_conn):  # the spec: never reserve or connect over a circuit
                await _hop_status(stream, StatusCode.PERMISSION_DENIED)
            elif request.type == HopMessage.RESERVE:
                await self._hop_reserve(stream, peer)
            elif request.type == HopMessage.CONNECT:
                await self._hop_connect(stream, peer, request)
            else:
                await _hop_status(stream, StatusCode.UNEXPECTED_MESSAGE)
        finally:
            await _close_quietly(stream)

    async def _hop_reserve(self, stream: INetStream, peer: str) -> None:
        assert self._book is not None and self._relay_admit is not None
        try:
            self._relay_admit(peer, RESERVE)
            for other in [p for p in self._book.reservations if not self._connections(p, direct=True)]:
                self._book.drop(other)  # a reservation lasts only while its peer stays connected
            expires = self._book.reserve(peer, time.time())
        except PsymeshError as exc:
            log.info("refused a reservation to %s: %s", peer, exc.message)
            await _hop_status(stream, _status_for(exc))
            return
        own = [a for a in self.addrs() if not _is_circuit(a)][:MAX_RELAY_ADDRS]
        reservation = CircuitReservation(expire=int(expires), addrs=[multiaddr.Multiaddr(a).to_bytes() for a in own])
        await _hop_status(stream, StatusCode.OK, reservation=reservation, limit=self._circuit_limit(),
                          peer=_observation(stream, peer))

    async def _hop_connect(self, stream: INetStream, source: str, request: HopMessage) -> None:
        assert self._book is not None and self._relay_admit is not None
        try:
            target = ID(request.peer.id)
            destination = target.to_base58()
        except Exception:
            await _hop_status(stream, StatusCode.MALFORMED_MESSAGE)
            return
        try:
            self._relay_admit(source, CONNECT)
            if not self._connections(destination, direct=True):
                self._book.drop(destination)
            self._book.open_circuit(source, destination, time.time())
        except PsymeshError as exc:
            log.info("refused a circuit from %s to %s: %s", source, destination, exc.message)
            await _hop_status(stream, _status_for(exc))
            return
        try:
            await self._open_circuit(stream, source, target)
        finally:
            self._book.close_circuit(source, destination)

    async def _open_circuit(self, stream: INetStream, source: str, target: ID) -> None:
        far: INetStream | None = None
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                far = await self._host.new_stream(target, [TProtocol(STOP)])
                await write_delimited_msg(far, StopMessage(type=StopMessage.CONNECT, limit=self._circuit_limit(),
                                                           peer=CircuitPeer(id=_parse_peer_id(source).to_bytes())))
                answer = await read_delimited_msg(far, StopMessage)
            if answer.status != StatusCode.OK:
                raise ConnectError(f"it answered {_status_name(answer.status)}")
        except Exception as exc:
            log.info("circuit from %s to %s failed: %s", source, target, _reason(exc))
            if far is not None:
                await _reset_quietly(far)
            await _hop_status(stream, StatusCode.CONNECTION_FAILED)
            return
        await _hop_status(stream, StatusCode.OK, limit=self._circuit_limit(), peer=_observation(stream, source))
        await self._splice(stream, far, f"{source} -> {target}")

    async def _splice(self, near: INetStream, far: INetStream, circuit: str) -> None:
        """Forward bytes both ways until both ends closed (each end's close is passed on as
        a half-close), one of them reset, or the circuit's time or bytes ran out (23): then
        both ends are reset. Each circuit owns its two streams (22)."""
        assert self._book is not None
        settings = self._book.settings
        left = [settings.circuit_bytes]
        broken: list[str] = []

        async def pump(src: INetStream, dst: INetStream, cancel: anyio.CancelScope) -> None:
            while True:
                try:
                    data = await src.read(READ_CHUNK)
                except StreamEOF:
                    data = b""
                except Exception as exc:
                    broken.append(f"a side went away ({_reason(exc)})")
                    cancel.cancel()
                    return
                if not data:  # (24) end of one direction: pass it on, keep the other
                    try:
                        await dst.close_write()
                    except Exception as exc:
                        log.debug("half-closing a circuit stream: %r", exc)
                    return
                left[0] -= len(data)
                if left[0] < 0:
                    broken.append(f"its {settings.circuit_bytes} bytes are used up")
                    cancel.cancel()
                    return
                try:
                    await dst.write(data)
                except Exception as exc:
                    broken.append(f"a side went away ({_reason(exc)})")
                    cancel.cancel()
                    return

        with anyio.move_on_after(settings.circuit_duration_s) as timer:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pump, near, far, tg.cancel_scope)
                tg.start_soon(pump, far, near, tg.cancel_scope)
        if timer.cancelled_caught:
            broken.append(f"its {settings.circuit_duration_s} s are up")
        if broken:
            log.info("circuit %s reset: %s", circuit, broken[0])
            await _reset_quietly(near)
            await _reset_quietly(far)
        else:
            await _close_quietly(far)

    async def _serve_stop(self, stream: INetStream) -> None:
        """A relay that holds our reservation brings a peer's circuit: say OK, then serve the
        connection over that stream as an inbound one, until it closes. Its own Noise
        handshake proves the peer (the relay sees ciphertext only) and, like any inbound
        connection, it is held to the limits for strangers (15, 17)."""
        relay = str(stream.muxed_conn.peer_id)
        if self.reservation(relay) is None:
            log.info("refused a circuit from %s: we hold no reservation there", relay)
            await _reset_quietly(stream)
            return
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                request = await read_delimited_msg(stream, StopMessage)
                source = ID(request.peer.id)
                if request.type != StopMessage.CONNECT:
                    raise ValueError("not a CONNECT")
                await write_delimited_msg(stream, StopMessage(type=StopMessage.STATUS, status=StatusCode.OK))
        except Exception as exc:
            log.debug("a circuit from relay %s failed: %s", relay, _reason(exc))
            await _reset_quietly(stream)
            return
        circuit = multiaddr.Multiaddr(f"/p2p/{relay}/p2p-circuit/p2p/{source}")
        ip = _remote_ip(stream.muxed_conn)
        if (why := self._admission.start_handshake(ip)) is not None:
            log.info("refused a circuit from relay %s: %s", relay, why)
            await _reset_quietly(stream)
            return
        try:
            raw = RawConnection(_HandshakeBudget(stream, HANDSHAKE_BYTES), False, ConnectionType.RELAYED, [circuit])
            muxed = await self._swarm.upgrade_inbound_raw_conn(raw, circuit)
        except Exception as exc:  # refused peer, failed handshake, limits: already logged
            log.debug("a circuit from relay %s failed: %s", relay, _reason(exc))
            await _reset_quietly(stream)
            return
        finally:
            self._admission.end_handshake(ip)
        await self._swarm._serve_connection(muxed)

    async def _dial_circuit(self, target: ID, addr: str) -> None:
        """Connect to `target` through the relay that `addr` names (`<relay>/p2p-circuit/p2p/<target>`):
        a CONNECT on a HOP stream to the relay, then Noise and yamux over that stream, as
        over a TCP socket. Everything that fails is a ConnectError saying why."""
        relay_part = addr.partition("/p2p-circuit")[0]
        relay_info = _peer_info(relay_part)
        relay = str(relay_info.peer_id)
        if relay in (self.peer_id, str(target)):
            raise ConnectError(f"cannot connect to {addr}: a circuit through the node itself")
        if not self._connections(relay, direct=True):
            await self._dial_relay(relay_info, relay_part)
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                stream = await self._host.new_stream(relay_info.peer_id, [TProtocol(HOP)])
        except Exception as exc:
            raise ConnectError(f"relay {relay} does not relay for us: {_reason(exc)}") from exc
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT,
                                                             peer=CircuitPeer(id=target.to_bytes())))
                reply = await read_delimited_msg(stream, HopMessage)
            if reply.status != StatusCode.OK:
                raise ConnectError(f"relay {relay} refused the circuit to {target}: {_status_name(reply.status)}")
            self._note_observed(relay, reply)
            raw = RawConnection(stream, True, ConnectionType.RELAYED, [multiaddr.Multiaddr(addr)])
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                await self._swarm.upgrade_outbound_raw_conn(raw, target)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await _reset_quietly(stream)
            if isinstance(exc, PsymeshError) or not isinstance(exc, Exception):
                raise
            raise ConnectError(f"cannot connect to {addr}: {_reason(exc)}") from exc

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


@dataclass(frozen=True)
class _Held:
    """A reservation we hold at a relay: until when, and the relay's own addresses (each
    ending /p2p/<relay>), which make ours through it."""

    expires: float
    addrs: tuple[str, ...]


class _PeerFilteringNoise(NoiseTransport):
    """Noise whose responder refuses peers that `allow(peer_id, ip)` rejects, right after the
    handshake proves who they are (7, 17): the connection closes before any muxer or stream
    exists. It hands the connection's handshake budget on to the muxer selection (15)."""

    def __init__(self, key_pair: KeyPair, allow: Callable[[str, str | None], bool]) -> None:
        # The Noise static key is per process: libp2p signs it with the identity key.
        super().__init__(key_pair, noise_privkey=x25519_key_pair().private_key)
        self._allow = allow

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        secured = await super().secure_inbound(conn)
        peer = str(secured.get_remote_peer())
        address = conn.get_remote_address()
        if not self._allow(peer, address[0] if address else None):
            await _close_quietly(secured)
            raise HandshakeFailure(f"peer {peer} is not allowed")
        budget = getattr(conn, "stream", None)
        if isinstance(budget, _HandshakeBudget):
            secured.handshake_budget = budget  # type: ignore[attr-defined]  # lifted by _MuxerSelect
        return secured


class _Host(BasicHost):
    """(18) libp2p 0.8.1's BasicHost, minus the identify it starts on every connection it dials."""

    def _schedule_identify(self, peer_id: ID, *, reason: str) -> None:
        return


class _Admission:
    """Who is a stranger, who may open what, and what strangers may cost (14-18): one per
    P2PNode, shared with its swarm, muxers and inbound streams. Also counts the inbound
    connections still in their handshake, per IP (15)."""

    def __init__(self) -> None:
        self.is_paired: PeerFilter = _anyone
        self.may_open: StreamFilter = _anything
        self.limits = StrangerLimits()
        self.handshaking: Counter[str | None] = Counter()
        self.handshake_rate = RateLimiter(max_keys=4096)  # new connections per IP (CPU: Noise)

    def paired(self, peer_id: str) -> bool:
        try:
            return bool(self.is_paired(peer_id))
        except Exception:
            log.exception("is_paired(%s) failed; treating the peer as a stranger", peer_id)
            return False

    def buffer_budget(self, peer_id: str) -> int:
        return PAIRED_BUFFER_BYTES if self.paired(peer_id) else self.limits.buffer_bytes

    def start_handshake(self, ip: str | None) -> str | None:
        """Take a handshake slot for a new inbound connection from `ip`; or say why not."""
        limits = self.limits
        if self.handshaking.total() >= limits.handshakes or self.handshaking[ip] >= limits.handshakes_per_ip:
            return "too many connections still handshaking"
        if self.handshake_rate.acquire(ip or "?", time.monotonic(), per_minute=limits.handshakes_per_ip_per_minute,
                                       burst=limits.handshake_burst_per_ip) is not None:
            return f"more than {limits.handshakes_per_ip_per_minute} new connections a minute from there"
        self.handshaking[ip] += 1
        return None

    def end_handshake(self, ip: str | None) -> None:
        self.handshaking[ip] -= 1
        if not self.handshaking[ip]:
            del self.handshaking[ip]


def _anyone(_: str) -> bool:
    return True


def _anything(_: str, __: str) -> bool:
    return True


class _HandshakeBudget(ReadWriteCloser):
    """(15) A new inbound TCP connection that may send at most `limit` bytes until `lift()`
    (called when its muxer exists); past that its reads fail and the upgrade is abandoned.
    Each read also asks for no more than what is left, so a huge announced length cannot
    make libp2p allocate a huge receive buffer."""

    def __init__(self, inner: ReadWriteCloser, limit: int) -> None:
        self._inner = inner
        self._left: int | None = limit

    def lift(self) -> None:
        self._left = None

    async def read(self, n: int | None = None) -> bytes:
        if self._left is None:
            return await self._inner.read(n)
        if self._left <= 0:
            raise IOException(f"the peer sent more than {HANDSHAKE_BYTES} bytes before its muxer started")
        data = await self._inner.read(self._left if n is None else min(n, self._left))
        self._left -= len(data)
        return data

    async def write(self, data: bytes) -> None:
        await self._inner.write(data)

    async def close(self) -> None:
        await self._inner.close()

    def get_remote_address(self) -> tuple[str, int] | None:
        return self._inner.get_remote_address()


class _MuxerSelect(MuxerMultistream):
    """(14, 15) The upgrader's muxer selection: every new Yamux becomes a `_BoundedYamux`,
    and the handshake budget of the connection comes off (the muxer bounds what follows).
    P2PNode swaps it in as the class of the upgrader's selector and sets `admission`."""

    admission: _Admission

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
        muxed = await super().new_conn(conn, peer_id)
        if (budget := getattr(conn, "handshake_budget", None)) is not None:
            budget.lift()
        if type(muxed) is not Yamux:
            raise RuntimeError(f"node/net/p2p.py bounds libp2p 0.8.1's Yamux, not {type(muxed)!r}")
        muxed.__class__ = _BoundedYamux
        muxed.admission = self.admission
        return muxed


class _BoundedYamux(Yamux):
    """(14) libp2p's Yamux, same state, with a budget for the unread bytes of a connection.
    `_read_data_body` is where libp2p reads every DATA frame's body: it is refused before
    any of it is read when it would take the unread bytes over the budget, by raising the
    one exception that `handle_incoming` answers by closing the connection (its data-body
    timeout, `trio.TooSlowError`)."""

    admission: _Admission

    async def _read_data_body(self, length: int) -> bytes:
        unread = sum(len(buffer) for buffer in self.stream_buffers.values())
        if unread + length > self.admission.limits.buffer_bytes:  # past a stranger's budget: ask who it is
            budget = self.admission.buffer_budget(str(self.peer_id))
            if unread + length > budget:
                log.info("closing the connection of %s: a %d-byte frame on top of %d unread bytes "
                         "exceeds its %d-byte budget", self.peer_id, length, unread, budget)
                raise trio.TooSlowError
        return await super()._read_data_body(length)

    def _finalize_stream_locked(self, stream: YamuxStream, *, fully_closed: bool) -> None:
        if stream.reset_received and (buffer := self.stream_buffers.get(stream.stream_id)):
            buffer.clear()  # nobody can read a reset stream: drop its data now, not in 60-90 s
        super()._finalize_stream_locked(stream, fully_closed=fully_closed)
        self._stream_closed().set()

    def _stream_closed(self) -> trio.Event:
        event = self.__dict__.get("_psymesh_closed")
        if event is None:
            event = self.__dict__["_psymesh_closed"] = trio.Event()
        return event

    async def _measure_rtt_loop(self) -> None:
        """(26) One RTT measurement, when the connection starts (the window tuning's input),
        not one every 30 s for the connection's life."""
        await trio.sleep(0.5)
        try:
            self._ping_id += 1
            self._ping_event = trio.Event()
            await self._write_frame(struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_PING, FLAG_SYN, 0, self._ping_id))
            self._ping_sent_time = trio.current_time()
            with trio.move_on_after(10.0):
                await self._ping_event.wait()
        except Exception:  # the connection closed: nothing to measure
            return

    async def _stale_stream_sweeper(self) -> None:
        """(26) libp2p's sweep, run when a closed stream's entry can be reclaimed (at once
        if it holds no unread data, else when its grace ends); asleep on a stream's close
        otherwise. Upstream's runs every 30 s, for the connection's life."""
        while not self.event_shutting_down.is_set():
            due = self._sweep_due()
            if due is None:
                await self._stream_closed().wait()
                self.__dict__.pop("_psymesh_closed", None)
                continue
            await trio.sleep(max(1.0, due - trio.current_time()))
            async with self.streams_lock:
                stuck = not self._sweep_stale_streams() and self._sweep_due() == due
            if stuck:  # nothing came of it (a stream upstream never reclaims): until the next close
                await self._stream_closed().wait()
                self.__dict__.pop("_psymesh_closed", None)

    def _sweep_due(self) -> float | None:
        """When `_sweep_stale_streams` would reclaim a stream next (None: never, as things are)."""
        due: float | None = None
        for sid, stream in self.streams.items():
            if not stream.closed:
                continue
            if not self.stream_buffers.get(sid):
                return trio.current_time()
            if stream._closed_at != 0.0:
                at = stream._closed_at + _STALE_STREAM_GRACE_SECONDS
                due = at if due is None else min(due, at)
        return due


class _NegotiationFailed(Exception):
    """An inbound stream agreed on no protocol (16): it is reset, quietly."""


class _Swarm(Swarm):
    """libp2p 0.8.1's Swarm with defect (4) fixed, plus a hook run before explicit dials (8, 10, 11).
    P2PNode swaps it in as the class of the swarm `new_host()` built, and sets `admission` (15)."""

    admission: _Admission

    async def _do_handle_inbound_connection(
        self, read_write_closer: ReadWriteCloser, maddr: multiaddr.Multiaddr, failure_event: Any
    ) -> None:
        """Upstream's TCP path with two changes. The handshake is bounded (15): a connection
        may send `HANDSHAKE_BYTES` before its muxer runs, and only so many may be handshaking
        at once (per IP and in all). And the last line waits for *this* connection to close,
        not for the swarm to stop (4), so the caller returns the `_inbound_limiter` slot and
        the task ends when the peer goes away. (The task must live while the connection
        does: `trio.serve_listeners` closes the socket when it returns.)"""
        if isinstance(read_write_closer, IMuxedConn):  # QUIC/WebTransport: psymesh enables neither
            await super()._do_handle_inbound_connection(read_write_closer, maddr, failure_event)
            return
        remote = self._build_remote_multiaddr(read_write_closer)
        if remote is not None and not await self.connection_gate.is_allowed(remote):
            log.debug("inbound connection from %s denied by the IP gate", remote)
            await _close_quietly(read_write_closer)
            return
        address = read_write_closer.get_remote_address()
        ip = address[0] if address else None
        if (why := self.admission.start_handshake(ip)) is not None:
            log.info("closed a new connection from %s: %s", ip, why)
            await _close_quietly(read_write_closer)
            return
        try:
            raw_conn = RawConnection(_HandshakeBudget(read_write_closer, HANDSHAKE_BYTES), False)
            try:
                muxed_conn = await self.upgrade_inbound_raw_conn(raw_conn, maddr)
            except Exception as exc:  # refused peer, failed handshake, limits: already logged
                log.debug("inbound connection on %s failed: %s", maddr, _reason(exc))
                await _close_quietly(raw_conn)
                return
        finally:
            self.admission.end_handshake(ip)
        await self._serve_connection(muxed_conn)

    async def _serve_connection(self, muxed_conn: IMuxedConn) -> None:
        """Until the connection closes (4); an unpaired one is closed after `connection_s`
        (17): a pairing run takes seconds, and a stranger must not camp on the few slots."""
        muxer, peer = _muxer_of(muxed_conn), str(muxed_conn.peer_id)
        if not self.admission.paired(peer):
            with anyio.move_on_after(self.admission.limits.connection_s):
                await muxer.event_closed.wait()
            if not muxer.event_closed.is_set() and not self.admission.paired(peer):
                log.info("closing the connection of %s: unpaired for %.0f s", peer, self.admission.limits.connection_s)
                for conn in self.get_connections(muxed_conn.peer_id):
                    if conn.muxed_conn is muxed_conn:
                        await _close_quietly(conn)
                await _close_quietly(muxed_conn)
                return
        # (26) paired: no timer for the connection's life (a revocation closes it: `disconnect`)
        await muxer.event_closed.wait()

    def prepare_dial(self, peer_id: ID, *, new_address: bool = False) -> None:
        """Before a dial someone asked for: forget a recent failure to reach the peer (8),
        connections to it that are closed but still listed (10) and, when the caller brings
        an address, the addresses remembered for it (11)."""
        self._negative_peer_cache.evict(str(peer_id))
        for conn in self.get_connections(peer_id):
            if conn.is_closed or conn.muxed_conn.is_closed:
                self.remove_conn(conn)
        if new_address and not self.get_connections(peer_id):
            self.peerstore.clear_addrs(peer_id)


class _Changes(INotifee):
    """The swarm's connection and listener events, as one callback (P2PNode.changes)."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self._changed = changed

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._changed()

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._changed()

    async def listen(self, network: INetwork, addr: multiaddr.Multiaddr) -> None:
        self._changed()

    async def listen_close(self, network: INetwork, addr: multiaddr.Multiaddr) -> None:
        self._changed()


class _QuietRecovery(GracefulDegradation):
    """(26) libp2p's resource manager tries to undo a degradation every 30 s, for the node's
    life; this one sleeps until something was degraded, then does the same."""

    def _degraded(self) -> trio.Event:
        event = self.__dict__.get("_psymesh_degraded")
        if event is None:
            event = self.__dict__["_psymesh_degraded"] = trio.Event()
        return event

    def handle_resource_exhaustion(self, resource_type: str) -> bool:
        applied = super().handle_resource_exhaustion(resource_type)
        self._degraded().set()
        return applied

    async def run_periodic_recovery(self, interval: float = 30.0) -> None:
        while True:
            if self.degradation_level == 0:
                await self._degraded().wait()
                self.__dict__.pop("_psymesh_degraded", None)
            await trio.sleep(interval)
            if self.degradation_level > 0:
                self.recover()


class _NoAutoConnect(AutoConnector):
    """(9) The swarm's auto-connector, minus the dialing: no background task, no dials,
    and (20) no backoff table of disconnected peers, which only that task pruned."""

    async def run_background_task(self, nursery: Any) -> None:
        return

    async def maybe_connect(self) -> None:
        return

    def record_disconnect(self, peer_id: ID) -> None:
        return


# -- helpers ---------------------------------------------------------------------------
def _muxer(conn: INetConn) -> Yamux:
    return _muxer_of(conn.muxed_conn)


def _remote_ip(muxed_conn: IMuxedConn) -> str | None:
    address = muxed_conn.get_remote_address()
    return address[0] if address else None


def _multistream_message(text: str) -> bytes:
    body = text.encode() + b"\n"
    return encode_uvarint(len(body)) + body


async def _write_multistream_message(stream: INetStream, text: str) -> None:
    try:
        await stream.write(_multistream_message(text))
    except Exception as exc:
        raise _NegotiationFailed(f"stream gone during negotiation ({_reason(exc)})") from None


async def _read_multistream_message(stream: INetStream) -> str:
    """(16) One multistream-select message, at most MAX_NEGOTIATION_MESSAGE bytes, read
    exactly (never past it: the protocol's first bytes may follow in the same frame)."""
    try:
        length = 0
        for shift in (0, 7):  # MAX_NEGOTIATION_MESSAGE needs at most 2 varint bytes
            byte = (await read_exactly(stream, 1))[0]
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
        else:
            raise _NegotiationFailed("negotiation message too long")
        if not 0 < length <= MAX_NEGOTIATION_MESSAGE:
            raise _NegotiationFailed(f"a {length}-byte negotiation message (the limit is {MAX_NEGOTIATION_MESSAGE})")
        body = await read_exactly(stream, length)
    except _NegotiationFailed:
        raise
    except Exception as exc:  # reset, EOF, a dead connection
        raise _NegotiationFailed(f"stream ended during negotiation ({_reason(exc)})") from None
    if not body.endswith(b"\n"):
        raise _NegotiationFailed("negotiation message without its newline")
    return body[:-1].decode("utf-8", "replace")


def _is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr


def _relay_of(addr: str) -> str | None:
    """The relay's peer id in a circuit address (None for any other address)."""
    if not _is_circuit(addr):
        return None
    parts = addr.partition("/p2p-circuit")[0].split("/")
    return parts[-1] if len(parts) >= 3 and parts[-2] in ("p2p", "ipfs") else None


def _with_peer_id(addr: str, peer_id: str) -> str:
    """`addr` ending in /p2p/<peer id>: as it is if it names one (a circuit address names the
    relay first, then its target), else with `peer_id`'s."""
    parts = addr.rstrip("/").split("/")
    return addr if len(parts) >= 3 and parts[-2] in ("p2p", "ipfs") else f"{addr}/p2p/{peer_id}"


def _is_relayed(conn: INetConn | IMuxedConn) -> bool:
    try:
        return conn.get_connection_type() == ConnectionType.RELAYED
    except Exception:
        return False


def _bytes_to_addr(data: bytes) -> str | None:
    try:
        return str(multiaddr.Multiaddr(bytes(data)))
    except Exception:
        return None


def _status_name(status: int) -> str:
    try:
        return StatusCode(status).name.lower()
    except ValueError:
        return f"status {status}"


def _status_for(exc: PsymeshError) -> StatusCode:
    """A refusal of our relay (the gate's, or its book's) as the spec's status."""
    if exc.code in (ErrorCode.UNKNOWN_PEER, ErrorCode.FORBIDDEN, ErrorCode.EXPIRED):
        return StatusCode.PERMISSION_DENIED
    if exc.code is ErrorCode.BUSY:
        return StatusCode.RESOURCE_LIMIT_EXCEEDED
    if exc.code is ErrorCode.NOT_FOUND:
        return StatusCode.NO_RESERVATION
    return StatusCode.CONNECTION_FAILED


def _refusal(status: int, what: str) -> PsymeshError:
    """A relay's status other than OK as the PsymeshError for it."""
    reason = f"{what}: {_status_name(status)}"
    if status == StatusCode.PERMISSION_DENIED:
        return PsymeshError(f"{reason} (it has not granted this node `relay`)", code=ErrorCode.FORBIDDEN)
    if status in (StatusCode.RESOURCE_LIMIT_EXCEEDED, StatusCode.RESERVATION_REFUSED):
        return PsymeshError(reason, code=ErrorCode.BUSY)
    return ConnectError(reason)


async def _hop_status(stream: INetStream, status: StatusCode, *, reservation: CircuitReservation | None = None,
                      limit: Limit | None = None, peer: CircuitPeer | None = None) -> None:
    message = HopMessage(type=HopMessage.STATUS, status=int(status))
    if peer is not None:
        message.peer.CopyFrom(peer)
    if reservation is not None:
        message.reservation.CopyFrom(reservation)
    if limit is not None:
        message.limit.CopyFrom(limit)
    try:
        with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
            await write_delimited_msg(stream, message)
    except Exception as exc:
        log.debug("sending a relay status: %s", _reason(exc))


def _observation(stream: INetStream, peer_id: str) -> CircuitPeer | None:
    """`peer_id` as a relay sees it: its id, and the address its connection comes from (for
    hole punching: the far side of the peer's NAT). None if the connection has no IP address."""
    address = stream.muxed_conn.get_remote_address()
    if not address:
        return None
    ip, port = address[0], address[1]
    addr = f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}"
    if _tcp_endpoint(addr) is None:
        return None
    return CircuitPeer(id=_parse_peer_id(peer_id).to_bytes(), addrs=[multiaddr.Multiaddr(addr).to_bytes()])


def _tcp_endpoint(addr: str) -> tuple[str, int] | None:
    """(ip, port) of a plain TCP multiaddr (`/ip4|ip6/IP/tcp/PORT`, optionally `/p2p/ID`); None
    for anything else (circuits, DNS, other transports)."""
    parts = addr.split("/")
    if len(parts) not in (5, 7) or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    if len(parts) == 7 and parts[5] not in ("p2p", "ipfs"):
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if ip.version != (4 if parts[1] == "ip4" else 6) or not 0 < port < 65536:
        return None
    return parts[2], port


def _is_loopback(addr: str) -> bool:
    endpoint = _tcp_endpoint(addr)
    return endpoint is not None and ipaddress.ip_address(endpoint[0]).is_loopback


async def _send_punch(stream: INetStream, kind: int, addrs: Sequence[str] = ()) -> None:
    await write_delimited_msg(stream, HolePunch(type=kind, ObsAddrs=[multiaddr.Multiaddr(a).to_bytes() for a in addrs]))


async def _read_punch(stream: INetStream, kind: int) -> list[str]:
    """One DCUtR message of type `kind` (at most the spec's 4 KiB); its plain TCP addresses."""
    message = HolePunch.FromString(await read_varint_prefixed_bytes_limited(stream, MAX_DCUTR_MESSAGE))
    if message.type != kind:
        raise ProtocolError(f"expected DCUtR {HolePunch.Type.Name(kind)}, got type {message.type}")
    addrs = [a for a in map(_bytes_to_addr, message.ObsAddrs[:MAX_PUNCH_ADDRS]) if a is not None]
    return [a for a in addrs if _tcp_endpoint(a) is not None]


def _muxer_of(muxed_conn: IMuxedConn) -> Yamux:
    assert isinstance(muxed_conn, Yamux), f"unexpected muxer {type(muxed_conn)!r}"
    return muxed_conn


async def _close_quietly(resource: Any) -> None:
    try:
        await resource.close()
    except Exception as exc:
        log.debug("closing %r: %r", resource, exc)


async def _reset_quietly(stream: INetStream) -> None:
    try:
        await stream.reset()
    except Exception as exc:
        log.debug("resetting a stream: %r", exc)


def _check_port_free(addr: multiaddr.Multiaddr) -> None:
    """(12) Refuse a fixed TCP port that something already listens on. libp2p binds with
    SO_REUSEPORT, so a second node would get the same port and the kernel would split the
    incoming connections between the two. Our probe binds without it (SO_REUSEADDR only
    tolerates TIME_WAIT leftovers), which fails while any socket listens there."""
    protocols = {p.name for p in addr.protocols()}
    if "tcp" not in protocols or not ({"ip4", "ip6"} & protocols):
        return
    port = int(addr.value_for_protocol("tcp"))
    if port == 0:
        return
    family, ip = ((socket.AF_INET6, addr.value_for_protocol("ip6")) if "ip6" in protocols
                  else (socket.AF_INET, addr.value_for_protocol("ip4")))
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError as exc:
            raise PsymeshError(f"cannot listen on {addr}: {exc.strerror or exc}", code=ErrorCode.UNAVAILABLE) from None


ADDRESS_POLL_S = 60.0  # where the kernel cannot tell us (no netlink): how often addresses are looked at
_RTMGRP_IPV4_IFADDR, _RTMGRP_IPV6_IFADDR = 0x10, 0x100


def _is_wildcard(addr: multiaddr.Multiaddr) -> bool:
    return str(addr).startswith(("/ip4/0.0.0.0/", "/ip6/::/"))


async def _watch_local_addresses(changed: Callable[[], None]) -> None:
    """(26) Call `changed()` when this machine's IP addresses change (a Wi-Fi network joined,
    a link up): told by the kernel (a netlink socket, Linux and Android), so nothing wakes
    while they stay the same; where that socket cannot be had, looked at every ADDRESS_POLL_S."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        sock.bind((0, _RTMGRP_IPV4_IFADDR | _RTMGRP_IPV6_IFADDR))
        sock.setblocking(False)
    except (OSError, AttributeError) as exc:
        log.debug("no netlink socket (%s): local addresses are looked at every %.0f s", exc, ADDRESS_POLL_S)
        seen = local_ipv4_addresses()
        while True:
            await anyio.sleep(ADDRESS_POLL_S)
            if (now := local_ipv4_addresses()) != seen:
                seen = now
                changed()
    with sock:
        while True:
            await anyio.wait_socket_readable(sock)
            try:
                while sock.recv(65536):
                    pass
            except BlockingIOError:
                pass
            changed()


def local_ipv4_addresses() -> list[str]:
    """This machine's IPv4 addresses, non-loopback first."""
    import ifaddr

    found = {ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips if isinstance(ip.ip, str)}
    return sorted(found, key=lambda a: (a.startswith("127."), a))


def expand_wildcard(addrs: Sequence[str], local: Sequence[str]) -> list[str]:
    """Replace each `/ip4/0.0.0.0/...` with one address per local IPv4 address."""
    out: list[str] = []
    for addr in addrs:
        if addr.startswith("/ip4/0.0.0.0/"):
            out += [addr.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in local]
        else:
            out.append(addr)
    return list(dict.fromkeys(out))


def _parse_multiaddr(addr: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(addr)
    except Exception as exc:
        raise PsymeshError(f"not a multiaddr: {addr!r} ({exc})", code=ErrorCode.BAD_REQUEST) from None


def _peer_info(addr: str) -> PeerInfo:
    maddr = _parse_multiaddr(addr)
    try:
        return info_from_p2p_addr(maddr)
    except Exception:
        raise PsymeshError(f"{addr!r} does not end in /p2p/<peer id>", code=ErrorCode.BAD_REQUEST) from None


def _parse_peer_id(peer_id: str) -> ID:
    try:
        return ID.from_base58(peer_id)
    except Exception:
        raise PsymeshError(f"not a peer id: {peer_id[:64]!r}", code=ErrorCode.BAD_REQUEST) from None


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


def _reason(exc: BaseException) -> str:
    """The first and the innermost message of a libp2p exception chain, for people."""
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(nxt)
    first, root = str(exc) or type(exc).__name__, str(chain[-1]) or type(chain[-1]).__name__
    return first if root == first or len(chain) == 1 else f"{first} ({root})"
