"""Rotating X25519 key rings on disk (protocol/keyring.py): the mail key (`mail.key`) and the
exit key (`web-exit.key`), each a 0600 file in the home, rewritten whole (a temporary file,
fsync, rename) whenever the ring rotates or deletes a retired key, so a deleted secret is gone
from the file at once. A file from before rings (one bare key) becomes a ring of that key,
counted as made now."""
from __future__ import annotations

import os
from collections.abc import Callable

from .home import NodeHome
from .paths import os_error
from ...protocol.keyring import KeyRing, RingKey

Legacy = Callable[[bytes, float], RingKey | None]
"""(old file's bytes, now) -> the one key it held, or None if it is not that format either."""


def load_ring(home: NodeHome, name: str, *, rotate_s: float, keep_s: float, now: float,
              legacy: Legacy | None = None) -> KeyRing:
    """The ring in `<home>/<name>`, made (and saved) on first use; stepped to `now`."""
    path = home.private_file(name)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise os_error(exc, path) from None
    old = legacy(data, now) if data and legacy is not None else None
    if not data:
        ring = KeyRing.new(now, rotate_s=rotate_s, keep_s=keep_s)
    elif old is not None:
        ring = KeyRing([old], rotate_s=rotate_s, keep_s=keep_s)
    else:
        ring = KeyRing.from_bytes(data, rotate_s=rotate_s, keep_s=keep_s)
    if ring.step(now) or not data or old is not None:
        save_ring(home, name, ring)
    return ring


def save_ring(home: NodeHome, name: str, ring: KeyRing) -> None:
    path = home.path / name
    temporary = home.private_file(name + ".new")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        with os.fdopen(fd, "wb") as f:
            f.write(ring.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        raise os_error(exc, path) from None
