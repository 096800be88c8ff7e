"""Static peers: addresses from config.toml (`static_peers`), for networks without multicast.

Each is dialed when the node starts and kept connected: whenever no connection to it is
open (it restarted, the Wi-Fi dropped, it closed ours), it is dialed again, with an
exponential backoff between failed dials (1 s doubling to 5 minutes, jittered so that
nodes which lost the same peer do not redial in step). The dial proves the peer's key
(Noise), so a paired static peer's address is one the node can trust (discovery/service.py).

A static peer we have not paired with closes our connection after its stranger limit
(60 s by default), so it is redialed about once a minute: listed by `psymesh discover`,
ready to pair with. Leave it out of `static_peers` if that is not wanted.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import anyio.abc

from .records import addr_peer_id
from ..protocol.errors import ErrorCode, PsymeshError
from ..protocol.identity import is_peer_id

log = logging.getLogger("psymesh.discovery")

MAX_STATIC_PEERS = 64
WATCH_S = 1.0           # how often an open connection to a static peer is checked
DIAL_TIMEOUT_S = 10.0   # one dial (TCP + Noise + yamux)
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 300.0


class Dialer(Protocol):
    """What static peers need of the p2p host (node/net/host.py P2PNode)."""

    async def connect(self, addr: str) -> str: ...

    def remote_ip(self, peer_id: str) -> str | None: ...  # None: no open connection to the peer


def backoff_s(failures: int, jitter: float) -> float:
    """Seconds to wait after `failures` dials in a row failed; `jitter` in [0, 1) takes up to
    half of it off."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(failures, 30)) * (1 - jitter / 2)


def check_static_peers(addrs: Sequence[str], local_peer_id: str) -> list[tuple[str, str]]:
    """(address, peer id) for each configured static peer, or BAD_REQUEST naming the first bad one."""
    if len(addrs) > MAX_STATIC_PEERS:
        raise PsymeshError(f"static_peers lists {len(addrs)} peers; at most {MAX_STATIC_PEERS}",
                           code=ErrorCode.BAD_REQUEST)
    out: list[tuple[str, str]] = []
    for addr in dict.fromkeys(addrs):
        peer_id = addr_peer_id(addr)
        if peer_id is None or not is_peer_id(peer_id) or not addr.startswith(("/ip4/", "/ip6/")):
            raise PsymeshError(f"static_peers: {addr!r} is not an /ip4/ or /ip6/ multiaddr ending in /p2p/<peer id> "
                               "(e.g. /ip4/192.168.1.20/tcp/4001/p2p/12D3KooW...)", code=ErrorCode.BAD_REQUEST)
        if peer_id == local_peer_id:
            raise PsymeshError(f"static_peers: {addr!r} is this node itself", code=ErrorCode.BAD_REQUEST)
        out.append((addr, peer_id))
    return out


class StaticPeers:
    def __init__(self, peers: Sequence[tuple[str, str]], host: Dialer,
                 on_reached: Callable[[str, str], None], *, watch_s: float = WATCH_S) -> None:
        self.peers = list(peers)
        self.host = host
        self.on_reached = on_reached  # (peer id, address) after each dial that worked
        self.watch_s = watch_s

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            for addr, peer_id in self.peers:
                tg.start_soon(self._keep, addr, peer_id)
            task_status.started()

    async def _keep(self, addr: str, peer_id: str) -> None:
        failures = 0
        while True:
            if self.host.remote_ip(peer_id) is None:
                try:
                    with anyio.fail_after(DIAL_TIMEOUT_S):
                        await self.host.connect(addr)
                except (PsymeshError, TimeoutError) as exc:
                    delay = backoff_s(failures, random.random())
                    failures += 1
                    log.log(logging.INFO if failures == 1 else logging.DEBUG,
                            "static peer %s unreachable (%s); next try in %.0f s", addr, exc, delay)
                    await anyio.sleep(delay)
                    continue
                if failures:
                    log.info("static peer %s reachable again", addr)
                failures = 0
                self.on_reached(peer_id, addr)
            await anyio.sleep(self.watch_s)
