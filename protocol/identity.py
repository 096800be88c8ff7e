"""Peer ids and fingerprints, computed from an Ed25519 public key with no libp2p import.

A libp2p Ed25519 peer id is base58btc(multihash-identity(protobuf PublicKey)), so the
public key can be read back out of the id: a manifest signed by a peer can be
verified from the peer id alone. The fingerprint is for people, like syncthing's
device id: base32 of SHA-256 of the key, in dash-separated groups.
"""
from __future__ import annotations

import functools
from typing import Annotated

import base64
import hashlib

import base58
from pydantic import AfterValidator

from .errors import ErrorCode, ProtocolError

# protobuf: field 1 (KeyType) = 1 (Ed25519), field 2 (Data) = 32 bytes
_ED25519_PROTO_PREFIX = b"\x08\x01\x12\x20"
# multihash: code 0x00 (identity), length 36
_IDENTITY_MULTIHASH_PREFIX = b"\x00\x24"


def peer_id_from_public_key(public_key: bytes) -> str:
    if len(public_key) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return base58.b58encode(_IDENTITY_MULTIHASH_PREFIX + _ED25519_PROTO_PREFIX + public_key).decode()


@functools.lru_cache(maxsize=1024)
def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 public key inside a `12D3KooW...` peer id, or ProtocolError.
    (Cached: every letter names two peer ids, checked at each parse.)"""
    try:
        raw = base58.b58decode(peer_id)
    except Exception:
        raise ProtocolError(f"not a base58 peer id: {peer_id[:64]!r}", code=ErrorCode.BAD_REQUEST) from None
    prefix = _IDENTITY_MULTIHASH_PREFIX + _ED25519_PROTO_PREFIX
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise ProtocolError(f"not an Ed25519 peer id: {peer_id[:64]!r}", code=ErrorCode.BAD_REQUEST)
    return raw[len(prefix):]


def checked_peer_id(value: str) -> str:
    """A pydantic check: `value` is a peer id with an Ed25519 key inside (the signer's)."""
    try:
        public_key_from_peer_id(value)
    except ProtocolError as exc:
        raise ValueError(exc.message) from None
    return value


# A message field holding a peer id: checked as it is parsed (every message module uses this one).
PeerId = Annotated[str, AfterValidator(checked_peer_id)]


def is_peer_id(text: str) -> bool:
    """Whether `text` is an Ed25519 peer id (as opposed to, say, a peer's name)."""
    try:
        public_key_from_peer_id(text)
    except ProtocolError:
        return False
    return True


def fingerprint(public_key: bytes, groups: int = 4) -> str:
    """A short, readable key fingerprint: e.g. `MFZW-IZLT-OQQG-S3TL` (80 bits)."""
    digest = base64.b32encode(hashlib.sha256(public_key).digest()).decode().rstrip("=")
    return "-".join(digest[i * 4:(i + 1) * 4] for i in range(groups))


def peer_fingerprint(peer_id: str) -> str:
    return fingerprint(public_key_from_peer_id(peer_id))
