"""Circuit relay v2, the IO (protocol/relay.py has the settings and the relay's book): the hop
side (`serve_relay`, answering RESERVE and CONNECT on HOP, then splicing a circuit's two
streams), the stop side (`_serve_stop`: a relay brings us a peer's circuit, served as an
inbound connection), reservations we hold (`reserve`), and dialing through a relay
(`_dial_circuit`). What a HOP request is answered is protocol/circuit.py's machine (`Hop`);
this drives it. libp2p's wire format, not its relay service or transport: defects 21-24
of net/patches.py say why. `Relaying` is mixed into P2PNode (net/host.py), whose host,
swarm and connections it uses."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.abc
import multiaddr
from libp2p.abc import INetStream
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Limit, StopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeer
from libp2p.relay.circuit_v2.pb.circuit_pb2 import Reservation as CircuitReservation
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from ...protocol.errors import ConnectError, PsymeshError
from ...protocol.circuit import Answer, Hop, Reserved, Status, refusal, status_name, stop_answer
from ...protocol.relay import HOP, STOP, RelayBook, RelaySettings
from .addrs import _bytes_to_addr, _is_circuit, _is_relayed, _parse_peer_id, _peer_info, _tcp_endpoint, _with_peer_id
from .patches import _remote_ip
from .stream import READ_CHUNK, _close_quietly, _reason, _reset_quietly
from .strangers import HANDSHAKE_BYTES, _HandshakeBudget

log = logging.getLogger(__name__)

# Circuit relay v2 (protocol/relay.py): how long one step (a HOP or STOP message, opening
# the relay's stream) may take.
RELAY_STEP_TIMEOUT_S = 10.0
MAX_RELAY_ADDRS = 4  # relay addresses kept from one reservation (each makes one address of ours)


class RelayAdmit(Protocol):
    def __call__(self, peer_id: str, what: str) -> None:
        """Return if `peer_id` may `what` (RESERVE, CONNECT of protocol/relay.py) at this relay;
        else raise the PsymeshError that says why (the daemon's gate decides and audits)."""


@dataclass(frozen=True)
class _Held:
    """A reservation we hold at a relay: until when, and the relay's own addresses (each
    ending /p2p/<relay>), which make ours through it."""

    expires: float
    addrs: tuple[str, ...]


class Relaying:
    """P2PNode's relay part (mixed in: it uses the host's `_host`, `_swarm`, `_admission`, `_label`,
    `_tg`, `_connections()`, `_dial()`, `addrs()`, `_changed()`, `_close_connections()`,
    `_require_running()`, and the hole-punching part's `_dial_relay()`)."""

    # -- circuit relay v2 (protocol/relay.py) ------------------------------------------
    def serve_relay(self, settings: RelaySettings, admit: RelayAdmit) -> None:
        """Relay for the peers `admit` lets through (the daemon's gate: paired, granted `relay`;
        it audits every decision), within `settings`. Call before `run()`."""
        self._book = RelayBook(settings)
        self._relay_admit = admit
        self._hop = Hop(self._book, admit, lambda peer: bool(self._connections(peer, direct=True)), self._label)
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
            raise ConnectError(f"relay {self._label(relay)} is unreachable: "
                               f"{'; '.join(failures) or 'no direct address'}")
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                stream = await self._host.new_stream(relay_id, [TProtocol(HOP)])
                try:
                    await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                    reply = await read_delimited_msg(stream, HopMessage)
                finally:
                    await _close_quietly(stream)
        except Exception as exc:
            raise ConnectError(f"relay {self._label(relay)} did not answer the reservation: {_reason(exc)}") from exc
        if reply.status != StatusCode.OK:
            raise refusal(reply.status, f"relay {self._label(relay)} refused the reservation")
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

    def _note_observed(self, relay: str, reply: HopMessage) -> None:
        """Keep the address `relay` says it sees us at (a psymesh relay puts it in the `peer`
        field of its OK to RESERVE and CONNECT; other relays leave it out)."""
        if not reply.HasField("peer") or bytes(reply.peer.id) != self._host.get_id().to_bytes():
            return
        addrs = [a for a in map(_bytes_to_addr, reply.peer.addrs[:1]) if a is not None and _tcp_endpoint(a)]
        if addrs:
            self._observed[relay] = addrs[0]

    def _circuit_limit(self) -> Limit:
        assert self._book is not None
        return Limit(duration=self._book.settings.circuit_duration_s, data=self._book.settings.circuit_bytes)

    async def _serve_hop(self, stream: INetStream) -> None:
        """One HOP request (RESERVE or CONNECT), answered with the spec's STATUS as the relay's
        machine (protocol/circuit.py `Hop`) decides. The peer is the one Noise proved (the
        message's own `peer` field is not asked who it is: 21)."""
        peer = str(stream.muxed_conn.peer_id)
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                request = await read_delimited_msg(stream, HopMessage)
        except Exception as exc:
            log.debug("a HOP request from %s failed: %s", peer, _reason(exc))
            await _reset_quietly(stream)
            return
        assert self._hop is not None
        target: ID | None = None
        if request.type == HopMessage.CONNECT:
            try:
                target = ID(request.peer.id)
                destination: str | None = target.to_base58()
            except Exception:
                destination = None
        else:
            destination = None
        try:
            action = self._hop.receive(peer, request.type, destination, relayed=_is_relayed(stream.muxed_conn),
                                       now=time.time())
            if isinstance(action, Answer):
                if action.reason is not None:
                    log.info("%s", action.reason)
                await _hop_status(stream, StatusCode(int(action.status)))
            elif isinstance(action, Reserved):
                own = [a for a in self.addrs() if not _is_circuit(a)][:MAX_RELAY_ADDRS]
                reservation = CircuitReservation(expire=int(action.expires),
                                                 addrs=[multiaddr.Multiaddr(a).to_bytes() for a in own])
                await _hop_status(stream, StatusCode.OK, reservation=reservation, limit=self._circuit_limit(),
                                  peer=_observation(stream, peer))
            else:
                assert target is not None
                try:
                    await self._open_circuit(stream, action.source, target)
                finally:
                    self._hop.closed(action.source, action.destination)
        finally:
            await _close_quietly(stream)

    async def _open_circuit(self, stream: INetStream, source: str, target: ID) -> None:
        far: INetStream | None = None
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                far = await self._host.new_stream(target, [TProtocol(STOP)])
                await write_delimited_msg(far, StopMessage(type=StopMessage.CONNECT, limit=self._circuit_limit(),
                                                           peer=CircuitPeer(id=_parse_peer_id(source).to_bytes())))
                answer = await read_delimited_msg(far, StopMessage)
            if answer.status != StatusCode.OK:
                raise ConnectError(f"it answered {status_name(answer.status)}")
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
        if not self._admission.take_circuit(relay, self.reservation(relay) is not None):  # audited by the door
            log.info("refused a circuit from relay %s: we hold no reservation there", self._label(relay))
            await _reset_quietly(stream)
            return
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                request = await read_delimited_msg(stream, StopMessage)
                source = ID(request.peer.id)
                if stop_answer(request.type) is not Status.OK:
                    raise ValueError("not a CONNECT")
                await write_delimited_msg(stream, StopMessage(type=StopMessage.STATUS, status=StatusCode.OK))
        except Exception as exc:
            log.debug("a circuit from relay %s failed: %s", relay, _reason(exc))
            await _reset_quietly(stream)
            return
        circuit = multiaddr.Multiaddr(f"/p2p/{relay}/p2p-circuit/p2p/{source}")
        ip = _remote_ip(stream.muxed_conn)
        if (why := self._admission.start_handshake(ip)) is not None:
            log.info("refused a circuit from relay %s: %s", self._label(relay), why)
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
            raise ConnectError(f"relay {self._label(relay)} does not relay for us: {_reason(exc)}") from exc
        try:
            with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT,
                                                             peer=CircuitPeer(id=target.to_bytes())))
                reply = await read_delimited_msg(stream, HopMessage)
            if reply.status != StatusCode.OK:
                raise ConnectError(f"relay {self._label(relay)} refused the circuit to {self._label(str(target))}: "
                                   f"{status_name(reply.status)}")
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
