"""A stranger that speaks just enough libp2p to attack a node (tests only).

TCP from any loopback source address, Noise with a fresh key each time, then yamux
frames it writes itself, so it can ignore flow control, leave streams half-negotiated
or announce frames it never finishes. multistream-select and psymesh frames go on top.

    async with Stranger.connect(addr, peer_id, source="127.0.0.2") as s:
        stream = await s.open("/psymesh/pair/1.0.0")
        if await stream.negotiated(): ...
"""
from __future__ import annotations

import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.trio import TrioTCPStream
from libp2p.io.utils import read_exactly
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.protocol_muxer.multiselect_client import MultiselectClient
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.utils.varint import encode_uvarint

from psymesh.protocol.channel import Channel
from psymesh.protocol.messages import Message

HEADER = struct.Struct("!BBHII")
DATA, WINDOW_UPDATE, PING, GO_AWAY = 0, 1, 2, 3
SYN, ACK, FIN, RST = 1, 2, 4, 8
MULTISTREAM = "/multistream/1.0.0"


def delim(text: str) -> bytes:
    """One multistream-select message: uvarint length, the text, a newline."""
    body = text.encode() + b"\n"
    return encode_uvarint(len(body)) + body


def host_port(addr: str) -> tuple[str, int]:
    """`/ip4/H/tcp/P/...` -> (H, P)."""
    parts = addr.split("/")
    return parts[2], int(parts[4])


class StrangerStream:
    def __init__(self, conn: "Stranger", sid: int, protocol: str | None) -> None:
        self.conn = conn
        self.sid = sid
        self.protocol = protocol
        self.inbox = bytearray()
        self.changed = trio.Event()
        self.reset = False
        self.eof = False
        self.channel = Channel(max_frame_size=1 << 24)

    async def _wait(self) -> None:
        await self.changed.wait()
        self.changed = trio.Event()

    async def read_delim(self) -> str | None:
        """The next multistream message, or None if the stream or connection ended first."""
        while True:
            if self.inbox:
                length, used = _uvarint(self.inbox)
                if used and len(self.inbox) >= used + length:
                    text = bytes(self.inbox[used:used + length]).decode(errors="replace").rstrip("\n")
                    del self.inbox[:used + length]
                    return text
            if self.reset or self.eof or self.conn.closed.is_set():
                return None
            await self._wait()

    async def negotiated(self) -> bool:
        """True when the node accepted `protocol`; False on `na`, reset or a closed connection."""
        if await self.read_delim() != MULTISTREAM:
            return False
        return await self.read_delim() == self.protocol

    async def send(self, data: bytes, *, fin: bool = False) -> None:
        await self.conn.data(self.sid, data, fin=fin)

    async def send_message(self, message: Message) -> None:
        await self.send(self.channel.send(message))

    async def receive_message(self) -> Message | None:
        """The next psymesh message, or None once the stream ended."""
        while True:
            if self.inbox:
                self.channel.receive_data(bytes(self.inbox))
                self.inbox.clear()
            message = self.channel.next_message()
            if message is not None:
                return message
            if self.reset or self.eof or self.conn.closed.is_set():
                return None
            await self._wait()

    async def ended(self) -> None:
        """Until the node reset or closed this stream, or the connection closed."""
        while not (self.reset or self.eof or self.conn.closed.is_set()):
            await self._wait()


