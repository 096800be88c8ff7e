"""The exit's node-wide memory: a TTL + LRU cache of answers, the token bucket capping its requests a
minute, and a fetched page as cached (`Page`, answered only to a request its hop hosts allow).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.web import Truncation, WebFetch, WebPage


# --------------------------------------------------------------------- cache and rate

K = TypeVar("K")
V = TypeVar("V")


class Cache(Generic[K, V]):
    """At most `entries` values, each for `ttl_s` (on the injected clock), least recently
    used out first."""

    def __init__(self, entries: int, ttl_s: float) -> None:
        self.entries = entries
        self.ttl_s = ttl_s
        self._items: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K, now: float) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        if now - item[0] >= self.ttl_s:
            del self._items[key]
            return None
        self._items.move_to_end(key)
        return item[1]

    def put(self, key: K, value: V, now: float) -> None:
        if self.entries == 0:
            return
        self._items[key] = (now, value)
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)


class Bucket:
    """`per_minute` requests a minute, in bursts of up to as many (a token bucket)."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.rate = per_minute / 60.0
        self.tokens = float(per_minute)
        self.at = now

    def take(self, now: float) -> None:
        self.tokens = min(float(self.per_minute), self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            raise PsymeshError(
                f"this exit is at its limit of {self.per_minute} web requests a minute ([web.exit] requests_per_minute)",
                code=ErrorCode.RATE_LIMITED, retry_after=(1.0 - self.tokens) / self.rate)
        self.tokens -= 1.0


@dataclass(frozen=True)
class Page:
    """A fetched page as the cache keeps it: its text (one char past the most any request
    may ask, so `truncated` stays right), why that text is not all of the page (`cut`: the
    HTML read past what is extracted, or nested too deep), the body's bytes and the bytes
    the text came from, and every hop's host, to re-check per asker."""

    final_url: str
    status: int
    content_type: str
    title: str
    text: str
    hosts: tuple[str, ...]
    cut: tuple[Truncation, ...] = ()
    body_bytes: int | None = None
    extracted_bytes: int | None = None

    def answer(self, request: WebFetch, *, cached: bool) -> WebPage:
        cut = self.cut + ((Truncation.MAX_CHARS,) if len(self.text) > request.max_chars else ())
        return WebPage(url=request.url, final_url=self.final_url, status=self.status,
                       content_type=self.content_type, title=self.title, text=self.text[:request.max_chars],
                       truncated=bool(cut), truncated_reasons=tuple(str(why) for why in cut), cached=cached,
                       body_bytes=self.body_bytes, extracted_bytes=self.extracted_bytes)
