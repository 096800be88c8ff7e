"""Messages of the local control API (Unix socket in the node home; same frames as the wire).

The control API is how the CLI and scripts drive their own daemon. Every request
gets exactly one reply (or an `error`), except streaming requests, which say so.

Replies are typed all the way down: a list in a reply holds `View`s (a peer, an audit
row, a task, an offer) with named, typed fields, so the SDK hands out attributes and
the CLI prints them without guessing shapes; `--json` prints their `model_dump`.

An `error` reply for a failure of the network (the daemon could not reach a peer, or
lost it mid-request) says so in `details["network"]` (see `error_reply`), so the SDK
raises it as the NetworkError it was, apart from refusals (RemoteError).

One job at ~750 lines: this is the control API's message catalogue (one frozen model per request and
reply, 69 classes), which the SDK and the control server share; splitting it would scatter one table.
"""

from collections.abc import Mapping
from typing import Annotated
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .common import Error
from .dialback import DialBackReply
from .errors import (
    ConnectError,
    ConnectionLost,
    NetworkError,
    NetworkTimeout,
    PsymeshError,
    RemoteError,
)
from .limits import Limits
from .messages import Message
from .messaging import LetterId, LetterKind, Thread
from .tasks import TaskKind, TaskState
from .web import WebFetch, WebPage, WebResults, WebSearch


class View(BaseModel):
    """One item inside a control reply (never sent alone). Frozen and typed; keys it does
    not know are ignored, so a newer daemon may add fields without breaking an older SDK."""

    model_config = ConfigDict(frozen=True, extra="ignore", defer_build=True)


class PeerAway(View):
    """A peer this node could not reach when it last tried: since when (the first failed
    try in a row, unix seconds) and the last failure. Cleared once a session opens."""

    since: float
    reason: str


class StatusRequest(Message):
    type = "control.status"


class ConnectedPeer(Message):
    type = "control.connected_peer"
    peer_id: str
    addrs: list[str] = Field(default_factory=list)
    name: str | None = None


class ConfirmedAddr(View):
    """An address of ours a paired peer dialed back (`psymesh doctor`, protocol/dialback.py):
    the IP it saw us at, and a port we listen on, reachable from where it is."""

    addr: str
    by: str        # the peer's id
    by_name: str   # its name here
    at: float      # when (Unix seconds)


class Reachability(View):
    """How peers can reach this node: at the addresses it listens on (`direct`; from where
    they route), at ones a peer proved by dialing back (`confirmed`), through relays that
    hold a reservation for it (`relayed`). All empty: only by connections it opens itself."""

    direct: list[str] = Field(default_factory=list)
    confirmed: list[ConfirmedAddr] = Field(default_factory=list)
    relayed: list[str] = Field(default_factory=list)


class StatusReply(Message):
    type = "control.status_reply"
    peer_id: str
    fingerprint: str
    name: str
    profile: str
    version: str
    addrs: list[str]
    uptime_s: float
    connected_peers: list[ConnectedPeer] = Field(default_factory=list)
    listen: list[str] = Field(default_factory=list)  # config `listen`, as configured (port 0: any)
    reachability: Reachability = Field(default_factory=Reachability)


class DoctorRequest(Message):
    """What the running daemon sees for `psymesh doctor`: its listen addresses, and each
    paired peer probed now (reachable? by which path? its clock? can it dial us back?),
    all within `timeout_s`."""

    type = "control.doctor"
    timeout_s: float = Field(default=10.0, gt=0, le=60)
    dialback: bool = True


ConnectionPath = Literal["direct", "relayed"]


class PeerDiagnosis(View):
    """One paired (not revoked) peer, probed by the daemon."""

    peer_id: str
    name: str
    reachable: bool
    path: ConnectionPath | None = None  # how the connection to it goes
    rtt_ms: float | None = None
    clock_skew_s: float | None = None  # its clock minus ours (>0: it runs ahead); None: not measured
    error: str = ""                    # why it is unreachable, or why a probe failed
    dialback: DialBackReply | None = None  # None: not asked (unreachable, or it refused)
    dialback_error: str = ""           # why it would not dial back (e.g. its grant to us has no room)


