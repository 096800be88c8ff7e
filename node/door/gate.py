"""The gate: the one door every inbound request passes, in one place.

    1. the remote peer id is paired and not revoked            unknown_peer
    2. the request is one this node serves (protocol/admission) bad_request
    3. by its rule:
       issuer      the manifest it carries is from the sender, to us, signed      forbidden
                   (a mail key, an address record, a receipt: the sender's own, signed)
       paired      nothing more (msg.missing: "send me again what you sent me")
       grant       we issued the peer a grant, ours, for it, signed, in date       forbidden / expired
       capability  ... and a capability covers this exact request, payload within  forbidden / too_large
                   (a letter, msg.send: first its own checks, from the sender, to us,
                   validly signed: bad_request / forbidden, so a refused letter is never charged)
    4. charged requests: within the grant's request rate       rate_limited (retry_after)
    5. requests that start a task: within the queue limits     busy (retry_after)
       deposits of mail: the recipient named this node its mailbox, and the sender's
       share of it has room                                    forbidden / too_large / busy
       receipts left here: the owner named this node its mailbox  forbidden

The first failure wins; nothing runs for a denied request. A refusal is charged to the
peer's refusal budget (`refusals_per_minute`, a rate of its own beside the grant's, so
refusals never spend what the peer may do); past it the refusal is `rate_limited`
(retry_after), counted into one audit row a window (operation `*`). Every decision,
allowed or denied, is in the audit log: one row each when allowed, identical refusals
counted into one row a window (node/door/audit.py). Work a peer asked for earlier is decided
again when it is done, by `readmit()` with a row of its own: a queued task as it starts
(`recheck()`), a peer's ask as the agent takes it up. The remote peer id comes from the Noise
session (libp2p), never from the request. Like syncthing's connection checks, the order
is fixed and the list lives here only: the daemon calls `admit()` from one place (its
session door), `admit_each()` for the letters of a batch the door let in (each as the
`msg.send` it stands for, through the same checks), `undo()` for a letter it admitted that the
inbox then refused (its unit given back, a refused row), `admit_stream()` for every inbound
stream (a revoked peer that took our notice may open pairing only), `recheck()` when a queued
task starts, `admit_rpc()` for each llama.cpp RPC stream of a split model (node/compute/worker.py;
`holds_rpc()` asks again, unaudited, whenever a grant changes, and `rpc_closed()` writes the row
of a stream it then cut), `admit_relay()` for each reservation and circuit asked of this node as
a relay (protocol/relay.py: steps 1 and 3, the grant covering `relay`), `admit_hole_punch()`
for each DCUtR stream (never on a direct connection), and `admit_circuit()` for each circuit
a relay brings us on STOP (only from a relay holding our reservation).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .audit import AuditLog
from ..core.logs import fields
from .trust import Peer, TrustStore
from ...protocol import ids
from ...protocol.addresses import AddrsPush
from ...protocol.admission import Need, operation_for, rule_for, task_operation
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.limits import RateLimiter
from ...protocol.mailbox import MailDeposit, MailKeyPush, MailLeaveReceipt, verify_mail_key
from ...protocol.manifest import (
    Decision,
    Manifest,
    ManifestPush,
    ManifestRevoke,
    Operation,
    check,
    verify_from_issuer,
    verify_grant,
)
from ...protocol.messages import Message
from ...protocol.messaging import MsgAck, MsgSend, MsgSendMany, answered_ask, check_letter, check_receipt
from ...protocol.relay import DCUTR, HOLE_PUNCH, HOP, STOP, TAKE_CIRCUIT
from ...protocol.oblivious import verify_exit_key
from ...protocol.web import WebKeyPush
from ...protocol.tasks import TaskSpec, TaskSubmit

log = logging.getLogger("psymesh.gate")
RECHECK = "task.start"  # the audit row of a queued task re-checked as it starts (not a wire request)
ASK_ANSWER = "ask.answer"  # ... of a peer's ask re-checked as this node's agent takes it up (neither)
INBOX = "msg.inbox"  # ... of a letter the door admitted and the inbox then refused (`undo`)
OVER_BUDGET = "*"  # the operation of the audit row counting a peer's refusals past its refusal budget


@dataclass(frozen=True, slots=True)
class QueueLoad:
    """What the door reads of the queue for one task: whether its peer holds it here already
    (a resubmit), the peer's unfinished tasks, and everyone's."""

    held: bool
    active_for_peer: int
    depth: int


class QueueGauge(Protocol):
    """How much work the node holds (the executor's store answers)."""

    def load(self, peer_id: str, task_id: str) -> QueueLoad:
        """`peer_id`'s and everyone's share of the queue as `task_id` arrives, read at once (one
        statement on the path of every task)."""
        ...


class MailDesk(Protocol):
    """The mailbox's own admission of a deposit (node/messaging/mailbox.py answers): raises, saying why."""

    def admit_deposit(self, sender: str, deposit: MailDeposit) -> None: ...

    def admit_receipt(self, owner: str) -> None: ...


class AskLedger(Protocol):
    """The asks this node sent (the message store answers)."""

    def asked(self, peer_id: str, ask_id: str) -> bool:
        """This node sent `peer_id` the ask `ask_id`."""


@dataclass(frozen=True)
class QueueLimits:
    max_queue: int = 256             # unfinished tasks held for all peers
    max_queue_per_peer: int = 64     # ... and for one peer (its grant may say less)
    busy_retry_after: float = 0.5


class Gate:
    def __init__(self, local_peer_id: str, trust: TrustStore, audit: AuditLog, *,
                 queue: QueueGauge | None = None, queue_limits: QueueLimits | None = None,
                 mailbox: MailDesk | None = None, asks: AskLedger | None = None,
                 clock: Callable[[], float] = time.time, name: str = "this node",
                 refusals_per_minute: int = 120) -> None:
        self.local_peer_id = local_peer_id
        self.name = name  # ours, in refusals: "home has not granted friend web.fetch"
        self.trust = trust
        self.audit = audit
        self.queue = queue
        self.queue_limits = queue_limits or QueueLimits()
        self.mailbox = mailbox
        self.asks = asks
        self.clock = clock
        self.rate = RateLimiter()
        self.refusals = RateLimiter()  # each peer's refusal budget, apart from its grant's rate
        self.refusals_per_minute = refusals_per_minute
        self._verified: dict[str, Manifest] = {}  # peer id -> the grant object whose signature held (`_check`)

    # -- requests ------------------------------------------------------------------
    def admit(self, peer_id: str, service: str, request: Message) -> Decision:
        """Allow `request` from `peer_id` (arrived on `service`) or raise; one audit row either way."""
        return self._admit_one(peer_id, service, request, self.clock())

    def admit_each(self, peer_id: str, service: str, requests: Sequence[Message]) -> list[PsymeshError | None]:
        """The items of a batch the door already let in (`msg.send_many`: each letter as its
        `msg.send`), each decided exactly as if it had come alone: same checks, one unit
        charged, one audit row. Returns, per item, None (allowed) or why it was refused;
        one refusal does not refuse the rest. The rows go in the audit log's next batch."""
        now = self.clock()
        out: list[PsymeshError | None] = []
        for request in requests:
            try:
                self._admit_one(peer_id, service, request, now)
            except PsymeshError as exc:
                out.append(exc)
                continue
            out.append(None)
        return out

    def _admit_one(self, peer_id: str, service: str, request: Message, now: float) -> Decision:
        """One decision and its audit row, named by the capability it needed, else its type."""
        operation = operation_for(request)
        what = operation.required() if operation is not None else request.type
        try:
            decision = self._decide(peer_id, request, operation, now)
        except PsymeshError as exc:
            raise self._refuse(peer_id, service, what, exc, now) from None
        self.audit.record(peer_id, service, what, True, now=now)
        return decision

    def _decide(self, peer_id: str, request: Message, operation: Operation | None, now: float) -> Decision:
        peer = self.paired(peer_id)
        rule = rule_for(request)
        if rule.need is Need.ISSUER and isinstance(request, MailKeyPush):
            verify_mail_key(request.key, sender=peer_id)
            return Decision(True)
        if rule.need is Need.ISSUER and isinstance(request, AddrsPush):
            request.record.verify(sender=peer_id)
            return Decision(True)
        if rule.need is Need.ISSUER and isinstance(request, MsgAck):
            check_receipt(request.receipt, recipient=peer_id, local_peer_id=self.local_peer_id)
            return Decision(True)
        if rule.need is Need.PAIRED:
            return Decision(True)
        if rule.need is Need.ISSUER and isinstance(request, MailLeaveReceipt):
            if request.receipt.recipient != peer_id or not request.receipt.signature_valid():
                raise PsymeshError("a receipt left here must be the sender's own, validly signed",
                                   code=ErrorCode.FORBIDDEN)
            if self.mailbox is None:
                raise PsymeshError(f"{self.name} keeps no mailbox", code=ErrorCode.UNAVAILABLE)
            self.mailbox.admit_receipt(peer_id)
            return Decision(True)
        if rule.need is Need.ISSUER and isinstance(request, WebKeyPush):
            verify_exit_key(request.key, exit=peer_id, now=now)
            return Decision(True)
        if rule.need is Need.ISSUER:
            assert isinstance(request, (ManifestPush, ManifestRevoke))
            signed = request.manifest if isinstance(request, ManifestPush) else request
            verify_from_issuer(signed, sender=peer_id, local_peer_id=self.local_peer_id)
            if isinstance(request, ManifestRevoke) and not request.voids(peer.received):
                raise PsymeshError(f"stale revocation: serial {request.serial} is older than the grant held",
                                   code=ErrorCode.CONFLICT)
            return Decision(True)
        if isinstance(request, MsgSend):  # the letter's own: from its sender, to us, signed (before any charge)
            check_letter(request.letter, sender=peer_id, local_peer_id=self.local_peer_id)
        if self._answers_our_asks(peer_id, request):
            return Decision(True)
        grant = self._grant_of(peer)
        decision = self._check(peer, grant, operation if rule.need is Need.CAPABILITY else None, now)
        decision.raise_if_denied()
        if rule.starts_task:
            assert isinstance(request, TaskSubmit)
            if self._check_queue(peer_id, request.spec.id, grant):
                return decision  # a resubmit of a task it holds here: already counted, and charged
        if rule.holds_mail:
            assert isinstance(request, MailDeposit)
            if self.mailbox is None:
                raise PsymeshError(f"{self.name} keeps no mailbox", code=ErrorCode.UNAVAILABLE)
            self.mailbox.admit_deposit(peer_id, request)
        if rule.charged:
            self._charge(peer_id, grant, now)
        return decision

    def _check(self, peer: Peer, grant: Manifest, operation: Operation | None, now: float) -> Decision:
        """`check()` (or `verify_grant()`, for no operation) of the peer's grant, its signature
        verified once per peer and stored grant: the trust store hands back the same frozen
        Manifest object while the row's blob is unchanged (node/door/trust.py), so an object
        seen verified is the same grant, signature and all. The row is read again after any
        change of the trust store (`paired`): a revocation or a new grant acts on the very
        next request."""
        known = self._verified.get(peer.peer_id) is grant
        if operation is not None:
            decision = self._whose(peer, check(grant, operation, local_peer_id=self.local_peer_id,
                                               remote_peer_id=peer.peer_id, now=now, signature_verified=known))
        else:
            decision = verify_grant(grant, local_peer_id=self.local_peer_id, remote_peer_id=peer.peer_id, now=now,
                                    signature_verified=known)
        if decision.allowed and not known:
            self._verified[peer.peer_id] = grant  # one entry per paired peer: replaced, never grows past them
        return decision

    def _whose(self, peer: Peer, decision: Decision) -> Decision:
        """A missing capability, said with whose grant lacks it: on a two-hop query the
        refusal reaches someone else than the peer refused (the phone, for its relay)."""
        details = decision.details or {}
        if decision.allowed or "missing" not in details:
            return decision
        same_kind = details.get("granted") or []
        reason = (f"{self.name} has not granted {peer.name} {details['missing']}"
                  + (f" (it grants {peer.name}: {', '.join(same_kind)})" if same_kind else ""))
        return dataclasses.replace(decision, reason=reason)

    def _answers_our_asks(self, peer_id: str, request: Message) -> bool:
        """The answer to a question this node asked `peer_id` (or a batch of nothing but
        such answers): admitted without a grant from us, uncharged. Asking is the
        permission: the README's pairing gives the asker nothing to grant back, and one
        answer per ask is all a peer can send this way (its id derives from the ask)."""
        if self.asks is None:
            return False
        letters = [request.letter] if isinstance(request, MsgSend) else \
            list(request.letters) if isinstance(request, MsgSendMany) else []
        if not letters:
            return False
        for letter in letters:
            ask = answered_ask(letter, local_peer_id=self.local_peer_id)
            if ask is None or not self.asks.asked(peer_id, ask):
                return False
        return True

    def undo(self, peer_id: str, request: Message, refusal: PsymeshError) -> None:
        """A request this door admitted that its service then refused (a letter the inbox
        cannot take: `conflict`, `expired`, `busy`): the unit it was charged is given back, so
        only work done is charged, and a refused row (service INBOX) says what became of it,
        after the door's allowed one."""
        now = self.clock()
        operation = operation_for(request)
        what = operation.required() if operation is not None else request.type
        peer = self.trust.get(peer_id)
        grant = peer.granted if peer is not None else None
        rpm = grant.limits.requests_per_minute if grant is not None else None
        if rule_for(request).charged and rpm is not None and not self._answers_our_asks(peer_id, request):
            self.rate.refund(peer_id, per_minute=rpm)
        self._record(peer_id, INBOX, what, refusal, now)

    def recheck(self, peer_id: str, spec: TaskSpec) -> Decision:
        """A queued task about to start: does the submitter's grant, as it is *now*, still
        cover it? Returns the decision (denied ones too, for the executor to report);
        writes its own audit row."""
        return self.readmit(peer_id, RECHECK, task_operation(spec))

    def readmit(self, peer_id: str, service: str, operation: Operation) -> Decision:
        """Work a peer asked for earlier, about to be done now (`service` names the moment:
        RECHECK, ASK_ANSWER): is `peer_id` still paired, and does our grant to it, as it is
        *now*, still cover `operation`? Returns the decision (denied ones too, for the
        caller to report); one audit row either way, uncharged."""
        now = self.clock()
        what = operation.required()
        try:
            peer = self.paired(peer_id)
            decision = self._check(peer, self._grant_of(peer), operation, now)
        except PsymeshError as exc:
            decision = Decision(False, exc.code, exc.message)
        if decision.allowed:
            self.audit.record(peer_id, service, what, True, now=now)
        else:
            error = decision.error()
            assert error is not None
            self._record(peer_id, service, what, error, now)
        return decision

    def _check_queue(self, peer_id: str, task_id: str, grant: Manifest) -> bool:
        """BUSY if the queue has no room for a new task; True if `peer_id` holds `task_id`
        here already (a resubmit: neither counted again nor charged)."""
        if self.queue is None:
            return False
        load = self.queue.load(peer_id, task_id)
        if load.held:
            return True
        limits = self.queue_limits
        per_peer = min(limits.max_queue_per_peer, grant.limits.concurrent_tasks or limits.max_queue_per_peer)
        if load.active_for_peer >= per_peer:
            raise PsymeshError(f"you have {per_peer} unfinished task(s) here, the most allowed; retry later",
                               code=ErrorCode.BUSY, retry_after=limits.busy_retry_after)
        if load.depth >= limits.max_queue:
            raise PsymeshError(f"{self.name}'s task queue is full; retry later", code=ErrorCode.BUSY,
                               retry_after=limits.busy_retry_after * 2)
        return False

    def _charge(self, peer_id: str, grant: Manifest, now: float) -> None:
        rpm = grant.limits.requests_per_minute
        if rpm is None:
            return
        retry_after = self.rate.acquire(peer_id, now, per_minute=rpm)
        if retry_after is not None:
            raise PsymeshError(f"over {rpm} requests per minute; retry in {retry_after:.1f} s",
                               code=ErrorCode.RATE_LIMITED, retry_after=retry_after)

    # -- peers, connections, streams -------------------------------------------------
    def paired(self, peer_id: str) -> Peer:
        """The peer's trust row, if it is paired and not revoked (else `unknown_peer`). The
        store keeps the rows it read until it changes (`TrustStore.version`, bumped by every
        write), so a revocation or a new grant acts on the very next request; whether the
        grant is in date is judged at each request, on the clock (`_check`)."""
        peer = self.trust.get(peer_id)
        if peer is None or peer.revoked:
            state = "was revoked" if peer is not None else f"is not paired with {self.name}"
            raise PsymeshError(f"peer {peer_id} {state}; pair first (psymesh pair join)",
                               code=ErrorCode.UNKNOWN_PEER)
        return peer

    def admit_stream(self, peer_id: str, protocol: str) -> None:
        """May `peer_id` open `protocol`? Anyone may pair; only paired peers open a session
        (a revoked one too, until it knows: its requests are refused, one by one, with
        `unknown_peer`, which is how it learns; once it took our notice it is a stranger
        again, held to the stranger limits, who may only pair: revocation ends the grant,
        not the key), and only paired peers not revoked speak
        circuit relay (each reservation and circuit is then `admit_relay`'s to decide; the
        p2p host takes a circuit on STOP only from a relay holding our reservation) and
        hole punching (DCUtR: one audit row per exchange, allowed or not; the p2p host serves
        it only over a relayed connection, and only with `[relay] hole_punch` on).
        Anything else is refused and audited."""
        if protocol == ids.PAIR:
            return
        peer = self.trust.get(peer_id)
        if peer is not None and not peer.shut_out and protocol == ids.SESSION:
            return
        if peer is not None and not peer.revoked and protocol in (HOP, STOP, ids.RPC):
            return  # each reservation, circuit and RPC stream is then decided (and audited) on its own
        if peer is not None and not peer.revoked and protocol == DCUTR:
            self.audit.record(peer_id, DCUTR, HOLE_PUNCH, True, now=self.clock())
            return
        if peer is not None and not peer.revoked:  # paired: libp2p's identify, ping, ...: not served, to anyone
            exc = PsymeshError(f"{self.name} does not serve {protocol} (psymesh serves pairing, sessions, relay and "
                               "hole punching)", code=ErrorCode.BAD_REQUEST)
        else:
            state = f"is not paired with {self.name}" if peer is None else "may not open this protocol"
            exc = PsymeshError(f"peer {peer_id} {state}; pair first (psymesh pair join)", code=ErrorCode.UNKNOWN_PEER)
        raise self._refuse(peer_id, protocol, HOLE_PUNCH if protocol == DCUTR else protocol, exc, self.clock())

    def admit_hole_punch(self, peer_id: str, relayed: bool) -> bool:
        """May `peer_id` run DCUtR on the connection its stream came on (`relayed`: through a
        relay)? As `admit_stream` for DCUtR, and the connection must be relayed: on a direct
        one there is nothing to punch (`bad_request`). One audit row either way."""
        if relayed:
            try:
                self.admit_stream(peer_id, DCUTR)
            except PsymeshError:
                return False
            return True
        try:
            self.paired(peer_id)
            exc = PsymeshError("hole punching on a connection that is already direct: there is nothing to punch",
                               code=ErrorCode.BAD_REQUEST)
        except PsymeshError as unpaired:
            exc = unpaired
        self._refuse(peer_id, DCUTR, HOLE_PUNCH, exc, self.clock())
        return False

    def admit_circuit(self, relay_id: str, reserved: bool) -> bool:
        """May relay `relay_id` bring us a circuit on STOP (`reserved`: we hold a reservation
        there)? Without one it is refused (`not_found`) and audited, one row."""
        if reserved:
            return True
        exc = PsymeshError(f"{self.name} holds no reservation at relay {self.trust.label(relay_id, fingerprint=True)}",
                           code=ErrorCode.NOT_FOUND)
        self._refuse(relay_id, STOP, TAKE_CIRCUIT, exc, self.clock())
        return False

    def admit_relay(self, peer_id: str, what: str) -> None:
        """May `peer_id` have `what` (protocol/relay.py RESERVE or CONNECT) of this node as a
        relay? Paired, not revoked, and our grant to it covers `relay`, in date. Raises the
        reason; one audit row either way (the relay's own limits come after, in node/net/circuit.py)."""
        now = self.clock()
        try:
            grant = self._grant_of(self.paired(peer_id))
            check(grant, Operation(name="relay"), local_peer_id=self.local_peer_id, remote_peer_id=peer_id,
                  now=now).raise_if_denied()
        except PsymeshError as exc:
            raise self._refuse(peer_id, HOP, what, exc, now) from None
        self.audit.record(peer_id, HOP, what, True, now=now)

    def admit_rpc(self, peer_id: str, *, probe: bool, continues: bool = False) -> Manifest:
        """May `peer_id` run a share of its split model here (`compute.rpc`, a stream of
        `/psymesh/rpc/1.0.0`)? Paired, not revoked, granted `compute.rpc`, in date, within the
        grant's request rate (each stream is one request; a probe too). Returns the grant that
        admitted it (its limits' `rpc_memory_mb` is the worker's budget for this peer, its
        `expires` when the stream must end). One audit row either way. `continues`: the worker
        says this stream goes on with the load the peer's previous one began (llama.cpp opens
        several connections one after another to load one model): checked, audited, not charged."""
        now = self.clock()
        what = "compute.rpc" + (" (probe)" if probe else "")
        try:
            peer = self.paired(peer_id)
            grant = self._grant_of(peer)
            self._check(peer, grant, Operation(name="compute.rpc"), now).raise_if_denied()
            if not continues:
                self._charge(peer_id, grant, now)
        except PsymeshError as exc:
            raise self._refuse(peer_id, ids.RPC, what, exc, now) from None
        self.audit.record(peer_id, ids.RPC, what, True, now=now)
        return grant

    def holds_rpc(self, peer_id: str) -> PsymeshError | None:
        """Whether our grant to `peer_id`, as it is now, still covers `compute.rpc`: None if it
        does, else why not. Unaudited and uncharged: the worker asks it of each open stream
        whenever the trust store changes, and audits the close itself (`rpc_closed`)."""
        try:
            peer = self.paired(peer_id)
            self._check(peer, self._grant_of(peer), Operation(name="compute.rpc"), self.clock()).raise_if_denied()
        except PsymeshError as exc:
            return exc
        return None

    def rpc_closed(self, peer_id: str, reason: PsymeshError) -> None:
        """The row of an admitted RPC stream the worker cut (its grant changed, its budget ran out)."""
        self._record(peer_id, ids.RPC, "compute.rpc", reason, self.clock())

    def _grant_of(self, peer: Peer) -> Manifest:
        if peer.granted is None:  # said by us, read by the peer: name both ("home has granted phone nothing")
            raise PsymeshError(f"{self.name} has granted {peer.name} nothing", code=ErrorCode.FORBIDDEN)
        return peer.granted

    def _refuse(self, peer_id: str, service: str, what: str, exc: PsymeshError, now: float) -> PsymeshError:
        """A peer's request refused: charged to its refusal budget, audited; the error to send.
        Past the budget the refusal says `rate_limited` (when to ask again), and all such
        refusals of the window share one audit row whatever they asked (operation `*`), so
        varying the request buys no more rows."""
        wait = self.refusals.acquire(peer_id, now, per_minute=self.refusals_per_minute)
        if wait is not None:
            exc = PsymeshError(f"over {self.refusals_per_minute} refused requests per minute; retry in {wait:.1f} s",
                               code=ErrorCode.RATE_LIMITED, retry_after=wait)
            if self.audit.record(peer_id, service, OVER_BUDGET, False, exc.code.value, exc.message, now=now):
                log.info("refusing %s's requests for %.1f s: over its refusal budget", self.trust.label(peer_id), wait,
                         extra=fields(code=exc.code.value))
            return exc
        self._record(peer_id, service, what, exc, now)
        return exc

    def _record(self, peer_id: str, service: str, what: str, exc: PsymeshError, now: float) -> None:
        if self.audit.record(peer_id, service, what, False, exc.code.value, exc.message, now=now):
            log.info("denied %s to %s: %s", what, self.trust.label(peer_id), exc.message, extra=fields(code=exc.code.value))
