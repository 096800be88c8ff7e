"""Two-hop web sealing (sans-IO): a phone's web query sealed to an exit's key, carried
by a relay that can read neither the query nor the answer. Oblivious HTTP (RFC 9458)
with our own labels, padding and replay guard.

The exit publishes a signed `ExitKey` (an X25519 public key, its `key_id` and suite,
valid until `not_after`). The phone seals a request (a packed `web.search`/`web.fetch`)
to it and hands it to a relay (`web.relay`, protocol/web.py); the relay passes it on
(`web.sealed`); the exit opens it with `Gateway.open`, runs it and seals the answer with
the returned `ResponseSealer`; the phone opens that with its `PendingResponse`.

Suite (HPKE, RFC 9180, base mode): DHKEM(X25519, HKDF-SHA256) = 0x0020, HKDF-SHA256 =
0x0001, ChaCha20-Poly1305 = 0x0003; so Nenc = 32, Nk = 32, Nn = 12, tag 16 bytes.

Exit key (what the exit signs with its Ed25519 identity key):

    signature = Ed25519(b"psymesh/web-key/v1\\x00" || canonical_encode({aead_id, exit,
                        kdf_id, kem_id, key_id, not_after, public_key}))

Request (RFC 9458 section 4.3, with label "psymesh web request"):

    hdr       = key_id (1 byte) || kem_id (2, big-endian) || kdf_id (2) || aead_id (2)
    info      = b"psymesh web request" || 0x00 || hdr
    plaintext = 0x01 (version) || sent_at_ms (8, big-endian, Unix ms) || len(body) (4) ||
                body || zero bytes up to the smallest bucket that holds it
    enc, ct   = HPKE SetupBaseS(exit public key, info); Seal(aad = b"", plaintext)
    sealed    = hdr || enc (32) || ct               -> len = bucket + 55

Response (RFC 9458 section 4.4, with label "psymesh web response"):

    secret    = context.Export(b"psymesh web response", max(Nn, Nk) = 32)
    nonce     = 32 random bytes
    prk       = HKDF-Extract(salt = enc || nonce, ikm = secret)        (SHA-256)
    key       = HKDF-Expand(prk, b"key", 32);  aead_nonce = HKDF-Expand(prk, b"nonce", 12)
    plaintext = 0x01 (version) || len(body) (4) || body || zero bytes up to a bucket
    sealed    = nonce || ChaCha20-Poly1305(key).Seal(aead_nonce, plaintext, aad = b"")
                                                    -> len = bucket + 48

Buckets (bytes of padded plaintext): 1 KiB, 4 KiB, 16 KiB, 64 KiB, 256 KiB, 1 MiB, 2 MiB.
A body whose framing does not fit 2 MiB is refused (TOO_LARGE) before sealing. A receiver
refuses a ciphertext whose length is not a bucket plus the tag, a frame whose length
field overruns its bucket or whose padding is not all zero (BAD_FRAME), and a version
other than 1 (UNSUPPORTED_VERSION): one layout, so the size of a sealed message says
only its bucket.

Who sees what. The relay sees the phone (its session), the exit (`web.relay.exit`),
each message's bucket, and timing; it can delay or drop, and a replay or an altered byte
is refused. The exit sees the relay (its session), the query, the answer and `sent_at`
(the phone's clock to the millisecond: a phone whose clock is off by a distinctive
amount can be told apart across its requests, within the window); never the phone's
peer id or address. The exit refuses a `sent_at` more than `window_s` (60 s) from its
own clock, and a second request with an `enc` it opened within that window (each
request's `enc` is a fresh ephemeral key, so an honest phone never repeats one).
"""
from __future__ import annotations

import heapq
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from pydantic import BaseModel, ConfigDict, Field
from pyhpke import AEADId, CipherSuite, KDFId, KEMId, PyHPKEError

from .errors import ErrorCode, PsymeshError
from .identity import PeerId
from .signing import Signed

_SECRET_MAGIC = b"psymesh/exit-secret/v1\x00"
REQUEST_LABEL = b"psymesh web request"
RESPONSE_LABEL = b"psymesh web response"

KEM_ID = KEMId.DHKEM_X25519_HKDF_SHA256.value
KDF_ID = KDFId.HKDF_SHA256.value
AEAD_ID = AEADId.CHACHA20_POLY1305.value
_SUITE = CipherSuite.new(KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.CHACHA20_POLY1305)
_NENC, _NK, _NN, _NT = 32, 32, 12, 16
_RESPONSE_SECRET_LEN = max(_NN, _NK)

