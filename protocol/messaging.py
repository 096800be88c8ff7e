"""Agent-to-agent messages (sans-IO): the signed letter, its wire messages, and the rules
that keep delivery exactly once and in order within a thread.

A *letter* is written and signed by its sender, addressed to one peer:

    id        sender-chosen, unique (a resend is the same letter: dropped by id)
    sender    peer id; signs the letter with its identity key
    recipient peer id
    thread    a conversation name; order is kept within (sender, thread)
    tseq      1, 2, 3 ... per (sender, recipient, thread): the receiver releases a
              thread's letters to the app strictly in this order, holding one whose
              predecessor has not arrived yet
    kind      send | ask | answer   (ask needs `msg.ask`: the receiver's agent answers it
              with an `answer` letter in the same thread, `reply_to` the ask)
    text, body, at, reply_to, group, withdrawn

On the session (`/psymesh/session/1.0.0`):

    msg.send {letter}   -> msg.receipt {id, status: "stored"}   once the recipient holds it durably
    msg.send_many {letters: 1..256}
                        -> msg.receipts {results: [{id, status, code, reason, retry_after}]}
                           one result per letter, in order: "stored" once the whole batch's
                           accepted letters are committed (one transaction), or "refused" with
                           the code a lone `msg.send` of that letter would have got, so one bad
                           letter refuses only itself

    msg.ack {receipt}   -> msg.ack_ok {}          the recipient's signed receipt for letters
                                                   that reached it another way (its mailbox)
    msg.missing {thread, tseqs: 1..256}
                        -> msg.missing_ok {resending}
                           the recipient has held a gap in `thread` too long: send these again

A receipt (`msg.receipt`, `msg.receipts`, `msg.ack`) carries `proof`: a `Receipt` the
recipient signed over the ids it stored, so the sender holds the recipient's word, not a
go-between's. The sender keeps each letter in its outbox until such a receipt comes back,
resending with backoff while the recipient is away; a letter left at the recipient's
mailbox is kept too, and sent again directly once the recipient can be reached, so a
mailbox that withholds a letter delays its thread but cannot cut it. A letter the recipient refuses for good (its grant
changed, the letter is too large) is replaced on the wire by a *withdrawn* stub with the
same id and tseq (no text, no body), so the letters after it in its thread are not held
for ever; the sender's app sees the refusal.
"""

import itertools
import hashlib
from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, ClassVar, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from .errors import ErrorCode, PsymeshError
from .identity import PeerId, public_key_from_peer_id
from .manifest import Operation
from .messages import Message
from .signing import Signed, canonical_encode
from .tasks import JsonMap

MAX_TEXT = 64 * 1024
MAX_THREAD = 128
LetterId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]
Thread = Annotated[str, Field(min_length=1, max_length=MAX_THREAD)]


def _signable(body: dict) -> dict:
    """A body the signature can cover: JSON has no NaN or infinity, and neither has §3's
    canonical form."""
    try:
        canonical_encode(body, floats=True)
    except TypeError as exc:
        raise ValueError(f"body: {exc}") from None
    return body


LetterBody = Annotated[JsonMap, AfterValidator(_signable)]


class LetterKind(StrEnum):
    SEND = "send"
    ASK = "ask"
    ANSWER = "answer"


class Letter(Signed, BaseModel):
    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")
    signing_context: ClassVar[bytes] = b"psymesh/letter/v1\x00"
    signer_field: ClassVar[str] = "sender"
    signer_role: ClassVar[str] = "sender"
    signing_floats: ClassVar[bool] = True  # `body` is free-form JSON: numbers signed by value (§3)

    id: LetterId
    sender: str
    recipient: str
    thread: Thread = "main"
    tseq: int = Field(ge=1, lt=2**63)
    kind: LetterKind = LetterKind.SEND
    text: str = Field(default="", max_length=MAX_TEXT)
    body: LetterBody = Field(default_factory=dict)
    at: int = Field(ge=0)  # Unix time in milliseconds, as the sender's clock says
    reply_to: LetterId | None = None
    group: Annotated[str, Field(max_length=64)] | None = None
    withdrawn: bool = False
    signature: bytes = Field(default=b"", max_length=64)

    @field_validator("sender", "recipient")
    @classmethod
    def _peer_id(cls, value: str) -> str:
        try:
            public_key_from_peer_id(value)
        except PsymeshError as exc:
            raise ValueError(exc.message) from None
        return value

    def stub(self) -> Self:
        """The withdrawn stand-in for this letter: same place in its thread, nothing in it.
        (Unsigned: sign it again.)"""
        return self.model_copy(update={"text": "", "body": {}, "withdrawn": True, "signature": b"",
                                       "kind": LetterKind.SEND, "reply_to": None})

    @property
    def payload_bytes(self) -> int:
        return len(self.text.encode()) + len(canonical_encode(self.body, floats=True))

    def operation(self) -> Operation:
        """What the recipient's manifest must allow (an `answer` is a kind of `send`)."""
        name = "msg.ask" if self.kind is LetterKind.ASK else "msg.send"
        return Operation(name=name, payload_bytes=self.payload_bytes)


