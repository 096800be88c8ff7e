"""What a stranger (a peer this node has not paired with) may cost it, and the guard on
pairing runs, told the time (sans-IO).

Anyone who can reach the port is a stranger: a fresh key costs nothing, so limits per
peer id alone stop nobody. When the unpaired connections are all taken, one from an address
holding fewer than the address holding the most takes one of that address's (`fair_share`
says which), so a few addresses cannot keep a new one out. `StrangerLimits` bounds what all strangers together can make
a node hold (the node's libp2p layer enforces the connection, stream and buffer numbers)
and how often they may try a pairing code. `PairingGuard` enforces the pairing numbers:

    guard = PairingGuard(limits)
    guard.start(peer_id, ip, now)    # raises BUSY or RATE_LIMITED; else a run slot is taken
    ...the pairing run...
    guard.finish(ip)

A run is charged when it starts (one `pair.hello` per run), whatever its nameplate, so
refusals say nothing about which invites exist. Budgets are checked per source IP first,
then node-wide, then per peer id: a hello refused for its IP spends nothing node-wide, so
one address cannot use up the node's budget and lock out a joiner elsewhere, and per-peer
state is only created for runs that got that far (fresh keys cannot grow it).
"""

from pydantic import BaseModel, ConfigDict, Field

from .errors import ErrorCode, PsymeshError
from .limits import ConcurrencyLimiter, RateLimiter

KiB = 1024
_NODE = "*"  # the ConcurrencyLimiter key for node-wide runs (IPs never look like this)


class StrangerLimits(BaseModel):
    """config.toml `[strangers]`. Paired peers get the larger fixed limits of `node/net/strangers.py`."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    # connections (checked when the Noise handshake has proved the key, before any stream)
    connections: int = Field(default=16, ge=1, le=1024)         # unpaired inbound connections at once
    connections_per_ip: int = Field(default=2, ge=1, le=1024)   # ... from one IP address
    connection_s: float = Field(default=60.0, ge=1.0, le=3600.0)  # how long one may stay unpaired
    handshakes: int = Field(default=16, ge=1, le=1024)          # inbound connections still handshaking (anyone)
    handshakes_per_ip: int = Field(default=4, ge=1, le=1024)
    # new inbound connections (each a Noise handshake: CPU) from one IP address: a burst, then
    # this many a minute; paired peers too, since who connects is known only after the handshake
    handshakes_per_ip_per_minute: int = Field(default=60, ge=1, le=100_000)
    handshake_burst_per_ip: int = Field(default=20, ge=1, le=100_000)
    # streams and bytes on one unpaired connection
    streams: int = Field(default=2, ge=1, le=64)                # inbound streams open at once
    buffer_bytes: int = Field(default=128 * KiB, ge=64 * KiB, le=16 * 1024 * KiB)  # unread bytes held
    # pairing runs (one `pair.hello` each)
    pair_runs: int = Field(default=4, ge=1, le=64)              # at once, node-wide
    pair_runs_per_ip: int = Field(default=2, ge=1, le=64)
    hellos_per_minute: int = Field(default=30, ge=1, le=10_000)  # node-wide
    hellos_per_ip_per_minute: int = Field(default=10, ge=1, le=10_000)
    hellos_per_peer_per_minute: int = Field(default=3, ge=1, le=10_000)


class PairingGuard:
    """Admission of pairing runs from strangers: concurrency (BUSY, spends nothing), then
    the hello budgets per IP, node-wide and per peer id (RATE_LIMITED with `retry_after`)."""

    def __init__(self, limits: StrangerLimits, *, max_keys: int = 4096) -> None:
        self.limits = limits
        self._per_ip = RateLimiter(max_keys)
        self._node = RateLimiter(1)
        self._per_peer = RateLimiter(max_keys)
        self._runs = ConcurrencyLimiter()

    def start(self, peer_id: str, ip: str, now: float) -> None:
        """Take a run slot for a pairing run from `peer_id` at `ip`, or raise."""
        limits = self.limits
        if self._runs.active(_NODE) >= limits.pair_runs or self._runs.active(ip) >= limits.pair_runs_per_ip:
            raise PsymeshError("this node is busy with other pairing attempts; retry in a moment",
                               code=ErrorCode.BUSY, retry_after=1.0)
        for limiter, key, per_minute in ((self._per_ip, ip, limits.hellos_per_ip_per_minute),
                                         (self._node, _NODE, limits.hellos_per_minute),
                                         (self._per_peer, peer_id, limits.hellos_per_peer_per_minute)):
            retry_after = limiter.acquire(key, now, per_minute=per_minute)
            if retry_after is not None:
                raise PsymeshError(f"too many pairing attempts; retry in {retry_after:.0f} s",
                                   code=ErrorCode.RATE_LIMITED, retry_after=retry_after)
        self._runs.acquire(_NODE, None)
        self._runs.acquire(ip, None)

    def finish(self, ip: str) -> None:
        """The run that `start` admitted is over (however it ended)."""
        self._runs.release(_NODE)
        self._runs.release(ip)

    def running(self) -> int:
        return self._runs.active(_NODE)


def fair_share(held: dict[str, int], ip: str, limits: StrangerLimits) -> str | bool:
    """Whether a new unpaired connection from `ip` may come in, given the unpaired connections
    each address holds: True (a free slot), False (refused), or the address that must give
    up one of its connections for it (all slots are taken, and that address holds at least
    two more than `ip` would: so no address is ever pushed below what the newcomer gets)."""
    mine = held.get(ip, 0)
    if mine >= limits.connections_per_ip:
        return False
    if sum(held.values()) < limits.connections:
        return True
    richest = max(held, key=lambda address: held[address], default=None)
    if richest is not None and richest != ip and held[richest] >= mine + 2:
        return richest
    return False