class DoctorReply(Message):
    type = "control.doctor_reply"
    listen: list[str]                  # config `listen`
    addrs: list[str]                   # what the daemon listens on now
    reachability: Reachability
    peers: list[PeerDiagnosis] = Field(default_factory=list)


class PingRequest(Message):
    """Ping a peer over the encrypted channel. `peer` is a multiaddr ending /p2p/<id>, or a known peer id/name."""

    type = "control.ping"
    peer: str = Field(min_length=1, max_length=1024)
    count: int = Field(default=4, ge=1, le=1000)
    payload_size: int = Field(default=32, ge=0, le=65536)


class PingReply(Message):
    type = "control.ping_reply"
    peer_id: str
    rtts_ms: list[float]
    connect_ms: float
    min_ms: float
    median_ms: float
    max_ms: float


class ShutdownRequest(Message):
    """Ask the daemon to stop cleanly (same as SIGTERM)."""

    type = "control.shutdown"


class Ok(Message):
    type = "control.ok"


# -- pairing and trust (control API) ---------------------------------------------


class PairInviteRequest(Message):
    type = "control.pair_invite"
    name: str | None = Field(default=None, max_length=64)  # what we will call the joiner
    grant: str = "phone"                                    # preset granted to the joiner
    ttl_s: float = Field(default=600.0, gt=0, le=7 * 86400)
    grant_ttl_s: float | None = Field(default=None, gt=0)
    wait: bool = False  # True: after the invite, a second reply (`control.paired` or `error`) when it is used or dies


class PairInviteReply(Message):
    type = "control.pair_invite_reply"
    code: str
    invite: str
    expires_at: float
    grant: str


class PairJoinRequest(Message):
    """`invite` is an invite string, or a code with `address` (multiaddr or host:port) of the inviter."""

    type = "control.pair_join"
    invite: str = Field(min_length=1, max_length=4096)
    address: str | None = Field(default=None, max_length=1024)
    grant: str | None = None  # optional preset this node grants back to the inviter (e.g. messaging)


class PairedReply(Message):
    type = "control.paired"
    peer_id: str
    name: str
    role: str
    verification: str
    granted: list[str] = Field(default_factory=list)   # what the peer may ask of us
    received: list[str] = Field(default_factory=list)  # what we may ask of the peer
    asked_name: str | None = None  # the name it came with, when another peer here holds it (`name` is unique)


class PeersRequest(Message):
    type = "control.peers"
    include_revoked: bool = True


class PeerView(View):
    """A paired peer as its owner sees it: who it is, what each side may ask of the other."""

    peer_id: str
    name: str
    role: str
    addrs: list[str] = Field(default_factory=list)
    paired_at: float
    revoked_at: float | None = None       # we revoked it
    granted: list[str] = Field(default_factory=list)   # what it may ask of us (CLI spelling)
    granted_expires: float | None = None
    granted_limits: Limits = Limits()     # the numbers of that grant (None: no limit from the grant)
    received: list[str] = Field(default_factory=list)  # what we may ask of it
    received_expires: float | None = None
    revoked_us_at: float | None = None    # it revoked us
    connected: bool = False               # a connection to it is open now


class PeersReply(Message):
    type = "control.peers_reply"
    peers: list[PeerView] = Field(default_factory=list)


class ServeRequest(Message):
    """Turn an endpoint on in the running daemon (`psymesh serve openai|a2a` while the
    daemon runs): the bridge's `[serve.SECTION]` settings from config.toml, with these
    over them. It stays on until the daemon stops (config.toml says whether it comes back)."""

    type = "control.serve"
    section: Literal["openai", "a2a"]
    host: str | None = None
    port: int | None = Field(default=None, ge=0, le=65535)
    # The key is the daemon's, as at start (node/bridges/apikey.py): never carried here.
    api_key_file: str | None = None


