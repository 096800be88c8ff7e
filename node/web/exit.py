"""The web exit: this node fetches and searches the web for paired peers that never touch it.

A phone asks (`web.fetch`, `web.search`, protocol/web.py); the exit, a trusted peer with a
real network, runs the request and answers with text. The door (node/door/gate.py) has already
admitted the request by a grant; this module is what keeps the exit itself safe while it
runs one. The threat model is a paired peer, or whoever the relay serves, that wants the
exit to do what it could not do itself:

  * reach the exit's side of the network: its loopback services, its LAN (the router's admin
    page, a NAS), the cloud metadata endpoint (169.254.169.254), the exit's own addresses.
    Tor's exit policy is the model: refuse by default, and the owner opens explicitly
    (`[web.exit] allow_loopback`, `allow_private`, `ports`).
  * slip past that check: a name that resolves to 127.0.0.1; DNS rebinding (a name that
    resolves to a public address when checked and to a private one when connected); a
    public page that redirects into private space; `::ffff:127.0.0.1` and other IPv6 forms
    that embed an IPv4 address; `0x7f.1` and other spellings of one. All of them meet one
    check, on the address actually connected to: `GuardedBackend` (node/web/guard.py) is the httpcore network
    backend of the fetch pool; it resolves the name itself, drops every address the policy
    refuses, connects to an allowed *IP*, and checks the socket's peer address again. TLS
    still verifies the URL's host name (httpcore hands it to start_tls), so connecting by IP
    costs no certificate check. Redirects are followed here, not by httpx, so every hop is
    checked: scheme (http and https only), the grant's domains (`host_allowed`), and again
    the address, by the backend, when the hop connects.
  * exhaust the exit: a body that never ends, a 10 KiB gzip that inflates to gigabytes, a
    server that stalls, a page whose text costs gigabytes to extract. One deadline bounds a
    whole fetch (every hop, the body and the extraction of its text); bodies
    are refused by Content-Length before reading, then counted as they stream, both as sent
    and as inflated (node/web/bodies.py inflates in bounded steps); the content type is checked
    before a byte of body is read. The text is extracted in child processes with a memory
    cap, a few at once (node/web/extractor.py), from at most `max_html_bytes` of HTML. A
    node-wide token bucket caps the exit's requests a minute, beside each peer's own grant
    rate.
  * use the exit to carry state between askers: no cookie is kept, no proxy from the
    environment is used, no credentials are sent.

What comes back is text from the web, marked untrusted: data for the asker, never
instructions (a page may well say "ignore your previous instructions").

The cache is node-wide (TTL + LRU, `cache_entries` per kind; 0 turns it off). A cached page
is served only if every hop host of the fetch that filled it is allowed to this request too.
It does tell an asker (by `cached`, or by timing) that someone asked the same within
`cache_ttl_s`; an exit whose askers must not learn that about each other sets
`cache_entries = 0`.
"""
from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.cookiejar import CookieJar, DefaultCookiePolicy
from types import TracebackType

import anyio
import httpcore
import httpx

from .bodies import charset, read_body
from .cache import Bucket, Cache, Page
from .extractor import Extractors, cut_html
from .guard import (  # IPAddress and resolve_host: callers import them from here
    AddressPolicy,
    GuardedBackend,
    HostAllowed,
    IPAddress,
    LocalAddresses,
    Resolver,
    interface_addresses,
    resolve_host,
)
from .search import backend_for
from ..core.websettings import ExitSettings, SearchSettings  # noqa: F401 (the config lives there)
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.web import MAX_PAGE_CHARS, Truncation, WebFetch, WebHit, WebPage, WebResults, WebSearch

__all__ = ["AddressPolicy", "ExitSettings", "GuardedBackend", "IPAddress", "SearchSettings", "WebExit", "resolve_host"]


# ---------------------------------------------------------------------------- the exit


