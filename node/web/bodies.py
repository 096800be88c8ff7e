"""Response bodies, bounded: refused by Content-Length before reading, then counted as they stream,
both as sent and as inflated (`Inflater` inflates gzip/deflate in bounded steps), and their charset.
"""
from __future__ import annotations

import codecs
import zlib
from contextlib import aclosing

import httpx

from ...protocol.errors import ErrorCode, PsymeshError


# ------------------------------------------------------------------------------- bodies


class Inflater:
    """Undoes a gzip or deflate Content-Encoding with a bound on what comes out. A 10 KiB
    gzip of zeros is 10 MiB of text, and a decoder that inflates a whole network read at
    once (httpx's does) turns one 64 KiB read into up to 64 MiB before any cap sees it;
    here each step yields at most what still fits under the cap, plus one byte to tell."""

    def __init__(self, encoding: str, limit: int) -> None:
        encoding = encoding.strip().lower()
        if encoding in ("", "identity"):
            self._zlib = None
        elif encoding in ("gzip", "x-gzip", "deflate"):
            self._zlib = zlib.decompressobj(wbits=zlib.MAX_WBITS | 32)   # a zlib or a gzip header
        else:
            raise PsymeshError(f"refused: content encoding {encoding!r} (the exit reads gzip and deflate only)",
                               code=ErrorCode.BAD_REQUEST)
        self.limit = limit
        self.size = 0

    def feed(self, data: bytes) -> bytes:
        if self._zlib is None:
            return self._count(data)
        parts = []
        try:
            while data:
                parts.append(self._count(self._zlib.decompress(data, self.limit - self.size + 1)))
                data = self._zlib.unconsumed_tail
        except zlib.error as exc:
            raise PsymeshError(f"the site sent a broken compressed body: {exc}", code=ErrorCode.UNAVAILABLE) from None
        return b"".join(parts)

    def flush(self) -> bytes:
        if self._zlib is None:
            return b""
        try:
            return self._count(self._zlib.flush())
        except zlib.error as exc:
            raise PsymeshError(f"the site sent a broken compressed body: {exc}", code=ErrorCode.UNAVAILABLE) from None

    def _count(self, data: bytes) -> bytes:
        self.size += len(data)
        if self.size > self.limit:
            raise too_large(self.limit)
        return data


def too_large(limit: int, declared: int | None = None) -> PsymeshError:
    size = f"{declared} bytes" if declared is not None else "over the limit"
    return PsymeshError(f"refused: the body is {size}; this exit reads at most {limit} bytes ([web.exit] max_body_bytes)",
                        code=ErrorCode.TOO_LARGE)


async def read_body(response: httpx.Response, limit: int) -> bytes:
    """The body, inflated, or TOO_LARGE as soon as it is known to pass `limit` (by its
    Content-Length, before reading; else as it streams, sent and inflated)."""
    declared = response.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit, int(declared))
    inflater = Inflater(response.headers.get("content-encoding", ""), limit)
    received = 0
    parts = []
    async with aclosing(response.aiter_raw()) as chunks:   # closed at once when we stop early
        async for chunk in chunks:
            received += len(chunk)
            if received > limit:
                raise too_large(limit)
            parts.append(inflater.feed(chunk))
    parts.append(inflater.flush())
    return b"".join(parts)


def charset(response: httpx.Response) -> str | None:
    """The response's declared charset, if Python knows it."""
    name = response.charset_encoding
    if name is None:
        return None
    try:
        return codecs.lookup(name).name
    except LookupError:
        return None
