"""What each inbound request needs before it may run: the one table the gate applies.

Every request message a peer may send on a session has a row here. A message type
with no row is refused (`bad_request`), and a test checks that every message a node
serves has one, so a new service cannot skip the door by accident.

    need         what is checked (after "the peer is paired and not revoked")
    ──────────   ─────────────────────────────────────────────────────────────────
    capability   a grant of ours, in date, with a capability covering `operation()`
    grant        a grant of ours, in date (peer-level requests: ping, reach.dialback, task.attach)
    issuer       nothing of ours: the message carries a manifest (or a revocation) the
                 *sender* issued to *us*, validly signed (manifest.push, manifest.revoke),
                 or the sender's own mail key, address record or exit key, signed by it
                 (mail.key, addrs.push, web.key), or the sender's own receipt for letters
                 we sent it (msg.ack), or its own receipt to hold for others (mail.leave_receipt:
                 `holds_mail`, so only from a peer that named us its mailbox)
    paired       nothing beyond pairing: the request only asks us to send the sender
                 again what we already sent it (msg.missing); not charged

A batch (`msg.send_many`) is admitted twice over: the envelope by its own row (a grant in
date, not charged), then each letter in it as the lone `msg.send` it stands for
(`Gate.admit_each`): its capability checked by kind and payload, one unit charged, one
audit row, a refusal refusing that letter only. A sealed web query (`web.sealed`) likewise:
the envelope by a grant in date, not charged; what it holds, once the exit opened it, as the
`web.search` / `web.fetch` it is, by the grant of the relay that brought it.

`charged` requests spend one unit of the grant's `requests_per_minute`. The messages
that follow a task already admitted (attach, ack, cancel, input) are not charged:
one task counts as one request. `starts_task` rows are also held to the queue
limits (the grant's `concurrent_tasks` and the node's own); `holds_mail` rows to the
mailbox's (the recipient named this node; the sender's share of it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from .addresses import AddrsPush
from .common import Ping
from .dialback import DialBack
from .mailbox import MailAck, MailDeposit, MailFetch, MailKeyPush, MailLeaveReceipt, MailTakeReceipts
from .errors import ErrorCode, PsymeshError
from .manifest import ManifestPush, ManifestRevoke, Operation
from .messages import Message
from .messaging import MsgAck, MsgMissing, MsgSend, MsgSendMany
from .web import WebFetch, WebKeyGet, WebKeyOf, WebKeyPush, WebRelay, WebSealed, WebSearch
from .tasks import (
    TaskAck,
    TaskAcks,
    TaskAttach,
    TaskCancel,
    TaskCaps,
    TaskInput,
    TaskKind,
    TaskList,
    TaskSpec,
    TaskSubmit,
)


class Need(StrEnum):
    CAPABILITY = "capability"
    GRANT = "grant"
    ISSUER = "issuer"
    PAIRED = "paired"


@dataclass(frozen=True)
class Rule:
    service: str
    need: Need
    charged: bool = True
    starts_task: bool = False
    holds_mail: bool = False


REQUESTS: Mapping[type[Message], Rule] = {
    TaskSubmit: Rule("task", Need.CAPABILITY, starts_task=True),
    TaskAttach: Rule("task", Need.GRANT, charged=False),
    TaskAck: Rule("task", Need.GRANT, charged=False),
    TaskAcks: Rule("task", Need.GRANT, charged=False),
    TaskCancel: Rule("task", Need.GRANT, charged=False),
    TaskInput: Rule("task", Need.GRANT, charged=False),
    TaskList: Rule("task", Need.GRANT),
    TaskCaps: Rule("task", Need.GRANT),
    Ping: Rule("ping", Need.GRANT),
    DialBack: Rule("reach", Need.GRANT),  # we connect to the asker's own IP only; charged like a ping
    ManifestPush: Rule("manifest", Need.ISSUER, charged=False),
    ManifestRevoke: Rule("manifest", Need.ISSUER, charged=False),
    MsgSend: Rule("msg", Need.CAPABILITY),
    MsgSendMany: Rule("msg", Need.GRANT, charged=False),  # each letter: admitted as its MsgSend
    MsgAck: Rule("msg", Need.ISSUER, charged=False),
    MsgMissing: Rule("msg", Need.PAIRED, charged=False),
    MailKeyPush: Rule("mail", Need.ISSUER, charged=False),
    MailDeposit: Rule("mail", Need.CAPABILITY, holds_mail=True),
    MailFetch: Rule("mail", Need.GRANT),
    MailAck: Rule("mail", Need.GRANT, charged=False),
    MailLeaveReceipt: Rule("mail", Need.ISSUER, charged=False, holds_mail=True),
    MailTakeReceipts: Rule("mail", Need.GRANT),
    AddrsPush: Rule("addrs", Need.ISSUER, charged=False),
    WebSearch: Rule("web", Need.CAPABILITY),
    WebFetch: Rule("web", Need.CAPABILITY),
    WebRelay: Rule("web", Need.CAPABILITY),
    WebSealed: Rule("web", Need.GRANT, charged=False),  # what it holds: admitted as its WebSearch/WebFetch
    WebKeyPush: Rule("web", Need.ISSUER, charged=False),
    WebKeyOf: Rule("web", Need.CAPABILITY, charged=False),   # web.relay: part of the query it precedes
    WebKeyGet: Rule("web", Need.GRANT, charged=False),
}


def rule_for(request: Message) -> Rule:
    rule = REQUESTS.get(type(request))
    if rule is None:
        raise PsymeshError(f"{request.type!r} is not a request this node serves", code=ErrorCode.BAD_REQUEST)
    return rule


def operation_for(request: Message) -> Operation | None:
    """The operation a `capability` request asks the manifest about (None for the others)."""
    if isinstance(request, TaskSubmit):
        return task_operation(request.spec)
    if isinstance(request, MsgSend):
        return request.letter.operation()
    if isinstance(request, (MailDeposit, WebSearch, WebFetch, WebRelay, WebKeyOf)):
        return request.operation()
    return None


def task_operation(spec: TaskSpec) -> Operation:
    """What the manifest must allow for `spec` (also re-checked when a queued task starts)."""
    payload = len(spec.model_dump_json())
    if spec.kind is TaskKind.TOOL:
        assert spec.tool is not None
        return Operation.tool_call(spec.tool, payload_bytes=payload)
    if spec.kind is TaskKind.INFER:
        return Operation.infer(spec.model, spec.max_tokens, payload_bytes=payload)
    return Operation(name="task.agent", payload_bytes=payload)
