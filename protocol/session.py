"""`/psymesh/session/1.0.0`: many requests over one long-lived stream (sans-IO).

Opening a libp2p stream costs about five round trips (yamux SYN, multistream-select),
so a peer opens one session stream to another and keeps it: every request then costs
one round trip, and a task's events come back on it without a stream of their own.
A session has a direction: the side that opened the stream (the *client*) sends
requests, the other (the *server*) answers. Two peers that both make requests hold
two sessions, one each way, on their one connection.

Every frame is an ordinary psymesh frame whose map carries two more envelope keys:

    rid   uint   the request id, chosen by the client: 1, 2, 3, ... strictly increasing
    end   bool   server frames only: true on the last frame that answers `rid`

    client                                     server
    {type: task.submit, rid: 7, ...}    ─────>
                                        <─────  {type: task.accepted, rid: 7, end: false}
                                        <─────  {type: task.event, rid: 7, end: false}
                                        <─────  {type: task.event, rid: 7, end: true}
    {type: session.cancel, rid: 9}      ─────>  (stop answering 9; its final frame still comes;
                                                 a rid not open: ignored)

Requests are answered concurrently, so frames of different requests interleave. Each
request gets any number of frames with `end: false`, then exactly one with `end: true`;
an `error` frame is always final. A server that refuses the whole session (a peer it
does not serve) sends one `error` frame with no `rid` and closes the stream; the client
raises it as a RemoteError for every open request. A malformed request (unknown type, invalid fields)
is refused with an `error` for its `rid` alone; a malformed *frame* (undecodable, no
integer `rid`, ids out of order) breaks the session, like any psymesh stream. At most
`max_open` requests may be open at once; the server refuses the excess with `busy`.

    client = SessionClient()
    rid, data = client.request(Ping(seq=1))          # send `data`
    client.receive_data(chunk)
    while (reply := client.next_reply()) is not None: ...   # Reply(rid, message, end)

    server = SessionServer()
    server.receive_data(chunk)
    while (event := server.next_event()) is not None: ...   # Request | Cancel | Refused
    data = server.reply(rid, Pong(seq=1))            # end=True by default
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from .common import Error
from .errors import ErrorCode, ProtocolError, PsymeshError, RemoteError
from .channel import FrameReader
from .framing import DEFAULT_MAX_FRAME_SIZE, encode_frame
from .messages import Message, decode_map, from_map, pack

MAX_OPEN_REQUESTS = 256
_MAX_RID = (1 << 63) - 1


class SessionCancel(Message):
    """Client -> server: stop working on request `rid`. It carries nothing but the envelope's
    `rid`, which names the request to stop: it is not a request itself (no rid of its own, no
    answer, no place in the order of rids). The server still ends the request with one final
    frame (a `canceled` error if nothing else); a cancel of a `rid` that is not open (it ended,
    or was never sent) is ignored, and the session goes on."""

    type = "session.cancel"


class SessionEnd(Message):
    """Server -> client: the final frame of a request whose answer was all `end: false`
    frames (a stream of events that reached its natural end)."""

    type = "session.end"
    reason: str = Field(default="", max_length=1024)


@dataclass(frozen=True)
class Reply:
    """A frame answering request `rid`; `end` says it is the last one."""

    rid: int
    message: Message
    end: bool


@dataclass(frozen=True)
class Request:
    rid: int
    message: Message


@dataclass(frozen=True)
class Cancel:
    rid: int


@dataclass(frozen=True)
class Refused:
    """A request the server cannot take (malformed, or too many open): answer it with
    `server.reply(rid, Error.from_exception(error))`."""

    rid: int
    error: PsymeshError


class _Side(FrameReader):
    """Framing and the broken-for-good rule (from `FrameReader`), plus the open requests."""

    def __init__(self, max_frame_size: int, max_open: int) -> None:
        super().__init__(max_frame_size)
        self.max_open = max_open
        self._open: set[int] = set()

    @property
    def open_requests(self) -> frozenset[int]:
        return frozenset(self._open)

    def _next_map(self) -> dict[str, Any] | None:
        body = self._next_body()
        if body is None:
            return None
        obj = decode_map(body)
        rid = obj.pop("rid", None)
        if rid is None and obj.get("type") == Error.type and isinstance(self, SessionClient):
            refusal = from_map(obj)  # the server refuses the whole session (e.g. unknown_peer)
            assert isinstance(refusal, Error)
            raise refusal.to_exception()
        if not isinstance(rid, int) or isinstance(rid, bool) or not 1 <= rid <= _MAX_RID:
            raise ProtocolError("a session frame needs an integer 'rid' of at least 1")
        obj["rid"] = rid
        return obj

    def _encode(self, message: Message, envelope: dict[str, Any]) -> bytes:
        return encode_frame(pack(message, envelope), self.max_frame_size)


class SessionClient(_Side):
    """The requesting end: numbers requests and matches the frames that answer them."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, max_open: int = MAX_OPEN_REQUESTS) -> None:
        super().__init__(max_frame_size, max_open)
        self._next_rid = 1

    def request(self, message: Message) -> tuple[int, bytes]:
        """A new request: its id and the bytes to send. BUSY if `max_open` are open."""
        self._check()
        if isinstance(message, (SessionCancel, SessionEnd, Error)):
            raise ProtocolError(f"{message.type!r} is not a request", code=ErrorCode.BAD_REQUEST)
        if len(self._open) >= self.max_open:
            raise PsymeshError(f"{self.max_open} requests are already open on this session",
                               code=ErrorCode.BUSY)
        data = self._encode(message, {"rid": self._next_rid})  # may raise TOO_LARGE: no id is spent
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        self._open.add(rid)
        return rid, data

    def cancel(self, rid: int) -> bytes:
        """Bytes asking the server to stop `rid` (b"" if it already ended)."""
        self._check()
        return self._encode(SessionCancel(), {"rid": rid}) if rid in self._open else b""

    def next_reply(self) -> Reply | None:
        """The next frame for one of our requests, or None if more bytes are needed.
        RemoteError if the server refused the whole session."""
        self._check()
        try:
            obj = self._next_map()
            if obj is None:
                return None
            rid, end = obj.pop("rid"), obj.pop("end", None)
            if rid not in self._open:
                raise ProtocolError(f"the server answered request {rid}, which is not open")
            if not isinstance(end, bool):
                raise ProtocolError("a session reply needs a boolean 'end'")
            message = from_map(obj)
            if isinstance(message, Error) and not end:
                raise ProtocolError("an 'error' frame must end its request")
        except ProtocolError as exc:
            raise self._fail(exc) from None
        except RemoteError as exc:
            self._error = ProtocolError(f"the server refused the session: {exc.message}", code=exc.code)
            raise
        if end:
            self._open.discard(rid)
        return Reply(rid, message, end)


