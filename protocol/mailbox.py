"""Mailboxes for sleeping phones (sans-IO): the mail key a node publishes, a letter sealed
to it, the wire messages and the mailbox's limits.

A phone is often unreachable (asleep, between networks, behind a carrier NAT). It names a
*mailbox*: a paired node that is usually on (its home PC). It publishes a signed `MailKey`
(its X25519 public key and its mailbox's peer id) to every paired peer. A sender that has
not reached the phone for a short grace seals the signed letter to that key and deposits
it at the mailbox; the phone fetches its mail when it can reach the mailbox, opens each
letter, checks it and admits it through its own door as if the sender had delivered it.

    mail.key     {key}                    -> mail.key_ok {serial}       issuer-signed, any node keeps it
    mail.deposit {recipient, ref, sealed} -> mail.receipt {ref}         once held durably
    mail.fetch   {after, wait_s}          -> mail.item* ..., session.end after wait_s
    mail.ack     {upto}                   -> mail.acked {upto, held}    held rows up to `upto` deleted
    mail.leave_receipt {receipt}          -> mail.receipt_left {}       the owner's signed receipt, held
                                                                        for a sender it cannot reach
    mail.take_receipts {recipient}        -> mail.receipts_taken {receipts}   a sender takes what
                                                                        `recipient` left for it here

Sealing is HPKE (RFC 9180), base mode, single shot, with DHKEM(X25519, HKDF-SHA256),
HKDF-SHA256 and ChaCha20-Poly1305, as `cryptography` implements it: a published
construction with test vectors, rather than one of our own. `info` binds the recipient,
the sender and the letter's `ref`, so a sealed letter cannot be passed off as another's.
The letter is padded to the web path's size buckets first (1 KiB, 4 KiB, ... 2 MiB), so
the mailbox sees who deposited, for whom, which bucket and when; not the letter, not
its length, not its id (`ref` is a hash of the letter's signature: stable across re-deposits of the same
letter, meaningless without it).
"""
from __future__ import annotations

import hashlib
from typing import ClassVar

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ErrorCode, PsymeshError
from .identity import PeerId
from .manifest import Operation
from .signing import Signed
from .messages import Message
from .messaging import Letter, Receipt
from .oblivious import is_bucket, pad, unpad

_SEAL_CONTEXT = b"psymesh/mail/v2\x00"
_PAD_HEAD = b"\x01"             # the padded plaintext's version
_SUITE = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.CHACHA20_POLY1305)
SEAL_OVERHEAD = 32 + 16          # the encapsulated key, then the AEAD tag (sealed = bucket + this)
REF_BYTES = 16
MAX_WAIT_S = 600.0               # the longest a mailbox holds one fetch open
VIA_MAILBOX = "mailbox"          # how the audit log names a letter admitted from a mailbox



class MailSettings(BaseModel):
    """config.toml `[mail]`: the sender's patience and what a mailbox holds for one sender."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    # sender: how long a recipient must stay unreachable before its letters go to its mailbox
    grace_s: float = Field(default=5.0, ge=0.0, le=86_400.0)
    # owner: a new mail key this often (the old secret is kept `keep_s` more, then deleted)
    key_rotate_s: float = Field(default=7 * 86_400.0, ge=1.0, le=365 * 86_400.0)
    # recipient: how long a thread may wait behind a gap before its sender is asked for what is missing
    gap_s: float = Field(default=600.0, ge=1.0, le=30 * 86_400.0)
    # mailbox: how long mail waits for a recipient that does not fetch it, then it is dropped
    keep_s: float = Field(default=7 * 86_400.0, ge=60.0, le=365 * 86_400.0)
    # mailbox: what one sender may have held here at once (for all recipients together)
    max_items_per_sender: int = Field(default=1000, ge=1, le=1_000_000)
    max_bytes_per_sender: int = Field(default=32 * 1024 * 1024, ge=64 * 1024, le=4 * 1024 ** 3)


class MailKey(Signed, BaseModel):
    """A node's public mail key and the mailbox that holds its mail, signed by the node
    (`owner`). A larger `serial` replaces a smaller one; `mailbox` None withdraws the
    mailbox (senders then keep letters for the owner themselves). There is no expiry: a
    key that lapsed while its owner slept would bounce mail exactly when it is needed."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    signing_context: ClassVar[bytes] = b"psymesh/mailkey/v1\x00"
    signer_field: ClassVar[str] = "owner"
    signer_role: ClassVar[str] = "owner"

    owner: PeerId
    public: bytes = Field(min_length=32, max_length=32)   # X25519
    mailbox: PeerId | None = None
    serial: int = Field(ge=0, lt=2**63)
    signature: bytes = Field(default=b"", max_length=64)


def verify_mail_key(key: MailKey, *, sender: str) -> None:
    """A pushed mail key must be the sender's own, validly signed (FORBIDDEN if not)."""
    if key.owner != sender or not key.signature_valid():
        raise PsymeshError("a mail key must be the sender's own, validly signed", code=ErrorCode.FORBIDDEN)


# ---------------------------------------------------------------------------- sealing


def mail_ref(letter: Letter) -> bytes:
    """The mailbox's name for a letter: the first 16 bytes of SHA-256 of its signature."""
    return hashlib.sha256(letter.signature).digest()[:REF_BYTES]


