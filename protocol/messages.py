"""Messages: frozen pydantic models, encoded as one msgpack map per frame.

Every frame body is a msgpack map with two envelope keys, `v` (schema version, an
int) and `type` (a string naming the message), plus the message's own fields
(envelope.py: the map and its checks, without the models). Receivers MUST ignore keys
they do not know, so fields can be added without a version bump; a change that breaks
old readers bumps `v`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .envelope import SCHEMA_VERSION, decode_map, open_envelope, seal
from .errors import ProtocolError
from .wiretypes import wire_type_error

__all__ = ["SCHEMA_VERSION", "Message", "decode_map", "first_error", "from_map", "message_types", "pack", "unpack"]

_REGISTRY: dict[str, type["Message"]] = {}


def first_error(exc: ValidationError) -> tuple[str, str]:
    """A validation failure in a person's words: where (`tools[0].name`, "" for the whole
    model) and what, without pydantic's wrapping ("1 validation error for ...", "Value error, ")."""
    first = exc.errors(include_url=False)[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first.get("loc", ())).lstrip(".")
    return where, str(first.get("msg", "invalid")).removeprefix("Value error, ")
M = TypeVar("M", bound="Message")


class Message(BaseModel):
    """Base of every wire message. Subclasses set `type` and are registered by it."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=False, defer_build=True)
    type: ClassVar[str] = ""
    # An answer that promises what it acknowledges is on disk (task.accepted, msg.receipt, ...):
    # the node sends it only after the transaction behind it is synced (node/core/db.py WalSync).
    durable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("type")
        if name:
            if name in _REGISTRY and _REGISTRY[name] is not cls:
                raise TypeError(f"message type {name!r} registered twice")
            _REGISTRY[name] = cls


# The modules that define messages: imported when a type is not known yet (a process
# imports only the ones it uses; a peer may send any of them).
MESSAGE_MODULES = ("addresses", "common", "compute", "control.common", "control.messaging", "control.node", "control.tasks",
                   "control.trust", "control.web", "dialback", "mailbox", "manifest", "messaging", "pairing", "runner",
                   "session", "tasks", "web")
_ALL_LOADED = False


def _load_all() -> dict[str, type["Message"]]:
    global _ALL_LOADED
    import importlib

    for name in MESSAGE_MODULES:
        importlib.import_module(f"psymesh.protocol.{name}")
    _ALL_LOADED = True
    return _REGISTRY


def message_types() -> dict[str, type[Message]]:
    """Every message type of the protocol, by name."""
    return dict(_load_all())


def pack(message: Message, envelope: Mapping[str, Any] | None = None) -> bytes:
    """Encode a message as a frame body (no length prefix). `envelope` adds keys beside `v`
    and `type` that belong to the stream, not the message (a session's `rid` and `end`)."""
    return seal(message.model_dump(mode="python"), message.type, envelope)


def unpack(body: bytes) -> Message:
    """Decode a frame body into its registered message class, validating every field."""
    return from_map(decode_map(body))


def from_map(obj: dict[str, Any]) -> Message:
    """The message an envelope map holds (`v` and `type` are consumed)."""
    kind = open_envelope(obj)
    cls = _REGISTRY.get(kind)
    if cls is None and not _ALL_LOADED:
        cls = _load_all().get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    if (problem := wire_type_error(cls, obj)) is not None:  # "1" is not 1 on the wire (§3)
        raise ProtocolError(f"invalid {kind!r} message: {problem}")
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        where, what = first_error(exc)
        raise ProtocolError(f"invalid {kind!r} message: {where or '(message)'}: {what}") from None
    except Exception as exc:  # a validator bug must still not escape as anything but ProtocolError
        raise ProtocolError(f"invalid {kind!r} message: {type(exc).__name__}") from None
