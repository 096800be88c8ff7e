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

The sender keeps each letter in its outbox until a receipt comes back, resending with
backoff while the recipient is away. A letter the recipient refuses for good (its grant
changed, the letter is too large) is replaced on the wire by a *withdrawn* stub with the
same id and tseq (no text, no body), so the letters after it in its thread are not held
for ever; the sender's app sees the refusal.
"""
from __future__ import annotations

from typing import Any

import msgpack
from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Self

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, field_validator

from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.identity import peer_id_from_public_key, public_key_from_peer_id
from psymesh.protocol.manifest import Operation
from psymesh.protocol.messages import Message
from psymesh.protocol.tasks import JsonMap

_SIGNING_CONTEXT = b"psymesh/letter/v1\x00"
MAX_TEXT = 64 * 1024
MAX_THREAD = 128
LetterId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]
Thread = Annotated[str, Field(min_length=1, max_length=MAX_THREAD)]


class LetterKind(StrEnum):
    SEND = "send"
    ASK = "ask"
    ANSWER = "answer"


class Letter(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")

    id: LetterId
    sender: str
    recipient: str
    thread: Thread = "main"
    tseq: int = Field(ge=1, lt=2**63)
    kind: LetterKind = LetterKind.SEND
    text: str = Field(default="", max_length=MAX_TEXT)
    body: JsonMap = Field(default_factory=dict)
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

    def signing_bytes(self) -> bytes:
        """What the sender signs: a context string, then the letter without its signature as
        msgpack with every map's keys sorted, nil fields left out and floats as float64."""
        return _SIGNING_CONTEXT + msgpack.packb(_sorted(self.model_dump(mode="python", exclude={"signature"},
                                                                        exclude_none=True)), use_bin_type=True)

    def sign(self, key: Ed25519PrivateKey) -> Self:
        if peer_id_from_public_key(key.public_key().public_bytes_raw()) != self.sender:
            raise ValueError("the signing key is not the sender's key")
        return self.model_copy(update={"signature": key.sign(self.signing_bytes())})

    def signature_valid(self) -> bool:
        key = Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(self.sender))
        try:
            key.verify(self.signature, self.signing_bytes())
        except InvalidSignature:
            return False
        return True

    def stub(self) -> Self:
        """The withdrawn stand-in for this letter: same place in its thread, nothing in it.
        (Unsigned: sign it again.)"""
        return self.model_copy(update={"text": "", "body": {}, "withdrawn": True, "signature": b"",
                                       "kind": LetterKind.SEND, "reply_to": None})

    @property
    def payload_bytes(self) -> int:
        return len(self.text.encode()) + len(msgpack.packb(_sorted(self.body), use_bin_type=True))

    def operation(self) -> Operation:
        """What the recipient's manifest must allow (an `answer` is a kind of `send`)."""
        name = "msg.ask" if self.kind is LetterKind.ASK else "msg.send"
        return Operation(name=name, payload_bytes=self.payload_bytes)


def _sorted(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {key: _sorted(obj[key]) for key in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_sorted(item) for item in obj]
    return obj


def check_letter(letter: Letter, *, sender: str, local_peer_id: str) -> None:
    """What a recipient checks before storing: from the peer that sent it, to us, signed."""
    if letter.sender != sender:
        raise PsymeshError("a letter must come from its sender", code=ErrorCode.FORBIDDEN)
    if letter.recipient != local_peer_id:
        raise PsymeshError("this letter is addressed to another peer", code=ErrorCode.BAD_REQUEST)
    if not letter.signature_valid():
        raise PsymeshError("the letter's signature does not verify", code=ErrorCode.FORBIDDEN)


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


MAX_BATCH = 256


class MsgSendMany(Message):
    """Deliver up to MAX_BATCH letters at once (one frame, one admission pass, one transaction
    on each side). Reply: `msg.receipts`, one result per letter in the same order."""

    type = "msg.send_many"
    letters: list[Letter] = Field(min_length=1, max_length=MAX_BATCH)


class LetterResult(BaseModel):
    """What became of one letter of a batch. A refused one carries the code (and, when it is
    worth retrying, `retry_after`) that a lone `msg.send` would have got as its error."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: LetterId
    status: ReceiptStatus = ReceiptStatus.STORED
    code: ErrorCode | None = None
    reason: Annotated[str, Field(max_length=500)] = ""
    retry_after: float | None = None

    @classmethod
    def refused(cls, letter_id: str, exc: PsymeshError) -> LetterResult:
        return cls(id=letter_id, status=ReceiptStatus.REFUSED, code=exc.code, reason=exc.message[:500],
                   retry_after=exc.retry_after)


class MsgReceipts(Message):
    type = "msg.receipts"
    durable = True
    results: list[LetterResult] = Field(max_length=MAX_BATCH)


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

