"""Control messages of pairing and trust: invites, joins, the paired peers, grants (with their
limits), revocations and the audit log."""
from collections.abc import Mapping

from pydantic import Field, ValidationError, field_validator

from ..limits import Limits
from ..messages import Message
from .common import PeerAway, View


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
    known_as: str | None = None    # the joiner: the name the inviter keeps this node under, when not its own


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
    granted: list[str] = Field(default_factory=list)   # what it may ask of us (CLI spelling); [] once revoked
    granted_expires: float | None = None
    granted_limits: Limits = Limits()     # the numbers of that grant (None: no limit from the grant)
    received: list[str] = Field(default_factory=list)  # what we may ask of it
    received_expires: float | None = None
    revoked_us_at: float | None = None    # it revoked us
    connected: bool = False               # a connection to it is open now
    away: PeerAway | None = None          # since when (and why) this node could not reach it, if its last try failed


class PeersReply(Message):
    type = "control.peers_reply"
    peers: list[PeerView] = Field(default_factory=list)


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
    expires_s: float | None = Field(default=None, gt=0)  # None: it ends when the current grant ends
    until_revoked: bool = False  # with no expires_s: no end (else the current grant's end is kept)
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