def answer_id(ask_sender: str, ask_id: str) -> str:
    """The id of the one answer to the ask `ask_id` of `ask_sender`: derived, so the answerer
    writes the same one after a restart, and the asker can tell an answer to its own
    question from any other letter (ask ids are unique per sender only)."""
    return "ans-" + hashlib.sha256(f"{ask_sender}\0{ask_id}".encode()).hexdigest()[:40]


def answered_ask(letter: Letter, *, local_peer_id: str) -> str | None:
    """The id of the ask of ours that `letter` claims to answer (an `answer` letter whose
    id is that ask's answer id), else None. Whether we asked it is the caller's to check."""
    if letter.kind is not LetterKind.ANSWER or letter.reply_to is None:
        return None
    return letter.reply_to if letter.id == answer_id(local_peer_id, letter.reply_to) else None


def check_letter(letter: Letter, *, sender: str, local_peer_id: str) -> None:
    """What a recipient checks before storing: from the peer that sent it, to us, signed."""
    if letter.sender != sender:
        raise PsymeshError("a letter must come from its sender", code=ErrorCode.FORBIDDEN)
    if letter.recipient != local_peer_id:
        raise PsymeshError("this letter is addressed to another peer", code=ErrorCode.BAD_REQUEST)
    if not letter.signature_valid():
        raise PsymeshError("the letter's signature does not verify", code=ErrorCode.FORBIDDEN)


MAX_BATCH = 256


class Receipt(Signed, BaseModel):
    """The recipient's signed word that it holds these letters of `sender`'s durably.

    signature = Ed25519 by the recipient over b"psymesh/receipt/v1\\x00" ||
                canonical_encode({at, ids, recipient, sender})   (protocol/signing.py)"""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")
    signing_context: ClassVar[bytes] = b"psymesh/receipt/v1\x00"
    signer_field: ClassVar[str] = "recipient"
    signer_role: ClassVar[str] = "recipient"

    recipient: PeerId
    sender: PeerId
    ids: list[LetterId] = Field(min_length=1, max_length=MAX_BATCH)
    at: int = Field(ge=0, lt=2**63)   # Unix ms, the recipient's clock
    signature: bytes = Field(default=b"", max_length=64)


def check_receipt(receipt: Receipt, *, recipient: str, local_peer_id: str) -> None:
    """What a sender checks before it takes a receipt as delivery: signed by the peer the
    letters went to, about letters from us (FORBIDDEN if not)."""
    if receipt.recipient != recipient or receipt.sender != local_peer_id or not receipt.signature_valid():
        raise PsymeshError("a receipt must be signed by the letters' recipient, about our letters",
                           code=ErrorCode.FORBIDDEN)


class MsgSend(Message):
    """Deliver one letter. Reply: `msg.receipt` once the recipient stored it."""

    type = "msg.send"
    letter: Letter


class ReceiptStatus(StrEnum):
    STORED = "stored"
    REFUSED = "refused"


class MsgReceipt(Message):
    type = "msg.receipt"
    durable = True  # `stored`: on disk before this is sent
    id: LetterId
    status: ReceiptStatus = ReceiptStatus.STORED
    proof: Receipt | None = None   # signed by the recipient over [id]


