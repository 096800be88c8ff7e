"""Length-prefixed frames: a 4-byte big-endian unsigned length, then that many bytes.

The decoder checks a claimed length against the limit as soon as the 4 header bytes
arrive, before waiting for (or allocating) the body, so a peer cannot make us
reserve memory by lying about a size.
"""
from __future__ import annotations

import struct

from .errors import ErrorCode, ProtocolError

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_SIZE = 4 * 1024 * 1024


def encode_frame(body: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Prefix `body` with its length; refuse bodies the peer would refuse."""
    if len(body) > max_frame_size:
        raise ProtocolError(
            f"frame of {len(body)} bytes exceeds the {max_frame_size}-byte limit",
            code=ErrorCode.TOO_LARGE,
        )
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Feed bytes in, take whole frame bodies out. Never raises anything but ProtocolError."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def next_frame(self) -> bytes | None:
        """The next whole frame body, or None if more bytes are needed."""
        if len(self._buffer) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buffer)
        if length > self.max_frame_size:
            raise ProtocolError(
                f"peer announced a {length}-byte frame; the limit is {self.max_frame_size}",
                code=ErrorCode.TOO_LARGE,
            )
        end = HEADER.size + length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[HEADER.size:end])
        del self._buffer[:end]
        return body

    def take_rest(self) -> bytes:
        """The bytes fed past the last whole frame, handed over: the stream leaves framing
        here (an `rpc.accept` is followed by llama.cpp's own bytes)."""
        rest, self._buffer = bytes(self._buffer), bytearray()
        return rest

    def at_frame_boundary(self) -> bool:
        """True when no partial frame is buffered (a clean place for the peer to stop)."""
        return not self._buffer
