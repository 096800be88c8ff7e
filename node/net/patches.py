"""The libp2p 0.8.1 defect patches: the subclasses P2PNode (net/host.py) swaps onto the host,
swarm, upgrader, muxers and resource manager that `new_host()` builds, and the bounded
stream negotiation. libp2p is imported only inside node/net/.

libp2p 0.8.1 defects measured on this machine, and what node/net/ does about each
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
the dialing are `serve_relay()`, `reserve()`, `_serve_stop()` and `_dial_circuit()` in net/circuit.py. Read
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

Found while making an idle phone fit in 100 MB (issue 23 item 3):

27. Importing any part of libp2p imports every transport and service it has (QUIC/aioquic,
   AutoTLS's ACME client with httpx and requests, its own mDNS/zeroconf, Prometheus,
   multiaddr's DNS resolvers/dnspython): ~25 MB RSS and ~0.4 s of start for features the
   node never turns on. `lean_import.py`, imported by node/net/__init__.py before any libp2p
   import, answers those modules with stand-ins that load the real module at first use
   (tests/test_p2p_imports.py).

Found while cutting a request's fixed costs (issue 23 item 4):

28. (19, continued) With `RELEASE_ON_READ` off, yamux still sends a WINDOW_UPDATE after
   almost every read: its "partial slack" branch credits back whatever was read whenever
   the window is short of its target by less than half, which after any read it is. go-yamux
   (`sendWindowUpdate`) sends nothing until half the window is used. A request/response
   session paid one more encrypted frame per round trip for it (3 yamux frames a ping,
   counted, instead of 2), and the peer one more to decrypt and handle. `_window_update`
   replaces the stream's method with go-yamux's rule: below half, nothing; at half or more,
   grow back to the target (and let the auto-tuning grow the target, as before).

Found while cutting a session round trip's fixed cost (issue 23 item 4, counted with a trio
instrument: 40 task steps and 29 turns of the scheduler a ping, both ends together):

29. Every lock on libp2p's frame path yields to the scheduler even when it is free (trio's
   `Lock.acquire` always checkpoints): the TCP stream's read and write locks, yamux's write
   lock, stream table lock and each stream's window and write locks, and the swarm stream's
   state lock, ~24 a ping, each one more turn of trio's run loop before the frame moves on;
   and yamux's `_write_frame` adds a checkpoint of its own after the socket's send (which has
   checkpointed already) and formats a debug line per frame whether debug logging is on or
   not. `_PromptLock` (anyio's `fast_acquire`, for libp2p's locks) takes a free lock without
   a checkpoint and otherwise waits in line, as trio's does; the four classes get it in place of
   their locks as they are built (`_prompt_locks`), and `_BoundedYamux._write_frame` is
   upstream's minus the second checkpoint (the debug line only when debug logging is on).
   The socket operations under them still checkpoint: nothing loops without one.
30. Noise reads each message in two exact reads (its 2-byte length, then its body), each a
   socket `recv` under the TCP stream's read lock and a checkpoint, plus a `recv` that finds
   nothing and waits: 3 socket calls a frame. `_NoiseReadAhead` reads what the socket holds
   (up to 64 KiB) into one buffer and cuts whole messages out of it: one `recv` a frame,
   usually, and one for several frames that came together. Installed on a connection once
   its muxer is chosen (`_MuxerSelect.new_conn`, the handshake's budget (15) lifted), so a
   connection holds at most one read beyond the message being read.

31. (29, continued) libp2p builds its debug lines with f-strings, so each is formatted
   whether debug logging is on or not: 28 of them a session ping, peer ids and sizes
   turned to text on every frame read or written. `_BoundedYamux.read_stream` (the read
   every stream's `read` comes to) and `_QuietNoise.read_msg` are upstream's, step for step,
   minus those lines (upstream's own, lines and all, while debug logging is on).
32. yamux reads every DATA frame's body under a timeout of its own (`_read_data_body`: a
   cancel scope with a deadline, registered with trio and removed again, and the timeout
   read from the environment), though nearly always the body is in the Noise message its
   header came in, decrypted and waiting in the secure session's buffer: two scopes and
   two environment lookups a ping for nothing to wait on. `_BoundedYamux._read_data_body`
   takes a body that is buffered whole from the buffer, and only waits for one (under
   upstream's timeout) that is not.

Hole punching (DCUtR, `enable_hole_punch()`, config `[relay] hole_punch`): likewise libp2p's
wire format (its `HolePunch` protobuf on `/libp2p/dcutr`) and its swarm's source-bound dials
(`dial_with_source`, `dial_addr_as_responder`), not its `DCUtRProtocol` service (which brings
its own polling loop and would open the stream to any peer). `hole_punch()` is the spec's `B`,
`_serve_dcutr()` its `A` (net/dcutr.py). Each side's address behind its NAT is what a relay tells it: a psymesh
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

import functools
import logging
import os
import struct
from collections.abc import Callable
from typing import Any

import anyio
import multiaddr
import trio
from libp2p.abc import IMuxedConn, INetConn, INetStream, INetwork, INotifee, IRawConnection, ISecureConn, ReadWriteCloser
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as x25519_key_pair
from libp2p.host.basic_host import BasicHost
from libp2p.io.exceptions import IncompleteReadError
from libp2p.io.trio import TrioTCPStream
from libp2p.io.utils import read_exactly
from libp2p.network.auto_connector import AutoConnector
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.stream.net_stream import NetStream
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.rcmgr.graceful_degradation import GracefulDegradation
from libp2p.security.exceptions import HandshakeFailure
from libp2p.security.noise.io import SIZE_NOISE_MESSAGE_LEN, NoisePacketReadWriter, NoiseTransportReadWriter
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.exceptions import MuxedStreamEOF, MuxedStreamReset
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import (
    _STALE_STREAM_GRACE_SECONDS,
    FLAG_SYN,
    TYPE_PING,
    YAMUX_HEADER_FORMAT,
    Yamux,
    YamuxStream,
)
from libp2p.utils.varint import encode_uvarint

from .stream import _close_quietly, _reason
from .strangers import HANDSHAKE_BYTES, _Admission, _HandshakeBudget

log = logging.getLogger(__name__)
_yamux_log = logging.getLogger("libp2p.stream_muxer.yamux.yamux")
_noise_log = logging.getLogger("libp2p.security.noise.io")
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")  # (19) read by libp2p's yamux at call time

# (16) Inbound stream negotiation (multistream-select 1.0, listener side).
MULTISTREAM = "/multistream/1.0.0"
MAX_NEGOTIATION_MESSAGE = 512
MAX_PROPOSALS = 8
NEGOTIATE_TIMEOUT_S = 5.0


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


class _MuxerSelect(MuxerMultistream):
    """(14, 15) The upgrader's muxer selection: every new Yamux becomes a `_BoundedYamux`,
    and the handshake budget of the connection comes off (the muxer bounds what follows).
    P2PNode swaps it in as the class of the upgrader's selector and sets `admission`."""

    admission: _Admission

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
        muxed = await super().new_conn(conn, peer_id)
        if (budget := getattr(conn, "handshake_budget", None)) is not None:
            budget.lift()
        _read_ahead(conn)  # (30)
        if type(muxed) is not Yamux:
            raise RuntimeError(f"node/net/patches.py bounds libp2p 0.8.1's Yamux, not {type(muxed)!r}")
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
        secured = self.secured_conn
        if isinstance(secured, SecureSession) and secured.high_watermark - secured.low_watermark >= length:
            return secured._drain(length)  # (32) decrypted and buffered whole: nothing to wait for
        return await super()._read_data_body(length)

    async def _write_frame(self, data: bytes) -> None:
        """(29) Upstream's, minus its second checkpoint after the send (which checkpointed) and
        its per-frame debug line unless debug logging is on."""
        if _yamux_log.isEnabledFor(logging.DEBUG):
            await super()._write_frame(data)
            return
        async with self._write_lock:
            await self.secured_conn.write(data)

    async def read_stream(self, stream_id: int, n: int = -1) -> bytes:
        """(31) Upstream's, step for step, minus a debug line formatted per call."""
        if _yamux_log.isEnabledFor(logging.DEBUG):
            return await super().read_stream(stream_id, n)
        if n is None:
            n = -1
        while True:
            async with self.streams_lock:
                stream = self.streams.get(stream_id)
                if stream is None:
                    raise MuxedStreamEOF("Stream closed")
                if self.event_shutting_down.is_set():
                    raise MuxedStreamEOF("Connection shut down")
                buffer = self.stream_buffers.get(stream_id)
                if buffer is None:
                    if stream.reset_received:
                        raise MuxedStreamReset("Stream was reset")
                    raise MuxedStreamEOF("Stream buffer closed")
                if buffer and (stream.recv_closed or not stream.reset_received):
                    if n == -1 or n >= len(buffer):
                        data = bytes(buffer)
                        buffer.clear()
                    else:
                        data = bytes(buffer[:n])
                        del buffer[:n]
                    if stream.closed:  # drained on a fully closed stream: reclaim it now, as upstream
                        self._finalize_stream_locked(stream, fully_closed=True)
                    return data
                if stream.reset_received:
                    raise MuxedStreamReset("Stream was reset")
                if stream.recv_closed:
                    raise MuxedStreamEOF("Stream is closed for receiving")
                if stream.closed:
                    raise MuxedStreamReset("Stream is reset or closed")
            try:
                await self.stream_events[stream_id].wait()
                self.stream_events[stream_id] = trio.Event()
            except KeyError:
                raise MuxedStreamEOF("Stream was removed") from None

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


