"""Pairing on the node: invites held by the daemon, `/psymesh/pair/1.0.0` served to anyone
(the only protocol an unpaired peer may use), and the joiner's side driven from the
control API. The cryptography and state machines are in `psymesh.protocol.pairing`.

Open invites live in the daemon's memory: a restart cancels them all, which is the
safe failure (the owner makes a new code). An invite that ended (expired, used, cancelled,
out of attempts) is kept `ENDED_INVITE_KEPT_S` past its expiry, so that a joiner who has its
code is told why it cannot pair instead of `bad_code` (protocol.md §4). A waiting `pair
invite` whose control connection closes (Ctrl-C) cancels its invite.

A run from a stranger is admitted by `PairingGuard` (runs at once, hellos per IP,
node-wide and per peer id), reads frames of at most `PAIR_MAX_FRAME` bytes (the daemon
serves the protocol with that limit), and must send each message within
`PAIR_STEP_TIMEOUT_S` and finish within `PAIR_RUN_TIMEOUT_S`: a stranger cannot hold a
run, or the memory of one, for long.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from ..core.commands import Commands
from ..net.framed import FramedStream
from ..core.home import Identity, NodeConfig
from ..core.logs import fields
from ..net.p2p import P2PNode
from .trust import TrustStore
from ...protocol import control as c
from ...protocol import ids
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.manifest import Manifest, preset
from ...protocol.pairing import (
    PAIR_MAX_FRAME,
    PAIR_RUN_TIMEOUT_S,
    PAIR_STEP_TIMEOUT_S,
    INVITE_PREFIX,
    Invite,
    InviteState,
    InviteTicket,
    PairingInviter,
    PairingCode,
    PairingJoiner,
    PairState,
    PeerInfo,
    encode_invite,
    new_invite,
    parse_code,
    parse_invite,
)
from ...protocol.strangers import PairingGuard

log = logging.getLogger("psymesh.pair")

ENDED_INVITE_KEPT_S = 3600.0  # an ended invite still answers a joiner with its code this long after expiry

PushManifest = Callable[[str, Manifest], Awaitable[None]]
Welcome = Callable[[str], Awaitable[object]]  # a peer just paired (either side): hand it what it needs from us
Nearby = Callable[[], list[c.SeenNode]]       # the nodes discovery lists now, most recently seen first


class PairingService:
    def __init__(self, identity: Identity, config: NodeConfig, p2p: P2PNode, trust: TrustStore,
                 push_manifest: PushManifest, welcome: Welcome | None = None,
                 clock: Callable[[], float] = time.time, nearby: Nearby | None = None,
                 commands: Commands | None = None) -> None:
        self.identity = identity
        self.commands = commands or Commands()  # how its refusals spell the command to run next
        self.nearby: Nearby = nearby or (lambda: [])  # unpaired nodes discovered on the LAN (the daemon sets it)
        self.clock = clock  # wall time: when invites expire and grants are issued (a test moves it)
        self.config = config
        self.p2p = p2p
        self.trust = trust
        self.push_manifest = push_manifest
        self.welcome = welcome
        self._invites: dict[int, Invite] = {}
        self.guard = PairingGuard(config.strangers)
        self._changed: dict[str, anyio.Event] = {}          # invite id -> set after each pairing run
        self._paired: dict[str, c.PairedReply] = {}         # invite id -> outcome, for the waiting CLI

    def _info(self) -> PeerInfo:
        return PeerInfo(name=self.config.name, role=self.config.profile, addrs=tuple(self.p2p.addrs()))

    def _known_invite(self, nameplate: int) -> Invite | None:
        """The invite with this number, open or ended not long ago, or None (the inviter then
        runs a decoy)."""
        return self._invites.get(nameplate) if nameplate in self._kept_nameplates(self.clock()) else None

    def _kept_nameplates(self, now: float) -> set[int]:
        for n in [n for n, inv in self._invites.items() if now >= inv.expires_at + ENDED_INVITE_KEPT_S]:
            del self._invites[n]  # long ended: gone for good (a hello for it gets a decoy)
        return set(self._invites)

    def cancel(self, invite: Invite) -> None:
        """End `invite` now: a joiner with its code is told it was cancelled."""
        if invite.state(self.clock()) is InviteState.OPEN:
            invite.canceled = True
            log.info("invite %s cancelled", invite.nameplate)
            self._notify(invite)

    # -- inviter ------------------------------------------------------------------
    async def create_invite(self, req: c.PairInviteRequest, framed: FramedStream) -> c.PairInviteReply:
        now = self.clock()
        invite = new_invite(now, ttl=req.ttl_s, grant=req.grant, name=req.name,
                            grant_ttl=int(req.grant_ttl_s) if req.grant_ttl_s else None,
                            taken=self._kept_nameplates(now))
        self._invites[invite.nameplate] = invite
        text = encode_invite(invite.ticket(self.identity.peer_id, self.p2p.addrs()))
        log.info("invite %s created (grant %s, expires in %.0f s)", invite.nameplate, invite.grant, req.ttl_s)
        reply = c.PairInviteReply(code=str(invite.code), invite=text, expires_at=invite.expires_at,
                                  grant=invite.grant)
        if not req.wait:
            return reply
        await framed.send(reply)
        if not isinstance(framed, FramedStream):  # answered in-process (the dashboard): no connection to watch
            return await self._outcome(invite)
        paired: list[c.PairedReply] = []
        failed: list[PsymeshError] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._cancel_when_gone, invite, framed)
            try:
                paired.append(await self._outcome(invite))
            except PsymeshError as exc:
                failed.append(exc)
            tg.cancel_scope.cancel()
        if failed:
            raise failed[0]
        return paired[0]

    async def _cancel_when_gone(self, invite: Invite, framed: FramedStream) -> None:
        """The waiting `pair invite` sends nothing more: its connection ending (Ctrl-C, a
        closed terminal) or anything it sends means it stopped waiting, and the invite dies
        with it, so that no device can join an invite nobody watches."""
        try:
            await framed.receive()
        except PsymeshError:
            pass
        self.cancel(invite)

    async def _outcome(self, invite: Invite) -> c.PairedReply:
        """Wait until the invite is used (-> the pairing) or dies (-> its error)."""
        while True:
            now = self.clock()
            state = invite.state(now)
            if state is InviteState.USED:
                return self._paired.pop(invite.id)
            if state is not InviteState.OPEN:
                invite.check_usable(now)  # raises the matching error (expired, exhausted)
            event = self._changed.setdefault(invite.id, anyio.Event())
            with anyio.move_on_after(max(0.0, invite.expires_at - now) + 0.01):
                await event.wait()
            self._changed.pop(invite.id, None)

    def _notify(self, invite: Invite | None) -> None:
        if invite is not None and (event := self._changed.get(invite.id)) is not None:
            event.set()

    async def serve(self, framed: FramedStream, remote_peer_id: str) -> None:
        """Inbound pairing run. Any PsymeshError is sent to the joiner by the caller."""
        ip = self.p2p.remote_ip(remote_peer_id) or "unknown"
        self.guard.start(remote_peer_id, ip, time.monotonic())
        try:
            await self._run_inviter(framed, remote_peer_id)
        finally:
            self.guard.finish(ip)

    async def _run_inviter(self, framed: FramedStream, remote_peer_id: str) -> None:
        machine = PairingInviter(local_peer_id=self.identity.peer_id, remote_peer_id=remote_peer_id,
                                 info=self._info(), signing_key=self.identity.private_key,
                                 find_invite=self._known_invite, name_for=self.trust.unique_name)
        try:
            with anyio.fail_after(PAIR_RUN_TIMEOUT_S):
                while machine.state is not PairState.DONE:
                    with anyio.fail_after(PAIR_STEP_TIMEOUT_S):
                        message = await framed.receive_required()
                    for out in machine.receive(message, self.clock()):
                        await framed.send(out)
        except TimeoutError:
            self._notify(machine.invite)
            raise PsymeshError("pairing took too long; start again", code=ErrorCode.TIMEOUT) from None
        except PsymeshError as exc:
            log.info("pairing with %s failed: %s", remote_peer_id, exc.message, extra=fields(code=exc.code.value))
            self._notify(machine.invite)  # a waiting `pair invite` re-checks attempts left
            raise
        result, invite = machine.result, machine.invite
        assert result is not None and invite is not None
        peer = self.trust.add(result.peer_id, name=result.known_as or result.name, role=result.role,
                              addrs=list(result.addrs), granted=result.manifest, received=None)
        self._paired[invite.id] = c.PairedReply(peer_id=peer.peer_id, name=peer.name, role=peer.role,
                                                verification=result.verification, granted=result.manifest.grants(),
                                                asked_name=result.name if peer.name != result.name else None)
        self._notify(invite)
        log.info("paired with %s (%s); verification: %s", result.name, result.peer_id, result.verification)
        if self.welcome is not None:
            await self.welcome(result.peer_id)

    # -- joiner --------------------------------------------------------------------
    async def join(self, req: c.PairJoinRequest, _: FramedStream) -> c.PairedReply:
        if req.address is None and not req.invite.strip().lower().startswith(INVITE_PREFIX):
            return await self._join_nearby(parse_code(req.invite), req)
        ticket = parse_invite(req.invite, req.address)
        if ticket.peer_id is None or not ticket.addrs:
            raise PsymeshError("need the inviter's address ending in /p2p/<peer id> (the invite string has it)",
                               code=ErrorCode.BAD_REQUEST)
        if ticket.peer_id == self.identity.peer_id:
            raise PsymeshError("that invite is from this node itself", code=ErrorCode.BAD_REQUEST)
        return await self._join_at(ticket, req)

    async def _join_nearby(self, code: PairingCode, req: c.PairJoinRequest) -> c.PairedReply:
        """A bare code: the inviter is one of the unpaired nodes discovered on the LAN. Each
        is tried in turn, most recently seen first, with the code. A node without an open
        invite of that number answers with a decoy (it fails like a wrong code and charges no
        invite), so only the real inviter counts the run as one of its invite's attempts,
        exactly as a join with its address would (protocol.md §4)."""
        candidates = [n for n in self.nearby() if not n.paired and n.addrs and n.peer_id != self.identity.peer_id]
        if not candidates:
            raise PsymeshError("a bare pairing code needs the inviter's address too (--address), or both nodes "
                               "on one LAN with mdns = true in config.toml, so that the inviter is found: no "
                               f"unpaired node is discovered here (see: {self.commands('discover')})",
                               code=ErrorCode.BAD_REQUEST)
        failures: list[str] = []
        for node in candidates:
            ticket = InviteTicket(code=code, peer_id=node.peer_id, addrs=tuple(node.addrs))
            try:
                return await self._join_at(ticket, req)
            except PsymeshError as exc:  # not this one (or unreachable): the next
                log.info("pairing code tried at %s: %s", node.peer_id, exc.message)
                failures.append(f"{node.peer_id[-8:]}: {exc.message}")
        raise PsymeshError(f"none of the {len(candidates)} unpaired node(s) discovered here took the code "
                           f"({'; '.join(failures)}); check it, or give the inviter's invite string",
                           code=ErrorCode.FORBIDDEN)

    async def _join_at(self, ticket: InviteTicket, req: c.PairJoinRequest) -> c.PairedReply:
        assert ticket.peer_id is not None
        stream = await self.p2p.open_stream_any(ticket.peer_id, ticket.addrs, ids.PAIR, who="the inviter")
        framed = FramedStream(stream, PAIR_MAX_FRAME)
        try:
            joiner = PairingJoiner(ticket.code, local_peer_id=self.identity.peer_id,
                                   remote_peer_id=stream.remote_peer_id, info=self._info())
            with anyio.fail_after(PAIR_RUN_TIMEOUT_S):
                await framed.send(joiner.start())
                while joiner.state is not PairState.DONE:
                    for out in joiner.receive(await framed.receive_required()):
                        await framed.send(out)
        except TimeoutError:
            raise PsymeshError("the inviter did not answer in time", code=ErrorCode.TIMEOUT) from None
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        result = joiner.result
        assert result is not None
        granted_back = None
        if req.grant:
            granted_back = preset(req.grant, self.identity.peer_id, result.peer_id, self.clock()).sign(
                self.identity.private_key)
        peer = self.trust.add(result.peer_id, name=result.name, role=result.role, addrs=list(result.addrs),
                              granted=granted_back, received=result.manifest)
        if granted_back is not None:
            await self.push_manifest(result.peer_id, granted_back)
        if self.welcome is not None:
            await self.welcome(result.peer_id)
        log.info("paired with %s (%s); verification: %s", result.name, result.peer_id, result.verification)
        return c.PairedReply(peer_id=peer.peer_id, name=peer.name, role=peer.role, verification=result.verification,
                             granted=granted_back.grants() if granted_back else [], received=result.manifest.grants(),
                             asked_name=result.name if peer.name != result.name else None,
                             known_as=result.known_as)