class ServeReply(Message):
    type = "control.serve_reply"
    url: str              # where it listens (the A2A agent's JSON-RPC URL; the OpenAI base without /v1)
    already: bool = False  # it was on already (these settings changed nothing)


class GrantRequest(Message):
    """A new grant to `peer`. Its capabilities (CLI spelling, e.g. `tool:files.*`):
    `capabilities` if given, else the preset `preset`'s, else the current grant's; then
    `remove` taken out and `add` put in (`grant phone +tool:system.info -msg.send`).

    Its limits: `limits` if given, else the preset `preset_limits`'s (or `preset`'s), else
    the current grant's; then each of `set_limits` replaces one of them (None: no limit)."""

    type = "control.grant"
    peer: str
    capabilities: list[str] = Field(default_factory=list, max_length=128)
    add: list[str] = Field(default_factory=list, max_length=128)
    remove: list[str] = Field(default_factory=list, max_length=128)
    preset: str | None = None
    expires_s: float | None = Field(default=None, gt=0)
    preset_limits: str | None = None
    limits: Limits | None = None
    set_limits: dict[str, int | None] = Field(default_factory=dict)

    @field_validator("set_limits")
    @classmethod
    def _limits_exist_and_fit(cls, changes: dict[str, int | None]) -> dict[str, int | None]:
        return check_limit_changes(changes)

    def limits_over(self, base: Limits) -> Limits:
        """`base` with `set_limits` applied, one limit at a time."""
        return Limits.model_validate({**base.model_dump(), **self.set_limits})


def check_limit_changes(changes: Mapping[str, int | None]) -> dict[str, int | None]:
    """`changes` as a dict if each names a field of `Limits` and fits it (None clears it);
    else ValueError naming the first that does not, in the words a person typed it."""
    known = list(Limits.model_fields)
    for name in changes:
        if name not in Limits.model_fields:
            raise ValueError(f"unknown limit {name!r} (known: {', '.join(known)})")
    try:
        Limits.model_validate(changes)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first.get("loc") else "limits"
        raise ValueError(f"{name}={changes.get(name)}: {first['msg'][:1].lower()}{first['msg'][1:]}") from None
    return dict(changes)


class RevokeRequest(Message):
    type = "control.revoke"
    peer: str


class PeerReply(Message):
    """The peer after a grant or a revocation. `delivered`: the peer took the news now (its
    new grant, or the revocation notice); if not, it learns it when it next calls."""

    type = "control.peer"
    peer: PeerView
    delivered: bool = False


class AuditRequest(Message):
    type = "control.audit"
    peer: str | None = None
    limit: int = Field(default=100, ge=1, le=10_000)
    denied_only: bool = False


class AuditRow(View):
    """One decision of the gate (or of the owner, e.g. a revocation), oldest first in a reply."""

    id: int
    ts: float
    peer_id: str
    protocol: str
    operation: str
    allowed: bool
    code: str | None = None  # the ErrorCode of a refusal
    reason: str = ""
    peer_name: str | None = None  # the paired peer's name (None: a stranger)
    count: int = 1  # identical refusals within the audit window, counted into this row


class AuditReply(Message):
    type = "control.audit_reply"
    rows: list[AuditRow] = Field(default_factory=list)


# -- delegated tasks (control API) -----------------------------------------------


class TaskSubmitRequest(Message):
    """Delegate `spec` to `to` (a paired peer's name or id), or to the best paired peer
    offering it when `to` is None. The task is durable once this returns."""

    type = "control.task_submit"
    to: str | None = None
    spec: dict  # a protocol.tasks.TaskSpec (validated by the daemon)


class TaskSubmitted(Message):
    type = "control.task_submitted"
    durable = True  # the outbox row is synced to disk before this is sent
    task_id: str
    target: str
    target_name: str
    accepted: bool  # False: stored and queued for delivery (the target was unreachable or busy)
    away: PeerAway | None = None  # not accepted because the target is unreachable: since when, why


