"""The letter courier: what the sender does next to hand one recipient its letters (sans-IO).

The messages are in `protocol/messaging.py`; this module decides who is sent what, when
to try again, and when a letter goes to the recipient's mailbox instead. The node runs
one `Courier` per recipient with letters waiting (node/messaging/service.py): it reads
the outbox, sends each batch the machine asks for, feeds back how each one went, and
carries out the actions returned, as node/tasks/submitter.py drives protocol/taskflow.py.

One round (the driver's time is `now`, a monotonic clock):

    begin(waiting) ─> Send(batch) ...   up to WINDOW letters, at most BATCH (and BATCH_BYTES)
                                        in one `msg.send_many`, a lone one as `msg.send`; a
                                        letter refused earlier goes as its withdrawn stub
      answered(send, reply, now)  ─> Settle: stored -> delivered, refused for good -> refused
                                     (its stub goes next round, at once); busy -> again later.
                                     A reply without the recipient's signed receipt over
                                     exactly the ids it stored: Suspect, the batch again later
      refused(send, error, now)   ─> busy, rate_limited ...: again after its retry_after;
                                     otherwise each letter refused, as it would be alone
      unreachable(send, now)      ─> Away (the first time: who waits on these is told);
                                     within `grace_s` of the first failure: again soon;
                                     past it: Deposit each letter its mailbox does not hold
                                     (held ones are offered directly again later)
        deposit_done(deposit, held)  ─> Deposited / StubDone, or (not held) again soon
      held_back(send)             ─> our side cannot send now (e.g. the peer revoked us):
                                     again in RETRY_MAX_S, the letters stay pending
    round_over(now) ─> Again (nothing to wait for) | CheckParked
      parked(waiting, now)        ─> TakeReceipts when every waiting letter sits at the
                                     recipient's mailbox, else the wait below
      receipts_taken(any, now)    ─> Again if they delivered a letter, else the wait below
    the wait: WaitUntil(now + backoff), backoff doubling from RETRY_MIN_S up to RETRY_MAX_S
    (PARKED_RETRY_MAX_S when parked), never shorter than a retry_after the recipient asked
    for; a round whose only retries are "at once" (a refused letter's stub) is Again.

The driver may end a wait early (a new letter, word from the recipient); a round's
batches may be answered in any order.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from .errors import ErrorCode, PsymeshError
from .messaging import (
    Letter,
    LetterResult,
    MsgReceipt,
    MsgReceipts,
    MsgSend,
    MsgSendMany,
    Receipt,
    ReceiptStatus,
    check_receipt,
)

WINDOW = 256           # letters in flight to one recipient ...
BATCH = 64             # ... at most this many in one msg.send_many ...
BATCH_BYTES = 1 << 20  # ... and this much text and body (a frame holds 4 MiB; one big letter goes alone)
RETRY_MIN_S = 0.2
RETRY_MAX_S = 30.0
PARKED_RETRY_MAX_S = 300.0   # a recipient whose letters all sit at its mailbox: offered directly this seldom
#: Refusals worth sending again (a letter's or a whole batch's): the recipient may take it later.
RETRYABLE = frozenset({ErrorCode.BUSY, ErrorCode.RATE_LIMITED, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT,
                       ErrorCode.INTERNAL, ErrorCode.CANCELED})


class OutState(StrEnum):
    """Where a letter of ours stands in the sender's outbox."""

    PENDING = "pending"
    DELIVERED = "delivered"
    REFUSED = "refused"        # refused for good; its withdrawn stub is sent in its place
    DEPOSITED = "deposited"    # the recipient's mailbox holds it; still offered directly


class Outgoing(Protocol):
    """A letter waiting in the outbox, as the machine sees it."""

    @property
    def letter(self) -> Letter: ...

    @property
    def state(self) -> OutState: ...


Stub = Callable[[Letter], Letter]
"""Makes a letter's withdrawn stub, signed by the sender (`letter.stub().sign(key)`)."""


@dataclass(frozen=True)
class Refusal:
    """A letter refused for good: its outbox row says why."""

    id: str
    code: str
    reason: str


# -- actions the driver carries out --------------------------------------------------------
@dataclass(frozen=True)
class Send:
    """Hand this batch over; tell the machine how it went (`answered`, `refused`,
    `unreachable` or `held_back`)."""

    letters: tuple[Letter, ...]      # as written and signed
    stubs: tuple[bool, ...]          # per letter: it goes as its withdrawn stub
    deposited: tuple[bool, ...]      # per letter: the recipient's mailbox holds it already

    def request(self, stub: Stub) -> MsgSend | MsgSendMany:
        """The message to send: alone, a plain `msg.send` (one decision at the door, not two)."""
        wire = [stub(letter) if is_stub else letter for letter, is_stub in zip(self.letters, self.stubs)]
        return MsgSend(letter=wire[0]) if len(wire) == 1 else MsgSendMany(letters=wire)

    @property
    def reply_type(self) -> type[MsgReceipt] | type[MsgReceipts]:
        return MsgReceipt if len(self.letters) == 1 else MsgReceipts


