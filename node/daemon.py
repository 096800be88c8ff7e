"""The node daemon: one root task group that owns every service.

    Node.run()
      ├── P2PNode.run          libp2p host (Noise + yamux over TCP), our protocol handlers
      ├── SessionPool.run      one outbound session per peer (+ a liveness watcher each)
      ├── TaskExecutor.run     recover unfinished tasks, N workers, expiry/purge housekeeping
      ├── TaskSubmitter.run    one driver per unfinished delegated task
      ├── ControlServer.serve  local Unix socket for the CLI and scripts
      └── signal watcher       SIGINT/SIGTERM -> cancel the root scope -> clean shutdown

Every request a peer sends arrives on a session (`/psymesh/session/1.0.0`) and passes
one door, `Node._door`: `Gate.admit()` decides and audits, then the service runs.

Every service starts with `await tg.start(...)`, so `run()` reports ready only when
the node really listens; nothing is spawned and forgotten.
"""
from __future__ import annotations

import logging
import signal
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

import psymesh
from psymesh.node.agents import AgentTaskRunner, node_tools
from psymesh.node.audit import AuditLog
from psymesh.node.control import ControlServer
from psymesh.node.db import open_db
from psymesh.node.executor import TaskExecutor
from psymesh.node.framed import FramedStream
from psymesh.node.gate import Gate
from psymesh.node.home import NodeConfig, NodeHome
from psymesh.node.logs import fields
from psymesh.node.p2p import P2PNode, P2PStream
from psymesh.node.pairing import PairingService
from psymesh.node.liveness import Liveness
from psymesh.node.ping import measure_ping
from psymesh.node.models import ModelPool, ModelRegistry
from psymesh.node.session import Call, SessionPool, serve_session
from psymesh.node.submitter import TaskSubmitter
from psymesh.node.taskstore import ExecutorStore, Outbox
from psymesh.node.trust import TrustStore
from psymesh.protocol import control as c
from psymesh.protocol import ids
from psymesh.protocol.identity import is_peer_id
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.manifest import (
    PRESETS,
    Manifest,
    ManifestOk,
    ManifestPush,
    ManifestRevoke,
    Operation,
    check,
    new_manifest,
    revocation,
)
from psymesh.protocol.common import Ping, Pong
from psymesh.protocol.messages import Message
from psymesh.protocol.pairing import PAIR_MAX_FRAME
from psymesh.protocol.session import MAX_OPEN_REQUESTS
from psymesh.protocol.tasks import TaskAck, TaskAttach, TaskCancel, TaskCaps, TaskCapsReply, TaskInput, TaskList, TaskSpec, TaskSubmit

log = logging.getLogger("psymesh.node")

InboundHandler = Callable[[FramedStream, str], Awaitable[None]]
Service = Callable[[Call], Awaitable[Message]]