BUCKETS = (1024, 4096, 16384, 65536, 262144, 1048576, 2097152)
_BUCKET_SET = frozenset(BUCKETS)
_VERSION = 1
_HDR = struct.Struct(">BHHH")          # key_id, kem_id, kdf_id, aead_id
_REQUEST_HEAD = struct.Struct(">BQ")   # version, sent_at_ms
_RESPONSE_HEAD = struct.Struct(">B")   # version
_LEN = struct.Struct(">I")
REQUEST_OVERHEAD = _HDR.size + _NENC + _NT            # sealed request = bucket + this
RESPONSE_OVERHEAD = _RESPONSE_SECRET_LEN + _NT        # sealed response = bucket + this
MAX_REQUEST_BODY = BUCKETS[-1] - _REQUEST_HEAD.size - _LEN.size
MAX_RESPONSE_BODY = BUCKETS[-1] - _RESPONSE_HEAD.size - _LEN.size



# ---------------------------------------------------------------------------- keys


class ExitKey(Signed, BaseModel):
    """An exit's public web key, signed by the exit. `key_id` names it in each sealed
    request so the exit can hold the next key beside this one while phones move over;
    `not_after` bounds how long a leaked private key stays useful."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    signing_context: ClassVar[bytes] = b"psymesh/web-key/v1\x00"
    signer_field: ClassVar[str] = "exit"
    signer_role: ClassVar[str] = "exit"

    exit: PeerId
    key_id: int = Field(ge=0, le=255)
    kem_id: int = Field(ge=0, le=0xFFFF)
    kdf_id: int = Field(ge=0, le=0xFFFF)
    aead_id: int = Field(ge=0, le=0xFFFF)
    public_key: bytes = Field(min_length=32, max_length=32)   # X25519
    not_after: int = Field(ge=0, lt=2**63)                     # Unix seconds
    signature: bytes = Field(default=b"", max_length=64)


def _check_suite(key: ExitKey) -> None:
    if (key.kem_id, key.kdf_id, key.aead_id) != (KEM_ID, KDF_ID, AEAD_ID):
        raise PsymeshError(
            f"unsupported HPKE suite (kem {key.kem_id:#06x}, kdf {key.kdf_id:#06x}, aead {key.aead_id:#06x});"
            " psymesh seals with X25519, HKDF-SHA256, ChaCha20-Poly1305", code=ErrorCode.BAD_REQUEST)


def verify_exit_key(key: ExitKey, *, exit: str, now: float, signature_verified: bool = False) -> None:
    """Check a key before sealing to it: it is `exit`'s own, validly signed (FORBIDDEN),
    in our suite (BAD_REQUEST), and not past `not_after` (EXPIRED). `signature_verified`:
    the caller verified this very key's signature before (an equal key: same fields, same
    signature), so only the rest is checked again."""
    if key.exit != exit or not (signature_verified or key.signature_valid()):
        raise PsymeshError("an exit key must be the exit's own, validly signed", code=ErrorCode.FORBIDDEN)
    _check_suite(key)
    if now > key.not_after:
        raise PsymeshError(f"the exit key {key.key_id} expired at {key.not_after}", code=ErrorCode.EXPIRED)


def consistent_key(ours: ExitKey, relays: ExitKey, *, exit: str, now: float,
                   signature_verified: bool = False) -> ExitKey:
    """The key to seal to: the relay's view of the exit's key (checked: the exit's own,
    signed, in date), which the relay shows every asker alike. CONFLICT if the exit handed
    us a different public key under the same `key_id`: it keeps a key per asker, and
    sealing to either would let it tell us apart. `signature_verified` as in `verify_exit_key`,
    for the relay's view."""
    verify_exit_key(relays, exit=exit, now=now, signature_verified=signature_verified)
    if ours.key_id == relays.key_id and ours.public_key != relays.public_key:
        raise PsymeshError(f"exit {exit} handed this node a key other than the one its relay sees under key id"
                           f" {ours.key_id}: it may be telling askers apart; not sealing to it",
                           code=ErrorCode.CONFLICT)
    return relays


