"""The search backends of a web exit: one small interface, several engines behind it.

    none      NoSearch        the default: a fresh exit searches nothing until its owner says how
    searxng   SearxngBackend  a SearXNG instance, GET {url}/search?q=...&format=json
    json      JsonBackend     any JSON search API, from a URL template and the names of its keys
    ddgs      DdgsBackend     the `ddgs` metasearch library (no server to run; it reaches the
                              engines itself, over its own HTTP stack)

The endpoint of `searxng` and `json` is the *owner's* configuration, not the asker's: it may
be a SearXNG on the owner's LAN or loopback, which a phone's `web.fetch` may never reach.
So the HTTP backends never open sockets themselves; they call a `Get` the exit hands them
(node/web/exit.py), which runs on a connection pool of its own, with the exit's timeout and
size caps but without the fetch address policy. A shared pool would be a hole: a keep-alive
connection opened for the owner's search server could be reused by a phone's fetch of the
same origin without any address check. Only the query text reaches a URL's query string
(percent-encoded): the asker cannot change where a search goes.

Everything a backend returns is text from the web: data for the asker, never instructions
(WebResults.untrusted).
"""
from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol
from urllib.parse import quote

import anyio
import httpx

from ...protocol.errors import ErrorCode, PsymeshError
from ..core.websettings import SearchSettings  # noqa: F401 (the config lives there)
from ...protocol.web import MAX_URL_CHARS, WebHit

MAX_TITLE_CHARS = 300
MAX_SNIPPET_CHARS = 1000

Get = Callable[[str], Awaitable[bytes]]
"""GET a URL on the search pool; the body, within the exit's timeout and size cap."""


class SearchBackend(Protocol):
    async def search(self, query: str, limit: int) -> tuple[WebHit, ...]: ...


class NoSearch:
    """An exit whose owner configured no search: every search is refused, clearly."""

    async def search(self, query: str, limit: int) -> tuple[WebHit, ...]:
        raise PsymeshError("this exit has no search backend configured ([web.exit.search] backend)",
                           code=ErrorCode.UNAVAILABLE)


class SearxngBackend:
    """A SearXNG instance's JSON API (its `search.formats` must include json)."""

    def __init__(self, url: str, get: Get) -> None:
        self.url = url.rstrip("/") + "/search"
        self.get = get

    async def search(self, query: str, limit: int) -> tuple[WebHit, ...]:
        url = httpx.URL(self.url, params={"q": query, "format": "json"})
        body = _json(await self.get(str(url)))
        return _hits(_at(body, "results"), limit, title="title", url="url", snippet="content")


class JsonBackend:
    """Any JSON search API: a URL template, and where the hits and their fields are."""

    def __init__(self, settings: SearchSettings, get: Get) -> None:
        assert settings.url is not None   # SearchSettings checked it
        self.template = settings.url
        self.settings = settings
        self.get = get

    async def search(self, query: str, limit: int) -> tuple[WebHit, ...]:
        s = self.settings
        url = self.template.replace("{query}", quote(query, safe="")).replace("{limit}", str(limit))
        body = _json(await self.get(url))
        return _hits(_at(body, s.results_key), limit, title=s.title_key, url=s.url_key, snippet=s.snippet_key)


class DdgsBackend:
    """The `ddgs` library (`DDGS().text`). It is synchronous and does its own HTTP, so it
    runs in a worker thread that a timeout abandons (its own `timeout` ends it soon after)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def search(self, query: str, limit: int) -> tuple[WebHit, ...]:
        import ddgs  # imported when used: it is heavy, and most exits never search through it
        from ddgs.exceptions import DDGSException, RatelimitException, TimeoutException

        def run() -> list[dict[str, object]]:
            return ddgs.DDGS(timeout=math.ceil(self.timeout_s)).text(query, max_results=limit)

        try:
            rows = await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
        except RatelimitException as exc:
            raise PsymeshError(f"the search engines rate-limited this exit: {exc}", code=ErrorCode.RATE_LIMITED) from None
        except TimeoutException as exc:
            raise PsymeshError(f"the search engines did not answer in time: {exc}", code=ErrorCode.TIMEOUT) from None
        except DDGSException as exc:
            raise PsymeshError(f"search failed: {exc}", code=ErrorCode.UNAVAILABLE) from None
        return _hits(rows, limit, title="title", url="href", snippet="body")


def backend_for(settings: SearchSettings, get: Get, *, timeout_s: float) -> SearchBackend:
    """The backend `settings` names; HTTP backends reach their endpoint only through `get`."""
    if settings.backend == "searxng":
        assert settings.url is not None
        return SearxngBackend(settings.url, get)
    if settings.backend == "json":
        return JsonBackend(settings, get)
    if settings.backend == "ddgs":
        return DdgsBackend(timeout_s)
    return NoSearch()


def _json(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        raise PsymeshError("the search backend did not answer with JSON", code=ErrorCode.UNAVAILABLE) from None


def _at(body: object, path: str) -> object:
    """`body["a"]["b"]` for the dotted `path` "a.b"; None where the path does not lead."""
    for key in path.split("."):
        if not isinstance(body, Mapping):
            return None
        body = body.get(key)
    return body


def _hits(rows: object, limit: int, *, title: str, url: str, snippet: str) -> tuple[WebHit, ...]:
    """The first `limit` rows that have a URL, as hits; anything malformed is skipped, not
    trusted: a backend's JSON is as foreign as any page."""
    if not isinstance(rows, list):
        raise PsymeshError("the search backend's answer has no list of results", code=ErrorCode.UNAVAILABLE)
    hits: list[WebHit] = []
    for row in rows:
        if len(hits) == limit:
            break
        link = row.get(url) if isinstance(row, Mapping) else None
        if not isinstance(link, str) or not 0 < len(link) <= MAX_URL_CHARS:
            continue
        hits.append(WebHit(title=_text(row.get(title), MAX_TITLE_CHARS), url=link,
                           snippet=_text(row.get(snippet), MAX_SNIPPET_CHARS)))
    return tuple(hits)


def _text(value: object, limit: int) -> str:
    return " ".join(value.split())[:limit] if isinstance(value, str) else ""
