"""What strangers may cost the host (defects 14-18, 25 of net/patches.py): `_Admission`, one per
P2PNode and shared with its swarm, muxers and inbound streams, knows who is a stranger (the
daemon's `is_paired`), who may open what (`may_open`), the limits (`StrangerLimits`, config
`[strangers]`), and counts the inbound connections still in their handshake, per IP, and the
new ones per IP a minute. `_HandshakeBudget` caps what a connection may send before its
muxer exists. Paired peers get the larger fixed budgets here."""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from libp2p.abc import ReadWriteCloser
from libp2p.io.exceptions import IOException

from ...protocol.limits import RateLimiter
from ...protocol.strangers import StrangerLimits

log = logging.getLogger(__name__)

# What a paired peer's connection may hold (14, 17): generous, it is trusted with tasks.
PAIRED_STREAMS = 1024
PAIRED_BUFFER_BYTES = 64 * 1024 * 1024
# (15) Bytes a new inbound connection may send before its muxer runs.
HANDSHAKE_BYTES = 64 * 1024

PeerFilter = Callable[[str], bool]
StreamFilter = Callable[[str, str], bool]  # (peer id, protocol) -> may that peer open it?
PunchFilter = Callable[[str, bool], bool]  # (peer id, over a relayed connection?) -> may it run DCUtR there?
CircuitFilter = Callable[[str, bool], bool]  # (relay id, we hold a reservation there?) -> take its circuit?


class _Admission:
    """Who is a stranger, who may open what, and what strangers may cost (14-18): one per
    P2PNode, shared with its swarm, muxers and inbound streams. Also counts the inbound
    connections still in their handshake, per IP (15)."""

    def __init__(self) -> None:
        self.is_paired: PeerFilter = _anyone
        self.may_open: StreamFilter = _anything
        self.may_punch: PunchFilter | None = None  # None: `may_open(peer, DCUTR)` decides
        self.take_circuit: CircuitFilter = _if_reserved
        self.limits = StrangerLimits()
        self.handshaking: Counter[str | None] = Counter()
        self.handshake_rate = RateLimiter(max_keys=4096)  # new connections per IP (CPU: Noise)

    def paired(self, peer_id: str) -> bool:
        try:
            return bool(self.is_paired(peer_id))
        except Exception:
            log.exception("is_paired(%s) failed; treating the peer as a stranger", peer_id)
            return False

    def buffer_budget(self, peer_id: str) -> int:
        return PAIRED_BUFFER_BYTES if self.paired(peer_id) else self.limits.buffer_bytes

    def start_handshake(self, ip: str | None) -> str | None:
        """Take a handshake slot for a new inbound connection from `ip`; or say why not."""
        limits = self.limits
        if self.handshaking.total() >= limits.handshakes or self.handshaking[ip] >= limits.handshakes_per_ip:
            return "too many connections still handshaking"
        if self.handshake_rate.acquire(ip or "?", time.monotonic(), per_minute=limits.handshakes_per_ip_per_minute,
                                       burst=limits.handshake_burst_per_ip) is not None:
            return f"more than {limits.handshakes_per_ip_per_minute} new connections a minute from there"
        self.handshaking[ip] += 1
        return None

    def end_handshake(self, ip: str | None) -> None:
        self.handshaking[ip] -= 1
        if not self.handshaking[ip]:
            del self.handshaking[ip]


def _anyone(_: str) -> bool:
    return True


def _anything(_: str, __: str) -> bool:
    return True


def _if_reserved(_: str, reserved: bool) -> bool:
    return reserved


class _HandshakeBudget(ReadWriteCloser):
    """(15) A new inbound TCP connection that may send at most `limit` bytes until `lift()`
    (called when its muxer exists); past that its reads fail and the upgrade is abandoned.
    Each read also asks for no more than what is left, so a huge announced length cannot
    make libp2p allocate a huge receive buffer."""

    def __init__(self, inner: ReadWriteCloser, limit: int) -> None:
        self._inner = inner
        self._left: int | None = limit

    def lift(self) -> None:
        self._left = None

    async def read(self, n: int | None = None) -> bytes:
        if self._left is None:
            return await self._inner.read(n)
        if self._left <= 0:
            raise IOException(f"the peer sent more than {HANDSHAKE_BYTES} bytes before its muxer started")
        data = await self._inner.read(self._left if n is None else min(n, self._left))
        self._left -= len(data)
        return data

    async def write(self, data: bytes) -> None:
        await self._inner.write(data)

    async def close(self) -> None:
        await self._inner.close()

    def get_remote_address(self) -> tuple[str, int] | None:
        return self._inner.get_remote_address()