def seal_info(recipient: str, sender: str, ref: bytes) -> bytes:
    """HPKE `info`: the context, then each of recipient, sender (UTF-8) and ref with a
    2-byte big-endian length in front."""
    parts = (recipient.encode(), sender.encode(), ref)
    return _SEAL_CONTEXT + b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def seal(letter: Letter, key: MailKey) -> bytes:
    """The signed letter (msgpack of all its fields) padded as a sealed web body is
    (protocol/oblivious.py `pad`: 0x01 || length || letter || zeros to a bucket) and sealed
    to `key`: enc (32 bytes) || ciphertext, so its size tells the mailbox only the bucket.
    TOO_LARGE for a letter over the largest bucket (it can only go directly)."""
    if key.owner != letter.recipient:
        raise ValueError("a letter is sealed to its recipient's key")
    plaintext = pad(_PAD_HEAD, msgpack.packb(letter.model_dump(mode="python"), use_bin_type=True))
    info = seal_info(letter.recipient, letter.sender, mail_ref(letter))
    return _SUITE.encrypt(plaintext, X25519PublicKey.from_public_bytes(key.public), info=info)


def unseal(sealed: bytes, secret: X25519PrivateKey, *, recipient: str, sender: str, ref: bytes) -> Letter:
    """Open a letter sealed to us and check it: it opens with our key under this recipient,
    sender and ref (FORBIDDEN if not), decodes (BAD_REQUEST), and is the letter the ref
    names, from that sender, to us, signed by the sender (FORBIDDEN)."""
    if not is_bucket(len(sealed) - SEAL_OVERHEAD):
        raise PsymeshError("a sealed letter is not one of the padding buckets", code=ErrorCode.BAD_FRAME)
    try:
        plaintext = _SUITE.decrypt(sealed, secret, info=seal_info(recipient, sender, ref))
    except (InvalidTag, ValueError):
        raise PsymeshError("the sealed letter does not open with this node's mail key", code=ErrorCode.FORBIDDEN) from None
    try:
        letter = Letter.model_validate(msgpack.unpackb(unpad(plaintext, len(_PAD_HEAD))[1], raw=False))
    except (ValueError, ValidationError, msgpack.UnpackException):
        raise PsymeshError("the sealed letter does not decode", code=ErrorCode.BAD_REQUEST) from None
    if (letter.sender != sender or letter.recipient != recipient or mail_ref(letter) != ref
            or not letter.signature_valid()):
        raise PsymeshError("the sealed letter is not the one deposited, or not signed by its sender",
                           code=ErrorCode.FORBIDDEN)
    return letter


# ---------------------------------------------------------------------------- wire


class MailKeyPush(Message):
    """A node hands a paired peer its current mail key (at start, and when it changes)."""

    type = "mail.key"
    key: MailKey


class MailKeyOk(Message):
    type = "mail.key_ok"
    serial: int    # the serial of the key now held for the owner (a newer one may be held already)


class MailDeposit(Message):
    """Hold this sealed letter for `recipient`, which named this node its mailbox. The
    sender is the peer that sent the request, as the Noise session authenticated it."""

    type = "mail.deposit"
    recipient: PeerId
    ref: bytes = Field(min_length=REF_BYTES, max_length=REF_BYTES)
    sealed: bytes = Field(min_length=SEAL_OVERHEAD)


    def operation(self) -> Operation:
        return Operation(name="mail.deposit", payload_bytes=len(self.sealed))


class MailReceipt(Message):
    type = "mail.receipt"
    durable = True  # the deposit is on disk before this is sent
    ref: bytes


class MailFetch(Message):
    """The caller's own held mail numbered above `after`, oldest first; then, for `wait_s`
    seconds, each new deposit as it arrives; then `session.end`."""

    type = "mail.fetch"
    after: int = Field(default=0, ge=0, lt=2**63)
    wait_s: float = Field(default=0.0, ge=0.0, le=MAX_WAIT_S)


class MailItem(Message):
    type = "mail.item"
    seq: int = Field(ge=1, lt=2**63)     # the mailbox's number for it, increasing
    sender: str
    ref: bytes
    at: float                            # when the mailbox took it, Unix seconds
    sealed: bytes


class MailAck(Message):
    """The caller stored every item it was sent numbered up to `upto`: delete them."""

    type = "mail.ack"
    upto: int = Field(ge=0, lt=2**63)


class MailAcked(Message):
    type = "mail.acked"
    upto: int
    held: int    # items still held for the caller


MAX_RECEIPTS = 64            # receipts handed over in one mail.receipts_taken


class MailLeaveReceipt(Message):
    """The owner -> its own mailbox: hold this signed receipt for its sender (the letters'
    sender could not be reached: two phones are seldom awake at once), as mail is held."""

    type = "mail.leave_receipt"
    receipt: Receipt


class MailReceiptLeft(Message):
    type = "mail.receipt_left"


class MailTakeReceipts(Message):
    """A sender -> `recipient`'s mailbox: the receipts `recipient` left here for me (each
    handed over once, then deleted)."""

    type = "mail.take_receipts"
    recipient: PeerId


class MailReceiptsTaken(Message):
    type = "mail.receipts_taken"
    receipts: list[Receipt] = Field(default_factory=list, max_length=MAX_RECEIPTS)