@dataclass(frozen=True)
class Settle:
    """Record what the batch's receipts said, in one transaction; then tell who waits on the
    delivered and refused letters."""

    delivered: tuple[str, ...] = ()
    stubs_done: tuple[str, ...] = ()   # stubs taken (or never to be: the recipient takes nothing from us)
    refused: tuple[Refusal, ...] = ()
    proof: Receipt | None = None       # the recipient's signed receipt over the ids it stored


@dataclass(frozen=True)
class Suspect:
    """The recipient answered without its signed receipt for exactly what it stored:
    nothing is recorded, the batch goes again later."""

    reason: str


@dataclass(frozen=True)
class Away:
    """The recipient was just found unreachable: tell who waits on these letters."""

    ids: tuple[str, ...]


@dataclass(frozen=True)
class Deposit:
    """Leave this letter (its stub, if `stub`) at the recipient's mailbox; then tell the
    machine whether the mailbox holds it (`deposit_done`)."""

    letter: Letter
    stub: bool

    def wire(self, stub: Stub) -> Letter:
        return stub(self.letter) if self.stub else self.letter


@dataclass(frozen=True)
class Deposited:
    """The recipient's mailbox holds the letter: its outbox row says so (still offered directly)."""

    id: str


@dataclass(frozen=True)
class StubDone:
    """The stub of a refused letter is at the recipient's mailbox: nothing is left to send."""

    id: str


@dataclass(frozen=True)
class Again:
    """Begin the next round now (read the outbox again)."""


@dataclass(frozen=True)
class CheckParked:
    """Read what still waits and tell the machine (`parked`)."""


@dataclass(frozen=True)
class TakeReceipts:
    """Every waiting letter sits at the recipient's mailbox: take the receipts it left
    there for us, record those that are its own, and tell the machine whether any letter
    was delivered by them (`receipts_taken`)."""


@dataclass(frozen=True)
class WaitUntil:
    """Begin the next round at `when` (the driver's clock), or sooner if woken."""

    when: float


Action = Settle | Suspect | Away | Deposit | Deposited | StubDone
Step = Again | CheckParked | TakeReceipts | WaitUntil


