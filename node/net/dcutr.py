"""Hole punching (DCUtR, libp2p/specs relay/DCUtR.md), the IO: `hole_punch()` is the spec's `B`
(the side a peer reached through a relay), `_serve_dcutr()` its `A`, `_punch()` the
simultaneous dials from our listening port. libp2p's wire format (its `HolePunch` protobuf on
`/libp2p/dcutr`) and its swarm's source-bound dials, not its `DCUtRProtocol` service (net/patches.py
says why). The rounds (which message when, the RTT, when to dial, when to stop) are
protocol/dcutr.py's machines; this drives them. `HolePunching` is mixed into P2PNode (net/host.py)."""
from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Sequence

import anyio
import multiaddr
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.rcmgr import Direction
from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
from libp2p.relay.circuit_v2.utils import write_delimited_msg
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

from ...protocol import dcutr
from ...protocol.relay import DCUTR
from .addrs import _bytes_to_addr, _is_loopback, _parse_peer_id, _tcp_endpoint
from .circuit import RELAY_STEP_TIMEOUT_S
from .stream import _close_quietly, _reason, _reset_quietly

log = logging.getLogger(__name__)

# DCUtR (hole punching): the spec's message cap and attempts per exchange; how long one round's
# dials may take (a SYN the far NAT dropped is sent again after 1 s and 3 s); addresses sent
# and tried per round; and the whole exchange's bound.
MAX_DCUTR_MESSAGE = 4096
HOLE_PUNCH_ATTEMPTS = dcutr.ATTEMPTS
HOLE_PUNCH_DIAL_TIMEOUT_S = 5.0
MAX_PUNCH_ADDRS = 8
PUNCH_POLL_S = 0.02  # how often a round looks for a direct connection that came in by the listener
HOLE_PUNCH_TIMEOUT_S = HOLE_PUNCH_ATTEMPTS * (RELAY_STEP_TIMEOUT_S + HOLE_PUNCH_DIAL_TIMEOUT_S)


class HolePunching:
    """P2PNode's hole-punching part (mixed in: it uses the host's `_host`, `_swarm`,
    `_connections()`, `path()`, `addrs()`, `_dial()`, `_require_running()`, and the relay
    part's `_observed`). It also dials the relays, from our listening port when it is on.."""

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
                machine = dcutr.Initiator(attempts=HOLE_PUNCH_ATTEMPTS)
                action: dcutr.Send | dcutr.Finish = machine.start(time.monotonic())
                while isinstance(action, dcutr.Send):
                    await self._send_round(stream, action)
                    kind, theirs = await _read_punch(stream)
                    dial = await self._answer(stream, machine.receive(kind, theirs, time.monotonic()))
                    assert dial is not None  # B's machine dials after every CONNECT it is answered
                    await anyio.sleep(dial.after_s)
                    punched = await self._punch(peer, dial.addrs, responder=True)
                    if punched:
                        log.info("hole punched to %s (attempt %d, relayed RTT %.1f ms)", peer_id, dial.attempt,
                                 (dial.rtt_s or 0.0) * 1000)
                    else:
                        log.info("hole punch to %s: attempt %d found no way through (%s)", peer_id, dial.attempt,
                                 " ".join(dial.addrs) or "it sent no address")
                    action = machine.dialed(punched, time.monotonic())
                if action.punched:
                    return True
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
            machine = dcutr.Responder(attempts=HOLE_PUNCH_ATTEMPTS)
            while not machine.finished:
                with anyio.fail_after(RELAY_STEP_TIMEOUT_S):
                    dial = None
                    while dial is None:
                        kind, theirs = await _read_punch(stream)
                        dial = await self._answer(stream, machine.receive(kind, theirs, time.monotonic()))
                punched = await self._punch(peer, dial.addrs, responder=False)
                if punched:
                    log.info("hole punched to %s", peer)
                machine.dialed(punched, time.monotonic())
        except Exception as exc:  # the peer gave up (closed the stream), or broke the exchange
            log.debug("DCUtR with %s ended: %s", peer, _reason(exc))
        finally:
            await _close_quietly(stream)

    async def _send_round(self, stream: INetStream, send: dcutr.Send) -> None:
        """One message the machine asked for: a CONNECT carries our addresses as they are now."""
        await _send_punch(stream, int(send.kind), self._punch_addrs() if send.kind is dcutr.Kind.CONNECT else ())

    async def _answer(self, stream: INetStream, actions: list[dcutr.Action]) -> dcutr.Dial | None:
        """Do what the machine said after a message: send what it sends; the dial it asks for, if any."""
        dial = None
        for action in actions:
            if isinstance(action, dcutr.Send):
                await self._send_round(stream, action)
            elif isinstance(action, dcutr.Dial):
                dial = action
        return dial

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


async def _send_punch(stream: INetStream, kind: int, addrs: Sequence[str] = ()) -> None:
    await write_delimited_msg(stream, HolePunch(type=kind, ObsAddrs=[multiaddr.Multiaddr(a).to_bytes() for a in addrs]))


async def _read_punch(stream: INetStream) -> tuple[int, tuple[str, ...]]:
    """One DCUtR message (at most the spec's 4 KiB): its type and its plain TCP addresses."""
    message = HolePunch.FromString(await read_varint_prefixed_bytes_limited(stream, MAX_DCUTR_MESSAGE))
    addrs = [a for a in map(_bytes_to_addr, message.ObsAddrs[:MAX_PUNCH_ADDRS]) if a is not None]
    return message.type, tuple(a for a in addrs if _tcp_endpoint(a) is not None)
