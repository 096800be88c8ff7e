"""Message framing over any byte stream: the IO shell around `protocol.Channel`.

Works over a libp2p stream (via `node.p2p.P2PStream`) and over the local control
socket (anyio), because both are adapted to the tiny `ByteStream` protocol below.
A stream that ends under a request is the network failing (`ConnectionLost`, and
`NetworkTimeout` for no answer in time), not a broken protocol.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import anyio.abc

from ...protocol.channel import Channel
from ...protocol.common import Error, expect
from ...protocol.errors import ConnectionLost, PsymeshError
from ...protocol.framing import DEFAULT_MAX_FRAME_SIZE, HEADER, encode_frame
from ...protocol.messages import M, Message, pack

READ_CHUNK = 65536


class ByteStream(Protocol):
    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        """Up to max_bytes; b"" at end of stream."""

    async def send_all(self, data: bytes) -> None:
        """All of `data`; ConnectionLost if the stream is gone."""

    async def aclose(self) -> None: ...


class FramedStream:
    """Send and receive whole psymesh messages on a byte stream."""

    def __init__(self, stream: ByteStream, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.stream = stream
        self.channel = Channel(max_frame_size)

    async def send(self, message: Message) -> None:
        await self.stream.send_all(self.channel.send(message))

    async def receive(self) -> Message | None:
        """The next message, or None when the peer closed the stream cleanly. Reads are no
        bigger than one whole frame, so with a small frame limit (pairing: 8 KiB) a peer's
        bytes wait in the transport's flow control, not here: at most two frames' worth
        is ever buffered."""
        read_size = min(READ_CHUNK, self.channel.max_frame_size + HEADER.size)
        while True:
            message = self.channel.next_message()
            if message is not None:
                return message
            if self.channel.eof:
                return None
            self.channel.receive_data(await self.stream.receive_some(read_size))

    async def receive_required(self) -> Message:
        message = await self.receive()
        if message is None:
            raise ConnectionLost("the peer closed the stream before replying")
        return message

    async def request(self, message: Message, reply_type: type[M]) -> M:
        """Send one message and wait for one reply of `reply_type` (an `error` reply raises)."""
        await self.send(message)
        return expect(await self.receive_required(), reply_type)

    async def send_error(self, exc: PsymeshError) -> None:
        """Best effort: tell the peer why, if the stream still takes bytes."""
        try:  # encoded directly: the channel may already be broken by the peer's bad frame
            frame = encode_frame(pack(Error.from_exception(exc)), self.channel.max_frame_size)
            await self.stream.send_all(frame)
        except Exception:
            pass

    async def aclose(self) -> None:
        await self.stream.aclose()


class AnyioByteStream:
    """Adapts an anyio ByteStream (the control socket) to `ByteStream`."""

    def __init__(self, stream: "anyio.abc.ByteStream") -> None:
        self._stream = stream

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        import anyio

        try:
            return await self._stream.receive(max_bytes)
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError):
            return b""

    async def send_all(self, data: bytes) -> None:
        import anyio

        try:
            await self._stream.send(data)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError) as exc:
            raise ConnectionLost(f"stream closed: {exc}") from None

    async def aclose(self) -> None:
        await self._stream.aclose()