class Stranger:
    """One connection from a fresh key. `closed` is set once the node closed it."""

    def __init__(self, secured: object, nursery: trio.Nursery, peer_id: str) -> None:
        self.secured = secured
        self.peer_id = peer_id
        self.nursery = nursery
        self.streams: dict[int, StrangerStream] = {}
        self.closed = trio.Event()
        self._next_sid = 1
        self._write_lock = trio.Lock()

    @classmethod
    @asynccontextmanager
    async def connect(cls, addr: str, peer_id: str, *, source: str = "127.0.0.1",
                      multistream_length: int | None = None) -> AsyncIterator["Stranger"]:
        host, port = host_port(addr)
        tcp = await trio.open_tcp_stream(host, port, local_address=source)
        raw = RawConnection(TrioTCPStream(tcp), True)
        try:
            await MultiselectClient().select_one_of([TProtocol("/noise")], MultiselectCommunicator(raw))
            key = create_new_key_pair(os.urandom(32))
            noise = NoiseTransport(key, noise_privkey=x25519_key_pair().private_key)
            secured = await noise.secure_outbound(raw, ID.from_base58(peer_id))
            await MultiselectClient().select_one_of([TProtocol("/yamux/1.0.0")], MultiselectCommunicator(secured))
            async with trio.open_nursery() as nursery:
                conn = cls(secured, nursery, ID.from_pubkey(key.public_key).to_base58())
                nursery.start_soon(conn._read_frames)
                try:
                    yield conn
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await tcp.aclose()

    async def _write(self, data: bytes) -> None:
        """Write, or note that the node closed the connection (an attacker does not care)."""
        if self.closed.is_set():
            return
        async with self._write_lock:
            try:
                await self.secured.write(data)  # type: ignore[attr-defined]
            except Exception:
                self.closed.set()

    async def frame(self, typ: int, flags: int, sid: int, length: int, body: bytes = b"") -> None:
        await self._write(HEADER.pack(0, typ, flags, sid, length) + body)

    async def data(self, sid: int, data: bytes, *, fin: bool = False) -> None:
        """DATA frames of up to 64 KiB, whatever the node's receive window says."""
        for i in range(0, max(len(data), 1), 65536):
            chunk = data[i:i + 65536]
            last = i + 65536 >= len(data)
            await self.frame(DATA, FIN if fin and last else 0, sid, len(chunk), chunk)

    async def open(self, protocol: str | None, *, first_data: bytes = b"") -> StrangerStream:
        """SYN, then (unless `protocol` is None) the multistream proposal, then `first_data`."""
        sid = self._next_sid
        self._next_sid += 2
        stream = self.streams[sid] = StrangerStream(self, sid, protocol)
        proposal = delim(MULTISTREAM) + delim(protocol) if protocol is not None else b""
        payload = proposal + first_data
        await self.frame(DATA, SYN, sid, len(payload), payload)
        return stream

    async def _read_frames(self) -> None:
        try:
            while True:
                typ_flags = await read_exactly(self.secured, HEADER.size)  # type: ignore[arg-type]
                _, typ, flags, sid, length = HEADER.unpack(typ_flags)
                body = await read_exactly(self.secured, length) if typ == DATA and length else b""  # type: ignore[arg-type]
                if typ == PING and flags & SYN:
                    await self.frame(PING, ACK, 0, length)
                    continue
                if typ == GO_AWAY:
                    return
                stream = self.streams.get(sid)
                if stream is None:
                    continue
                if body:
                    stream.inbox += body
                    await self.frame(WINDOW_UPDATE, 0, sid, len(body))
                if flags & RST:
                    stream.reset = True
                if flags & FIN:
                    stream.eof = True
                stream.changed.set()
        except Exception:
            return
        finally:
            self.closed.set()
            for stream in self.streams.values():
                stream.changed.set()


def _uvarint(buf: bytearray) -> tuple[int, int]:
    """(value, bytes used), or (0, 0) while incomplete."""
    value = shift = 0
    for i, byte in enumerate(buf[:10]):
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    return 0, 0


async def flood_before_handshake(addr: str, *, seconds: float, source: str = "127.0.0.1",
                                 announce: int = 1 << 40) -> int:
    """A TCP client with no key: announce a multistream message of `announce` bytes, then
    send junk until the node closes the connection or `seconds` pass. Returns bytes sent."""
    host, port = host_port(addr)
    sent = 0
    with trio.move_on_after(seconds):
        try:
            tcp = await trio.open_tcp_stream(host, port, local_address=source)
        except OSError:
            return 0
        async with tcp:
            try:
                await tcp.send_all(encode_uvarint(announce))
                junk = b"\0" * 65536
                while True:
                    await tcp.send_all(junk)
                    sent += len(junk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
    return sent
