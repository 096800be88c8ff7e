"""A GGUF file's metadata, read from its header alone: what `psymesh model add` needs.

`gguf.GGUFReader` maps the whole file and builds a numpy view of every array and tensor
(the tokenizer's 49k-250k strings among them): 2 s for a 98 MB model, and the reason
`model add` took 4.7 s. The scalars of the key-value section are all `model add` reads
(the architecture, its context length and attention shapes), so this reads that section
sequentially, keeps the scalar values and short numeric arrays (a per-layer head count)
and skips the others (seeking over numeric ones; string arrays by their length prefixes),
and never touches the tensor infos or the tensor data. Layout per the GGUF spec
(ggml/docs/gguf.md), little-endian, versions 2-3:
``"GGUF" u32 version, u64 tensor_count, u64 kv_count`` then per pair a string key, a u32
value type and the value; a string is ``u64 length`` + UTF-8 bytes, an array ``u32 item
type, u64 count`` + items.

Bounded: at most MAX_KV pairs, a scalar string of at most MAX_STRING bytes, and a file
that ends early or names an unknown type is a GgufHeaderError, never a hang.
"""
from __future__ import annotations

import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ...protocol.errors import ErrorCode, PsymeshError

__all__ = ["GgufHeader", "GgufHeaderError", "read_gguf_header"]

MAGIC = b"GGUF"
MAX_KV = 1 << 16
MAX_STRING = 1 << 24         # a chat template is tens of KB; a scalar string past 16 MiB is no header of ours
_READ_BUFFER = 1 << 20

_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALARS: dict[int, struct.Struct] = {
    0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"), 3: struct.Struct("<h"),
    4: struct.Struct("<I"), 5: struct.Struct("<i"), 6: struct.Struct("<f"), _BOOL: struct.Struct("<?"),
    10: struct.Struct("<Q"), 11: struct.Struct("<q"), 12: struct.Struct("<d"),
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

MAX_KEPT_ARRAY = 1024        # numeric arrays up to this long are kept (per-layer values); longer ones skipped

Scalar = int | float | bool | str
Value = Scalar | tuple[int | float | bool, ...]


class GgufHeaderError(PsymeshError):
    """Not a GGUF file this reader understands, or one cut short."""

    default_code = ErrorCode.BAD_REQUEST


@dataclass(frozen=True)
class GgufHeader:
    """The metadata of a GGUF (string arrays and long arrays skipped), and its counts."""

    version: int
    tensor_count: int
    values: Mapping[str, Value]
    found: frozenset[str] = frozenset()  # of the strings asked for, those some string array holds

    def int(self, key: str) -> int | None:
        """An integer value; of a per-layer array, its largest item."""
        value = self.values.get(key)
        if isinstance(value, tuple):
            ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
            return max(ints) if ints else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def str(self, key: str) -> str | None:
        value = self.values.get(key)
        return value if isinstance(value, str) else None

    @property
    def architecture(self) -> str:
        return self.str("general.architecture") or ""


def read_gguf_header(path: Path, find: Collection[str] = ()) -> GgufHeader:
    """The header of the GGUF at `path` (GgufHeaderError if it is none; OSError if unreadable);
    `find`: short strings to look for in its string arrays (a vocabulary's special tokens), as
    they are skipped: `found` says which are there."""
    with open(path, "rb", buffering=_READ_BUFFER) as f:
        return _Reader(f, path, find).header()


class _Reader:
    def __init__(self, f: BinaryIO, path: Path, find: Collection[str] = ()) -> None:
        self.f, self.path = f, path
        self.wanted = {s.encode(): s for s in find}
        self.lengths = {len(b) for b in self.wanted}
        self.found: set[str] = set()

    def _bytes(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GgufHeaderError(f"{self.path} ends inside its GGUF header")
        return data

    def _unpack(self, fmt: struct.Struct) -> int | float | bool:
        return fmt.unpack(self._bytes(fmt.size))[0]  # type: ignore[no-any-return]

    def _skip(self, n: int) -> None:
        self.f.seek(n, 1)

    def _string(self) -> str:
        n = int(self._unpack(_U64))
        if n > MAX_STRING:
            raise GgufHeaderError(f"{self.path}: a metadata string of {n} bytes (at most {MAX_STRING})")
        return self._bytes(n).decode("utf-8", errors="replace")

    def header(self) -> GgufHeader:
        if self._bytes(4) != MAGIC:
            raise GgufHeaderError(f"{self.path} is not a GGUF file")
        version = int(self._unpack(_U32))
        if version not in (2, 3):
            raise GgufHeaderError(f"{self.path}: GGUF version {version} is not one this reader knows (2, 3)")
        tensors, count = int(self._unpack(_U64)), int(self._unpack(_U64))
        if count > MAX_KV:
            raise GgufHeaderError(f"{self.path}: {count} metadata pairs (at most {MAX_KV})")
        values: dict[str, Value] = {}
        for _ in range(count):
            key = self._string()
            kind = int(self._unpack(_U32))
            if kind == _STRING:
                values[key] = self._string()
            elif kind == _ARRAY:
                kept = self._array()
                if kept is not None:
                    values[key] = kept
            elif kind in _SCALARS:
                values[key] = self._unpack(_SCALARS[kind])
            else:
                raise GgufHeaderError(f"{self.path}: metadata {key!r} has an unknown value type {kind}")
        return GgufHeader(version=version, tensor_count=tensors, values=values, found=frozenset(self.found))

    def _skip_strings(self, n: int) -> None:
        """Past `n` length-prefixed strings (a vocabulary: 49k-250k of them, and as many merges),
        walking their lengths in 1 MiB chunks rather than with a read and a seek each."""
        buf, at = b"", 0
        for _ in range(n):
            if len(buf) - at < 8:
                buf, at = buf[at:] + self.f.read(_READ_BUFFER), 0
                if len(buf) < 8:
                    raise GgufHeaderError(f"{self.path} ends inside its GGUF header")
            n = _U64.unpack_from(buf, at)[0]
            if n in self.lengths and at + 8 + n <= len(buf) and buf[at + 8:at + 8 + n] in self.wanted:
                self.found.add(self.wanted[buf[at + 8:at + 8 + n]])
            at += 8 + n
            if at > len(buf):  # a string longer than what is buffered: seek past the rest of it
                self._skip(at - len(buf))
                buf, at = b"", 0
        self._skip(at - len(buf))  # back to just after the last string

    def _array(self) -> tuple[int | float | bool, ...] | None:
        """A short numeric array's items; None for the others, skipped."""
        kind, n = int(self._unpack(_U32)), int(self._unpack(_U64))
        if kind in _SCALARS and n <= MAX_KEPT_ARRAY:
            fmt = _SCALARS[kind]
            return tuple(v[0] for v in fmt.iter_unpack(self._bytes(n * fmt.size)))
        if kind in _SCALARS:
            self._skip(n * _SCALARS[kind].size)
        elif kind == _STRING:
            self._skip_strings(n)
        else:
            raise GgufHeaderError(f"{self.path}: an array of value type {kind} (nested arrays are not read)")
        return None
