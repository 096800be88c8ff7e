"""What every group of control messages shares: `View` (an item inside a reply), `PeerAway`,
`Ok`, and the `error` reply for what a control request raised (a failure of the network says
so in `details["network"]`: protocol/errors.py `network_kind`, and the SDK raises it as the
NetworkError it was, `raised`)."""
from pydantic import BaseModel, ConfigDict

from ..common import Error
from ..errors import PsymeshError, network_kind
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


def error_reply(exc: PsymeshError) -> Error:
    """The `error` reply for what a control request raised inside the daemon."""
    kind = network_kind(exc)
    reply = Error.from_exception(exc)
    return reply if kind is None else reply.model_copy(update={"details": {**reply.details, "network": kind}})