@dataclass(frozen=True, eq=False)
class ExitSecret:
    """The exit's private X25519 key for one `key_id`. `to_bytes` is for the node's 0600
    key file: b"psymesh/exit-secret/v1\\x00" || key_id (1 byte) || private key (32)."""

    key_id: int
    private_key: X25519PrivateKey = field(repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.key_id <= 255:
            raise ValueError("a key id is one byte")

    @classmethod
    def generate(cls, key_id: int) -> ExitSecret:
        return cls(key_id, X25519PrivateKey.generate())

    def to_bytes(self) -> bytes:
        return _SECRET_MAGIC + bytes([self.key_id]) + self.private_key.private_bytes_raw()

    @classmethod
    def from_bytes(cls, data: bytes) -> ExitSecret:
        if len(data) != len(_SECRET_MAGIC) + 1 + 32 or not data.startswith(_SECRET_MAGIC):
            raise PsymeshError("not a psymesh exit secret (v1)", code=ErrorCode.BAD_REQUEST)
        raw = data[len(_SECRET_MAGIC):]
        return cls(raw[0], X25519PrivateKey.from_private_bytes(raw[1:]))

    def public(self, identity_key: Ed25519PrivateKey, exit: str, now: float, ttl_s: float) -> ExitKey:
        """The signed `ExitKey` for this secret, valid for `ttl_s` seconds from `now`."""
        if ttl_s <= 0:
            raise ValueError("an exit key needs a positive lifetime")
        return ExitKey(
            exit=exit, key_id=self.key_id, kem_id=KEM_ID, kdf_id=KDF_ID, aead_id=AEAD_ID,
            public_key=self.private_key.public_key().public_bytes_raw(), not_after=int(now + ttl_s),
        ).sign(identity_key)


# ---------------------------------------------------------------------------- padding


def pad(head: bytes, body: bytes) -> bytes:
    """head || len(body) (4 bytes, big-endian) || body || zeros, to the smallest bucket
    that holds it all (also how sealed mail is padded, protocol/mailbox.py)."""
    size = len(head) + _LEN.size + len(body)
    bucket = next((b for b in BUCKETS if size <= b), None)
    if bucket is None:
        limit = BUCKETS[-1] - len(head) - _LEN.size
        raise PsymeshError(f"a sealed body is at most {limit} bytes, not {len(body)}", code=ErrorCode.TOO_LARGE)
    return b"".join((head, _LEN.pack(len(body)), body, bytes(bucket - size)))


def unpad(plaintext: bytes, head_size: int) -> tuple[bytes, bytes]:
    """(head, body) of a padded plaintext whose head starts with the version byte 1; the
    caller checked its length is a bucket (`is_bucket`)."""
    if plaintext[0] != _VERSION:
        raise PsymeshError(f"sealed frame version {plaintext[0]} is not 1", code=ErrorCode.UNSUPPORTED_VERSION)
    (length,) = _LEN.unpack_from(plaintext, head_size)
    start = head_size + _LEN.size
    end = start + length
    if end > len(plaintext) or plaintext.count(0, end) != len(plaintext) - end:
        raise PsymeshError("a sealed frame's length overruns it, or its padding is not zero",
                           code=ErrorCode.BAD_FRAME)
    return plaintext[:head_size], plaintext[start:end]


def is_bucket(size: int) -> bool:
    """Whether `size` bytes of plaintext is one of the padding buckets."""
    return size in _BUCKET_SET


def _check_sealed_size(ciphertext_len: int, what: str) -> None:
    if not is_bucket(ciphertext_len - _NT):
        raise PsymeshError(f"a sealed web {what} is not one of the padding buckets", code=ErrorCode.BAD_FRAME)


# ---------------------------------------------------------------------------- response keys


def _response_key_nonce(secret: bytes, enc: bytes, response_nonce: bytes, *, nk: int, nn: int) -> tuple[bytes, bytes]:
    """RFC 9458 section 4.4: the response's AEAD key and nonce, from the exported secret,
    the request's `enc` and the response's own random nonce."""
    extract = hmac.HMAC(enc + response_nonce, hashes.SHA256())
    extract.update(secret)
    prk = extract.finalize()
    key = HKDFExpand(hashes.SHA256(), nk, b"key").derive(prk)
    nonce = HKDFExpand(hashes.SHA256(), nn, b"nonce").derive(prk)
    return key, nonce


class PendingResponse:
    """The phone's half of one exchange: what it needs to open the exit's answer."""

    __slots__ = ("_enc", "_secret")

    def __init__(self, enc: bytes, secret: bytes) -> None:
        self._enc = enc
        self._secret = secret

    def open(self, sealed_response: bytes) -> bytes:
        """The exit's answer body. BAD_FRAME if malformed; FORBIDDEN if it does not open
        (not this exit's answer to this request, or altered on the way)."""
        if len(sealed_response) < _RESPONSE_SECRET_LEN:
            raise PsymeshError("a sealed web reply is shorter than its nonce", code=ErrorCode.BAD_FRAME)
        response_nonce, ct = sealed_response[:_RESPONSE_SECRET_LEN], sealed_response[_RESPONSE_SECRET_LEN:]
        _check_sealed_size(len(ct), "reply")
        key, nonce = _response_key_nonce(self._secret, self._enc, response_nonce, nk=_NK, nn=_NN)
        try:
            plaintext = ChaCha20Poly1305(key).decrypt(nonce, ct, b"")
        except InvalidTag:
            raise PsymeshError("the sealed web reply does not open: it is not the exit's answer to this"
                               " request, or it was altered on the way", code=ErrorCode.FORBIDDEN) from None
        return unpad(plaintext, _RESPONSE_HEAD.size)[1]


class ResponseSealer:
    """The exit's half of one exchange: seals the answer so only the asker opens it."""

    __slots__ = ("_enc", "_secret")

    def __init__(self, enc: bytes, secret: bytes) -> None:
        self._enc = enc
        self._secret = secret

    def seal(self, body: bytes) -> bytes:
        """response_nonce || ct; TOO_LARGE if `body` is over MAX_RESPONSE_BODY."""
        plaintext = pad(_RESPONSE_HEAD.pack(_VERSION), body)
        response_nonce = os.urandom(_RESPONSE_SECRET_LEN)
        key, nonce = _response_key_nonce(self._secret, self._enc, response_nonce, nk=_NK, nn=_NN)
        return response_nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, b"")


