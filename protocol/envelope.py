"""The envelope every frame body is: one msgpack map with a schema version `v` (an int) and a
`type` (a string naming the message) beside the message's own fields.

Apart from messages.py (the typed models) so that a reader that only needs the map, the
control API's one-shot client (node/control/oneshot.py) and the invite blob's decoder, does
not build pydantic: bytes -> map -> (type, fields), with every check a receiver makes of the
envelope itself. Receivers MUST ignore keys they do not know; a change that breaks old readers
bumps `v`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from .errors import ErrorCode, ProtocolError

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})


def seal(body: dict[str, Any], kind: str, envelope: Mapping[str, Any] | None = None) -> bytes:
    """A message's fields (`body`, which this takes over) as a frame body of type `kind`.
    `envelope` adds keys beside `v` and `type` that belong to the stream, not the message
    (a session's `rid` and `end`)."""
    if envelope:
        body.update(envelope)
    body["v"] = SCHEMA_VERSION
    body["type"] = kind
    return msgpack.packb(body, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("msgpack extension types are not used by psymesh")


def decode_map(body: bytes) -> dict[str, Any]:
    """msgpack bytes -> envelope map, or ProtocolError. Nothing else escapes."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception as exc:  # msgpack raises many types (ExtraData, StackError, ValueError, ...)
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a frame must hold a msgpack map")
    return obj


def open_envelope(obj: dict[str, Any]) -> str:
    """The type an envelope map names; `v` and `type` are taken out of it (what stays is the
    message's fields). ProtocolError for a version this node does not speak."""
    version = obj.pop("v", None)
    kind = obj.pop("type", None)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProtocolError("frame has no integer schema version 'v'")
    if version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            f"schema version {version} is not supported (this node speaks {sorted(SUPPORTED_VERSIONS)})",
            code=ErrorCode.UNSUPPORTED_VERSION,
        )
    if not isinstance(kind, str):
        raise ProtocolError("frame has no string 'type'")
    return kind
