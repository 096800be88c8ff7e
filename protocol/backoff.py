"""How long to wait before dialing a peer again after dials in a row failed (sans-IO).

Exponential, 1 s doubling to 5 minutes, jittered so that nodes which lost the same peer
do not redial it in step. Used for every "keep this peer connected" loop: static peers
(discovery/static.py) and the peers a phone keeps its connection to (node/reach/keep.py).
"""
from __future__ import annotations

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 300.0


def backoff_s(failures: int, jitter: float) -> float:
    """Seconds to wait after `failures` dials in a row failed; `jitter` in [0, 1) takes up to
    half of it off."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(failures, 30)) * (1 - jitter / 2)
