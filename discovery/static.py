"""Static peers: addresses from config.toml (`static_peers`), for networks without multicast.

Each is dialed when the node starts and kept connected: whenever its connection ends (it
restarted, the Wi-Fi dropped, it closed ours; a change of connections wakes the watcher,
no timer), it is dialed again, with an exponential backoff between failed dials
(protocol/backoff.py: 1 s doubling to 5 minutes, jittered so that nodes which lost the
same peer do not redial in step). The dial proves the peer's key
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
from ..protocol.backoff import backoff_s
from ..protocol.errors import ErrorCode, PsymeshError
from ..protocol.identity import is_peer_id

log = logging.getLogger("psymesh.discovery")

MAX_STATIC_PEERS = 64
DIAL_TIMEOUT_S = 10.0   # one dial (TCP + Noise + yamux)


class Dialer(Protocol):
    """What static peers need of the p2p host (node/net/host.py P2PNode)."""

    async def connect(self, addr: str) -> str: ...

    def remote_ip(self, peer_id: str) -> str | None: ...  # None: no open connection to the peer

    def changes(self) -> anyio.Event: ...  # set at the next change of connections


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
                 on_reached: Callable[[str, str], None]) -> None:
        self.peers = list(peers)
        self.host = host
        self.on_reached = on_reached  # (peer id, address) after each dial that worked

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
            while True:  # until the connection ends: woken by changes of connections, no timer
                changed = self.host.changes()
                if self.host.remote_ip(peer_id) is None:
                    break
                await changed.wait()