class TaskWatchRequest(Message):
    """Stream this node's mirror of a delegated task's events after `after_seq`
    (`task.event` messages), then `control.ok` once the task has ended."""

    type = "control.task_watch"
    task_id: str
    after_seq: int = Field(default=0, ge=0)


class TaskCancelRequest(Message):
    type = "control.task_cancel"
    task_id: str


class TaskListRequest(Message):
    type = "control.task_list"
    limit: int = Field(default=100, ge=1, le=1000)


class SubmittedTaskView(View):
    """A task this node delegated, from its durable mirror."""

    task_id: str
    kind: TaskKind
    target: str          # the executing peer's name (its id if it is no longer paired)
    state: TaskState
    accepted: bool       # the target holds it (False: still queued here for delivery)
    events: int          # events mirrored so far
    created_at: float
    updated_at: float
    away: PeerAway | None = None  # unfinished, and the target could not be reached when last tried


class ExecutingTaskView(View):
    """A task this node runs for a peer."""

    task_id: str
    kind: TaskKind
    submitter: str       # the submitting peer's name (its id if it is no longer paired)
    state: TaskState
    last_seq: int        # events in the task's log
    acked_seq: int       # events the submitter confirmed it stored
    created_at: float
    updated_at: float
    deadline: float | None = None


class TaskListReply(Message):
    type = "control.task_list_reply"
    submitted: list[SubmittedTaskView] = Field(default_factory=list)  # tasks this node delegated
    executing: list[ExecutingTaskView] = Field(default_factory=list)  # tasks this node runs for others


class TaskInputRequest(Message):
    """Answer a delegated task that is `input-required` (forwarded to the executing node)."""

    type = "control.task_input"
    task_id: str
    data: dict = Field(default_factory=dict)


class OffersRequest(Message):
    """Which paired peers would take a task of `operation` (e.g. task.agent), with what they offer."""

    type = "control.offers"
    operation: str = "task.agent"


class Offer(View):
    """A paired peer that would take the operation now, and what it has for it."""

    peer_id: str
    name: str
    models: list[str] = Field(default_factory=list)
    tools: list[str] = Field(default_factory=list)
    queue_depth: int = 0  # tasks waiting there


class OffersReply(Message):
    type = "control.offers_reply"
    offers: list[Offer] = Field(default_factory=list)


# -- the dashboard (control API) -------------------------------------------------------


class UiRequest(Message):
    """Start the dashboard in the running daemon if it is not running (a phone starts it
    only on demand), and say where it is: `psymesh ui`."""

    type = "control.ui"


class UiReply(Message):
    type = "control.ui_reply"
    url: str        # http://HOST:PORT
    login_url: str  # url + /login?token=TOKEN: opening it trades the token for the session cookie
    token_source: str  # where the token is kept (its file, or the environment variable)


# -- models (control API) ------------------------------------------------------------


class ModelsPsRequest(Message):
    """The node's models as their runner processes stand: `psymesh model ps`."""

    type = "control.models_ps"


class LoadedModel(View):
    """One registered model's runner. `loaded` False: no process holds it now (never used,
    or gone after `keep_alive_s` idle, or after a crash); the next request loads it."""

    name: str
    path: str
    loaded: bool
    pid: int | None = None
    rss_bytes: int | None = None
    n_ctx: int = 0
    state_cache_bytes: int = 0      # saved model states the runner holds (state reuse)
    idle_s: float | None = None     # since its last request ended; None: never used, or busy now
    jobs_served: int = 0
    crashes: int = 0                # in a row, since its last request that succeeded
    keep_alive_s: float | None = None
    pending: int = 0                # requests queued or running
    running: bool = False           # the runner has started one of them (it is decoding now)


class ModelsPsReply(Message):
    type = "control.models_ps_reply"
    models: list[LoadedModel] = Field(default_factory=list)


# -- discovery (control API) -----------------------------------------------------------