# ---------------------------------------------------------------------------- request


def _request_info(hdr: bytes) -> bytes:
    return REQUEST_LABEL + b"\x00" + hdr


def seal_request(key: ExitKey, body: bytes, *, now: float) -> tuple[bytes, PendingResponse]:
    """Seal `body` to `key` (verify it first with `verify_exit_key`): the bytes for
    `web.relay.sealed`, and what opens the answer. TOO_LARGE over MAX_REQUEST_BODY."""
    _check_suite(key)
    plaintext = pad(_REQUEST_HEAD.pack(_VERSION, round(now * 1000)), body)
    hdr = _HDR.pack(key.key_id, key.kem_id, key.kdf_id, key.aead_id)
    try:
        enc, context = _SUITE.create_sender_context(_SUITE.kem.deserialize_public_key(key.public_key),
                                                    info=_request_info(hdr))
    except (PyHPKEError, ValueError):
        raise PsymeshError("the exit key is not a usable X25519 public key", code=ErrorCode.BAD_REQUEST) from None
    sealed = hdr + enc + context.seal(plaintext)
    return sealed, PendingResponse(enc, context.export(RESPONSE_LABEL, _RESPONSE_SECRET_LEN))


@dataclass(frozen=True, eq=False)
class Opened:
    """A sealed request the exit could decrypt, not yet judged fresh: its body, when the
    phone says it sent it, its `enc` (the replay guard's name for it), and the sealer for
    the answer. Once a request is opened every refusal goes back sealed with `sealer`,
    so the relay cannot tell an expired or replayed request from an answer."""

    body: bytes
    sent_at: float
    enc: bytes
    sealer: ResponseSealer = field(repr=False)


@dataclass(frozen=True)
class Remembered:
    """One enc the replay guard holds, until `forget_at` (sent_at + window): what an exit
    keeps on disk so that a restart does not forget the window."""

    enc: bytes
    forget_at: float


