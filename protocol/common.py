"""Messages shared by every service: the typed error reply and ping."""

from typing import Any

from pydantic import Field

from .errors import ErrorCode, ProtocolError, PsymeshError, RemoteError
from .messages import M, Message


class Error(Message):
    """A refused or failed request. `code` is stable (see ErrorCode); `message` is for people."""

    type = "error"
    code: str
    message: str = ""
    retry_after: float | None = None
    details: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_exception(cls, exc: PsymeshError) -> "Error":
        return cls(code=exc.code.value, message=exc.message, retry_after=exc.retry_after, details=exc.details)

    @classmethod
    def of(cls, code: ErrorCode, message: str, **kw: Any) -> "Error":
        return cls(code=code.value, message=message, **kw)

    def to_exception(self) -> RemoteError:
        return RemoteError(self.message, code=self.code, retry_after=self.retry_after, details=self.details)


class Ping(Message):
    """`/psymesh/ping/1.0.0`: echo `payload` back in a Pong with the same `seq`."""

    type = "ping"
    seq: int = Field(ge=0)
    payload: bytes = b""


class Pong(Message):
    """`time`: the responder's wall clock as it answered (Unix seconds), so the asker can
    see how far apart their clocks are (grants and replay windows depend on them). Older
    nodes send none (None)."""

    type = "pong"
    seq: int = Field(ge=0)
    payload: bytes = b""
    time: float | None = None



def expect(message: Message, cls: type[M]) -> M:
    """Narrow a received message to `cls`; an `error` reply becomes RemoteError. (Here, not
    in messages.py, so that messages.py needs nothing of this module.)"""
    if isinstance(message, cls):
        return message
    if isinstance(message, Error):
        raise message.to_exception()
    raise ProtocolError(f"expected {cls.type!r}, got {message.type!r}")