class DiscoverRequest(Message):
    """Nodes this node has seen on the LAN (mDNS) or reached at a static address, paired or
    not. `wait_s`: listen that many seconds more first (a daemon just started has heard little)."""

    type = "control.discover"
    wait_s: float = Field(default=0.0, ge=0.0, le=60.0)


class SeenNode(View):
    """A node seen on the network. Its peer id and addresses are what it announced: the
    fingerprint is for a person to compare with `psymesh id` on the device before pairing,
    and pairing proves the key."""

    peer_id: str
    fingerprint: str | None = None   # None: not an Ed25519 peer id (another libp2p implementation)
    addrs: list[str] = Field(default_factory=list)
    source: Literal["mdns", "static"]
    first_seen: float
    last_seen: float
    paired: bool = False             # paired and not revoked
    name: str | None = None          # the paired peer's name


class DiscoverReply(Message):
    type = "control.discover_reply"
    mdns: bool                                            # config `mdns`
    announced: list[str] = Field(default_factory=list)    # what this node announces now (mDNS)
    static_peers: int = 0                                 # config `static_peers` entries
    nodes: list[SeenNode] = Field(default_factory=list)   # most recently seen first


# -- messages between agents (control API) ---------------------------------------------

GroupName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]


class SentLetter(View):
    """A letter this node wrote, as its outbox holds it: `pending` until the recipient's
    receipt (`delivered`), or `refused` for good (`code`, `reason` say why)."""

    id: str
    recipient: str
    recipient_name: str
    thread: str
    tseq: int
    kind: LetterKind
    group: str | None = None
    state: str              # pending | delivered | refused
    code: str | None = None
    reason: str = ""
    away: PeerAway | None = None  # pending, and the recipient could not be reached when last tried


class InboxLetter(Message):
    """A letter released to this node's app, in release order (`seq`: 1, 2, 3 ... across
    the inbox; a reader resumes with `after` = the last `seq` it took). Streamed by
    `control.msg_inbox`, one per frame."""

    type = "control.inbox_letter"
    seq: int
    id: str
    sender: str
    sender_name: str        # the sender's peer id if it is no longer paired
    thread: str
    tseq: int
    kind: LetterKind
    text: str = ""
    body: dict = Field(default_factory=dict)
    at: float               # when the sender wrote it, Unix seconds by its clock (the letter's `at` / 1000)
    received_at: float      # when this node stored it, Unix seconds
    reply_to: str | None = None
    group: str | None = None
    # Letters of this thread before this one that never came: their place was given up after
    # the letters behind them had waited `[inbox] held_s` (0: none skipped).
    skipped: int = 0


class MsgSendRequest(Message):
    """Write a letter to `to` (a paired peer's name or id). Durable once this returns; a
    courier delivers it. The same `letter_id` again is the same letter (not sent twice)."""

    type = "control.msg_send"
    to: str = Field(min_length=1, max_length=256)
    text: str = ""
    body: dict = Field(default_factory=dict)
    thread: Thread = "main"
    letter_id: LetterId | None = None


class MsgSentReply(Message):
    type = "control.msg_sent"
    durable = True
    letter: SentLetter


class MsgStatusRequest(Message):
    """A sent letter's state; with `wait`, once it is delivered or refused."""

    type = "control.msg_status"
    id: LetterId
    wait: bool = False
    until_away: bool = False  # with wait: also answer (still pending) once the recipient is found unreachable


class MsgInboxRequest(Message):
    """Stream released letters after `after` (`control.inbox_letter` each), then
    `control.ok`: once the inbox is read (`follow` false), after `limit` letters, or,
    following, never (the client closes the connection to stop)."""

    type = "control.msg_inbox"
    after: int = Field(default=0, ge=0)
    follow: bool = False
    limit: int | None = Field(default=None, ge=1)


class MsgAskRequest(Message):
    """Ask `to`'s agent (it needs our `msg.ask`); the reply is its answer letter. `params`
    are agent params the peer may set (model, max_steps, seed, ...), checked there."""

    type = "control.msg_ask"
    to: str = Field(min_length=1, max_length=256)
    text: str = Field(min_length=1)
    thread: Thread = "main"
    params: dict = Field(default_factory=dict)
    timeout_s: float = Field(default=120.0, gt=0, le=3600)


