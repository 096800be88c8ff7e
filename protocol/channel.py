"""A sans-IO framed channel: bytes in, messages out; messages in, bytes out.

    ch = Channel()
    ch.receive_data(chunk)          # whatever the socket gave us
    while (msg := ch.next_message()) is not None: ...
    wire = ch.send(Pong(seq=1))     # bytes for the socket

After a ProtocolError the channel is broken for good (like h11's ERROR state):
further use raises the same error, so a half-parsed stream is never trusted.
"""
from __future__ import annotations

from psymesh.protocol.errors import ProtocolError
from psymesh.protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame
from psymesh.protocol.messages import Message, pack, unpack


class Channel:
    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._decoder = FrameDecoder(max_frame_size)
        self._error: ProtocolError | None = None
        self.eof = False

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the peer; b"" means the peer closed its side."""
        self._check()
        if not data:
            self.eof = True
            return
        self._decoder.feed(data)

    def next_message(self) -> Message | None:
        """The next whole message, or None if more bytes are needed (or the peer is done)."""
        self._check()
        try:
            body = self._decoder.next_frame()
            if body is None:
                if self.eof and not self._decoder.at_frame_boundary():
                    raise ProtocolError("peer closed the stream in the middle of a frame")
                return None
            return unpack(body)
        except ProtocolError as exc:
            self._error = exc
            raise

    def send(self, message: Message) -> bytes:
        self._check()
        return encode_frame(pack(message), self.max_frame_size)

    @property
    def broken(self) -> bool:
        return self._error is not None
