"""Keys that rotate (sans-IO): the X25519 secrets behind a node's mail key and exit key.

A stolen key file should not open every letter or query ever recorded. So a ring holds one
*current* secret, used for everything sealed from now on, and replaced once it is
`rotate_s` old; the secret it replaces is *retired*: kept, to open what was sealed to it
and is still on its way, for `keep_s`, then deleted.

    mail key   keep_s = the mailbox's `[mail] keep_s`: a letter sealed to the old key may
               wait that long in the mailbox (a sender that seals to a key already gone is
               not cut off: its letter stays in its outbox and goes directly, §5.7)
    exit key   keep_s = the time the old key is still in date after it is replaced (its
               `not_after`) plus the replay window: no request sealed to it is fresh after

`next_deadline()` is the one instant at which `step(now)` has something to do (the next
rotation or the next deletion), so the node sets one timer for it and sleeps otherwise.

The file (`to_bytes`, kept 0600 by the node): b"psymesh/keyring/v1\\x00" || msgpack list of
[key_id, secret (32 bytes), created_at (float), retired_at (float or nil)], oldest first.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgpack
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from .errors import ErrorCode, PsymeshError

_MAGIC = b"psymesh/keyring/v1\x00"
MAX_KEY_ID = 255


@dataclass(frozen=True, eq=False)
class RingKey:
    """One secret of a ring: its id (1..255, the exit key's `key_id`), when it was made,
    and when it stopped being current (None while it is)."""

    key_id: int
    secret: X25519PrivateKey = field(repr=False)
    created_at: float
    retired_at: float | None = None

    @property
    def public(self) -> bytes:
        return self.secret.public_key().public_bytes_raw()


class KeyRing:
    """The current secret and the retired ones still kept (see the module docstring)."""

    def __init__(self, keys: Sequence[RingKey], *, rotate_s: float, keep_s: float) -> None:
        if rotate_s <= 0 or keep_s < 0:
            raise ValueError("a key ring rotates after a positive time and keeps for a non-negative one")
        if not keys or keys[-1].retired_at is not None or any(k.retired_at is None for k in keys[:-1]):
            raise ValueError("a key ring holds retired keys, then one current key")
        self.rotate_s = rotate_s
        self.keep_s = keep_s
        self._keys = list(keys)

    @classmethod
    def new(cls, now: float, *, rotate_s: float, keep_s: float) -> KeyRing:
        return cls([RingKey(1, X25519PrivateKey.generate(), now)], rotate_s=rotate_s, keep_s=keep_s)

    @property
    def current(self) -> RingKey:
        return self._keys[-1]

    @property
    def keys(self) -> list[RingKey]:
        """Every secret held, newest first (what to try when opening)."""
        return self._keys[::-1]

    def get(self, key_id: int) -> RingKey | None:
        return next((k for k in self._keys if k.key_id == key_id), None)

    def next_deadline(self) -> float:
        """When `step` next has work: the current key's rotation, or a retired key's deletion."""
        drops = (k.retired_at + self.keep_s for k in self._keys if k.retired_at is not None)
        return min(self.current.created_at + self.rotate_s, min(drops, default=math.inf))

    def step(self, now: float) -> bool:
        """Rotate if the current key is `rotate_s` old, delete retired keys kept `keep_s`;
        whether anything changed (then save the ring, and publish the new current key)."""
        changed = False
        if now >= self.current.created_at + self.rotate_s:
            held = {k.key_id for k in self._keys}
            key_id = self.current.key_id
            for _ in range(MAX_KEY_ID):
                key_id = key_id % MAX_KEY_ID + 1
                if key_id not in held:
                    break
            else:
                raise PsymeshError("every key id is held: rotate_s is too short for keep_s", code=ErrorCode.INTERNAL)
            self._keys[-1] = replace(self.current, retired_at=now)
            self._keys.append(RingKey(key_id, X25519PrivateKey.generate(), now))
            changed = True
        kept = [k for k in self._keys if k.retired_at is None or now < k.retired_at + self.keep_s]
        changed = changed or len(kept) != len(self._keys)
        self._keys = kept
        return changed

    def to_bytes(self) -> bytes:
        return _MAGIC + msgpack.packb([[k.key_id, k.secret.private_bytes_raw(), k.created_at, k.retired_at]
                                       for k in self._keys], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, *, rotate_s: float, keep_s: float) -> KeyRing:
        if not data.startswith(_MAGIC):
            raise PsymeshError("not a psymesh key ring (v1)", code=ErrorCode.BAD_REQUEST)
        try:
            rows = msgpack.unpackb(data[len(_MAGIC):], raw=False)
            keys = [RingKey(int(key_id), X25519PrivateKey.from_private_bytes(secret), float(created),
                            None if retired is None else float(retired))
                    for key_id, secret, created, retired in rows]
            return cls(keys, rotate_s=rotate_s, keep_s=keep_s)
        except (ValueError, TypeError, msgpack.UnpackException):
            raise PsymeshError("a damaged psymesh key ring", code=ErrorCode.BAD_REQUEST) from None