def _client(network: httpcore.AsyncNetworkBackend, ssl_context: ssl.SSLContext, headers: dict[str, str]) -> httpx.AsyncClient:
    """An httpx client on `network`: no redirects followed, no cookies kept, nothing taken
    from the environment (an HTTP_PROXY would connect for us, past the address check)."""
    transport = httpx.AsyncHTTPTransport(verify=ssl_context, trust_env=False)
    # httpx 0.28 takes no network backend; the transport sends through its httpcore pool,
    # so the pool is swapped for one on ours.
    transport._pool = httpcore.AsyncConnectionPool(ssl_context=ssl_context, network_backend=network,
                                                   max_connections=100, max_keepalive_connections=20,
                                                   keepalive_expiry=5.0)
    return httpx.AsyncClient(transport=transport, headers=headers, trust_env=False, follow_redirects=False,
                             timeout=None, cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])))


@contextmanager
def _network_errors(timeout_s: float) -> Iterator[None]:
    """httpx's and the deadline's exceptions as PsymeshError, at the module's edge."""
    try:
        yield
    except (TimeoutError, httpx.TimeoutException):
        raise PsymeshError(f"no answer within {timeout_s:g} s ([web.exit] timeout_s)", code=ErrorCode.TIMEOUT) from None
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise PsymeshError(f"not a URL the exit can fetch: {exc}", code=ErrorCode.BAD_REQUEST) from None
    except httpx.ConnectError as exc:
        raise PsymeshError(f"could not connect: {exc}", code=ErrorCode.UNAVAILABLE) from None
    except httpx.HTTPError as exc:
        raise PsymeshError(f"the connection failed: {exc}", code=ErrorCode.UNAVAILABLE) from None


def _check_hop(url: httpx.URL, host_allowed: HostAllowed) -> str:
    """A hop may be fetched: http(s), to a host the asker's grant allows. Its host."""
    if url.scheme not in ("http", "https"):
        raise PsymeshError(f"refused: {url.scheme or 'scheme-less'} URLs are not fetched (http and https only)",
                           code=ErrorCode.FORBIDDEN)
    if not url.host:
        raise PsymeshError(f"not a URL with a host: {str(url)[:120]!r}", code=ErrorCode.BAD_REQUEST)
    _check_host(url.host, host_allowed)
    return url.host


def _check_host(host: str, host_allowed: HostAllowed) -> None:
    if not host_allowed(host):
        raise PsymeshError(f"refused: {host} is not among the domains this request's grant allows (web.fetch:domains)",
                           code=ErrorCode.FORBIDDEN)