class Gateway:
    """The exit's side: opens sealed requests with its secrets (by `key_id`), refusing
    stale, future-dated and replayed ones.

    A request is fresh while |now - sent_at| <= window_s; its `enc` is remembered until
    sent_at + window_s, after which the timestamp alone refuses it. When `max_remembered`
    encs are held, new requests get BUSY (retry_after: when the oldest is forgotten)
    rather than an old enc being forgotten early: forgetting it would let a relay replay
    that request inside its window, running it twice and watching what the exit does.
    At the default cap that is about 20 MB, reached only at ~1,700 requests a second.
    Rotate keys with `set_secrets` on the same Gateway: a new one would forget the window,
    unless it is given what the old one remembered (`remembered=`, as the exit restores it
    from disk after a restart)."""

    def __init__(self, secrets: Mapping[int, ExitSecret], *, window_s: float = 60.0,
                 max_remembered: int = 100_000, remembered: Iterable[Remembered] = ()) -> None:
        if window_s <= 0 or max_remembered < 1:
            raise ValueError("a gateway needs a positive window and room to remember")
        self._window_s = window_s
        self._max_remembered = max_remembered
        self._seen: set[bytes] = set()
        self._forget_at: list[tuple[float, bytes]] = []    # heap: (sent_at + window_s, enc)
        for item in remembered:
            if item.enc not in self._seen:
                self._seen.add(item.enc)
                self._forget_at.append((item.forget_at, item.enc))
        heapq.heapify(self._forget_at)
        self.set_secrets(secrets)

    @property
    def window_s(self) -> float:
        return self._window_s

    def set_secrets(self, secrets: Mapping[int, ExitSecret]) -> None:
        """Replace the keys requests may be sealed to (say, the current and the next)."""
        if any(secret.key_id != key_id for key_id, secret in secrets.items()):
            raise ValueError("each exit secret must be filed under its own key id")
        self._secrets = {key_id: _SUITE.kem.deserialize_private_key(secret.private_key.private_bytes_raw())
                         for key_id, secret in secrets.items()}

    @property
    def remembered(self) -> int:
        """How many encs are held against replay."""
        return len(self._seen)

    def open(self, sealed: bytes, *, now: float) -> tuple[bytes, ResponseSealer]:
        """`decrypt` then `admit`: the request body, and the sealer for its answer."""
        opened = self.decrypt(sealed)
        self.admit(opened, now=now)
        return opened.body, opened.sealer

    def decrypt(self, sealed: bytes) -> Opened:
        """Open a sealed request (not yet judged fresh: `admit` does). Refuses, unsealed
        (there is no one to seal to yet): malformed or undecryptable (BAD_FRAME), unknown
        key id or suite (BAD_REQUEST), a version other than 1 (UNSUPPORTED_VERSION)."""
        if len(sealed) < _HDR.size + _NENC:
            raise PsymeshError("a sealed web request is shorter than its header", code=ErrorCode.BAD_FRAME)
        key_id, kem_id, kdf_id, aead_id = _HDR.unpack_from(sealed)
        if (kem_id, kdf_id, aead_id) != (KEM_ID, KDF_ID, AEAD_ID):
            raise PsymeshError(f"unsupported HPKE suite (kem {kem_id:#06x}, kdf {kdf_id:#06x}, aead {aead_id:#06x})",
                               code=ErrorCode.BAD_REQUEST)
        secret = self._secrets.get(key_id)
        if secret is None:
            raise PsymeshError(f"no exit key {key_id} here (rotated? fetch the exit's current key)",
                               code=ErrorCode.BAD_REQUEST)
        hdr, enc, ct = sealed[:_HDR.size], sealed[_HDR.size:_HDR.size + _NENC], sealed[_HDR.size + _NENC:]
        _check_sealed_size(len(ct), "request")
        try:
            context = _SUITE.create_recipient_context(enc, secret, info=_request_info(hdr))
            plaintext = context.open(ct)
        except (PyHPKEError, ValueError):
            raise PsymeshError("the sealed web request does not open with this exit's key",
                               code=ErrorCode.BAD_FRAME) from None
        head, body = unpad(plaintext, _REQUEST_HEAD.size)
        sent_at = _REQUEST_HEAD.unpack(head)[1] / 1000
        return Opened(body, sent_at, enc, ResponseSealer(enc, context.export(RESPONSE_LABEL, _RESPONSE_SECRET_LEN)))

    def admit(self, opened: Opened, *, now: float) -> Remembered:
        """Judge an opened request fresh and remember it; what is now remembered (for the
        exit to keep on disk). Refuses (seal these with `opened.sealer`): sent_at out of
        the window (EXPIRED), a replay (CONFLICT), a full replay memory (BUSY)."""
        self._forget(now)
        if abs(now - opened.sent_at) > self._window_s:
            raise PsymeshError("stale or future-dated request", code=ErrorCode.EXPIRED,
                               details={"window_s": self._window_s})
        if opened.enc in self._seen:
            raise PsymeshError("replayed request", code=ErrorCode.CONFLICT)
        if len(self._seen) >= self._max_remembered:
            raise PsymeshError("too many recent requests to guard against replay; retry shortly",
                               code=ErrorCode.BUSY, retry_after=max(0.0, self._forget_at[0][0] - now))
        self._seen.add(opened.enc)
        item = Remembered(opened.enc, opened.sent_at + self._window_s)
        heapq.heappush(self._forget_at, (item.forget_at, item.enc))
        return item

    def _forget(self, now: float) -> None:
        """Drop encs whose requests the timestamp check now refuses on its own."""
        while self._forget_at and self._forget_at[0][0] < now:
            self._seen.discard(heapq.heappop(self._forget_at)[1])
