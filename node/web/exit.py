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
    check, on the address actually connected to: `GuardedBackend` is the httpcore network
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
    and as inflated (`_Inflater` inflates in bounded steps); the content type is checked
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

import codecs
import ipaddress
import socket
import ssl
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from types import TracebackType
from typing import Generic, TypeVar

import anyio
import httpcore
import httpx
import ifaddr

from .extractor import Extractors, cut_html
from .search import backend_for
from ..core.websettings import ExitSettings, SearchSettings  # noqa: F401 (the config lives there)
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.web import MAX_PAGE_CHARS, WebFetch, WebHit, WebPage, WebResults, WebSearch

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[Sequence[IPAddress]]]
"""(host, port) -> the addresses `host` resolves to, in the order to try them."""
LocalAddresses = Callable[[], frozenset[IPAddress]]
HostAllowed = Callable[[str], bool]
"""Whether the asker's grant lets it fetch from this host (called for every hop)."""


# ------------------------------------------------------------------------- addresses


def interface_addresses() -> frozenset[IPAddress]:
    """This machine's own addresses, now (a laptop's change as it moves, so ask each time)."""
    found: set[IPAddress] = set()
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            text = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            try:
                found.add(ipaddress.ip_address(text.split("%", 1)[0]))
            except ValueError:
                continue
    return frozenset(found)


async def resolve_host(host: str, port: int) -> Sequence[IPAddress]:
    """The system resolver's answer for `host` (an IP literal is its own answer)."""
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        pass
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise PsymeshError(f"could not resolve {host}: {exc}", code=ErrorCode.UNAVAILABLE) from None
    found: dict[IPAddress, None] = {}
    for *_, sockaddr in infos:
        found.setdefault(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]), None)
    return tuple(found)


_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NEVER = "the exit never fetches from these"
_HINTS = {
    "allow_loopback": "the exit does not fetch from loopback unless [web.exit] allow_loopback = true",
    "allow_private": "the exit does not fetch from private networks unless [web.exit] allow_private = true",
}


def _embedded_v4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64): it is where a socket may
    really go, so it is the one judged."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _kind(ip: IPAddress) -> tuple[str, str | None] | None:
    """What non-public kind of address `ip` is, and the setting that opens it (None: none
    does); None for a public address. Order matters: Python calls ff02::1 'global'."""
    if ip.is_unspecified or (isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_NETWORK):
        return "an unspecified address", None
    if ip.is_loopback:
        return "a loopback address", "allow_loopback"
    if ip.is_link_local:
        return "a link-local address", None
    if ip.is_multicast:
        return "a multicast address", None
    if ip.is_reserved:
        return "a reserved address", None
    if ip.is_private or not ip.is_global or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local):
        return "a private address", "allow_private"
    return None


