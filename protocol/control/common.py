"""What every group of control messages shares: `View` (an item inside a reply), `PeerAway`,
`Ok`, and how a failure of the network travels apart from a refusal (an `error` reply's
`details["network"]`, raised by the SDK as the NetworkError it was)."""
from pydantic import BaseModel, ConfigDict

from ..common import Error
from ..errors import ConnectError, ConnectionLost, NetworkError, NetworkTimeout, PsymeshError, RemoteError
from ..messages import Message


class View(BaseModel):
    """One item inside a control reply (never sent alone). Frozen and typed; keys it does
    not know are ignored, so a newer daemon may add fields without breaking an older SDK."""

    model_config = ConfigDict(frozen=True, extra="ignore", defer_build=True)


class PeerAway(View):
    """A peer this node could not reach when it last tried: since when (the first failed
    try in a row, unix seconds) and the last failure. Cleared once a session opens."""

    since: float
    reason: str


class Ok(Message):
    type = "control.ok"


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


def error_reply(exc: PsymeshError) -> Error:
    """The `error` reply for what a control request raised inside the daemon."""
    kind = network_kind(exc)
    reply = Error.from_exception(exc)
    return reply if kind is None else reply.model_copy(update={"details": {**reply.details, "network": kind}})


def raised(exc: RemoteError) -> PsymeshError:
    """What the SDK raises for an `error` reply: the NetworkError the daemon met, or the refusal."""
    cls = NETWORK_FAILURES.get(str(exc.details.get("network")))
    if cls is None:
        return exc
    return cls(exc.message, code=exc.code, retry_after=exc.retry_after, details=exc.details)
