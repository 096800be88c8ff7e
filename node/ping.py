"""The measuring side of `psymesh ping`: round trips on a session (`ping` is served by the door)."""
from __future__ import annotations

import os
import statistics
import time

from psymesh.node.session import OutboundSession
from psymesh.protocol.common import Ping, Pong
from psymesh.protocol.control import PingReply
from psymesh.protocol.errors import ProtocolError


async def measure_ping(session: OutboundSession, peer_id: str, count: int, payload_size: int,
                       connect_ms: float) -> PingReply:
    """`count` ping round trips on an open session: what one request costs on the mesh."""
    payload = os.urandom(payload_size)
    rtts: list[float] = []
    for seq in range(count):
        start = time.perf_counter()
        pong = await session.request(Ping(seq=seq, payload=payload), Pong)
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
