"""Per-peer limits from a manifest, and the sans-IO counters that enforce the stateful ones.

`Limits` is the part of a capability manifest that is a number, not a permission.
Two of its numbers need memory between requests, so they live here as small
state machines that are told the time instead of reading a clock:

    rate = RateLimiter()
    retry_after = rate.acquire(peer_id, now, per_minute=60)   # None = admitted

    slots = ConcurrencyLimiter()   # things at once per key (pairing runs per address, ...)

The gate (node/door/gate.py) applies a grant's rate; its queue limits count the executor's
unfinished tasks in SQLite, which survive a restart.

The rate limiter is GCRA (the "virtual scheduling" form of a token bucket): one
float per key, the theoretical arrival time of the next request, so memory does
not grow with the rate, and the refusal comes with an exact `retry_after`.
"""

from pydantic import BaseModel, ConfigDict, Field


class Limits(BaseModel):
    """Numeric limits for one peer. `None` means "no limit from the manifest" (the node's
    own global limits still apply)."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    requests_per_minute: int | None = Field(default=None, ge=1, le=1_000_000)
    concurrent_tasks: int | None = Field(default=None, ge=1, le=10_000)
    max_runtime_s: int | None = Field(default=None, ge=1)
    max_payload_bytes: int | None = Field(default=None, ge=0)
    rpc_memory_mb: int | None = Field(default=None, ge=1)  # compute.rpc: buffers a split model may allocate here


class RateLimiter:
    """GCRA per key. A key may spend `burst` requests at once (default: a full minute's
    allowance), then is admitted at the steady rate of `per_minute`.

    The limit is passed on every call rather than fixed per key, so a peer whose
    manifest changes is limited by the new numbers from its next request on.
    """

    def __init__(self, max_keys: int = 100_000) -> None:
        self.max_keys = max_keys
        self._tat: dict[str, float] = {}  # theoretical arrival time of the next request

    def acquire(self, key: str, now: float, *, per_minute: int, burst: int | None = None) -> float | None:
        """Admit one request (None) or say how many seconds until one would be admitted."""
        if per_minute < 1:
            raise ValueError("per_minute must be at least 1")
        burst = per_minute if burst is None else burst
        if burst < 1:
            raise ValueError("burst must be at least 1")
        interval = 60.0 / per_minute
        tolerance = (burst - 1) * interval
        tat = max(self._tat.get(key, now), now)
        wait = tat - tolerance - now
        if wait > 0:
            return wait
        if key not in self._tat and len(self._tat) >= self.max_keys:
            self.prune(now)
        self._tat[key] = tat + interval
        return None

    def refund(self, key: str, *, per_minute: int) -> None:
        """Give back one request `acquire` admitted (work that was then not done)."""
        tat = self._tat.get(key)
        if tat is not None:
            self._tat[key] = tat - 60.0 / per_minute

    def prune(self, now: float) -> int:
        """Forget keys whose allowance is full again (they behave as if never seen).

        Called automatically when `max_keys` is reached, so memory stays bounded by the
        number of peers that were active within the last minute-or-so."""
        stale = [key for key, tat in self._tat.items() if tat <= now]
        for key in stale:
            del self._tat[key]
        return len(stale)

    def __len__(self) -> int:
        return len(self._tat)


class ConcurrencyLimiter:
    """Counts tasks in flight per key. Pair every successful `acquire` with one `release`."""

    def __init__(self) -> None:
        self._active: dict[str, int] = {}

    def active(self, key: str) -> int:
        return self._active.get(key, 0)

    def acquire(self, key: str, limit: int | None) -> bool:
        """Take a slot if fewer than `limit` are in use (`None`: unlimited)."""
        if limit is not None and self.active(key) >= limit:
            return False
        self._active[key] = self.active(key) + 1
        return True

    def release(self, key: str) -> None:
        count = self.active(key)
        if count <= 0:
            raise RuntimeError(f"release() without acquire() for {key!r}")
        if count == 1:
            del self._active[key]
        else:
            self._active[key] = count - 1