class SessionServer(_Side):
    """The answering end: admits requests in order and frames the answers."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, max_open: int = MAX_OPEN_REQUESTS) -> None:
        super().__init__(max_frame_size, max_open)
        self._last_rid = 0
        self._farewell_sent = False

    def next_event(self) -> Request | Cancel | Refused | None:
        """The next thing the client asked, or None if more bytes are needed."""
        self._check()
        while True:
            try:
                obj = self._next_map()
                if obj is None:
                    return None
                rid = obj.pop("rid")
                if obj.get("type") == SessionCancel.type:  # its `rid` names the request to stop
                    if rid in self._open:
                        return Cancel(rid)
                    continue  # ended while the cancel was on its way, or never sent: nothing to stop
                if rid <= self._last_rid:
                    raise ProtocolError(f"request id {rid} does not follow {self._last_rid}")
            except ProtocolError as exc:
                raise self._fail(exc) from None
            self._last_rid = rid
            self._open.add(rid)
            if len(self._open) > self.max_open:
                return Refused(rid, PsymeshError(f"{self.max_open} requests are already open; retry",
                                                 code=ErrorCode.BUSY, retry_after=0.1))
            try:
                return Request(rid, from_map(obj))
            except ProtocolError as exc:  # a bad request, not a bad session: refuse just this one
                return Refused(rid, exc)

    def farewell(self) -> bytes:
        """Once the session is broken (a reused `rid`, an undecodable frame), the one frame to
        send before closing the stream: an `error` without `rid` saying why, which the client
        takes as the end of the whole session (b"" if the session is not broken, or was told)."""
        if self._error is None or self._farewell_sent:
            return b""
        self._farewell_sent = True
        return encode_frame(pack(Error.from_exception(self._error)), self.max_frame_size)

    def reply(self, rid: int, message: Message, *, end: bool = True) -> bytes:
        """Bytes answering `rid`; `end=True` (always, for an `error`) closes the request."""
        self._check()
        if rid not in self._open:
            raise ProtocolError(f"request {rid} is not open", code=ErrorCode.INTERNAL)
        end = end or isinstance(message, Error)
        data = self._encode(message, {"rid": rid, "end": end})
        if end:
            self._open.discard(rid)
        return data
