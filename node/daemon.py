"""The node daemon: one root task group that owns every service.

    Node.run()
      ├── WakeLock.run         under Termux: a wake lock only while work is in flight (node/core/wakelock.py)
      ├── P2PNode.run          libp2p host (Noise + yamux over TCP), our protocol handlers
      ├── SessionPool.run      one outbound session per peer (+ a liveness watcher each)
      ├── McpTools.run         [[mcp]] servers' tools mounted as mcp.NAME.*, restarted when they die
      ├── TaskExecutor.run     recover unfinished tasks, N workers, expiry/purge housekeeping
      ├── TaskSubmitter.run    one driver per unfinished delegated task
      ├── OpenAIEndpoint.run   [serve.openai]: an OpenAI-compatible HTTP endpoint (node/bridges/openai.py)
      ├── A2AEndpoint.run      [serve.a2a]: the agent as an A2A agent, a2a-sdk on its own asyncio thread
      ├── Messaging.run        one courier per recipient with letters to deliver
      ├── Answering.run        peers' asks answered by the agent, one at a time (node/messaging/answering.py)
      ├── Mailbox.run          mail held for peers that named this node: expiry housekeeping
      ├── MailOwner.run        our mail key to every peer; our mail fetched from our mailbox
      ├── Discovery.run        mDNS (if configured), static peers; paired peers' addresses follow them
      ├── Relaying.run         reservations at our relays; direct paths preferred (node/reach/relaying.py)
      ├── Resync.run           each paired peer's grant, our addresses, our exit key: told on every connection (node/reach/resync.py)
      ├── KeepConnected.run    a phone's home PCs and any node's mailbox: redialed when the connection ends (node/reach/keep.py)
      ├── RpcLinks.run         a split model's workers, each a loopback port for its runner (node/compute/link.py)
      ├── WorkerService.run    [worker]: llama.cpp's RPC server lent to peers granted compute.rpc (node/compute/worker.py)
      ├── ControlServer.serve  local Unix socket for the CLI and scripts (handlers: node/control/owner.py)
      └── signal watcher       SIGINT/SIGTERM -> cancel the root scope -> clean shutdown

Every request a peer sends arrives on a session (`/psymesh/session/1.0.0`) and passes
one door, `Node._door`: `Gate.admit()` decides and audits, then the service runs.

Every service starts with `await tg.start(...)`, so `run()` reports ready only when
the node really listens; nothing is spawned and forgotten.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Literal

import anyio
import anyio.abc

from ..discovery.service import Discovery
from .models.agents import AgentTaskRunner, node_tools
from .messaging.answering import Answering
from .bridges.apikey import load_api_key
from .door.audit import AuditLog
from .control.server import ControlServer
from .core.commands import Commands
from .core.db import SYNC_FILE, Checkpointer, Tally, WalSync, open_db
from .tasks.executor import TaskExecutor
from .net.framed import FramedStream
from .door.gate import Gate
from .messaging.groups import Groups
from .core.home import NodeConfig, NodeHome
from .core.logs import fields
from .bridges.mcp import McpTools
from .net.p2p import P2PNode, P2PStream, local_ipv4_addresses
from .reach.keep import KeepConnected, PoolReacher, kept_peers
from .reach.relaying import Relaying
from .reach.resync import AddressTiding, ExitKeyTiding, GrantTiding, Resync
from .door.pairing import PairingService
from .compute.link import RpcLinks
from .compute.split import SplitPlacement
from .compute.worker import WorkerService, rpc_engine, worker_log
from .net.liveness import Liveness
from .messaging.mailbox import Mailbox, MailStore
from .messaging.mailclient import MailOwner, MailSender
from .messaging.service import Messaging
from .messaging.store import MessageStore
from .models import ModelPool, ModelRegistry
from .core.notify import Pulse
from .core.redact import Redactor
from .control.owner import Owner
from .net.ping import pong_time
from .core.bridgeconfig import A2AServe, OpenAIServe
from .reach.dialback import Reach
from .net.session import Call, SessionPool, serve_session
from .tasks.submitter import TaskSubmitter
from .tasks.store import ExecutorStore, Outbox
from .door.trust import Peer, TrustStore
from .web.router import WebKeys, WebRouter
from .web.serve import WebServer
from .core.wakelock import WakeCommands, WakeLock, termux_commands
from .web.tools import web_tools
from ..protocol import ids
from ..protocol.addresses import AddrsPush, dial_addresses, is_loopback_addr
from ..protocol.identity import is_peer_id
from ..protocol.errors import ErrorCode, PsymeshError
from ..protocol.manifest import Manifest, ManifestOk, ManifestPush, ManifestRevoke, Operation, check, revocation
from ..protocol.common import Ping, Pong
from ..protocol.dialback import DialBack
from ..protocol.messages import Message
from ..protocol.mailbox import MailAck, MailDeposit, MailFetch, MailKeyPush, MailLeaveReceipt, MailTakeReceipts
from ..protocol.messaging import MsgAck, MsgMissing, MsgSend, MsgSendMany
from ..protocol.pairing import PAIR_MAX_FRAME
from ..protocol.compute import RPC_MAX_FRAME
from ..protocol.session import MAX_OPEN_REQUESTS
from ..protocol.web import (
    WebAnswer,
    WebFetch,
    WebKeyGet,
    WebKeyOf,
    WebKeyPush,
    WebRelay,
    WebRequest,
    WebSealed,
    WebSearch,
)
from ..protocol.tasks import TaskAck, TaskAcks, TaskAttach, TaskCancel, TaskCaps, TaskCapsReply, TaskInput, TaskList, TaskSubmit

if TYPE_CHECKING:
    from .bridges.a2a import A2AEndpoint, A2AParts
    from .control.dashboard import Dashboard
    from .bridges.openai import OpenAIEndpoint, OpenAIParts

log = logging.getLogger("psymesh.node")


def _relayed(path: str | None) -> bool | None:
    return None if path is None else path == "relayed"

InboundHandler = Callable[[FramedStream, str], Awaitable[None]]
Service = Callable[[Call], Awaitable[Message]]
# Requests whose service answers at once (it awaits nothing, its answer is not durable):
# a session serves them in its read loop, without a task each (node/net/session.py).
PROMPT: frozenset[type[Message]] = frozenset({Ping})
# Requests whose service keeps the durability promise of its answers itself, and no more than
# it (`Node._door` syncs for every other durable answer): `task.accepted` promises the task's
# row, which the executor syncs, not the events its worker writes meanwhile, which go out in
# the same write (a sync of those would be a second fsync on the path of every task).
SYNCS_ITSELF: frozenset[type[Message]] = frozenset({TaskSubmit})


class Node:
    REVOCATION_NOTICE_S = 2.0  # `psymesh revoke` waits at most this long for the peer to take the notice

    def __init__(self, home: NodeHome, config: NodeConfig | None = None, *,
                 environ: Mapping[str, str] = os.environ, fsync: Callable[[int], None] = SYNC_FILE,
                 wake_commands: WakeCommands | None | Literal["termux"] = "termux") -> None:
        """`environ`: where the bridges' keys may come from ($PSYMESH_OPENAI_API_KEY, ...), and
        the PATH a phone's device commands are found on (agent/acting/device_commands.py).
        `fsync`: how the WAL is synced before a durable answer (a test traces it).
        `wake_commands`: how a wake lock is taken and let go while work is in flight
        (node/core/wakelock.py); by default Termux's, when the node runs under Termux."""
        self.home = home
        self.redact = Redactor.for_node(home.path)  # what a peer is told never names this machine's paths
        self.identity = home.init()
        self.config = config or home.load_config()
        self._environ = environ  # for a bridge turned on later (serve_endpoint)
        storage = self.config.storage
        self.checkpointer = Checkpointer(home.db_path, settle_s=storage.checkpoint_settle_s,
                                         max_defer_s=storage.checkpoint_max_defer_s,
                                         wal_max_bytes=storage.wal_max_bytes)
        self.wal = WalSync(home.db_path, fsync=fsync)
        self.db_tally = Tally()  # statements and transactions on the node's connection (tests, benches)
        self.db = open_db(home.db_path, background_checkpoints=True, wal_max_bytes=storage.wal_max_bytes,
                          on_write=self._wrote, tally=self.db_tally)
        self.started_at = time.monotonic()
        self.wake = WakeLock(termux_commands(environ) if wake_commands == "termux" else wake_commands)
        # how this node's own messages spell a command for its owner: with --home when its home is not the default
        self.commands = Commands.of(home.path)
        self.trust = TrustStore(self.db, commands=self.commands)
        # The audit log's batches are committed on a connection of their own, on a worker thread
        # (node/door/audit.py): the event loop serves requests meanwhile.
        self.audit_db = open_db(home.db_path, background_checkpoints=True, wal_max_bytes=storage.wal_max_bytes)
        self.audit = AuditLog(self.db, writer=self.audit_db, committed=self.checkpointer.wrote,
                              flush_ms=storage.audit_flush_ms,
                              batch_rows=storage.audit_batch_rows, coalesce_s=storage.audit_coalesce_s,
                              max_rows=storage.audit_max_rows)
        executor_store = ExecutorStore(self.db)
        mail_store = MailStore(self.db)
        self.mailbox = Mailbox(self.identity.peer_id, mail_store, self.trust, self.config.mail)
        msg_store = MessageStore(self.db, self.config.inbox)
        self.gate = Gate(self.identity.peer_id, self.trust, self.audit, queue=executor_store, mailbox=self.mailbox,
                         asks=msg_store, name=self.config.name, refusals_per_minute=storage.refusals_per_minute)
        self.p2p = P2PNode(self.identity.seed, self.config.listen,
                           label=functools.partial(self.trust.label, fingerprint=True))
        self.control = ControlServer(home.socket_path, self.config.max_frame_size, refused=self._control_refused,
                                     commands=self.commands)
        self.sessions = SessionPool(self.open_peer_stream, ids.SESSION, self.config.max_frame_size,
                                    Liveness(self.config.liveness_probe_s, self.p2p.disconnect), path=self.p2p.path)
        self.relaying = Relaying(self.config.relay, self.p2p, self.trust)
        self.keeper = KeepConnected(
            lambda: kept_peers(self.trust, profile=self.config.profile, mailbox=self.config.mailbox),
            self.p2p, PoolReacher(self.sessions), keep_alive_s=self.config.keep_alive_s, label=self.trust.label)
        self.trust.on_change(self.keeper.poke)
        self.reach = Reach(self.p2p, self.sessions, self.trust)
        self.web = WebServer(self.config.web.exit, home, self.identity.private_key, self.identity.peer_id,
                             gate=self.gate, audit=self.audit, trust=self.trust, sessions=self.sessions, db=self.db)
        # What each paired peer must hold from us (our addresses, its grant, our exit key): told on
        # every new connection, whenever it changes, and again until it has it (node/reach/resync.py).
        # Addresses first: they are what lets the peer reach us again.
        self.grant_tiding = GrantTiding()
        self.key_tiding = ExitKeyTiding(lambda: self.web.key)
        self.resync = Resync(self.trust, self.p2p, self.sessions,
                             [AddressTiding(self.identity, self.p2p), self.grant_tiding, self.key_tiding],
                             revoked_by=lambda peer_id, reason: self.submitter.revoked_by(
                                 peer_id, ErrorCode.UNKNOWN_PEER, reason))
        self.web.on_key = self.resync.poke
        self.pairing = PairingService(self.identity, self.config, self.p2p, self.trust, self.push_manifest,
                                      welcome=functools.partial(self.resync.tell, tiding=self.key_tiding),
                                      commands=self.commands)
        # A model split across other homes (node/compute/): its workers reached through loopback ports,
        # each a stream of /psymesh/rpc/1.0.0; this node's own compute lent through the door.
        self.rpc_links = RpcLinks(self.open_peer_stream, self.trust.label, engine=rpc_engine)
        self.worker = WorkerService(self.config.worker, home.rpc_socket_path, self.gate, self.trust,
                                    name=self.config.name, log_path=worker_log(home.logs_dir))
        self.models = ModelPool(ModelRegistry(self.db, commands=self.commands), keep_alive_s=self.config.models.keep_alive_for(self.config.profile),
                                memory_limit_mb=self.config.models.memory_limit_mb, log_dir=home.logs_dir,
                                placement_for=self._placement, split_of=self._split_of)
        self.web_router = WebRouter(self.config.web, self.identity.peer_id, self.trust, self.sessions,
                                    WebKeys(self.db))
        self.tools = node_tools(home, self.config, environ)
        if self.config.web.exit.enabled or self.config.profile == "phone" or self.config.web.via:
            for tool in web_tools(self._web_for_agent):
                self.tools.register(tool)
        self.agents = AgentTaskRunner(self.models, self.tools, self.config.profile, self.config.share_dir,
                                      self.config.agent_model)
        self.executor = TaskExecutor(store=executor_store, gate=self.gate, trust=self.trust, tools=self.tools, models=self.models,
                                     profile=self.config.profile, share_dir=self.config.share_dir,
                                     agent_runner=self.agents, wake=self.wake, wal=self.wal, redact=self.redact)
        self.submitter = TaskSubmitter(local_peer_id=self.identity.peer_id, outbox=Outbox(self.db), trust=self.trust,
                                       sessions=self.sessions, wal=self.wal, wake=self.wake,
                                       commands=self.commands)
        self.messaging = Messaging(self.identity, msg_store, self.trust, self.sessions,
                                   door=self.gate.admit_each,
                                   mail=MailSender(self.identity.peer_id, mail_store, self.trust, self.sessions,
                                                   self.mailbox), grace_s=self.config.mail.grace_s,
                                   gap_s=self.config.mail.gap_s, wake=self.wake, links=self.p2p,
                                   undo=self.gate.undo)
        self.mail = MailOwner(home, self.identity, self.config.mailbox, mail_store, self.trust, self.sessions,
                              self._door, self.messaging, self.config.mail)
        self.groups = Groups(self.db, self.trust, self.messaging, commands=self.commands)
        self.answering = Answering(self.db, self.messaging, self.trust, self.agents, self.tools, self.identity.peer_id,
                                   door=self.gate.readmit, redact=self.redact)
        self.discovery = Discovery(self.identity.peer_id, mdns=self.config.mdns, static_peers=self.config.static_peers,
                                   host=self.p2p, peers=self.trust,
                                   probe=lambda peer_id: self.sessions.request(peer_id, Ping(seq=0), Pong))
        self.pairing.nearby = self.discovery.seen  # `pair join CODE` finds its inviter among them
        # Bridges (docs/bridges.md): MCP servers' tools join self.tools; apps speaking OpenAI's API get
        # this node's models, and its paired homes' (imported only when on: it brings an HTTP server).
        self.mcp = McpTools(self.config.mcp, self.tools, home.path)
        self.openai: OpenAIEndpoint | None = None
        if self.config.serve.openai.enabled:
            from .bridges.openai import OpenAIEndpoint

            self.openai = OpenAIEndpoint(self._openai_parts(), self.config.serve.openai,
                                         load_api_key(self.config.serve.openai, home, environ))
        self.a2a: A2AEndpoint | None = None
        if self.config.serve.a2a.enabled:
            from .bridges.a2a import A2AEndpoint

            self.a2a = A2AEndpoint(self._a2a_parts(), self.config.serve.a2a, load_api_key(self.config.serve.a2a, home, environ))
        # The dashboard (node/control/dashboard.py): on for a home unless [ui] says otherwise; on a phone
        # started on demand (start_ui), so an idle phone never imports or runs an HTTP server.
        self.activity = Pulse()  # fired by every task event, letter and audit row: the open pages re-read
        self.audit.pulse = self.activity
        for notifier in (self.submitter.changed, self.messaging.changed, self.executor.changed,
                         self.mailbox.arrived):
            notifier.pulse = self.activity
        self.ui: Dashboard | None = None
        self._environ = environ
        self._root: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._register_services()

    # -- wiring ---------------------------------------------------------------
    def _register_services(self) -> None:
        self._served: set[str] = set()
        self.p2p.set_admission(is_paired=self._is_paired, may_open=self._may_open, limits=self.config.strangers,
                               may_punch=self.gate.admit_hole_punch, take_circuit=self.gate.admit_circuit)
        if self.config.relay.enabled:
            self.p2p.serve_relay(self.config.relay, self.gate.admit_relay)
        self.inbound(ids.PAIR, self.pairing.serve, max_frame_size=PAIR_MAX_FRAME)
        self.inbound(ids.SESSION, self._serve_session)
        self.inbound(ids.RPC, self.worker.serve, max_frame_size=RPC_MAX_FRAME)
        self.services: dict[type[Message], Service] = {
            **{t: self.executor.handle for t in (TaskSubmit, TaskAttach, TaskAck, TaskAcks, TaskCancel, TaskInput,
                                                 TaskList, TaskCaps)},
            Ping: self._pong,
            DialBack: self.reach.serve,
            ManifestPush: self._receive_grant,
            ManifestRevoke: self._receive_revocation,
            MsgSend: self.messaging.receive,
            MsgSendMany: self.messaging.receive_many,
            MsgAck: self.messaging.receive_ack,
            MsgMissing: self.messaging.receive_missing,
            MailKeyPush: self.mailbox.receive_key,
            MailDeposit: self.mailbox.deposit,
            MailFetch: self.mailbox.fetch,
            MailAck: self.mailbox.ack,
            MailLeaveReceipt: self.mailbox.leave_receipt,
            MailTakeReceipts: self.mailbox.take_receipts,
            AddrsPush: self.relaying.receive,
            WebSearch: self.web.serve,
            WebFetch: self.web.serve,
            WebSealed: self.web.serve_sealed,
            WebRelay: self.web.relay,
            WebKeyPush: self.web_router.keys.receive,
            WebKeyOf: self.web.key_of,
            WebKeyGet: self.web.key_get,
        }
        Owner(self).serve_on(self.control)

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

    def _placement(self, model: str, workers: tuple[str, ...], on_worker_loss: str) -> SplitPlacement:
        """Where split model `model`'s layers go at each load (node/compute/split.py)."""
        return SplitPlacement(self.rpc_links, workers, on_worker_loss="wait" if on_worker_loss == "wait" else "reload",
                              label=self.trust.name_of, relayed=lambda peer_id: _relayed(self.p2p.path(peer_id)))

    def _split_of(self, model: str) -> tuple[tuple[str, ...], str]:
        """A model's workers (peer ids) and on_worker_loss: its [models.NAME] table in config.toml
        if that names any, else what `model add --split` registered."""
        table = self.config.models.tables().get(model)
        if table is None or not table.split:
            return self.models.registry.split_of(model)
        try:
            workers = tuple(self.trust.resolve(name).peer_id for name in table.split)
        except PsymeshError as exc:
            raise PsymeshError(f"config.toml [models.{model}] split: {exc.message}", code=exc.code) from None
        return workers, table.on_worker_loss

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

    async def serve_endpoint(self, section: Literal["openai", "a2a"], settings: OpenAIServe | A2AServe) -> tuple[str, bool]:
        """Turn the OpenAI-compatible endpoint or the A2A agent on now, in the root task
        group (`psymesh serve` against a running daemon); (url, was it on already). Its key
        comes as at start (node/bridges/apikey.py: the daemon's environment, api_key_file, or
        <home>/KEY_FILE, made on first use)."""
        running = self.openai if section == "openai" else self.a2a
        if running is not None:
            assert running.url is not None
            return running.url, True
        if self._tg is None:
            raise PsymeshError("the node is not running", code=ErrorCode.UNAVAILABLE)
        if section == "openai":
            from .bridges.openai import OpenAIEndpoint

            assert isinstance(settings, OpenAIServe)
            openai = OpenAIEndpoint(self._openai_parts(), settings, load_api_key(settings, self.home, self._environ))
            await self._tg.start(openai.run)
            self.openai, url = openai, openai.url
        else:
            from .bridges.a2a import A2AEndpoint

            assert isinstance(settings, A2AServe)
            a2a = A2AEndpoint(self._a2a_parts(), settings, load_api_key(settings, self.home, self._environ))
            await self._tg.start(a2a.run)
            self.a2a, url = a2a, a2a.url
        assert url is not None
        return url, False

    # -- lifecycle ------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._root = tg.cancel_scope
                self._tg = tg
                await tg.start(self._watch_signals, tg.cancel_scope)
                await tg.start(self.checkpointer.run)
                await tg.start(self.wake.run)
                await tg.start(self.audit.run)
                await tg.start(self.p2p.run)
                await tg.start(self.sessions.run)
                await tg.start(self.mcp.run)  # before the executor requeues tasks that may call MCP tools
                await tg.start(self.executor.run)
                await tg.start(self.submitter.run)
                if self.openai is not None:
                    await tg.start(self.openai.run)
                if self.a2a is not None:
                    await tg.start(self.a2a.run)
                await tg.start(self.messaging.run)
                await tg.start(self.answering.run)
                await tg.start(self.mailbox.run)
                await tg.start(self.mail.run)
                await tg.start(self.discovery.run)
                await tg.start(self.relaying.run)
                await tg.start(self.resync.run)
                await tg.start(self.keeper.run)
                await tg.start(self.rpc_links.run)
                await tg.start(self.worker.run)
                await tg.start(self.web.run)
                if self.config.ui.on_for(self.config.profile):  # before the control socket answers: a
                    await self.start_ui(required=False)        # signal then always finds its handler
                await tg.start(self.control.serve)
                log.info("node %s (%s, profile: %s) listening on %s", self.config.name, self.identity.peer_id,
                         self.config.profile,
                         " ".join(self.p2p.addrs()))
                if self.config.relay.enabled:  # else a user who turned it on sees no sign it took
                    log.info("relaying for paired peers granted relay (up to %d reservations, %d circuits)",
                             self.config.relay.max_reservations, self.config.relay.max_circuits)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self.models.aclose()
            self.audit_db.close()
            self.db.close()
            self.wal.close()
            log.info("node stopped")

    def _wrote(self) -> None:
        """A statement that writes started on the node's connection (any thread)."""
        self.checkpointer.wrote()
        self.wal.wrote()

    async def start_ui(self, *, required: bool = True, port: int | None = None) -> Dashboard:
        """The dashboard, started in the node's task group if it is not running yet (at `port`
        if given, else `[ui] port`). At start (`required` False) a port in use is logged and the
        node runs on without it; `psymesh ui` (control.ui) then says why."""
        if self.ui is not None and self.ui.url is not None:
            return self.ui
        assert self._tg is not None, "the node is not running"
        from .control.dashboard import Dashboard, DashboardParts

        ui = Dashboard(DashboardParts(config=self.config, identity=self.identity, trust=self.trust, models=self.models,
                                      tools=self.tools, agents=self.agents, messaging=self.messaging,
                                      mailbox=self.mailbox, submitter=self.submitter, control=self.control,
                                      activity=self.activity, commands=self.commands),
                       self.config.ui if port is None else self.config.ui.model_copy(update={"port": port}),
                       load_api_key(self.config.ui, self.home, self._environ),
                       reload_key=functools.partial(load_api_key, self.config.ui, self.home, self._environ))
        try:
            await self._tg.start(ui.run)
        except PsymeshError as exc:
            if required:
                raise
            log.warning("%s", exc.message)
            return ui
        self.ui = ui
        return ui

    def stop(self) -> None:
        if self._root is not None:
            self._root.cancel()

    async def _watch_signals(self, scope: anyio.CancelScope, *,
                             task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """SIGINT/SIGTERM cancel `scope`. Started first, so that a signal at any moment of the
        start (a service already announced, the next one still starting) stops the node cleanly."""
        try:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                task_status.started()
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    scope.cancel()
                    return
        except (ValueError, RuntimeError, NotImplementedError):
            # not the main thread (e.g. a node embedded in tests): the owner stops us
            task_status.started()
            await anyio.sleep_forever()

    # -- outbound -------------------------------------------------------------------
    def _control_refused(self, uid: int, pid: int | None) -> None:
        """A local process of another uid opened the control socket: one audit row."""
        self.audit.record(f"uid:{uid}", "control", "connect", False, ErrorCode.FORBIDDEN.value,
                          f"a process of uid {uid} (pid {pid if pid is not None else '?'}) is not this "
                          f"daemon's owner (uid {self.control.uid})")

    async def open_peer_stream(self, peer: str, protocol: str) -> P2PStream:
        """Open `protocol` to a multiaddr (…/p2p/<id>), or to a paired peer by id or name."""
        if peer.startswith("/"):
            return await self.p2p.open_stream(peer, protocol)
        known = self.trust.get(peer) if is_peer_id(peer) else self.trust.resolve(peer)
        if known is None:  # a peer id we are not paired with (a stranger's ping): the open connection
            return await self.p2p.open_stream(peer, protocol)
        known.refuse_if_revoked_us()
        return await self.p2p.open_stream_any(known.peer_id, self._dial_addresses(known), protocol,
                                              who=known.name)

    def _dial_addresses(self, peer: Peer) -> list[str]:
        """The peer's stored addresses, then circuits through every paired relay that granted
        us `relay` (protocol/addresses.py `dial_addresses`): a home that took a reservation
        after the phone last reached it is still found."""
        now = time.time()
        relays = [(r.peer_id, list(r.addrs)) for r in self.trust.list(include_revoked=False)
                  if r.peer_id != peer.peer_id and r.received is not None and r.revoked_us_at is None
                  and check(r.received, Operation(name="relay"), local_peer_id=r.peer_id,
                            remote_peer_id=self.identity.peer_id, now=now).allowed]
        local = frozenset(local_ipv4_addresses()) if any(map(is_loopback_addr, peer.addrs)) else frozenset()
        return dial_addresses(peer.peer_id, list(peer.addrs), relays, local)

    async def push_manifest(self, peer_id: str, manifest: Manifest) -> bool:
        """Hand `peer_id` its current grant (the one the trust store holds: `manifest`) now; True
        once it took it. A peer not reached is told when it is back (node/reach/resync.py)."""
        return await self.resync.tell(peer_id, self.grant_tiding)

    async def _tell_subject(self, peer_id: str, message: ManifestRevoke, what: str, *,
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
            self._tg.start_soon(self.tell_revoked, peer.peer_id)  # it has not heard yet (or it would not call)
        await serve_session(framed.stream, peer_id, self._door, max_frame_size=self.config.max_frame_size,
                            max_open=MAX_OPEN_REQUESTS, prompt=PROMPT)

    async def _door(self, call: Call, via: str = ids.SESSION) -> Message:
        """Every request of every peer: admitted (and audited) by the gate, then served.
        `via`: how it came (a session; or a letter handed over by our mailbox, as its sender's).
        An answer that promises durability (`Message.durable`: task.accepted, msg.receipt(s),
        mail.receipt) leaves only once the WAL is synced, whether it ends the call or not (or
        goes out with the final answer, `Call.send_with_answer`); the services of SYNCS_ITSELF
        keep that promise themselves."""
        try:
            self.gate.admit(call.peer_id, via, call.request)
            if type(call.request) in SYNCS_ITSELF:
                return await self.services[type(call.request)](call)
            reply = await self.services[type(call.request)](Call(call.peer_id, call.rid, call.request,
                                                                 self._durable_send(call), call.ahead))
        except PsymeshError as exc:  # said to the peer: never this machine's paths (node/core/redact.py)
            redacted = self.redact.error(exc)
            if redacted is exc:
                raise
            raise redacted from exc
        if reply.durable or any(m.durable for m in call.ahead):
            await self.wal.sync()
        return reply

    def _durable_send(self, call: Call) -> Callable[[int, tuple[Message, ...]], Awaitable[None]]:
        async def send(rid: int, messages: tuple[Message, ...]) -> None:
            if any(m.durable for m in messages):
                await self.wal.sync()
            await call.send(*messages)

        return send

    async def _pong(self, call: Call) -> Message:
        assert isinstance(call.request, Ping)
        return Pong(seq=call.request.seq, payload=call.request.payload, time=pong_time())

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

    async def tell_revoked(self, peer_id: str) -> None:
        """Hand a revoked peer our signed notice (best effort, at most REVOCATION_NOTICE_S)."""
        peer = self.trust.get(peer_id)
        if peer is None or not peer.revoked or peer.revocation_told_at is not None:
            return
        notice = revocation(self.identity.peer_id, peer_id, peer.granted, now=time.time())
        if await self._tell_subject(peer_id, notice.sign(self.identity.private_key), "its revocation",
                                    timeout=self.REVOCATION_NOTICE_S):
            self.trust.revocation_told(peer_id)

    # -- web queries ----------------------------------------------------------------------
    async def _web_for_agent(self, request: WebRequest, peer_id: str | None) -> WebAnswer:
        """An agent's web.search / web.fetch: run here if we are an exit (for `peer_id`, held to
        its grant), else sent through our route (the node's own agent only)."""
        if self.config.web.exit.enabled:
            return await self.web.answer_for(request, peer_id)
        return await self.web_router.query(request, self.web_router.route(request))

    # -- delegated tasks ----------------------------------------------------------------
    def _openai_parts(self) -> OpenAIParts:
        from .bridges.openai import OpenAIParts

        return OpenAIParts(peer_id=self.identity.peer_id, models=self.models, trust=self.trust,
                           submitter=self.submitter, offers=self.offers, commands=self.commands)

    def _a2a_parts(self) -> A2AParts:
        from .bridges.a2a import A2AParts

        return A2AParts(name=self.config.name, profile=self.config.profile, peer_id=self.identity.peer_id,
                        agents=self.agents, tools=self.tools, commands=self.commands)

    async def offers(self, peer_id: str) -> TaskCapsReply:
        return await self.sessions.request(peer_id, TaskCaps(), TaskCapsReply)