@dataclass(frozen=True)
class AddressPolicy:
    """Which addresses and ports the exit may connect to for a fetch."""

    allow_loopback: bool = False
    allow_private: bool = False
    ports: frozenset[int] | None = None
    local_addresses: LocalAddresses = interface_addresses

    @classmethod
    def of(cls, settings: ExitSettings, local_addresses: LocalAddresses = interface_addresses) -> "AddressPolicy":
        ports = None if settings.ports is None else frozenset(settings.ports)
        return cls(settings.allow_loopback, settings.allow_private, ports, local_addresses)

    def port_refusal(self, port: int) -> str | None:
        if self.ports is None or port in self.ports:
            return None
        return f"refused: port {port} is not open on this exit ([web.exit] ports = {sorted(self.ports)})"

    def refusal(self, address: IPAddress) -> str | None:
        """Why the exit must not connect to `address`, as the end of a sentence about it
        ("is a loopback address (...)"); None when it may."""
        inner = _embedded_v4(address)
        judged = inner or address
        prefix = f"embeds {inner}, which " if inner is not None else ""
        kind = _kind(judged)
        if kind is not None:
            what, setting = kind
            if setting is None or not getattr(self, setting):
                return f"{prefix}is {what} ({_HINTS[setting] if setting else _NEVER})"
        if not self.allow_loopback and judged in self.local_addresses():
            return (f"{prefix}is an address of this machine "
                    "(the exit does not fetch from itself unless [web.exit] allow_loopback = true)")
        return None

    def refused(self, host: str, address: IPAddress, why: str) -> PsymeshError:
        subject = str(address) if host == str(address) else f"{host} resolves to {address}, which"
        return PsymeshError(f"refused: {subject} {why}", code=ErrorCode.FORBIDDEN)


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the address policy in it: the one place a fetch
    connects, so the one place its address is judged. It resolves `host` itself and connects
    to an allowed IP, so there is no second lookup an attacker's DNS could answer
    differently (rebinding), and it checks the connected socket's peer address again."""

    def __init__(self, policy: AddressPolicy, *, resolve: Resolver = resolve_host,
                 inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.policy = policy
        self.resolve = resolve
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.AsyncNetworkStream:
        refused_port = self.policy.port_refusal(port)
        if refused_port is not None:
            raise PsymeshError(refused_port, code=ErrorCode.FORBIDDEN)
        addresses = await self.resolve(host, port)
        if not addresses:
            raise PsymeshError(f"could not resolve {host}: no addresses", code=ErrorCode.UNAVAILABLE)
        allowed = [ip for ip in addresses if self.policy.refusal(ip) is None]
        if not allowed:
            first = addresses[0]
            raise self.policy.refused(host, first, self.policy.refusal(first) or "")
        failure: Exception | None = None
        for ip in allowed:
            try:
                stream = await self.inner.connect_tcp(str(ip), port, timeout=timeout, local_address=local_address,
                                                      socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
                continue
            await self._check_peer(host, stream)
            return stream
        assert failure is not None
        raise failure

    async def _check_peer(self, host: str, stream: httpcore.AsyncNetworkStream) -> None:
        """The address the socket is really connected to passes the policy too."""
        peer = stream.get_extra_info("server_addr")
        try:
            address = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
        except (TypeError, IndexError, ValueError):
            await stream.aclose()
            raise PsymeshError(f"refused: could not confirm the address connected to for {host}",
                               code=ErrorCode.FORBIDDEN) from None
        why = self.policy.refusal(address)
        if why is not None:
            await stream.aclose()
            raise PsymeshError(f"refused: the connection for {host} reached {address}, which {why}",
                               code=ErrorCode.FORBIDDEN)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.AsyncNetworkStream:
        raise PsymeshError("refused: the exit never connects to unix sockets", code=ErrorCode.FORBIDDEN)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


# ------------------------------------------------------------------------------- bodies


class _Inflater:
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
            raise _too_large(self.limit)
        return data


def _too_large(limit: int, declared: int | None = None) -> PsymeshError:
    size = f"{declared} bytes" if declared is not None else "over the limit"
    return PsymeshError(f"refused: the body is {size}; this exit reads at most {limit} bytes ([web.exit] max_body_bytes)",
                        code=ErrorCode.TOO_LARGE)


async def _read(response: httpx.Response, limit: int) -> bytes:
    """The body, inflated, or TOO_LARGE as soon as it is known to pass `limit` (by its
    Content-Length, before reading; else as it streams, sent and inflated)."""
    declared = response.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, int(declared))
    inflater = _Inflater(response.headers.get("content-encoding", ""), limit)
    received = 0
    parts = []
    async with aclosing(response.aiter_raw()) as chunks:   # closed at once when we stop early
        async for chunk in chunks:
            received += len(chunk)
            if received > limit:
                raise _too_large(limit)
            parts.append(inflater.feed(chunk))
    parts.append(inflater.flush())
    return b"".join(parts)


def _charset(response: httpx.Response) -> str | None:
    """The response's declared charset, if Python knows it."""
    name = response.charset_encoding
    if name is None:
        return None
    try:
        return codecs.lookup(name).name
    except LookupError:
        return None


# --------------------------------------------------------------------- cache and rate

K = TypeVar("K")
V = TypeVar("V")


class _Cache(Generic[K, V]):
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


class _Bucket:
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
class _Page:
    """A fetched page as the cache keeps it: its text (one char past the most any request
    may ask, so `truncated` stays right) and every hop's host, to re-check per asker."""

    final_url: str
    status: int
    content_type: str
    title: str
    text: str
    hosts: tuple[str, ...]

    def answer(self, request: WebFetch, *, cached: bool) -> WebPage:
        return WebPage(url=request.url, final_url=self.final_url, status=self.status,
                       content_type=self.content_type, title=self.title, text=self.text[:request.max_chars],
                       truncated=len(self.text) > request.max_chars, cached=cached)


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
        self._pages: _Cache[str, _Page] = _Cache(settings.cache_entries, settings.cache_ttl_s)
        self._results: _Cache[tuple[str, int], tuple[WebHit, ...]] = _Cache(settings.cache_entries, settings.cache_ttl_s)
        self._bucket = _Bucket(settings.requests_per_minute, clock())
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

    async def _download(self, url: httpx.URL, host_allowed: HostAllowed) -> _Page:
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
                        body = await _read(response, s.max_body_bytes)
                        break
                    request = response.next_request
                    hosts.append(_check_hop(request.url, host_allowed))
                finally:
                    await response.aclose()
            else:
                raise PsymeshError(f"refused: more than {s.max_redirects} redirects ([web.exit] max_redirects)",
                                   code=ErrorCode.BAD_REQUEST)
            title, text = await self._extractors.text(cut_html(body, media_type, s.max_html_bytes), media_type,
                                                      _charset(response))
        return _Page(final_url=str(response.url), status=response.status_code, content_type=media_type,
                     title=title, text=text[:MAX_PAGE_CHARS + 1], hosts=tuple(hosts))

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
            return await _read(response, self.settings.max_body_bytes)
        finally:
            await response.aclose()
