"""The measuring side of `psymesh ping`: round trips on a session (`ping` is served by the
door), and the clock skew `psymesh doctor` reads from a pong's `time`."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

from .session import OutboundSession
from ...protocol.common import Ping, Pong
from ...protocol.control import PingReply
from ...protocol.errors import ProtocolError


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


# Test only: makes a node *say* its clock is this many seconds off in its pongs, so tests
# can run `psymesh doctor` against a skewed peer. Read here and nowhere else; the node's
# own clock (grants, the gate, letters) is untouched.
CLOCK_OFFSET_ENV = "PSYMESH_CLOCK_OFFSET_S"


def pong_time() -> float:
    """This node's wall clock as its pongs tell it (Unix seconds)."""
    try:
        offset = float(os.environ.get(CLOCK_OFFSET_ENV) or 0.0)
    except ValueError:
        offset = 0.0
    return time.time() + offset


@dataclass(frozen=True)
class ClockReading:
    rtt_ms: float
    skew_s: float | None  # the peer's clock minus ours; None: its pong told no time


def clock_skew(sent_at: float, rtt_s: float, peer_time: float) -> float:
    """How far the peer's clock is ahead of ours: its time when it answered, minus ours at
    that moment, taken as halfway through the round trip (off by at most half of it)."""
    return peer_time - (sent_at + rtt_s / 2)


async def read_clock(session: OutboundSession) -> ClockReading:
    """One ping on an open session: its round trip, and the peer's clock against ours."""
    sent_at, start = time.time(), time.perf_counter()
    pong = await session.request(Ping(seq=0), Pong)
    rtt = time.perf_counter() - start
    skew = None if pong.time is None else round(clock_skew(sent_at, rtt, pong.time), 3)
    return ClockReading(round(rtt * 1000, 3), skew)