class Node:
    REVOCATION_NOTICE_S = 2.0  # `psymesh revoke` waits at most this long for the peer to take the notice

    def __init__(self, home: NodeHome, config: NodeConfig | None = None) -> None:
        self.home = home
        self.identity = home.init()
        self.config = config or home.load_config()
        self.db = open_db(home.db_path)
        self.started_at = time.monotonic()
        self.trust = TrustStore(self.db)
        self.audit = AuditLog(self.db)
        executor_store = ExecutorStore(self.db)
        self.gate = Gate(self.identity.peer_id, self.trust, self.audit, queue=executor_store)
        self.p2p = P2PNode(self.identity.seed, self.config.listen, allow_peer=self.gate.allow_connection)
        self.control = ControlServer(home.socket_path, self.config.max_frame_size)
        self.sessions = SessionPool(self.open_peer_stream, ids.SESSION, self.config.max_frame_size,
                                    Liveness(self.config.liveness_probe_s, self.p2p.disconnect))
        self.pairing = PairingService(self.identity, self.config, self.p2p, self.trust, self.push_manifest)
        self.models = ModelPool(ModelRegistry(self.db))
        self.tools = node_tools(home, self.config)
        self.executor = TaskExecutor(store=executor_store, gate=self.gate, trust=self.trust, tools=self.tools, models=self.models,
                                     profile=self.config.profile, share_dir=self.config.share_dir,
                                     agent_runner=AgentTaskRunner(self.models, self.tools, self.config.profile,
                                                                  self.config.share_dir, self.config.agent_model))
        self.submitter = TaskSubmitter(local_peer_id=self.identity.peer_id, outbox=Outbox(self.db), trust=self.trust,
                                       sessions=self.sessions)
        self._root: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._register_services()

    # -- wiring ---------------------------------------------------------------
    def _register_services(self) -> None:
        self._served: set[str] = set()
        self.p2p.set_admission(is_paired=self._is_paired, may_open=self._may_open, limits=self.config.strangers)
        self.inbound(ids.PAIR, self.pairing.serve, max_frame_size=PAIR_MAX_FRAME)
        self.inbound(ids.SESSION, self._serve_session)
        self.services: dict[type[Message], Service] = {
            **{t: self.executor.handle for t in (TaskSubmit, TaskAttach, TaskAck, TaskCancel, TaskInput, TaskList,
                                                 TaskCaps)},
            Ping: self._pong,
            ManifestPush: self._receive_grant,
            ManifestRevoke: self._receive_revocation,
        }
        routes = {
            c.StatusRequest: self._status,
            c.PingRequest: self._ping,
            c.ShutdownRequest: self._shutdown,
            c.PairInviteRequest: self.pairing.create_invite,
            c.PairJoinRequest: self.pairing.join,
            c.PeersRequest: self._peers,
            c.GrantRequest: self._grant,
            c.RevokeRequest: self._revoke,
            c.AuditRequest: self._audit,
            c.TaskSubmitRequest: self._task_submit,
            c.TaskInputRequest: self._task_input,
            c.OffersRequest: self._offers,
            c.TaskWatchRequest: self._task_watch,
            c.TaskCancelRequest: self._task_cancel,
            c.TaskListRequest: self._task_list,
        }
        for request_type, handler in routes.items():
            self.control.route(request_type, handler)

    def inbound(self, protocol: str, handler: InboundHandler, *, max_frame_size: int | None = None) -> None:
        """Serve `protocol` on the p2p host with framing and typed error replies. The gate
        decides first who may open it (`Gate.admit_stream`: anyone may pair, paired peers
        open sessions, and each request on a session passes the door again); a refusal is
        answered with its typed error (`unknown_peer`: pair first). Frames over
        `max_frame_size` (default: the node's) are refused before they are buffered."""
        self._served.add(protocol)
        frame_limit = max_frame_size or self.config.max_frame_size

        async def on_stream(stream: P2PStream) -> None:
            framed = FramedStream(stream, frame_limit)
            try:
                self.gate.admit_stream(stream.remote_peer_id, protocol)
                await handler(framed, stream.remote_peer_id)
            except PsymeshError as exc:
                log.info("refused %s from %s: %s", protocol, stream.remote_peer_id, exc,
                         extra=fields(code=exc.code.value))
                await framed.send_error(exc)
            finally:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

        self.p2p.set_handler(protocol, on_stream)

    def _may_open(self, peer_id: str, protocol: str) -> bool:
        """Asked by the p2p host while it negotiates every inbound stream. `Gate.admit_stream`
        is the rule, and audits what it refuses: for a psymesh service it is applied in
        `inbound()`, where the refusal can be answered with a typed error; for libp2p's own
        protocols (identify, identify push, ping) here, where a refusal is a plain `na`."""
        if protocol in self._served:
            return True
        try:
            self.gate.admit_stream(peer_id, protocol)
        except PsymeshError:
            return False
        return True

    def _is_paired(self, peer_id: str) -> bool:
        """Paired and not revoked: the peers the p2p host holds to the larger limits."""
        try:
            self.gate.paired(peer_id)
        except PsymeshError:
            return False
        return True

    # -- lifecycle ------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._root = tg.cancel_scope
                self._tg = tg
                await tg.start(self.p2p.run)
                await tg.start(self.sessions.run)
                await tg.start(self.executor.run)
                await tg.start(self.submitter.run)
                await tg.start(self.control.serve)
                tg.start_soon(self._watch_signals, tg.cancel_scope)
                log.info("node %s (%s) listening on %s", self.identity.peer_id, self.config.profile,
                         " ".join(self.p2p.addrs()))
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self.models.aclose()
            self.db.close()
            log.info("node stopped")

    def stop(self) -> None:
        if self._root is not None:
            self._root.cancel()

    async def _watch_signals(self, scope: anyio.CancelScope) -> None:
        try:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    scope.cancel()
                    return
        except (ValueError, RuntimeError, NotImplementedError):
            # not the main thread (e.g. a node embedded in tests): the owner stops us
            await anyio.sleep_forever()

    # -- control handlers ------------------------------------------------------
    async def _status(self, req: c.StatusRequest, _: FramedStream) -> c.StatusReply:
        return c.StatusReply(
            peer_id=self.identity.peer_id,
            fingerprint=self.identity.fingerprint,
            name=self.config.name,
            profile=self.config.profile,
            version=psymesh.__version__,
            addrs=self.p2p.addrs(),
            uptime_s=round(time.monotonic() - self.started_at, 3),
            connected_peers=[c.ConnectedPeer(peer_id=p["peer_id"], addrs=p.get("addrs", []))
                             for p in self.p2p.connected_peers()],
        )

    # -- outbound -------------------------------------------------------------------
    async def open_peer_stream(self, peer: str, protocol: str) -> P2PStream:
        """Open `protocol` to a multiaddr (…/p2p/<id>), or to a paired peer by id or name."""
        if peer.startswith("/"):
            return await self.p2p.open_stream(peer, protocol)
        known = self.trust.get(peer) if is_peer_id(peer) else self.trust.resolve(peer)
        if known is None:  # a peer id we are not paired with (a stranger's ping): the open connection
            return await self.p2p.open_stream(peer, protocol)
        known.refuse_if_revoked_us()
        return await self.p2p.open_stream_any(known.peer_id, known.addrs, protocol,
                                              who=f"{known.name} ({known.peer_id})")

    async def push_manifest(self, peer_id: str, manifest: Manifest) -> bool:
        """Hand `peer_id` its current grant; best effort (it can also learn it at the next pairing)."""
        return await self._tell_subject(peer_id, ManifestPush(manifest=manifest), "its new grant", timeout=10)

    async def _tell_subject(self, peer_id: str, message: ManifestPush | ManifestRevoke, what: str, *,
                            timeout: float) -> bool:
        """One best-effort request, all of it (dialing included) within `timeout` seconds."""
        try:
            with anyio.fail_after(timeout):
                await self.sessions.request(peer_id, message, ManifestOk, timeout=timeout)
            return True
        except (PsymeshError, TimeoutError) as exc:
            log.info("could not hand %s %s: %s", peer_id, what, exc)
            return False

    # -- inbound: one door for every request ---------------------------------------------
    async def _serve_session(self, framed: FramedStream, peer_id: str) -> None:
        peer = self.trust.get(peer_id)
        if peer is not None and peer.revoked and self._tg is not None:
            self._tg.start_soon(self._tell_revoked, peer.peer_id)  # it has not heard yet (or it would not call)
        await serve_session(framed.stream, peer_id, self._door, max_frame_size=self.config.max_frame_size,
                            max_open=MAX_OPEN_REQUESTS)

    async def _door(self, call: Call) -> Message:
        """Every request of every peer: admitted (and audited) by the gate, then served."""
        self.gate.admit(call.peer_id, ids.SESSION, call.request)
        return await self.services[type(call.request)](call)

    async def _pong(self, call: Call) -> Message:
        assert isinstance(call.request, Ping)
        return Pong(seq=call.request.seq, payload=call.request.payload)

    async def _receive_grant(self, call: Call) -> Message:
        """A paired issuer hands us the grant it holds for us (the door checked who issued it)."""
        assert isinstance(call.request, ManifestPush)
        self.trust.set_received(call.peer_id, call.request.manifest)
        return ManifestOk(serial=call.request.manifest.serial)

    async def _receive_revocation(self, call: Call) -> Message:
        """The issuer revoked us: stop following what it runs for us and submitting to it, now."""
        notice = call.request
        assert isinstance(notice, ManifestRevoke)
        issuer = self.trust.get(call.peer_id)
        assert issuer is not None  # the door lets only paired peers through (and refused stale notices)
        self.submitter.revoked_by(call.peer_id, ErrorCode.FORBIDDEN, f"{issuer.name} revoked this node's access")
        return ManifestOk(serial=notice.serial)

    async def _ping(self, req: c.PingRequest, _: FramedStream) -> c.PingReply:
        """Round trips on the session to the peer (the first one opens it: `connect_ms`)."""
        if req.peer.startswith("/"):
            peer_id = await self.p2p.connect(req.peer)
        else:
            peer_id = self.trust.resolve(req.peer).peer_id
        start = time.perf_counter()
        session = await self.sessions.session(peer_id)
        connect_ms = (time.perf_counter() - start) * 1000
        with anyio.fail_after(30):
            return await measure_ping(session, peer_id, req.count, req.payload_size, connect_ms)

    async def _peers(self, req: c.PeersRequest, _: FramedStream) -> c.PeersReply:
        connected = {p["peer_id"] for p in self.p2p.connected_peers()}
        return c.PeersReply(peers=[{**p.as_dict(), "connected": p.peer_id in connected}
                                   for p in self.trust.list(include_revoked=req.include_revoked)])

    async def _grant(self, req: c.GrantRequest, _: FramedStream) -> c.PeerReply:
        peer = self.trust.resolve(req.peer)
        if peer.revoked:
            raise PsymeshError(f"{peer.name} was revoked; pair again first", code=ErrorCode.UNKNOWN_PEER)
        if req.preset_limits is not None and req.preset_limits not in PRESETS:
            raise PsymeshError(f"unknown preset {req.preset_limits!r}", code=ErrorCode.BAD_REQUEST)
        if req.limits is not None:
            limits = req.limits
        elif req.preset_limits:
            limits = PRESETS[req.preset_limits][1]
        else:
            limits = peer.granted.limits if peer.granted else None
        manifest = new_manifest(self.identity.peer_id, peer.peer_id, req.capabilities, now=time.time(),
                                ttl=req.expires_s, limits=limits).sign(self.identity.private_key)
        self.trust.set_granted(peer.peer_id, manifest)
        log.info("grant to %s is now: %s", peer.name, ", ".join(manifest.grants()))
        delivered = await self.push_manifest(peer.peer_id, manifest)
        updated = self.trust.get(peer.peer_id)
        assert updated is not None
        return c.PeerReply(peer={**updated.as_dict(), "delivered": delivered})

    async def _revoke(self, req: c.RevokeRequest, _: FramedStream) -> c.PeerReply:
        """Takes effect at once: the trust store says no to the next request, the peer is told
        (a signed notice, so it stops following its tasks here and submitting new ones; at most
        2 s, and a peer that misses it is told when it next calls, and meanwhile learns from the
        refusal of its requests), and open connections (with their streams) are closed now.
        Once it took the notice, it is refused already at the connection."""
        peer = self.trust.resolve(req.peer)
        self.trust.revoke(peer.peer_id)
        self.audit.record(peer.peer_id, "control", "revoke", True, reason="revoked by the owner")
        await self._tell_revoked(peer.peer_id)
        await self.p2p.disconnect(peer.peer_id)
        canceled = self.executor.cancel_for(peer.peer_id, "the submitter was revoked")
        log.info("revoked %s (%s): %d queued or running task(s) canceled", peer.name, peer.peer_id, canceled)
        updated = self.trust.get(peer.peer_id)
        assert updated is not None
        return c.PeerReply(peer=updated.as_dict())

    async def _tell_revoked(self, peer_id: str) -> None:
        """Hand a revoked peer our signed notice (best effort, at most REVOCATION_NOTICE_S)."""
        peer = self.trust.get(peer_id)
        if peer is None or not peer.revoked or peer.revocation_told_at is not None:
            return
        notice = revocation(self.identity.peer_id, peer_id, peer.granted, now=time.time())
        if await self._tell_subject(peer_id, notice.sign(self.identity.private_key), "its revocation",
                                    timeout=self.REVOCATION_NOTICE_S):
            self.trust.revocation_told(peer_id)

    async def _audit(self, req: c.AuditRequest, _: FramedStream) -> c.AuditReply:
        peer_id = req.peer if req.peer is None or is_peer_id(req.peer) else self.trust.resolve(req.peer).peer_id
        return c.AuditReply(rows=self.audit.query(peer_id=peer_id, limit=req.limit, denied_only=req.denied_only))

    # -- delegated tasks ----------------------------------------------------------------
    async def offers(self, peer_id: str) -> TaskCapsReply:
        return await self.sessions.request(peer_id, TaskCaps(), TaskCapsReply)

    async def _task_submit(self, req: c.TaskSubmitRequest, _: FramedStream) -> c.TaskSubmitted:
        try:
            spec = TaskSpec.model_validate(req.spec)
        except ValueError as exc:
            raise PsymeshError(f"invalid task: {exc}", code=ErrorCode.BAD_REQUEST) from None
        target, accepted = await self.submitter.submit(spec, req.to, self.offers)
        peer = self.trust.get(target)
        return c.TaskSubmitted(task_id=spec.id, target=target, target_name=peer.name if peer else target,
                               accepted=accepted)

    async def _task_watch(self, req: c.TaskWatchRequest, framed: FramedStream) -> c.Ok:
        outbox, sent = self.submitter.outbox, req.after_seq
        outbox.get(req.task_id)  # NOT_FOUND for a task this node never delegated
        while True:
            events = outbox.events_after(req.task_id, sent)
            for ev in events:
                await framed.send(ev)
                sent = ev.seq
            if events:
                continue  # more may have come while we were sending
            task = outbox.get(req.task_id)
            if task.terminal and sent >= task.last_seq:
                return c.Ok()
            await self.submitter.changed.wait(req.task_id)  # no await since the reads: nothing is missed

    async def _task_input(self, req: c.TaskInputRequest, _: FramedStream) -> c.Ok:
        await self.submitter.respond(req.task_id, req.data)
        return c.Ok()

    async def _offers(self, req: c.OffersRequest, _: FramedStream) -> c.OffersReply:
        """Paired peers whose grant to us covers `operation` and that answer now."""
        try:
            op = Operation(name=req.operation)
        except ValueError as exc:
            raise PsymeshError(f"unknown operation {req.operation!r}: {exc}", code=ErrorCode.BAD_REQUEST) from None
        found: list[dict] = []
        for peer in self.trust.list(include_revoked=False):
            grant = peer.received
            if grant is None or not check(grant, op, local_peer_id=peer.peer_id, remote_peer_id=self.identity.peer_id,
                                          now=time.time()).allowed:
                continue
            with anyio.move_on_after(5):
                try:
                    caps = await self.offers(peer.peer_id)
                except PsymeshError:
                    continue
                found.append({"peer_id": peer.peer_id, "name": peer.name, "models": caps.models,
                              "tools": caps.tools, "queue_depth": caps.queue_depth})
        return c.OffersReply(offers=found)

    async def _task_cancel(self, req: c.TaskCancelRequest, _: FramedStream) -> c.Ok:
        await self.submitter.cancel(req.task_id)
        return c.Ok()

    async def _task_list(self, req: c.TaskListRequest, _: FramedStream) -> c.TaskListReply:
        names = {p.peer_id: p.name for p in self.trust.list()}
        submitted = [{"task_id": t.id, "kind": t.spec.kind.value, "target": names.get(t.target, t.target),
                      "state": t.state.value, "accepted": t.accepted, "events": t.last_seq,
                      "created_at": t.created_at, "updated_at": t.updated_at}
                     for t in self.submitter.outbox.list()[-req.limit:]]
        executing = [{**r.status().model_dump(mode="json"), "submitter": names.get(r.submitter, r.submitter)}
                     for r in self.executor.store.list(limit=req.limit)]
        return c.TaskListReply(submitted=submitted, executing=executing)

    async def _shutdown(self, req: c.ShutdownRequest, framed: FramedStream) -> None:
        log.info("shutdown requested over the control socket")
        await framed.send(c.Ok())  # answer first: cancelling the root scope ends this connection too
        self.stop()
