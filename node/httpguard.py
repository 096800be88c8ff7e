"""The door of the node's local HTTP faces: one ASGI middleware, the same for the
OpenAI-compatible endpoint (node/openai_api.py), the A2A agent (node/a2a_api.py) and
the local web dashboard to come, so that a web page the owner visits cannot drive them
(docs/security.md, "A web page the owner visits").

A page can make the browser send a "simple" request anywhere, with no preflight: a GET,
or a POST whose Content-Type is text/plain, a form's or multipart. It cannot add headers
(Authorization, A2A-Version) without a CORS preflight, which nothing here answers; and
with DNS rebinding (its own name re-pointed at 127.0.0.1) it can even read the answers,
but its requests then carry its own name in Host. So every request passes, in order
(the first that fails answers, and the app never sees the request):

    1. Host      a loopback address, `localhost`, or a name the owner configured (the
                 bind host, `allowed_hosts`, the host of the A2A `public_url`); any IP
                 address when bound to all (0.0.0.0, ::), since rebinding needs a name.
                 403 `host_not_allowed`. Syncthing's GUI does the same.
    2. Origin    if sent, the request's own origin (same host and port as Host); an
                 `Origin: null` or a `Sec-Fetch-Site` other than same-origin or none
                 (the owner typed the URL) is refused too. 403 `cross_origin`.
    3. The key   `Authorization: Bearer KEY`, compared in constant time; not asked of
                 GET/HEAD on the rules' public paths (the A2A card). 401
                 `invalid_api_key` with `WWW-Authenticate: Bearer`.
    4. JSON      a request that carries a body (POST, PUT, PATCH, DELETE, or any with a
                 Content-Length or Transfer-Encoding) says `Content-Type:
                 application/json` (parameters such as charset allowed). 415
                 `unsupported_media_type`.
    5. A header  if the rules name one (A2A: `A2A-Version: 1.0` or `0.3`), it is there
                 with one of its values; not asked on public paths. 400
                 `version_not_supported`.

WebSocket connections are closed unheard (no face serves one yet).

API, for a face that serves HTTP:

    rules = GuardRules(key=load_api_key(settings, home, os.environ).value,
                       hosts=AllowedHosts.of(settings.host_names()),
                       public=frozenset({"/.well-known/agent-card.json"}),   # optional
                       header=RequiredHeader("A2A-Version", frozenset({"1.0", "0.3"})))  # optional
    app = HttpGuard(app, rules, refuse)    # refuse(Refusal) -> starlette Response, in the
                                           # face's own error shape (OpenAI's, JSON-RPC's)
    refusal = check_request(rules, method, path, headers)   # the same checks, pure: None
                                                            # if the request may pass

A Refusal carries the check that failed (`Check`, whose value is the stable error
code), the HTTP status, a one-line message and the headers to send (WWW-Authenticate).

The dashboard (issue 24) wraps its Starlette app the same way, with the same rules: its
login page is a public path; its pages then authenticate with an HttpOnly SameSite=Strict
cookie instead of the Authorization header, which is a credential to add to step 3 here
(kept beside the bearer check, never a second copy of it), with a CSRF token checked on
every request with a body. Steps 1, 2 and 4 already refuse what a cross-site page or a
rebound name could send.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("psymesh.http")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_SAFE_METHODS = frozenset({"GET", "HEAD"})
_FETCH_SITES = frozenset({"same-origin", "none"})  # Sec-Fetch-Site values of a request we may serve
_LOOPBACK_NAMES = frozenset({"localhost"})
_ANY = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))


class Check(StrEnum):
    """The check a request failed; the value is the error code its answer carries."""

    HOST = "host_not_allowed"
    ORIGIN = "cross_origin"
    KEY = "invalid_api_key"
    CONTENT_TYPE = "unsupported_media_type"
    HEADER = "version_not_supported"


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: answer it with `status`, `message` and `headers`."""

    check: Check
    status: int
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)


def _ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _name(host: str) -> str:
    """A host as compared: lowercase, without the root's trailing dot or IPv6 brackets."""
    host = host.strip().lower().removesuffix(".")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclass(frozen=True)