class MsgSendMany(Message):
    """Deliver up to MAX_BATCH letters at once (one frame, one admission pass, one transaction
    on each side). Reply: `msg.receipts`, one result per letter in the same order."""

    type = "msg.send_many"
    letters: list[Letter] = Field(min_length=1, max_length=MAX_BATCH)


class LetterResult(BaseModel):
    """What became of one letter of a batch. A refused one carries the code (and, when it is
    worth retrying, `retry_after`) that a lone `msg.send` would have got as its error."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="ignore")

    id: LetterId
    status: ReceiptStatus = ReceiptStatus.STORED
    code: ErrorCode | None = None
    reason: Annotated[str, Field(max_length=500)] = ""
    retry_after: float | None = None

    @classmethod
    def refused(cls, letter_id: str, exc: PsymeshError) -> "LetterResult":
        return cls(id=letter_id, status=ReceiptStatus.REFUSED, code=exc.code, reason=exc.message[:500],
                   retry_after=exc.retry_after)


class MsgReceipts(Message):
    type = "msg.receipts"
    durable = True
    results: list[LetterResult] = Field(max_length=MAX_BATCH)
    proof: Receipt | None = None   # signed by the recipient over the ids stored, in order


class MsgAck(Message):
    """Recipient -> sender: letters that reached the recipient another way (its mailbox)
    are stored. Admitted by the issuer rule: `receipt` is the requester's own, signed,
    about letters from us."""

    type = "msg.ack"
    receipt: Receipt


class MsgAckOk(Message):
    type = "msg.ack_ok"


class MsgMissing(Message):
    """Recipient -> sender: these tseqs of `thread` (the sender's thread to the requester)
    have not arrived while later ones wait: send them again (or their withdrawn stubs)."""

    type = "msg.missing"
    thread: Thread
    tseqs: list[Annotated[int, Field(ge=1, lt=2**63)]] = Field(min_length=1, max_length=MAX_BATCH)


class MsgMissingOk(Message):
    type = "msg.missing_ok"
    resending: int   # how many of them the sender holds and will send again


class InboxSettings(BaseModel):
    """config.toml `[inbox]`: what one sender's letters may take of this node's inbox.
    Sized so that a phone's disk is safe from each paired sender (8 MiB held, 64 MiB kept,
    the places of 8192 threads)
    and an honest sender never meets them: its courier has at most 256 letters (about
    4 MiB) in flight, so a gap it leaves holds no more than that."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    held_letters: int = Field(default=256, ge=1, le=1_000_000)           # held behind a gap, per sender
    held_bytes: int = Field(default=8 * 1024 * 1024, ge=64 * 1024, le=4 * 1024 ** 3)
    held_s: float = Field(default=86_400.0, ge=1.0, le=365 * 86_400.0)   # then the gap is given up
    kept_letters: int = Field(default=4096, ge=1, le=10_000_000)         # released, per sender (oldest go)
    kept_bytes: int = Field(default=64 * 1024 * 1024, ge=64 * 1024, le=64 * 1024 ** 3)
    # threads whose place is kept, per sender (a letter opening one more is refused `busy`); a
    # thread's place goes with its last letter, so the default, above kept_letters + held_letters
    # + a batch, is never met: the letter shares bound the threads. Set lower, a sender with that
    # many threads open waits until its oldest letters here are pruned.
    threads: int = Field(default=8192, ge=1, le=10_000_000)


# -- the receiver's ordering rule ------------------------------------------------------------
def releasable(held: Iterable[int], released_upto: int) -> list[int]:
    """Given the tseqs held (stored, not yet released) for one (sender, thread) and the last
    one released, the tseqs that may go to the app now, in order: the run that continues
    `released_upto` without a gap."""
    out: list[int] = []
    nxt = released_upto + 1
    for tseq in sorted(set(held)):
        if tseq < nxt:
            continue
        if tseq != nxt:
            break
        out.append(tseq)
        nxt += 1
    return out


def missing(held: Iterable[int], released_upto: int, limit: int = MAX_BATCH) -> list[int]:
    """The tseqs one (sender, thread) lacks: those after `released_upto` and before the
    highest held that are not held, lowest first, at most `limit`."""
    have = set(held)
    if not have:
        return []
    gaps = (t for t in range(released_upto + 1, max(have)) if t not in have)
    return list(itertools.islice(gaps, limit))

