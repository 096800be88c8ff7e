"""One control request and its reply, blocking, without an event loop or the message models:
what a CLI command that only asks the daemon and prints needs (`psymesh status`).

Scripts call such commands in loops, and on a phone every module a command loads is paid on every
call: the SDK (client.py) brings anyio on asyncio and pydantic's models, 60 % of `psymesh status`'s
start-up (bench/cli.py, issue 22 item 13). This speaks the same frames on the same socket after the
same checks (control_socket.py), and hands the command the reply's fields as attributes (`Reply`)
instead of validating them into a model: the daemon built the reply from its typed model
(protocol/control/), after this process made sure the daemon is its owner's. The request's and
reply's types are the models' `type` names; `ASKS` lists what may be asked this way, and
tests/test_cli_startup.py checks it against the models and each command's output against the SDK's.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Union

from ..core.paths import HomePaths
from .control_socket import ControlSocket
from ...protocol.envelope import decode_map, open_envelope, seal
from ...protocol.errors import ConnectionLost, ErrorCode, ProtocolError, PsymeshError, RemoteError, raised
from ...protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame

if TYPE_CHECKING:
    # A reply's field values: what msgpack decodes to, maps and lists of maps as Replys.
    Value = Union[str, int, float, bool, bytes, None, list["Value"], "Reply"]

# request type -> reply type, for the requests a command asks this way (the models' `type`s)
ASKS = {"control.status": "control.status_reply"}

READ_CHUNK = 65536


class Reply:
    """A reply's (or a View's) fields as read-only attributes. `fields` is the map as the daemon
    sent it, which is the model's `model_dump()` (what `--json` prints)."""

    __slots__ = ("kind", "fields")

    def __init__(self, kind: str, fields: Mapping[str, object]) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "fields", dict(fields))

    def __getattr__(self, name: str) -> Value:
        try:
            return _value(self.kind, self.fields[name])
        except KeyError:
            raise PsymeshError(f"the daemon's {self.kind!r} reply has no field {name!r}: is it an older psymesh? "
                               "restart it (psymesh node stop, then node start)", code=ErrorCode.INTERNAL) from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self.kind} replies are read-only")

    def __repr__(self) -> str:
        return f"Reply({self.kind!r}, {self.fields!r})"


def _value(kind: str, raw: object) -> Value:
    if isinstance(raw, dict):
        return Reply(kind, raw)
    if isinstance(raw, list):
        return [_value(kind, item) for item in raw]
    if raw is None or isinstance(raw, str | int | float | bool | bytes):
        return raw
    raise ProtocolError(f"the daemon's {kind!r} reply holds a {type(raw).__name__}")


def ask(home: str | os.PathLike[str] | None, request: str, fields: Mapping[str, object] | None = None, *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> Reply:
    """Send the `request` (a type of ASKS, with its `fields`) to the daemon of `home`, and return
    its reply. An `error` reply raises as the SDK raises it: the NetworkError the daemon met, or
    the refusal (RemoteError); DaemonNotRunning, NotOurDaemon as the SDK's."""
    expected = ASKS[request]
    paths = HomePaths(home)
    sock = ControlSocket(paths.socket_path, paths.path).connect_blocking()
    with sock:
        sock.sendall(encode_frame(seal(dict(fields or {}), request), max_frame_size))
        decoder = FrameDecoder(max_frame_size)
        while (body := decoder.next_frame()) is None:
            data = sock.recv(READ_CHUNK)
            if not data:
                raise ConnectionLost("the daemon closed the control connection without answering")
            decoder.feed(data)
    obj = decode_map(body)
    kind = open_envelope(obj)
    if kind == "error":
        retry_after = obj.get("retry_after")
        details = obj.get("details")
        raise raised(RemoteError(str(obj.get("message", "")), code=str(obj.get("code", "")),
                                 retry_after=float(retry_after) if isinstance(retry_after, int | float) else None,
                                 details=details if isinstance(details, dict) else {}))
    if kind != expected:
        raise ProtocolError(f"the daemon answered {request!r} with {kind!r}, not {expected!r}")
    return Reply(kind, obj)
