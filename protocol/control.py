"""Messages of the local control API (Unix socket in the node home; same frames as the wire).

The control API is how the CLI and scripts drive their own daemon. Every request
gets exactly one reply (or an `error`), except streaming requests, which say so.
"""
from __future__ import annotations

from pydantic import Field

from psymesh.protocol.limits import Limits
from psymesh.protocol.messages import Message


class StatusRequest(Message):
    type = "control.status"


class ConnectedPeer(Message):
    type = "control.connected_peer"
    peer_id: str
    addrs: list[str] = Field(default_factory=list)
    name: str | None = None


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


class PeersRequest(Message):
    type = "control.peers"
    include_revoked: bool = True


class PeersReply(Message):
    type = "control.peers_reply"
    peers: list[dict] = Field(default_factory=list)


class GrantRequest(Message):
    """Replace the grant to `peer` with these capabilities (CLI spelling, e.g. `tool:files.*`)."""

    type = "control.grant"
    peer: str
    capabilities: list[str] = Field(min_length=1, max_length=128)
    expires_s: float | None = Field(default=None, gt=0)
    preset_limits: str | None = None  # take limits from a preset (default: keep the current limits)
    limits: Limits | None = None      # explicit limits (rate, concurrent tasks, ...); wins over preset_limits


class RevokeRequest(Message):
    type = "control.revoke"
    peer: str


class PeerReply(Message):
    type = "control.peer"
    peer: dict


class AuditRequest(Message):
    type = "control.audit"
    peer: str | None = None
    limit: int = Field(default=100, ge=1, le=10_000)
    denied_only: bool = False


class AuditReply(Message):
    type = "control.audit_reply"
    rows: list[dict] = Field(default_factory=list)


# -- delegated tasks (control API) -----------------------------------------------


class TaskSubmitRequest(Message):
    """Delegate `spec` to `to` (a paired peer's name or id), or to the best paired peer
    offering it when `to` is None. The task is durable once this returns."""

    type = "control.task_submit"
    to: str | None = None
    spec: dict  # a protocol.tasks.TaskSpec (validated by the daemon)


class TaskSubmitted(Message):
    type = "control.task_submitted"
    task_id: str
    target: str
    target_name: str
    accepted: bool  # False: stored and queued for delivery (the target was unreachable or busy)


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


class TaskListReply(Message):
    type = "control.task_list_reply"
    submitted: list[dict] = Field(default_factory=list)  # tasks this node delegated
    executing: list[dict] = Field(default_factory=list)  # tasks this node runs for others



class TaskInputRequest(Message):
    """Answer a delegated task that is `input-required` (forwarded to the executing node)."""

    type = "control.task_input"
    task_id: str
    data: dict = Field(default_factory=dict)


class OffersRequest(Message):
    """Which paired peers would take a task of `operation` (e.g. task.agent), with what they offer."""

    type = "control.offers"
    operation: str = "task.agent"


class OffersReply(Message):
    type = "control.offers_reply"
    offers: list[dict] = Field(default_factory=list)  # {peer_id, name, models, tools, queue_depth}
