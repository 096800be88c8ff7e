"""One error tree for all of psymesh, with stable codes.

    PsymeshError            .code is a stable string from ErrorCode
    ├── ProtocolError       bytes or messages that break the protocol (ours or the peer's)
    ├── RemoteError         the other side answered with a typed error reply
    └── NetworkError        the network failed us; retrying later may work (unavailable)
        ├── ConnectError        could not reach the peer
        ├── NetworkTimeout      no answer in time (timeout)
        └── ConnectionLost      an open connection, stream or session ended under us

Codes travel on the wire inside `error` replies, so they never change meaning;
new ones may be added. Callers branch on `.code`, people read `.message`.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    BAD_FRAME = "bad_frame"              # undecodable bytes, wrong types, unknown message type
    TOO_LARGE = "too_large"              # a frame or payload over the negotiated limit
    UNSUPPORTED_VERSION = "unsupported_version"
    BAD_REQUEST = "bad_request"          # well-formed, but not a valid request here
    FORBIDDEN = "forbidden"              # paired, but no capability covers this request
    UNKNOWN_PEER = "unknown_peer"        # not paired (or revoked)
    EXPIRED = "expired"                  # manifest, grant or invite out of date
    RATE_LIMITED = "rate_limited"
    BUSY = "busy"                        # queue full: retry after `retry_after` seconds
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    TIMEOUT = "timeout"
    CANCELED = "canceled"
    UNAVAILABLE = "unavailable"          # peer unreachable, daemon not running
    BAD_CODE = "bad_code"                # pairing: wrong short code
    MODEL_CRASHED = "model_crashed"      # the model runner process died running this request
    UNSUPPORTED = "unsupported"          # the model cannot do what was asked (tools to a model without tool calling)
    INTERNAL = "internal"


class PsymeshError(Exception):
    """Base of every error psymesh raises on purpose."""

    default_code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | str | None = None,
        retry_after: float | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        try:
            self.code = ErrorCode(code) if code is not None else self.default_code
        except ValueError:  # an unknown code from a newer peer stays readable
            self.code = ErrorCode.INTERNAL
            self.message = f"[{code}] {message}"
        self.retry_after = retry_after
        self.details = details or {}

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class ProtocolError(PsymeshError):
    """Bytes or messages that break the protocol. After one, the channel is unusable."""

    default_code = ErrorCode.BAD_FRAME


class RemoteError(PsymeshError):
    """The other side refused or failed a request and said why (an `error` reply)."""


class NetworkError(PsymeshError):
    """The network failed us: nothing was refused, and the same request may work later.
    Mapped from libp2p and socket exceptions where `node/` calls them (as httpcore maps
    its transport's errors), so callers branch on the class, never on a message."""

    default_code = ErrorCode.UNAVAILABLE


class ConnectError(NetworkError):
    """The peer could not be reached (no route, refused, handshake failed). `cause`: why, in
    a few words without the peer's name (`connection refused at 127.0.0.1:4001`), for a line
    that names the peer itself ("home is unreachable since 14:02 (<cause>)")."""

    def __init__(self, message: str, *, cause: str | None = None, nobody_listens: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.cause = cause or message
        # the address answered that nothing listens there (connection refused): the peer is down,
        # which says more than what any other way to it (a relay) answered after
        self.nobody_listens = nobody_listens



def cause_of(exc: PsymeshError) -> str:
    """Why `exc` happened, for a line that names the peer itself ("home is unreachable since
    14:02 (<why>)"): a ConnectError's `cause`, else the message."""
    return exc.cause if isinstance(exc, ConnectError) else exc.message

class NetworkTimeout(NetworkError):
    """The peer did not answer in time."""

    default_code = ErrorCode.TIMEOUT


class ConnectionLost(NetworkError):
    """An open connection, stream or session ended under a request."""


# details["network"] of an `error` reply -> the NetworkError the SDK raises for it
NETWORK_FAILURES: dict[str, type[NetworkError]] = {
    "connect": ConnectError,
    "timeout": NetworkTimeout,
    "lost": ConnectionLost,
    "network": NetworkError,
}


def network_kind(exc: PsymeshError) -> str | None:
    """How the network failed, if `exc` is the network failing rather than a refusal. The
    transport (node/net/host.py, node/net/framed.py) raises its failures as NetworkErrors, so the
    class alone says it: a ProtocolError, whatever its code, is never the network."""
    for kind, cls in NETWORK_FAILURES.items():
        if isinstance(exc, cls):
            return kind
    return None


def raised(exc: RemoteError) -> PsymeshError:
    """What the SDK raises for an `error` reply: the NetworkError the daemon met, or the refusal."""
    cls = NETWORK_FAILURES.get(str(exc.details.get("network")))
    if cls is None:
        return exc
    return cls(exc.message, code=exc.code, retry_after=exc.retry_after, details=exc.details)
