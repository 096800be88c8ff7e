"""One way to sign: a context string, then the canonical msgpack of the signed fields.

Every signed object on the wire (a grant, a revocation notice, a mail key, a letter, a
receipt, an exit key, an address record) is signed the same way, by the peer one of its
fields names:

    signature = Ed25519(signer's identity key, context || canonical_encode(fields))

where `fields` are the object's fields without `signature`, nil ones left out at every
depth, and `context` names the kind (`psymesh/manifest/v1\\0`, ...), so a signature made
for one kind can never be passed off as another's. `Signed` is that rule, written once.

Canonical msgpack (`canonical_encode`): every map's keys sorted (by code point: the keys
are ASCII field names), arrays in order, ints in msgpack's smallest encoding, byte
strings as `bin`, text as `str` (msgpack-python's `packb(use_bin_type=True)`). Floats
have no place in signed grants and are refused unless the caller allows them (a letter's
free-form `body` may hold them). A number is signed by its *value*, never by the type or
width it arrived in, so that an encoder with one number type (JavaScript's) or other
widths (float32, int64 for small ints) signs the same bytes: a whole number in the 64-bit
range is an integer in its smallest form (2.0 -> 0x02, -0.0 -> 0x00), any other finite
float a float64 (0xcb); NaN and infinities are refused (the body is JSON).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, ClassVar, Self

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from .identity import peer_id_from_public_key, public_key_from_peer_id


_INT_RANGE = (-(2**63), 2**64 - 1)


def canonical_encode(obj: Any, *, floats: bool = False) -> bytes:
    """msgpack with sorted map keys: equal values always give equal bytes. A float is a
    TypeError unless `floats` (then a whole one is its integer, any other a float64)."""
    return msgpack.packb(_canonical(obj, floats), use_bin_type=True)


def _canonical(obj: Any, floats: bool, by_value: bool = True) -> Any:
    if isinstance(obj, dict):
        return {key: _canonical(obj[key], floats, by_value) for key in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_canonical(item, floats, by_value) for item in obj]
    if isinstance(obj, float):
        if not floats:
            raise TypeError("floats have no canonical encoding here; use integers")
        if not math.isfinite(obj):
            raise TypeError("NaN and infinities have no canonical encoding")
        if by_value and obj.is_integer() and _INT_RANGE[0] <= obj <= _INT_RANGE[1]:
            return int(obj)
    return obj


def legacy_encode(obj: Any) -> bytes:
    """The canonical form of releases before issue 34, which kept a float's type (2.0 as a
    float64): still accepted in their letters, never signed."""
    return msgpack.packb(_canonical(obj, True, by_value=False), use_bin_type=True)


@functools.lru_cache(maxsize=1024)
def verify(signer: str, signature: bytes, message: bytes) -> bool:
    """Ed25519 verification by `signer`'s peer id, memoized on the exact signed bytes: the
    door checks a grant on every request, and the same few come back again and again
    (~0.3 ms -> ~0.04 ms)."""
    key = Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(signer))
    try:
        key.verify(signature, message)
    except InvalidSignature:
        return False
    return True


class Signed:
    """Mixin for a pydantic model with a `signature` field, signed by the peer its
    `signer_field` names (`class Manifest(Signed, BaseModel)`; a mixin, not a base model,
    so each model keeps its own field order on the wire).

    Subclasses set `signing_context`, `signer_field` (and `signer_role`, the word the
    refusal to sign with a wrong key uses); `signing_floats` lets a float through (as
    float64) where the model's schema allows one."""

    signing_context: ClassVar[bytes] = b""
    signer_field: ClassVar[str] = ""
    signer_role: ClassVar[str] = ""
    signing_floats: ClassVar[bool] = False
    if TYPE_CHECKING:
        signature: bytes

        def model_dump(self, **kwargs: Any) -> dict[str, Any]: ...
        def model_copy(self, *, update: dict[str, Any]) -> Self: ...

    @property
    def signer(self) -> str:
        return str(getattr(self, self.signer_field))

    def signing_bytes(self) -> bytes:
        fields = self.model_dump(mode="python", exclude={"signature"}, exclude_none=True)
        return self.signing_context + canonical_encode(fields, floats=self.signing_floats)

    def sign(self, key: Ed25519PrivateKey) -> Self:
        """A copy signed by `key`, which must be the signer's identity key."""
        if peer_id_from_public_key(key.public_key().public_bytes_raw()) != self.signer:
            raise ValueError(f"the signing key is not the {self.signer_role}'s key")
        return self.model_copy(update={"signature": key.sign(self.signing_bytes())})

    def signature_valid(self) -> bool:
        if verify(self.signer, self.signature, self.signing_bytes()):
            return True
        if not self.signing_floats:
            return False
        # a sender of an older release signed a whole-number float as a float64
        fields = self.model_dump(mode="python", exclude={"signature"}, exclude_none=True)
        return verify(self.signer, self.signature, self.signing_context + legacy_encode(fields))