class AllowedHosts:
    """The Host header values a face answers to (without the port)."""

    names: frozenset[str]
    ips: frozenset[IPAddress]
    any_ip: bool  # bound to all addresses: any IP literal (the machine's own, as a client dialed it)

    @classmethod
    def of(cls, configured: Iterable[str]) -> AllowedHosts:
        """Loopback and `localhost`, and each configured name or address (the bind host
        first: 0.0.0.0 or :: there means any IP literal)."""
        names, ips, any_ip = set(_LOOPBACK_NAMES), set(), False
        for entry in configured:
            host = _name(entry)
            ip = _ip(host)
            if ip is None:
                if host:
                    names.add(host)
            elif ip in _ANY:
                any_ip = True
            else:
                ips.add(ip)
        return cls(frozenset(names), frozenset(ips), any_ip)

    def allows(self, host: str) -> bool:
        host = _name(host)
        ip = _ip(host)
        if ip is None:
            return host in self.names
        return ip.is_loopback or self.any_ip or ip in self.ips


@dataclass(frozen=True)
class RequiredHeader:
    """A header every non-public request must carry, with one of `values`."""

    name: str
    values: frozenset[str]


@dataclass(frozen=True)
class GuardRules:
    """What one face asks of every request (see the module docstring for the order)."""

    key: str = field(repr=False)
    hosts: AllowedHosts
    public: frozenset[str] = frozenset()  # paths a GET or HEAD reaches without the key (nor the header)
    header: RequiredHeader | None = None


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header as (host, port); None if it is not one ("[::1]:8080", "localhost")."""
    value = value.strip()
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = value.partition(":")
        if ":" in port_text:  # a bare IPv6 address: not a valid Host
            return None
    if not host:
        return None
    if not port_text:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return host, int(port_text)


def _same_origin(origin: str, host: str, port: int | None) -> bool:
    """Whether `Origin: origin` names the host and port the request was sent to."""
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return False
    if _name(parts.hostname) != _name(host):
        return False
    if port is None:  # Host without a port (a reverse proxy's): the name decides
        return True
    return (origin_port or (443 if parts.scheme == "https" else 80)) == port


def _bearer_matches(headers: Headers, key: str) -> bool:
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _carries_body(method: str, headers: Headers) -> bool:
    return (method in _BODY_METHODS or headers.get("content-length", "0").strip() not in ("", "0")
            or "transfer-encoding" in headers)


def check_request(rules: GuardRules, method: str, path: str, headers: Headers) -> Refusal | None:
    """The first check (module docstring) the request fails, or None if it may pass."""
    host_header = headers.get("host", "")
    where = split_host(host_header)
    if where is None or not rules.hosts.allows(where[0]):
        return Refusal(Check.HOST, 403, f"Host {host_header!r} is not a name of this node (a page that "
                                        "re-pointed its own name here?); use 127.0.0.1 or localhost, or add "
                                        "the name to allowed_hosts")
    origin = headers.get("origin")
    if origin is not None and not _same_origin(origin, *where):
        return Refusal(Check.ORIGIN, 403, f"cross-origin requests are refused (Origin {origin!r})")
    site = headers.get("sec-fetch-site")
    if site is not None and site.strip().lower() not in _FETCH_SITES:
        return Refusal(Check.ORIGIN, 403, f"cross-site requests are refused (Sec-Fetch-Site {site!r})")
    public = method in _SAFE_METHODS and path in rules.public
    if not public and not _bearer_matches(headers, rules.key):
        return Refusal(Check.KEY, 401, "missing or incorrect API key (send Authorization: Bearer KEY; "
                                       "psymesh serve ... --show-key prints it)",
                       {"WWW-Authenticate": 'Bearer realm="psymesh"'})
    if _carries_body(method, headers):
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            return Refusal(Check.CONTENT_TYPE, 415, f"the body must be JSON with Content-Type: application/json "
                                                    f"(got {media or 'none'!r})")
    if rules.header is not None and not public:
        given = headers.get(rules.header.name)
        if given is None or given.strip() not in rules.header.values:
            wanted = " or ".join(sorted(rules.header.values))
            return Refusal(Check.HEADER, 400, f"send the header {rules.header.name}: {wanted} "
                                              f"(got {'none' if given is None else repr(given)})")
    return None


class HttpGuard:
    """ASGI middleware: `app` hears only requests that pass `check_request(rules, ...)`;
    the others are answered with `refuse(refusal)` and logged."""

    def __init__(self, app: ASGIApp, rules: GuardRules, refuse: Callable[[Refusal], Response]) -> None:
        self.app, self.rules, self.refuse = app, rules, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a WebSocket: no face serves one
            await send({"type": "websocket.close", "code": 1008})
            return
        refusal = check_request(self.rules, scope["method"], scope["path"], Headers(scope=scope))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        log.info("refused %s %s from %s: %s", scope["method"], scope["path"],
                 f"{client[0]}:{client[1]}" if client else "?", refusal.message)
        await self.refuse(refusal)(scope, receive, send)
