"""The nodes this node has seen, sans-IO: who, at which addresses, how and when.

Announcements on a LAN are unauthenticated and cost nothing to send, so the table is
bounded (`max_nodes`; the node seen least recently goes first) and holds claims, not
facts: what a person checks with the fingerprint before pairing, and what the daemon
proves with a dial before it trusts an address (discovery/service.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Literal

Source = Literal["mdns", "static"]
MAX_NODES = 256


@dataclass(frozen=True)
class Sighting:
    peer_id: str
    addrs: tuple[str, ...]  # as last announced (mDNS) or configured (static), each ending /p2p/<id>
    source: Source          # how it was seen last
    first_seen: float
    last_seen: float


class SeenTable:
    def __init__(self, max_nodes: int = MAX_NODES) -> None:
        self.max_nodes = max_nodes
        self._nodes: OrderedDict[str, Sighting] = OrderedDict()  # least recently seen first

    def saw(self, peer_id: str, addrs: tuple[str, ...], source: Source, now: float) -> Sighting:
        """Record that `peer_id` was seen at `addrs` now; the latest sighting's addresses win
        (a node that restarted elsewhere is where it says it is now)."""
        old = self._nodes.pop(peer_id, None)
        seen = (Sighting(peer_id, addrs, source, now, now) if old is None
                else replace(old, addrs=addrs, source=source, last_seen=now))
        self._nodes[peer_id] = seen
        while len(self._nodes) > self.max_nodes:
            self._nodes.popitem(last=False)
        return seen

    def forget(self, peer_id: str, source: Source) -> None:
        """`peer_id` left (its mDNS records were withdrawn or expired): drop it, unless it
        was last seen another way."""
        seen = self._nodes.get(peer_id)
        if seen is not None and seen.source == source:
            del self._nodes[peer_id]

    def get(self, peer_id: str) -> Sighting | None:
        return self._nodes.get(peer_id)

    def all(self) -> list[Sighting]:
        """Every node, most recently seen first."""
        return list(reversed(self._nodes.values()))
