"""A sans-IO framed channel: bytes in, messages out; messages in, bytes out.

    ch = Channel()
    ch.receive_data(chunk)          # whatever the socket gave us
    while (msg := ch.next_message()) is not None: ...
    wire = ch.send(Pong(seq=1))     # bytes for the socket

After a ProtocolError the channel is broken for good (like h11's ERROR state):
further use raises the same error, so a half-parsed stream is never trusted.
`FrameReader` is that rule with the framing, shared with the session ends
(`protocol/session.py`), which read envelope keys before the message.
"""
from __future__ import annotations

from .errors import ProtocolError
from .framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame
from .messages import Message, pack, unpack


class FrameReader:
    """Bytes in, whole frame bodies out; broken for good after a ProtocolError."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._decoder = FrameDecoder(max_frame_size)
        self._error: ProtocolError | None = None
        self.eof = False

    @property
    def broken(self) -> bool:
        return self._error is not None

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: ProtocolError) -> ProtocolError:
        self._error = exc
        return exc

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the peer; b"" means the peer closed its side."""
        self._check()
        if not data:
            self.eof = True
            return
        self._decoder.feed(data)

    def detach(self) -> bytes:
        """Leave framing: the bytes already read past the last frame (the stream's own from here)."""
        self._check()
        return self._decoder.take_rest()

    def _next_body(self) -> bytes | None:
        """The next whole frame body, or None if more bytes are needed (or the peer is done)."""
        body = self._decoder.next_frame()
        if body is None and self.eof and not self._decoder.at_frame_boundary():
            raise ProtocolError("peer closed the stream in the middle of a frame")
        return body


class Channel(FrameReader):
    def next_message(self) -> Message | None:
        """The next whole message, or None if more bytes are needed (or the peer is done)."""
        self._check()
        try:
            body = self._next_body()
            return None if body is None else unpack(body)
        except ProtocolError as exc:
            raise self._fail(exc) from None

    def send(self, message: Message) -> bytes:
        self._check()
        return encode_frame(pack(message), self.max_frame_size)
