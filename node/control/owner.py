"""What the node's owner asks over the control socket: one handler per control request.

The daemon (node/daemon.py) wires the services and the p2p door; this module is the
owner's side of it. Handlers reach the services through `OwnerNode` (the members of the daemon they use,
written out below, so this module imports nothing above control/), and
each returns one reply (or sends several itself and returns None, see ControlServer).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import aclosing
from typing import TYPE_CHECKING, Literal, Protocol

import anyio
from pydantic import ValidationError

import psymesh
from .server import ControlServer, Handler
from ..core.commands import Commands
from ..messaging.answering import ask_body, wait_answer
from .doctor import DoctorParts, diagnose
from ..net.framed import FramedStream
from ..messaging.store import OutState, Received, Sent
from ..net.ping import measure_ping
from ...protocol import control as c
from ...protocol.errors import ErrorCode, NetworkTimeout, PsymeshError
from ...protocol.identity import is_peer_id
from ...protocol.limits import Limits
from ...protocol.manifest import PRESETS, Operation, check, edit_capabilities, limits_for, new_manifest
from ...protocol.messages import Message, first_error
from ...protocol.messaging import Letter, LetterKind
from ...protocol.tasks import TaskCapsReply, TaskEvent, TaskSpec
from ...protocol.web import WebResults

if TYPE_CHECKING:
    from ...discovery.service import Discovery
    from ...protocol.manifest import Manifest
    from ..bridges.mcp import McpTools
    from ..core.bridgeconfig import A2AServe, OpenAIServe
    from ..core.db import WalSync
    from ..core.home import Identity, NodeConfig
    from ..door.audit import AuditLog
    from ..door.pairing import PairingService
    from ..door.trust import TrustStore
    from ..messaging.groups import Groups
    from ..messaging.service import Messaging
    from ..models import ModelPool
    from ..compute.worker import WorkerService
    from ..net.p2p import P2PNode
    from ..net.session import SessionPool
    from ..reach.dialback import Reach
    from ..tasks.executor import TaskExecutor
    from ..tasks.submitter import TaskSubmitter
    from ..web.router import WebRouter
    from .dashboard import Dashboard

log = logging.getLogger("psymesh.node")

PING_TIMEOUT_S = 30.0  # all of `psymesh ping`'s round trips
# Durable answers whose handler syncs what it promises itself, and no more: `task_submitted`
# (TaskSubmitter.submit returns once the outbox row is on disk, synced while the task is on its
# way; a sync here would wait again for the rows the answer does not promise: event 1, ...).
SYNCS_ITSELF: frozenset[type[Message]] = frozenset({c.TaskSubmitRequest})
# Requests that write what their durable answer promises (a letter a courier then sends): once a
# WAL fsync failed, refused before they write, since no answer could promise it (the submitter
# checks the same for a task, WalSync.refuse_if_failed, just before its row is written).
WRITES_DURABLY: frozenset[type[Message]] = frozenset({c.MsgSendRequest, c.GroupSendRequest})



def _lifetime(req: c.GrantRequest, current: Manifest | None, now: float) -> float | None:
    """How long a new grant lasts: `expires_s` if given; no end with `until_revoked`; else as long
    as the grant it replaces (an edit such as `grant phone +CAP` must not turn a 30-day grant into
    one for good), or no end if that one had none or has ended."""
    if req.expires_s is not None:
        return req.expires_s
    if req.until_revoked or current is None or current.expires is None or current.expires <= now:
        return None
    return current.expires - now

class OwnerNode(Protocol):
    commands: Commands
    """What the owner's handlers use of the daemon (node/daemon.py's Node is one)."""

    config: NodeConfig
    identity: Identity
    started_at: float
    trust: TrustStore
    audit: AuditLog
    wal: WalSync
    p2p: P2PNode
    sessions: SessionPool
    reach: Reach
    pairing: PairingService
    discovery: Discovery
    models: ModelPool
    worker: WorkerService
    executor: TaskExecutor
    submitter: TaskSubmitter
    messaging: Messaging
    groups: Groups
    web_router: WebRouter
    mcp: McpTools

    async def offers(self, peer_id: str) -> TaskCapsReply: ...
    async def push_manifest(self, peer_id: str, manifest: Manifest) -> bool: ...
    async def tell_revoked(self, peer_id: str) -> None: ...
    async def serve_endpoint(self, section: Literal["openai", "a2a"],
                             settings: OpenAIServe | A2AServe) -> tuple[str, bool]: ...
    async def start_ui(self, *, required: bool = True, port: int | None = None) -> Dashboard: ...
    def stop(self) -> None: ...


class Owner:
    """The control API's handlers for one node."""

    def __init__(self, node: OwnerNode) -> None:
        self.node = node

    def serve_on(self, control: ControlServer) -> None:
        routes: dict[type[Message], Handler] = {
            c.StatusRequest: self._status,
            c.DoctorRequest: self._doctor,
            c.PingRequest: self._ping,
            c.ShutdownRequest: self._shutdown,
            c.PairInviteRequest: self.node.pairing.create_invite,
            c.PairJoinRequest: self.node.pairing.join,
            c.PeersRequest: self._peers,
            c.GrantRequest: self._grant,
            c.RevokeRequest: self._revoke,
            c.AuditRequest: self._audit,
            c.TaskSubmitRequest: self._task_submit,
            c.TaskInputRequest: self._task_input,
            c.OffersRequest: self._offers,
            c.TaskWatchRequest: self._task_watch,
            c.TaskWaitRequest: self._task_wait,
            c.TaskCancelRequest: self._task_cancel,
            c.TaskListRequest: self._task_list,
            c.DiscoverRequest: self._discover,
            c.MsgSendRequest: self._msg_send,
            c.MsgStatusRequest: self._msg_status,
            c.MsgInboxRequest: self._msg_inbox,
            c.MsgAskRequest: self._msg_ask,
            c.GroupCreateRequest: self._group_create,
            c.GroupAddRequest: self._group_add,
            c.GroupRemoveRequest: self._group_remove,
            c.GroupListRequest: self._group_list,
            c.GroupSendRequest: self._group_send,
            c.WebQueryRequest: self._web,
            c.ServeRequest: self._serve,
            c.ModelsPsRequest: self._models_ps,
            c.WorkerRequest: self._worker,
            c.McpStatusRequest: self._mcp_status,
            c.UiRequest: self._ui,
        }
        for request_type, handler in routes.items():
            control.route(request_type, handler if request_type in SYNCS_ITSELF
                          else self._durable(handler, writes=request_type in WRITES_DURABLY))

    def _durable(self, handler: Handler, *, writes: bool = False) -> Handler:
        """An answer that promises durability (`Message.durable`: the letter written) leaves
        only once the WAL is synced. The routes in SYNCS_ITSELF keep that promise themselves.
        `writes` (WRITES_DURABLY): refused before the handler writes, once a WAL fsync failed."""
        async def answer(req: Message, framed: FramedStream) -> Message | None:
            if writes:
                self.node.wal.refuse_if_failed()  # a letter it could not promise must not be written
            reply = await handler(req, framed)
            if reply is not None and reply.durable:
                await self.node.wal.sync()
            return reply

        return answer

    async def _models_ps(self, req: c.ModelsPsRequest, _: FramedStream) -> c.ModelsPsReply:
        running = {s.name: s for s in self.node.models.ps()}
        models = []
        for name in self.node.models.registry.names():
            s = running.get(name)
            family = self.node.models.registry.get(name).get("tool_family")  # as `model add` read it
            try:
                split = [self.node.trust.name_of(p) for p in self.node.models.split_of(name)[0]]
            except PsymeshError as exc:  # config.toml names a peer that is not paired
                split = [exc.message]
            if s is None:
                settings = self.node.models.settings(name)  # what it will load with: its keep-alive too
                models.append(c.LoadedModel(name=name, path=str(settings.path), loaded=False, n_ctx=settings.n_ctx,
                                            keep_alive_s=settings.keep_alive_s, tool_family=family, split=split))
            else:
                models.append(c.LoadedModel(**{**dataclasses.asdict(s), "tool_family": s.tool_family or family,
                                               "split": split}))
        return c.ModelsPsReply(models=models)

    async def _worker(self, req: c.WorkerRequest, _: FramedStream) -> c.WorkerReply:
        """`psymesh worker start|stop|status`: this node's compute lent to split models."""
        if req.action == "start":
            await self.node.worker.start()
        elif req.action == "stop":
            await self.node.worker.stop()
        now = time.time()
        granted = [p.name for p in self.node.trust.list(include_revoked=False) if p.granted is not None
                   and check(p.granted, Operation(name="compute.rpc"), local_peer_id=self.node.identity.peer_id,
                             remote_peer_id=p.peer_id, now=now).allowed]
        return c.WorkerReply(**dataclasses.asdict(self.node.worker.view()), granted=granted)

    async def _mcp_status(self, req: c.McpStatusRequest, _: FramedStream) -> c.McpStatusReply:
        return c.McpStatusReply(servers=[c.McpServerState(**dataclasses.asdict(s)) for s in self.node.mcp.status()])

    async def _ui(self, req: c.UiRequest, _: FramedStream) -> c.UiReply:
        ui = await self.node.start_ui(port=req.port)
        assert ui.url is not None
        return c.UiReply(url=ui.url, login_url=ui.mint_login(), token_source=ui.key.source)

    async def _status(self, req: c.StatusRequest, _: FramedStream) -> c.StatusReply:
        names = self.node.trust.names()
        return c.StatusReply(
            peer_id=self.node.identity.peer_id,
            fingerprint=self.node.identity.fingerprint,
            name=self.node.config.name,
            profile=self.node.config.profile,
            version=psymesh.__version__,
            addrs=self.node.p2p.addrs(),
            uptime_s=round(time.monotonic() - self.node.started_at, 3),
            connected_peers=[c.ConnectedPeer(peer_id=p["peer_id"], addrs=p.get("addrs", []),
                                             name=names.get(p["peer_id"]))
                             for p in self.node.p2p.connected_peers()],
            listen=list(self.node.config.listen),
            reachability=self.node.reach.view(),
            device_tools=[c.DeviceTool(tool=t.name, backend=t.backend) for t in self.node.tools if t.backend],
        )

    async def _doctor(self, req: c.DoctorRequest, _: FramedStream) -> c.DoctorReply:
        n = self.node
        return await diagnose(DoctorParts(trust=n.trust, listen=n.config.listen, p2p=n.p2p, sessions=n.sessions,
                                          reach=n.reach), req)

    async def _ping(self, req: c.PingRequest, _: FramedStream) -> c.PingReply:
        """Round trips on the session to the peer (the first one opens it: `connect_ms`)."""
        if req.peer.startswith("/"):
            peer_id = await self.node.p2p.connect(req.peer)
        else:
            peer_id = self.node.trust.resolve(req.peer).peer_id
        start = time.perf_counter()
        session = await self.node.sessions.session(peer_id)
        connect_ms = (time.perf_counter() - start) * 1000
        try:
            with anyio.fail_after(PING_TIMEOUT_S):
                return await measure_ping(session, peer_id, req.count, req.payload_size, connect_ms)
        except TimeoutError:
            raise NetworkTimeout(f"{req.peer} did not answer {req.count} ping(s) within {PING_TIMEOUT_S:g} s") from None

    async def _shutdown(self, req: c.ShutdownRequest, framed: FramedStream) -> None:
        log.info("shutdown requested over the control socket")
        await framed.send(c.Ok())  # answer first: cancelling the root scope ends this connection too
        self.node.stop()

    def _connected(self) -> set[str]:
        return {p["peer_id"] for p in self.node.p2p.connected_peers()}

    async def _serve(self, req: c.ServeRequest, _: FramedStream) -> c.ServeReply:
        settings = getattr(self.node.config.serve, req.section)
        given = {"host": req.host, "port": req.port, "api_key_file": req.api_key_file}
        settings = settings.model_copy(update={"enabled": True, **{k: v for k, v in given.items() if v is not None}})
        url, already = await self.node.serve_endpoint(req.section, settings)
        return c.ServeReply(url=url, already=already)

    async def _peers(self, req: c.PeersRequest, _: FramedStream) -> c.PeersReply:
        connected = self._connected()
        return c.PeersReply(peers=[p.view(connected=p.peer_id in connected, away=self.node.sessions.away(p.peer_id))
                                   for p in self.node.trust.list(include_revoked=req.include_revoked)])

    async def _grant(self, req: c.GrantRequest, _: FramedStream) -> c.PeerReply:
        """A new signed grant replaces the old one, and the peer is handed it (best effort)."""
        peer = self.node.trust.resolve(req.peer)
        if peer.revoked:
            raise PsymeshError(f"{peer.name} was revoked; pair again first", code=ErrorCode.UNKNOWN_PEER)
        for name in (req.preset_limits, req.preset):
            if name is not None and name not in PRESETS:
                raise PsymeshError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})",
                                   code=ErrorCode.BAD_REQUEST)
        if req.capabilities:
            start = req.capabilities
        elif req.preset:
            start = list(PRESETS[req.preset][0])
        else:
            start = peer.granted.grants() if peer.granted else []
        capabilities = edit_capabilities(start, add=req.add, remove=req.remove)
        if not capabilities:
            raise PsymeshError(f"that would leave {peer.name} no capability; to cut it off: "
                               f"{self.node.commands('revoke', peer.name)}",
                               code=ErrorCode.BAD_REQUEST)
        if req.limits is not None:
            base = req.limits
        elif req.preset_limits or req.preset:
            base = PRESETS[req.preset_limits or req.preset][1]  # type: ignore[index]
        elif peer.granted:
            base = peer.granted.limits
        else:  # a first grant starts from its preset's limits, never from none
            base = limits_for(capabilities)
        limits = req.limits_over(base)
        now = time.time()
        manifest = new_manifest(self.node.identity.peer_id, peer.peer_id, capabilities, now=now,
                                ttl=_lifetime(req, peer.granted, now), limits=limits).sign(self.node.identity.private_key)
        self.node.trust.set_granted(peer.peer_id, manifest)
        log.info("grant to %s is now: %s", peer.name, ", ".join(manifest.grants()))
        delivered = await self.node.push_manifest(peer.peer_id, manifest)
        updated = self.node.trust.get(peer.peer_id)
        assert updated is not None
        return c.PeerReply(peer=updated.view(connected=updated.peer_id in self._connected()), delivered=delivered)

    async def _revoke(self, req: c.RevokeRequest, _: FramedStream) -> c.PeerReply:
        """Takes effect at once: the trust store says no to the next request, the peer is told
        (a signed notice, so it stops following its tasks here and submitting new ones; at most
        2 s, and a peer that misses it is told when it next calls, and meanwhile learns from the
        refusal of its requests), and open connections (with their streams) are closed now.
        Once it took the notice, it is refused already at the connection."""
        peer = self.node.trust.resolve(req.peer)
        self.node.trust.revoke(peer.peer_id)
        self.node.audit.record(peer.peer_id, "control", "revoke", True, reason="revoked by the owner")
        await self.node.tell_revoked(peer.peer_id)
        await self.node.p2p.disconnect(peer.peer_id)
        canceled = self.node.executor.cancel_for(peer.peer_id, "the submitter was revoked")
        dropped = self.node.messaging.store.forget(peer.peer_id)  # letters it left behind a gap, thread rows
        if dropped:
            log.info("revoked %s: %d letter(s) it had held behind a gap removed", peer.name, dropped)
        log.info("revoked %s (%s): %d queued or running task(s) canceled", peer.name, peer.peer_id, canceled)
        updated = self.node.trust.get(peer.peer_id)
        assert updated is not None
        return c.PeerReply(peer=updated.view(connected=updated.peer_id in self._connected()), delivered=updated.revocation_told_at is not None)

    async def _audit(self, req: c.AuditRequest, _: FramedStream) -> c.AuditReply:
        peer_id = req.peer if req.peer is None or is_peer_id(req.peer) else self.node.trust.resolve(req.peer).peer_id
        rows = self.node.audit.query(peer_id=peer_id, limit=req.limit, denied_only=req.denied_only)
        names = self.node.trust.names()
        return c.AuditReply(rows=[c.AuditRow.model_validate({**r, "peer_name": names.get(r["peer_id"])}) for r in rows])

    async def _task_submit(self, req: c.TaskSubmitRequest, _: FramedStream) -> c.TaskSubmitted:
        try:
            spec = TaskSpec.model_validate(req.spec)
        except ValidationError as exc:  # (a client other than the SDK, which checks it first)
            where, what = first_error(exc)
            raise PsymeshError(f"invalid task: {where + ': ' if where else ''}{what}",
                               code=ErrorCode.BAD_REQUEST) from None
        target, accepted, final = await self.node.submitter.submit(spec, req.to, self.node.offers)
        peer = self.node.trust.get(target)
        # a short task's events come with its acceptance (`final`): result() then asks nothing more
        return c.TaskSubmitted(task_id=spec.id, target=target, target_name=peer.name if peer else target,
                               accepted=accepted, away=None if accepted else self.node.sessions.away(target),
                               final=final)

    async def _task_input(self, req: c.TaskInputRequest, _: FramedStream) -> c.Ok:
        await self.node.submitter.respond(req.task_id, req.data)
        return c.Ok()

    async def _offers(self, req: c.OffersRequest, _: FramedStream) -> c.OffersReply:
        """Paired peers whose grant to us covers `operation` and that answer now."""
        try:
            op = Operation(name=req.operation)
        except ValueError as exc:
            raise PsymeshError(f"unknown operation {req.operation!r}: {exc}", code=ErrorCode.BAD_REQUEST) from None
        found: list[c.Offer] = []
        for peer in self.node.trust.list(include_revoked=False):
            grant = peer.received
            if grant is None or not check(grant, op, local_peer_id=peer.peer_id, remote_peer_id=self.node.identity.peer_id,
                                          now=time.time()).allowed:
                continue
            with anyio.move_on_after(5):
                try:
                    caps = await self.node.offers(peer.peer_id)
                except PsymeshError:
                    continue
                found.append(c.Offer(peer_id=peer.peer_id, name=peer.name, models=caps.models, tools=caps.tools,
                                     queue_depth=caps.queue_depth))
        return c.OffersReply(offers=found)

    async def _task_watch(self, req: c.TaskWatchRequest, framed: FramedStream) -> c.Ok:
        outbox, sent = self.node.submitter.outbox, req.after_seq
        while True:
            events, ended = outbox.news(req.task_id, sent)  # NOT_FOUND for a task this node never delegated
            for ev in events:
                await framed.send(ev)
                sent = ev.seq
            if ended or (events and events[-1].state.terminal):  # nothing follows a final event
                return c.Ok()
            if events:
                continue  # more may have come while we were sending
            await self.node.submitter.changed.wait(req.task_id)  # no await since the reads: nothing is missed

    async def _task_wait(self, req: c.TaskWaitRequest, _: FramedStream) -> TaskEvent:
        """The final event alone: what `result()` needs, in one reply (a watch sends every event)."""
        submitter = self.node.submitter
        while (final := submitter.outbox.final(req.task_id)) is None:  # NOT_FOUND for a task never delegated
            await submitter.changed.wait(req.task_id)  # no await since the read: nothing is missed
        return final

    async def _task_cancel(self, req: c.TaskCancelRequest, _: FramedStream) -> c.Ok:
        await self.node.submitter.cancel(req.task_id)
        return c.Ok()

    async def _task_list(self, req: c.TaskListRequest, _: FramedStream) -> c.TaskListReply:
        names = self.node.trust.names()
        outbox = self.node.submitter.outbox

        def error(task_id: str) -> str | None:
            outcome = outbox.result(task_id)
            return None if outcome is None or outcome.ok else f"{outcome.code}: {outcome.message}"

        submitted = [c.SubmittedTaskView(task_id=t.id, kind=t.spec.kind, target=names.get(t.target, t.target),
                                         state=t.state, accepted=t.accepted, events=t.last_seq,
                                         created_at=t.created_at, updated_at=t.updated_at,
                                         away=None if t.terminal else self.node.sessions.away(t.target),
                                         what=c.task_summary(t.spec), error=error(t.id) if t.terminal else None)
                     for t in outbox.list()[-req.limit:]]
        executing = [c.ExecutingTaskView(**r.status().model_dump(), submitter=names.get(r.submitter, r.submitter),
                                         what=c.task_summary(r.spec))
                     for r in self.node.executor.store.list(limit=req.limit)]
        return c.TaskListReply(submitted=submitted, executing=executing)

    async def _discover(self, req: c.DiscoverRequest, _: FramedStream) -> c.DiscoverReply:
        return await self.node.discovery.discovered(req.wait_s)

    # -- messages between agents -------------------------------------------------------
    def _name(self, peer_id: str) -> str:
        peer = self.node.trust.get(peer_id)
        return peer.name if peer else peer_id

    def _sent(self, sent: Sent) -> c.SentLetter:
        letter = sent.letter
        return c.SentLetter(id=letter.id, recipient=letter.recipient, recipient_name=self._name(letter.recipient),
                            thread=letter.thread, tseq=letter.tseq, kind=letter.kind, group=letter.group,
                            state=sent.state.value, code=sent.code, reason=sent.reason,
                            away=self.node.sessions.away(letter.recipient) if sent.state is OutState.PENDING else None)

    def _written(self, letter: Letter) -> c.SentLetter:
        sent = self.node.messaging.store.sent(letter.id)
        assert sent is not None  # just written (or written before, with the same id)
        return self._sent(sent)

    def _inbox_letter(self, received: Received) -> c.InboxLetter:
        letter = received.letter
        assert received.release_seq is not None
        return c.InboxLetter(seq=received.release_seq, id=letter.id, sender=letter.sender,
                             sender_name=self._name(letter.sender), thread=letter.thread, tseq=letter.tseq,
                             kind=letter.kind, text=letter.text, body=letter.body, at=letter.at / 1000,
                             received_at=received.received_at, reply_to=letter.reply_to, group=letter.group,
                             skipped=received.skipped)

    async def _msg_send(self, req: c.MsgSendRequest, _: FramedStream) -> c.MsgSentReply:
        letter = self.node.messaging.send(req.to, req.text, body=req.body, thread=req.thread,
                                          letter_id=req.letter_id)
        if req.letter_id is None:  # just written: pending (no second read of the row on a hot path)
            return c.MsgSentReply(letter=self._sent(Sent(letter, OutState.PENDING, None, "", False)))
        return c.MsgSentReply(letter=self._written(letter))

    async def _msg_status(self, req: c.MsgStatusRequest, _: FramedStream) -> c.MsgSentReply:
        messaging = self.node.messaging
        sent = await messaging.wait_sent(req.id, until_away=req.until_away) if req.wait else messaging.store.sent(req.id)
        if sent is None:
            raise PsymeshError(f"no letter {req.id!r} was sent from here", code=ErrorCode.NOT_FOUND)
        return c.MsgSentReply(letter=self._sent(sent))

    async def _msg_inbox(self, req: c.MsgInboxRequest, framed: FramedStream) -> c.Ok:
        count = 0
        async with aclosing(self.node.messaging.follow(req.after, live=req.follow)) as letters:
            async for received in letters:
                await framed.send(self._inbox_letter(received))
                count += 1
                if req.limit is not None and count >= req.limit:
                    break
        return c.Ok()

    async def _msg_ask(self, req: c.MsgAskRequest, _: FramedStream) -> c.MsgAnswerReply:
        """Send the ask, then wait for its answer letter; a refusal of the ask ends the wait
        at once (its code and reason), and so does `timeout_s` (the ask stays sent: a late
        answer lands in the inbox)."""
        messaging = self.node.messaging
        after = messaging.store.last_released()
        ask = messaging.send(req.to, req.text, body=ask_body(req.params), thread=req.thread, kind=LetterKind.ASK)
        answer: Received | None = None
        refused: Sent | None = None
        with anyio.move_on_after(req.timeout_s):
            async with anyio.create_task_group() as tg:
                async def answered() -> None:
                    nonlocal answer
                    answer = await wait_answer(messaging, ask, after)
                    tg.cancel_scope.cancel()

                async def delivered() -> None:
                    nonlocal refused
                    sent = await messaging.wait_sent(ask.id)
                    if sent.state is OutState.REFUSED:
                        refused = sent
                        tg.cancel_scope.cancel()

                tg.start_soon(answered)
                tg.start_soon(delivered)
        if refused is not None:
            raise PsymeshError(f"{self._name(ask.recipient)} refused the ask: {refused.reason}",
                               code=ErrorCode(refused.code) if refused.code else ErrorCode.FORBIDDEN)
        if answer is None:
            state = self._written(ask).state
            why = (f"no answer from {self._name(ask.recipient)} within {req.timeout_s:g} s (the ask is {state}; "
                   f"a late answer lands in the inbox, see: {self.node.commands('msg inbox')})")
            if state == OutState.PENDING:  # it never got there: the network, not the agent
                raise NetworkTimeout(why)
            raise PsymeshError(why, code=ErrorCode.TIMEOUT)
        return c.MsgAnswerReply(ask=self._written(ask), answer=self._inbox_letter(answer))

    async def _group_create(self, req: c.GroupCreateRequest, _: FramedStream) -> c.GroupReply:
        return c.GroupReply(group=self.node.groups.create(req.name, req.members))

    async def _group_add(self, req: c.GroupAddRequest, _: FramedStream) -> c.GroupReply:
        return c.GroupReply(group=self.node.groups.add(req.name, req.members))

    async def _group_remove(self, req: c.GroupRemoveRequest, _: FramedStream) -> c.GroupReply:
        return c.GroupReply(group=self.node.groups.remove(req.name, req.members))

    async def _group_list(self, req: c.GroupListRequest, _: FramedStream) -> c.GroupsReply:
        return c.GroupsReply(groups=self.node.groups.list())

    async def _group_send(self, req: c.GroupSendRequest, _: FramedStream) -> c.GroupSentReply:
        letters = self.node.groups.send(req.name, req.text, body=req.body)
        return c.GroupSentReply(group=req.name, letters=[self._written(letter) for letter in letters])

    async def _web(self, req: c.WebQueryRequest, _: FramedStream) -> c.WebQueryReply:
        request = req.search or req.fetch
        assert request is not None  # the request model holds exactly one
        router = self.node.web_router
        route = router.route(request, via=req.via, relay=req.relay, hops=req.hops)
        answer = await router.query(request, route)
        if isinstance(answer, WebResults):
            return c.WebQueryReply(results=answer, exit=route.exit, relay=route.relay)
        return c.WebQueryReply(page=answer, exit=route.exit, relay=route.relay)