class Courier:
    """The sender's side of its letters to one recipient, for as long as any wait."""

    def __init__(self, recipient: str, *, local_peer_id: str, grace_s: float) -> None:
        self.recipient = recipient
        self.local_peer_id = local_peer_id
        self.grace_s = grace_s        # unreachable this long: letters go to the recipient's mailbox
        self.away_since: float | None = None   # when the recipient was first found unreachable
        self._backoff = 0.0
        self._retries: list[float] = []   # this round: after how long each failed part wants another try
        self._parked = False

    # -- a round -------------------------------------------------------------------------
    def begin(self, waiting: Sequence[Outgoing]) -> list[Send]:
        """The outbox's waiting letters for the recipient (oldest first, up to WINDOW): the
        batches to send now, oldest first; none when nothing waits (the courier's work is done)."""
        self._retries = []
        self._parked = False
        return [Send(letters=tuple(o.letter for o in batch), stubs=tuple(o.state is OutState.REFUSED for o in batch),
                     deposited=tuple(o.state is OutState.DEPOSITED for o in batch)) for batch in batches(waiting)]

    def answered(self, send: Send, reply: MsgReceipt | MsgReceipts, now: float) -> list[Action]:
        """The recipient's receipts for the batch (a lone letter's `msg.receipt` too)."""
        self.away_since = None
        if isinstance(reply, MsgReceipt):
            reply = MsgReceipts(results=[LetterResult(id=reply.id, status=reply.status)], proof=reply.proof)
        if [r.id for r in reply.results] != [letter.id for letter in send.letters] or not self._proves(reply):
            self._retry(RETRY_MIN_S)
            return [Suspect(f"{self.recipient} answered a batch without its signed receipt for the letters")]
        return [self._settle(send, reply.results, reply.proof if reply.results else None)]

    def refused(self, send: Send, error: PsymeshError, now: float) -> list[Action]:
        """The recipient refused the whole request (a batch's envelope, or a lone letter)."""
        if error.code in RETRYABLE:
            self._retry(error.retry_after or RETRY_MIN_S)
            return []
        # refused for good: each letter is, as it would be alone
        return [self._settle(send, [LetterResult.refused(letter.id, error) for letter in send.letters], None)]

    def unreachable(self, send: Send, now: float) -> list[Action]:
        """The request failed on the way (no connection, the session broke, no answer in time)."""
        actions: list[Action] = []
        if self.away_since is None:  # a sender waiting on these is told the recipient is away
            self.away_since = now
            actions.append(Away(tuple(letter.id for letter in send.letters)))
        if now - self.away_since < self.grace_s:
            self._retry(RETRY_MIN_S)
            return actions
        for letter, stub, deposited in zip(send.letters, send.stubs, send.deposited):
            if deposited:  # its mailbox holds it: offered directly again later
                self._retry(RETRY_MIN_S)
            else:
                actions.append(Deposit(letter, stub))
        return actions

    def deposit_done(self, deposit: Deposit, held: bool) -> list[Action]:
        """Whether the recipient's mailbox took the deposit (False: it named none we can use,
        or the mailbox did not take it; the letter stays pending)."""
        if not held:
            self._retry(RETRY_MIN_S)
            return []
        return [StubDone(deposit.letter.id) if deposit.stub else Deposited(deposit.letter.id)]

    def held_back(self, send: Send) -> list[Action]:
        """This side may not send the batch now (e.g. the recipient revoked us): the letters
        stay pending, and the app sees why."""
        self._retry(RETRY_MAX_S)
        return []

    def round_over(self, now: float) -> Step:
        """Every batch of the round has been answered or has failed (deposits included)."""
        if not self._retries:
            self._backoff = 0.0
            return Again()
        return CheckParked()

    def parked(self, waiting: Sequence[Outgoing], now: float) -> Step:
        """What waits now, after a round with retries: all of it at the mailbox?"""
        self._parked = all(o.state is OutState.DEPOSITED for o in waiting)
        return TakeReceipts() if self._parked else self._wait(now)

    def receipts_taken(self, delivered: bool, now: float) -> Step:
        """Whether the receipts the recipient left at its mailbox delivered any letter."""
        return Again() if delivered else self._wait(now)

    # -- inside ----------------------------------------------------------------------------
    def _retry(self, after: float) -> None:
        self._retries.append(after)

    def _wait(self, now: float) -> Step:
        if not any(self._retries):  # only "at once" (a refused letter's stub goes next): no wait
            return Again()
        cap = PARKED_RETRY_MAX_S if self._parked else RETRY_MAX_S
        self._backoff = min(cap, max(RETRY_MIN_S, self._backoff * 2, max(self._retries)))
        return WaitUntil(now + self._backoff)

    def _proves(self, reply: MsgReceipts) -> bool:
        """The reply's proof is the recipient's signature over exactly the ids it stored."""
        stored = [r.id for r in reply.results if r.status is ReceiptStatus.STORED]
        if not stored:
            return reply.proof is None
        if reply.proof is None or reply.proof.ids != stored:
            return False
        try:
            check_receipt(reply.proof, recipient=self.recipient, local_peer_id=self.local_peer_id)
        except PsymeshError:
            return False
        return True

    def _settle(self, send: Send, results: Sequence[LetterResult], proof: Receipt | None) -> Settle:
        delivered: list[str] = []
        stubs_done: list[str] = []
        refused: list[Refusal] = []
        for letter, stub, result in zip(send.letters, send.stubs, results):
            code = result.code or ErrorCode.INTERNAL  # a refusal without a code: try again
            if result.status is ReceiptStatus.STORED:
                (stubs_done if stub else delivered).append(letter.id)
            elif code in RETRYABLE:
                self._retry(result.retry_after or RETRY_MIN_S)
            elif stub:  # the recipient takes nothing from us now: no thread of ours is held there
                stubs_done.append(letter.id)
            else:
                refused.append(Refusal(letter.id, code.value, result.reason))
                self._retry(0.0)  # its stub goes in the next round, at once
        return Settle(tuple(delivered), tuple(stubs_done), tuple(refused), proof)


def batches(waiting: Sequence[Outgoing]) -> Iterator[list[Outgoing]]:
    """Oldest first, cut at BATCH letters or BATCH_BYTES of payload (a letter over that goes alone)."""
    batch: list[Outgoing] = []
    size = 0
    for item in waiting:
        weight = item.letter.payload_bytes
        if batch and (len(batch) == BATCH or size + weight > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += weight
    if batch:
        yield batch
