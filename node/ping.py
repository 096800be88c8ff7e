"""`/psymesh/ping/1.0.0`: echo service and the measuring side used by `psymesh ping`."""
from __future__ import annotations

import os
import statistics
import time

from psymesh.node.framed import FramedStream
from psymesh.protocol.common import Ping, Pong
from psymesh.protocol.control import PingReply
from psymesh.protocol.errors import ProtocolError
from psymesh.protocol.messages import expect


async def serve_ping(framed: FramedStream) -> None:
    """Answer every Ping on the stream until the peer closes it."""
    while (message := await framed.receive()) is not None:
        ping = expect(message, Ping)
        await framed.send(Pong(seq=ping.seq, payload=ping.payload))


async def measure_ping(framed: FramedStream, peer_id: str, count: int, payload_size: int, connect_ms: float) -> PingReply:
    payload = os.urandom(payload_size)
    rtts: list[float] = []
    for seq in range(count):
        start = time.perf_counter()
        pong = await framed.request(Ping(seq=seq, payload=payload), Pong)
        rtts.append((time.perf_counter() - start) * 1000)
        if pong.seq != seq or pong.payload != payload:
            raise ProtocolError(f"peer answered ping {seq} with a different seq or payload")
    return PingReply(
        peer_id=peer_id,
        rtts_ms=[round(r, 4) for r in rtts],
        connect_ms=round(connect_ms, 3),
        min_ms=round(min(rtts), 4),
        median_ms=round(statistics.median(rtts), 4),
        max_ms=round(max(rtts), 4),
    )