class WebExit:
    """Runs web.fetch and web.search for the exit. One fetch pool (keep-alive) behind the
    address policy, one search pool for the owner's configured endpoint (never shared: see
    node/web/search.py), the cache and the node-wide rate. Use as an async context manager.

    `resolve`, `local_addresses`, `network` and `ssl_context` are the seams tests use to
    map names, fake this machine's addresses, watch connections and trust a test CA."""

    def __init__(self, settings: ExitSettings, *, clock: Callable[[], float] = time.monotonic,
                 resolve: Resolver = resolve_host, local_addresses: LocalAddresses = interface_addresses,
                 network: httpcore.AsyncNetworkBackend | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.settings = settings
        self._clock = clock
        context = ssl_context or httpx.create_ssl_context(trust_env=False)
        network = network or httpcore.AnyIOBackend()
        guarded = GuardedBackend(AddressPolicy.of(settings, local_addresses), resolve=resolve, inner=network)
        self._fetcher = _client(guarded, context, {
            "User-Agent": settings.user_agent, "Accept": ", ".join(settings.content_types),
            "Accept-Encoding": "gzip, deflate"})
        self._searcher = _client(network, context, {
            "User-Agent": settings.user_agent, "Accept": "application/json", "Accept-Encoding": "gzip, deflate"})
        self._search = backend_for(settings.search, self._get, timeout_s=settings.timeout_s)
        self._pages: Cache[str, Page] = Cache(settings.cache_entries, settings.cache_ttl_s)
        self._results: Cache[tuple[str, int], tuple[WebHit, ...]] = Cache(settings.cache_entries, settings.cache_ttl_s)
        self._bucket = Bucket(settings.requests_per_minute, clock())
        self._extractors = Extractors(settings.extractions, settings.extract_memory_bytes)

    async def __aenter__(self) -> "WebExit":
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._extractors.aclose()
        await self._fetcher.aclose()
        await self._searcher.aclose()

    async def fetch(self, request: WebFetch, *, host_allowed: HostAllowed) -> WebPage:
        """The page at `request.url` as text. Every hop's host must pass `host_allowed`
        (the asker's grant), every connection the address policy.

        Raises PsymeshError: FORBIDDEN (refused address, port, scheme or host), BAD_REQUEST
        (content type or encoding, too many redirects, bad URL), TOO_LARGE, TIMEOUT,
        UNAVAILABLE (resolve or connect failed, broken response), RATE_LIMITED."""
        try:
            url = httpx.URL(request.url).copy_with(fragment=None)
        except httpx.InvalidURL as exc:
            raise PsymeshError(f"not a URL the exit can fetch: {exc}", code=ErrorCode.BAD_REQUEST) from None
        _check_hop(url, host_allowed)
        key = str(url)
        page = self._pages.get(key, self._clock())
        if page is not None:
            for host in page.hosts:
                _check_host(host, host_allowed)
            return page.answer(request, cached=True)
        self._bucket.take(self._clock())
        page = await self._download(url, host_allowed)
        self._pages.put(key, page, self._clock())
        return page.answer(request, cached=False)

    async def search(self, request: WebSearch) -> WebResults:
        """Hits for `request.query` from the configured backend.

        Raises PsymeshError: UNAVAILABLE (no backend, or it failed), TIMEOUT, TOO_LARGE,
        RATE_LIMITED."""
        key = (" ".join(request.query.split()).casefold(), request.limit)
        hits = self._results.get(key, self._clock())
        if hits is not None:
            return WebResults(query=request.query, hits=hits, cached=True)
        self._bucket.take(self._clock())
        timeout_s = self.settings.timeout_s
        with _network_errors(timeout_s), anyio.fail_after(timeout_s):
            hits = await self._search.search(request.query, request.limit)
        self._results.put(key, hits, self._clock())
        return WebResults(query=request.query, hits=hits)

    async def _download(self, url: httpx.URL, host_allowed: HostAllowed) -> Page:
        """Follow redirects by hand (each hop checked), read the body within the caps and
        extract its text (in a child): all of it within one deadline."""
        s = self.settings
        hosts = [url.host]
        with _network_errors(s.timeout_s), anyio.fail_after(s.timeout_s):
            request = self._fetcher.build_request("GET", url)
            for _ in range(s.max_redirects + 1):
                response = await self._fetcher.send(request, stream=True)
                try:
                    if response.next_request is None:
                        media_type = self._media_type(response)
                        body = await read_body(response, s.max_body_bytes)
                        break
                    request = response.next_request
                    hosts.append(_check_hop(request.url, host_allowed))
                finally:
                    await response.aclose()
            else:
                raise PsymeshError(f"refused: more than {s.max_redirects} redirects ([web.exit] max_redirects)",
                                   code=ErrorCode.BAD_REQUEST)
            extracted = cut_html(body, media_type, s.max_html_bytes)
            readable = await self._extractors.text(extracted, media_type, charset(response))
        cut = ((Truncation.TOO_LARGE,) if len(extracted) < len(body) else ()) + readable.cut
        return Page(final_url=str(response.url), status=response.status_code, content_type=media_type,
                    title=readable.title, text=readable.text[:MAX_PAGE_CHARS + 1], hosts=tuple(hosts), cut=cut,
                    body_bytes=len(body), extracted_bytes=len(extracted))

    def _media_type(self, response: httpx.Response) -> str:
        """The response's media type, if this exit serves it; checked before the body is read."""
        media_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type not in self.settings.content_types:
            raise PsymeshError(f"refused: {media_type or 'a body without a content type'} is not a content type "
                               "this exit serves ([web.exit] content_types)", code=ErrorCode.BAD_REQUEST)
        return media_type

    async def _get(self, url: str) -> bytes:
        """GET on the search pool, for the search backends (their caller holds the deadline)."""
        response = await self._searcher.send(self._searcher.build_request("GET", url), stream=True)
        try:
            if not response.is_success:
                raise PsymeshError(f"the search backend answered HTTP {response.status_code}",
                                   code=ErrorCode.UNAVAILABLE)
            return await read_body(response, self.settings.max_body_bytes)
        finally:
            await response.aclose()
