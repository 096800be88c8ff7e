"""Rate and concurrency limits, driven by an injected clock."""
from __future__ import annotations

import pytest

from psymesh.protocol.limits import ConcurrencyLimiter, Limits, RateLimiter

T0 = 1_000.0


def test_a_minutes_allowance_then_the_steady_rate() -> None:
    rate = RateLimiter()
    assert [rate.acquire("phone", T0, per_minute=3) for _ in range(3)] == [None, None, None]
    assert rate.acquire("phone", T0, per_minute=3) == pytest.approx(20.0)
    assert rate.acquire("phone", T0 + 19.9, per_minute=3) == pytest.approx(0.1)
    assert rate.acquire("phone", T0 + 20, per_minute=3) is None
    assert rate.acquire("phone", T0 + 20, per_minute=3) == pytest.approx(20.0)
    # after a quiet minute the full allowance is back
    assert [rate.acquire("phone", T0 + 100, per_minute=3) for _ in range(3)] == [None, None, None]


def test_refusals_do_not_push_the_retry_time_back() -> None:
    rate = RateLimiter()
    rate.acquire("p", T0, per_minute=1)
    for _ in range(50):  # a client hammering while limited
        assert rate.acquire("p", T0 + 30, per_minute=1) == pytest.approx(30.0)
    assert rate.acquire("p", T0 + 60, per_minute=1) is None


def test_peers_are_limited_separately_and_burst_is_adjustable() -> None:
    rate = RateLimiter()
    assert rate.acquire("a", T0, per_minute=60, burst=1) is None
    assert rate.acquire("a", T0, per_minute=60, burst=1) == pytest.approx(1.0)
    assert rate.acquire("b", T0, per_minute=60, burst=1) is None


def test_memory_stays_bounded() -> None:
    rate = RateLimiter(max_keys=10)
    for i in range(10):
        rate.acquire(f"peer{i}", T0, per_minute=60)
    assert len(rate) == 10
    rate.acquire("late", T0 + 5, per_minute=60)  # the others' allowance has refilled: forgotten
    assert len(rate) == 1


def test_concurrency_counter() -> None:
    slots = ConcurrencyLimiter()
    assert slots.acquire("p", 2) and slots.acquire("p", 2)
    assert not slots.acquire("p", 2)
    slots.release("p")
    assert slots.active("p") == 1 and slots.acquire("p", 2)
    slots.release("p")
    slots.release("p")
    with pytest.raises(RuntimeError):
        slots.release("p")


def test_limits_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        Limits(requests_per_minute=0)
    with pytest.raises(ValueError):
        RateLimiter().acquire("p", T0, per_minute=0)