class MsgAnswerReply(Message):
    type = "control.msg_answer"
    ask: SentLetter
    answer: InboxLetter


class WebQueryRequest(Message):
    """Run one web query through a trusted exit: exactly one of `search` / `fetch`. `via`
    names the exit, `relay` the relay (two hops); unset, the node's `[web]` config and its
    grants decide (see node/web/router.py)."""

    type = "control.web"
    search: WebSearch | None = None
    fetch: WebFetch | None = None
    via: str | None = Field(default=None, max_length=256)
    relay: str | None = Field(default=None, max_length=256)
    hops: Literal[1, 2] | None = None

    @model_validator(mode="after")
    def _one(self) -> "WebQueryRequest":
        if (self.search is None) == (self.fetch is None):
            raise ValueError("a web query is exactly one of search or fetch")
        return self


class WebQueryReply(Message):
    """The answer (`results` for a search, `page` for a fetch), and the way it went."""

    type = "control.web_reply"
    results: WebResults | None = None
    page: WebPage | None = None
    exit: str
    relay: str | None = None


class GroupMember(View):
    peer_id: str
    name: str


class GroupView(View):
    """A named list of peers kept by this node alone: a message to it is one letter per member."""

    name: str
    members: list[GroupMember] = Field(default_factory=list)
    created_at: float


class GroupCreateRequest(Message):
    type = "control.group_create"
    name: GroupName
    members: list[str] = Field(default_factory=list, max_length=1000)  # paired peers' names or ids


class GroupAddRequest(Message):
    type = "control.group_add"
    name: GroupName
    members: list[str] = Field(min_length=1, max_length=1000)


class GroupRemoveRequest(Message):
    type = "control.group_remove"
    name: GroupName
    members: list[str] = Field(min_length=1, max_length=1000)


class GroupListRequest(Message):
    type = "control.group_list"


class GroupReply(Message):
    type = "control.group"
    group: GroupView


class GroupsReply(Message):
    type = "control.groups"
    groups: list[GroupView] = Field(default_factory=list)


class GroupSendRequest(Message):
    """One letter to each member, in the thread `group:<name>`, each carrying the group's name."""

    type = "control.group_send"
    name: GroupName
    text: str = ""
    body: dict = Field(default_factory=dict)


class GroupSentReply(Message):
    type = "control.group_sent"
    durable = True
    group: str
    letters: list[SentLetter] = Field(default_factory=list)


# -- errors: the network failing vs a refusal ----------------------------------------

# details["network"] of an `error` reply -> the NetworkError the SDK raises for it
NETWORK_FAILURES: dict[str, type[NetworkError]] = {
    "connect": ConnectError,
    "timeout": NetworkTimeout,
    "lost": ConnectionLost,
    "network": NetworkError,
}


def network_kind(exc: PsymeshError) -> str | None:
    """How the network failed, if `exc` is the network failing rather than a refusal. The
    transport (node/net/host.py, node/net/framed.py) raises its failures as NetworkErrors, so the
    class alone says it: a ProtocolError, whatever its code, is never the network."""
    for kind, cls in NETWORK_FAILURES.items():
        if isinstance(exc, cls):
            return kind
    return None


def error_reply(exc: PsymeshError) -> Error:
    """The `error` reply for what a control request raised inside the daemon."""
    kind = network_kind(exc)
    reply = Error.from_exception(exc)
    return reply if kind is None else reply.model_copy(update={"details": {**reply.details, "network": kind}})


def raised(exc: RemoteError) -> PsymeshError:
    """What the SDK raises for an `error` reply: the NetworkError the daemon met, or the refusal."""
    cls = NETWORK_FAILURES.get(str(exc.details.get("network")))
    if cls is None:
        return exc
    return cls(exc.message, code=exc.code, retry_after=exc.retry_after, details=exc.details)