async def _window_update(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """(28) go-yamux's `sendWindowUpdate`: credit the peer back only once at least half the
    receive window was read (then all of it, and the auto-tuning's growth), never per read."""
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        delta = self.target_recv_window - (self.recv_window + buffered)
        if delta <= 0 or delta < self.target_recv_window // 2:  # go-yamux: half (upstream reads env per read)
            return
        self._window_update_full_grow += 1
        total = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
        self._pending_recv_release = 0
    if total > 0:
        await self.send_window_update(total, skip_lock=True)


YamuxStream._auto_tune_and_send_window_update = _window_update  # type: ignore[method-assign]


class _PromptLock:
    """(29) A lock for libp2p's frame path: taken at once, without a checkpoint, when it is
    free (as anyio's `Lock(fast_acquire=True)`); otherwise the task parks, in order, and the
    release hands the lock straight to the first one waiting (a waiter that is cancelled
    leaves the line). So while anyone waits the lock is held, and a newcomer queues behind
    them. Also yamux's stream write lock: yamux uses its `ReadWriteLock` only as
    `write_lock()`. Held across awaits, like trio's; no owner check (libp2p takes each in
    `async with`)."""

    __slots__ = ("_held", "_parked", "_waiting")

    def __init__(self) -> None:
        self._held = False
        self._parked = 0  # waiters, counted until each runs again (a cancelled one may linger)
        self._waiting = trio.lowlevel.ParkingLot()

    async def acquire(self) -> None:
        if not self._held:
            self._held = True
            return
        self._parked += 1
        try:
            await self._waiting.park()  # returns once release() handed the lock over
        finally:
            self._parked -= 1

    def release(self) -> None:
        if not (self._parked and self._waiting.unpark()):
            self._held = False

    def locked(self) -> bool:
        return self._held

    def write_lock(self) -> "_PromptLock":
        return self

    async def __aenter__(self) -> None:  # acquire(), its free case inline
        if not self._held:
            self._held = True
            return
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:  # release(), inline
        if not (self._parked and self._waiting.unpark()):
            self._held = False


def _prompt_locks(cls: type, *names: str) -> None:
    """(29) `cls`'s instances get a `_PromptLock` for each lock attribute named, as they are built."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for name in names:
            setattr(self, name, _PromptLock())

    cls.__init__ = __init__  # type: ignore[misc]


_prompt_locks(TrioTCPStream, "read_lock", "write_lock")
_prompt_locks(Yamux, "streams_lock", "_write_lock")
_prompt_locks(YamuxStream, "window_lock", "rw_lock", "close_lock")
_prompt_locks(NetStream, "_state_lock")

READ_AHEAD = 65536


class _NoiseReadAhead(NoisePacketReadWriter):
    """(30) Noise's packet reader (a 2-byte big-endian length, then that many bytes), reading
    whatever the connection holds, up to READ_AHEAD bytes at a time, into one buffer: one
    read a message instead of two exact ones (and a third that waits). Ends as upstream's:
    `IncompleteReadError`, clean (no byte received) between messages."""

    def __init__(self, read_write_closer: ReadWriteCloser) -> None:
        super().__init__(read_write_closer)
        self._buffer = bytearray()

    async def read_msg(self) -> bytes:
        buffer = self._buffer
        while len(buffer) < SIZE_NOISE_MESSAGE_LEN:
            await self._read_more(SIZE_NOISE_MESSAGE_LEN)
        end = SIZE_NOISE_MESSAGE_LEN + int.from_bytes(buffer[:SIZE_NOISE_MESSAGE_LEN], "big")
        while len(buffer) < end:
            await self._read_more(end)
        message = bytes(buffer[SIZE_NOISE_MESSAGE_LEN:end])
        del buffer[:end]
        return message

    async def _read_more(self, wanted: int) -> None:
        data = await self.read_write_closer.read(READ_AHEAD)
        if not data:
            got = len(self._buffer)
            raise IncompleteReadError(f"Connection closed during read operation: expected {wanted} bytes but "
                                      f"received {got} bytes", expected_bytes=wanted, received_bytes=got)
        self._buffer += data


class _QuietNoise(NoiseTransportReadWriter):
    """(31) Noise's transport messages as upstream reads them, minus three debug lines
    formatted per message (upstream's, lines and all, while debug logging is on)."""

    async def read_msg(self, prefix_encoded: bool = False) -> bytes:
        if prefix_encoded or _noise_log.isEnabledFor(logging.DEBUG):
            return await super().read_msg(prefix_encoded)
        return self.decrypt(await self.read_writer.read_msg())


def _read_ahead(conn: ISecureConn) -> None:
    """(30, 31) Noise's reads on `conn` through `_NoiseReadAhead` and `_QuietNoise`, between
    two messages (none is being read: the muxer that will read them is not started yet)."""
    noise = getattr(conn, "conn", None)
    if isinstance(conn, SecureSession) and type(noise) is NoiseTransportReadWriter \
            and type(noise.read_writer) is NoisePacketReadWriter:
        noise.read_writer = _NoiseReadAhead(noise.read_writer.read_write_closer)
        noise.__class__ = _QuietNoise


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


def _muxer_of(muxed_conn: IMuxedConn) -> Yamux:
    assert isinstance(muxed_conn, Yamux), f"unexpected muxer {type(muxed_conn)!r}"
    return muxed_conn


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
