"""The door of the node's local HTTP faces: one ASGI middleware, the same for the
OpenAI-compatible endpoint (node/bridges/openai.py), the A2A agent (node/bridges/a2a.py) and
the local web dashboard (node/control/dashboard.py), so that a web page the owner visits cannot drive them
(docs/security.md, "A web page the owner visits").

A page can make the browser send a "simple" request anywhere, with no preflight: a GET,
or a POST whose Content-Type is text/plain, a form's or multipart. It cannot add headers
(Authorization) without a CORS preflight, which nothing here answers; and
with DNS rebinding (its own name re-pointed at 127.0.0.1) it can even read the answers,
but its requests then carry its own name in Host. So every request passes, in order
(the first that fails answers, and the app never sees the request):

    1. Host      a loopback address, `localhost`, or a name the owner configured (the
                 bind host, `allowed_hosts`, the host of the A2A `public_url`), or one under
                 a suffix the face names (the dashboard: `*.localhost`); any IP
                 address when bound to all (0.0.0.0, ::), since rebinding needs a name.
                 403 `host_not_allowed`. Syncthing's GUI does the same.
    2. Origin    if sent, the request's own origin (same host and port as Host; a Host
                 without a port is the scheme's default one, so the Origin names none);
                 an `Origin: null` or a `Sec-Fetch-Site` other than same-origin or none
                 (the owner typed the URL) is refused too, except for a link's top-level
                 GET to one of the rules' `links` (the dashboard's one-use login link,
                 opened from a file: its own credential). 403 `cross_origin`.
    3. The key   `Authorization: Bearer KEY`, compared in constant time; not asked of
                 GET/HEAD on the rules' public paths (the A2A card). 401
                 `invalid_api_key` with `WWW-Authenticate: Bearer`.
    4. JSON      a request that carries a body (POST, PUT, PATCH, DELETE, or any with a
                 Content-Length or Transfer-Encoding) says `Content-Type:
                 application/json` (parameters such as charset allowed). 415
                 `unsupported_media_type`.
    5. A version if the rules name a version header (A2A: `A2A-Version`), the version it
                 names, Major.Minor (a patch number is ignored, A2A §3.6), is one of its
                 values; an absent or empty header stands for the rules' `absent` (A2A:
                 0.3, as A2A §3.6.2 says). Not asked on public paths. 400
                 `version_not_supported`.

Then the body, for a request that carries one (the app is handed the body read here):

    6. Size      at most the face's `max_body` bytes: a larger Content-Length is refused
                 unread, and a body that streams past the limit (chunked, or framed by a
                 Content-Length the server trusts) is refused once it does, so no more than
                 `max_body` (and one chunk) is ever held. 413 `request_too_large`, with
                 `Connection: close`. The answer goes out at once; then, as nginx's lingering
                 close does, the rest of the body is read and dropped for up to LINGER_S
                 before the connection closes: a client that sends its whole body before
                 it reads (httpx, most do) would otherwise lose the answer to the reset a
                 close with unread data makes.
    7. JSON      a JSON body parses, and nests at most JSON_MAX_DEPTH arrays and objects
                 deep (so no parser or validator behind the door recurses past that). 400
                 `invalid_json`.

An exception the app did not handle is logged once (here, with its traceback) and
answered in the face's own error shape, status 500 `internal` (Starlette's own bare 500
never answers: HttpGuard installs the face's answer as the app's 500 handler); if the
answer had already begun (a stream), it is ended where it is. A client that went away
costs a debug line. So no face ever answers a bare 500, nor lets its server log a
traceback for what a client sent.

WebSocket connections are closed unheard (no face serves one yet).

API, for a face that serves HTTP:

    rules = GuardRules(key=load_api_key(settings, home, os.environ).value,
                       hosts=AllowedHosts.of(settings.host_names()),
                       public=frozenset({"/.well-known/agent-card.json"}),   # optional
                       header=VersionHeader("A2A-Version", frozenset({"1.0", "0.3"}), absent="0.3"),  # optional
                       max_body=settings.max_body_bytes)                        # default 4 MiB
    app = HttpGuard(app, rules, refuse)    # refuse(Refusal) -> starlette Response, in the
                                           # face's own error shape (OpenAI's, JSON-RPC's, an
                                           # HTML page), for every answer the guard makes
    refusal = check_request(rules, method, path, headers)   # the same checks, pure: None
                                                            # if the request may pass

A Refusal carries the check that failed (`Check`, whose value is the stable error
code), the HTTP status, a one-line message and the headers to send (WWW-Authenticate).

A browser face (the dashboard, node/control/dashboard.py) adds `session=SessionRules(...)`:

    3. The key   ... or the session cookie (`Cookie: NAME=VALUE`, HttpOnly, SameSite=Strict,
                 set by the face's login page, a public path), which the face looks up
                 (`find(value, host)`: a live session of its own, made at this Host name).
                 The app finds the cookie's value at scope["psymesh.session"].
    4. The body  a request the cookie admitted that carries a body must also carry that
                 session's CSRF token: in the `X-CSRF-Token` header (a JSON body), or as the
                 `csrf` field of an application/x-www-form-urlencoded body (a form, read
                 here within the face's `max_body` and handed on to the app unchanged).
                 403 `csrf_token_invalid` without it; a body of any other type, 415.

Steps 1 and 2 already refuse what a cross-site page or a rebound name could send; the
cookie is SameSite=Strict, so another site's page cannot make the browser send it; the
CSRF token is the last line, should one of those ever fail.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import accumulate
from urllib.parse import parse_qs, urlsplit

import anyio
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...protocol.errors import ErrorCode

log = logging.getLogger("psymesh.http")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_SAFE_METHODS = frozenset({"GET", "HEAD"})
_FETCH_SITES = frozenset({"same-origin", "none"})  # Sec-Fetch-Site values of a request we may serve
_LOOPBACK_NAMES = frozenset({"localhost"})
_ANY = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))
FORM = "application/x-www-form-urlencoded"
MAX_BODY_BYTES = 4 * 1024 * 1024  # a face's body limit unless its rules say otherwise
JSON_MAX_DEPTH = 64               # arrays and objects inside each other, at most
LINGER_S = 5.0                    # how long the rest of a refused body is read and dropped
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf"


class Check(StrEnum):
    """The check a request failed; the value is the error code its answer carries."""

    HOST = "host_not_allowed"
    ORIGIN = "cross_origin"
    KEY = "invalid_api_key"
    CONTENT_TYPE = "unsupported_media_type"
    HEADER = "version_not_supported"
    CSRF = "csrf_token_invalid"
    SIZE = "request_too_large"
    JSON = "invalid_json"
    INTERNAL = "internal"          # not a check: the app failed; the guard answers for it


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
    suffixes: frozenset[str] = frozenset()  # "*.localhost" given: any name ending ".localhost"

    @classmethod
    def of(cls, configured: Iterable[str]) -> AllowedHosts:
        """Loopback and `localhost`, and each configured name or address (the bind host
        first: 0.0.0.0 or :: there means any IP literal); `*.NAME`: every name under NAME."""
        names, ips, any_ip, suffixes = set(_LOOPBACK_NAMES), set(), False, set()
        for entry in configured:
            host = _name(entry)
            ip = _ip(host)
            if host.startswith("*.") and len(host) > 2:
                suffixes.add(host[1:])
            elif ip is None:
                if host:
                    names.add(host)
            elif ip in _ANY:
                any_ip = True
            else:
                ips.add(ip)
        return cls(frozenset(names), frozenset(ips), any_ip, frozenset(suffixes))

    def allows(self, host: str) -> bool:
        host = _name(host)
        ip = _ip(host)
        if ip is None:
            return host in self.names or any(host.endswith(suffix) for suffix in self.suffixes)
        return ip.is_loopback or self.any_ip or ip in self.ips


@dataclass(frozen=True)
class VersionHeader:
    """A header naming the protocol version a non-public request speaks: Major.Minor in
    `values` (a patch number is not considered: `1.0.2` is `1.0`); absent or empty, it
    stands for `absent` (None: it must be sent)."""

    name: str
    values: frozenset[str]
    absent: str | None = None

    def version(self, given: str | None) -> str | None:
        """The version a request with this header value (None: no header) speaks, or None
        if it is not one of `values`."""
        text = (given or "").strip()
        if not text:
            return self.absent if self.absent in self.values else None
        major_minor = ".".join(text.split(".")[:2])
        return major_minor if major_minor in self.values else None


@dataclass(frozen=True)
class SessionRules:
    """A browser's credential besides the bearer key: the cookie its login set, and the
    CSRF token every request with a body it admits must carry (module docstring)."""

    cookie: str                          # the cookie's name
    find: Callable[[str, str], str | None]  # (its value, the Host header) -> that live session's CSRF token


@dataclass(frozen=True)
class GuardRules:
    """What one face asks of every request (see the module docstring for the order)."""

    key: str = field(repr=False)
    hosts: AllowedHosts
    public: frozenset[str] = frozenset()  # paths a GET or HEAD reaches without the key (nor the header)
    header: VersionHeader | None = None
    session: SessionRules | None = None   # a browser face: the cookie and the CSRF token
    max_body: int = MAX_BODY_BYTES        # bytes of a request body, at most
    links: frozenset[str] = frozenset()   # paths a link from elsewhere may open (a top-level GET)


@dataclass(frozen=True)
class Admitted:
    """A request that passed the headers' checks; `form_csrf`: the body is a form that
    must still show this CSRF token (`check_form`) before the app may read it; `session`:
    the cookie value that admitted it (None: the key did, or a public path)."""

    form_csrf: str | None = field(default=None, repr=False)
    session: str | None = field(default=None, repr=False)


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
    default = 443 if parts.scheme == "https" else 80
    if port is None:  # Host without a port (a reverse proxy's): the default one, so the Origin names none
        return origin_port in (None, default)
    return (origin_port or default) == port


def _bearer_matches(headers: Headers, key: str) -> bool:
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _cookie_session(headers: Headers, session: SessionRules | None, host: str) -> tuple[str, str] | None:
    """The cookie value that opens a live session at this host, and that session's CSRF token."""
    if session is None:
        return None
    for part in headers.get("cookie", "").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name == session.cookie:
            csrf = session.find(value.strip(), host)
            if csrf is not None:
                return value.strip(), csrf
    return None


def _csrf_refusal(where: str) -> Refusal:
    return Refusal(Check.CSRF, 403, f"the CSRF token is missing or wrong ({where}); reload the page and try again")


def csrf_matches(given: str | None, csrf: str) -> bool:
    return given is not None and hmac.compare_digest(given.strip().encode(), csrf.encode())


def _carries_body(method: str, headers: Headers) -> bool:
    return (method in _BODY_METHODS or headers.get("content-length", "0").strip() not in ("", "0")
            or "transfer-encoding" in headers)


def check_request(rules: GuardRules, method: str, path: str, headers: Headers) -> Refusal | None:
    """The first check (module docstring) the request fails, or None if it may pass
    (a form body's CSRF token aside: `admit` says when `check_form` must still run)."""
    decision = admit(rules, method, path, headers)
    return decision if isinstance(decision, Refusal) else None


def admit(rules: GuardRules, method: str, path: str, headers: Headers) -> Refusal | Admitted:
    """The first check the request's headers fail, or what is left to check of its body."""
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
    link = method == "GET" and path in rules.links and headers.get("sec-fetch-mode") == "navigate"
    if site is not None and site.strip().lower() not in _FETCH_SITES and not link:
        return Refusal(Check.ORIGIN, 403, f"cross-site requests are refused (Sec-Fetch-Site {site!r})")
    public = method in _SAFE_METHODS and path in rules.public
    by_cookie: tuple[str, str] | None = None
    if not public and not _bearer_matches(headers, rules.key):
        by_cookie = _cookie_session(headers, rules.session, host_header)
        if by_cookie is None:
            return Refusal(Check.KEY, 401, "missing or incorrect API key (send Authorization: Bearer KEY; "
                                           "psymesh serve ... --show-key prints it; for the dashboard, "
                                           "open the link psymesh ui prints)",
                           {"WWW-Authenticate": 'Bearer realm="psymesh"'})
    form_csrf: str | None = None
    if _carries_body(method, headers):
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        if by_cookie is not None:
            if media == FORM:
                form_csrf = by_cookie[1]
            elif media == "application/json" and not csrf_matches(headers.get(CSRF_HEADER), by_cookie[1]):
                return _csrf_refusal("X-CSRF-Token header")
        if media != "application/json" and form_csrf is None:
            return Refusal(Check.CONTENT_TYPE, 415, f"the body must be JSON with Content-Type: application/json "
                                                    f"(got {media or 'none'!r})")
    if rules.header is not None and not public:
        given = headers.get(rules.header.name)
        if rules.header.version(given) is None:
            wanted = " or ".join(sorted(rules.header.values))
            return Refusal(Check.HEADER, 400, f"send the header {rules.header.name}: {wanted} "
                                              f"(got {'none' if given is None else repr(given)})")
    return Admitted(form_csrf=form_csrf, session=None if by_cookie is None else by_cookie[0])


def check_form(csrf: str, body: bytes) -> Refusal | None:
    """A form body's CSRF field (the last check of a cookie's request with a form)."""
    given = parse_qs(body.decode("latin-1"), keep_blank_values=True).get(CSRF_FIELD, [None])[-1]
    return None if csrf_matches(given, csrf) else _csrf_refusal("form field csrf")


# A JSON string, or what is left of the body after an unterminated one: possessive, so each
# byte is read once whatever the body (a backtracking pattern is quadratic on `"\\"\\"\\"...`).
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.?)*+"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth(document: bytes) -> int:
    """How deep arrays and objects nest in `document` (brackets inside strings do not
    count). Linear in the length of any bytes, well-formed or not, and no recursion."""
    brackets = _JSON_STRING.sub(b"", document).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_json(body: bytes) -> Refusal | None:
    """A JSON body: nested at most JSON_MAX_DEPTH deep (counted before it is parsed, so no
    parser here or behind the door recurses further), UTF-8 (RFC 8259) and well-formed."""
    depth = json_depth(body)
    if depth > JSON_MAX_DEPTH:
        return Refusal(Check.JSON, 400, f"the JSON body nests {depth} deep; at most {JSON_MAX_DEPTH} levels "
                                        "of arrays and objects are taken")
    try:
        json.loads(body.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError included
        return Refusal(Check.JSON, 400, f"the body is not JSON in UTF-8 ({str(exc).splitlines()[0]})")
    return None


def _too_large(limit: int) -> Refusal:
    return Refusal(Check.SIZE, 413, f"the request body is over {limit} bytes", {"Connection": "close"})


INTERNAL = Refusal(Check.INTERNAL, 500, "the node failed to answer; see its log")

_STATUS: Mapping[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400, ErrorCode.BAD_FRAME: 400, ErrorCode.TOO_LARGE: 413, ErrorCode.NOT_FOUND: 404,
    ErrorCode.FORBIDDEN: 403, ErrorCode.UNKNOWN_PEER: 404, ErrorCode.EXPIRED: 403, ErrorCode.CONFLICT: 409,
    ErrorCode.RATE_LIMITED: 429, ErrorCode.BUSY: 429, ErrorCode.TIMEOUT: 504, ErrorCode.UNAVAILABLE: 503,
    ErrorCode.CANCELED: 499, ErrorCode.MODEL_CRASHED: 502, ErrorCode.UNSUPPORTED: 400,
}


def http_status(code: ErrorCode) -> int:
    """The HTTP status a face answers a PsymeshError of `code` with (500 for the rest)."""
    return _STATUS.get(code, 500)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes `limit` bytes (the rest unread).
    Raises ClientDisconnect if the client leaves first."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body the guard already read, then the client's
    own next message (its disconnect: a stream's app learns that the client left)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _declared_length(headers: Headers) -> int | None:
    value = headers.get("content-length", "").strip()
    return int(value) if value.isdigit() else None


async def _linger(refusal: Response, scope: Scope, receive: Receive, send: Send) -> None:
    """Send `refusal` whole but for its end, read and drop what is left of the request body
    for up to LINGER_S (constant memory), then end the answer (the server then closes)."""

    async def all_but_the_end(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            message = {**message, "more_body": True}
        await send(message)

    await refusal(scope, receive, all_but_the_end)
    if "expect" not in Headers(scope=scope):  # a client waiting for 100-continue sends no body
        with anyio.move_on_after(LINGER_S):
            while (message := await receive())["type"] == "http.request" and message.get("more_body", False):
                pass
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Answer:
    """The app's `send`, watched: whether its answer has begun, and ended."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = self.ended = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)


class HttpGuard:
    """ASGI middleware: `app` hears only requests that pass `admit(rules, ...)` and whose
    body passes the size and JSON checks; the others are answered with `refuse(refusal)`
    and logged. An exception out of `app` is answered `refuse(INTERNAL)` and logged once.
    A Starlette `app` gets that answer as its 500 handler (its own would be a bare
    text/plain 500)."""

    def __init__(self, app: ASGIApp, rules: GuardRules, refuse: Callable[[Refusal], Response]) -> None:
        self.app, self.rules, self.refuse = app, rules, refuse
        if isinstance(app, Starlette):
            app.add_exception_handler(Exception, self._internal)

    async def _internal(self, request: Request, exc: Exception) -> Response:
        """Starlette's 500 handler: the face's answer; Starlette re-raises, and __call__ logs."""
        return self.refuse(INTERNAL)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a WebSocket: no face serves one
            await send({"type": "websocket.close", "code": 1008})
            return
        answer = _Answer(send)
        try:
            await self._serve(scope, receive, answer.send)
        except ClientDisconnect:
            log.debug("%s %s: the client left before its answer", scope["method"], scope["path"])
        except Exception as exc:
            log.error("%s %s failed", scope["method"], scope["path"], exc_info=exc)
            if not answer.started:
                await self.refuse(INTERNAL)(scope, receive, send)
            elif not answer.ended:  # a stream already under way: end it where it is
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, headers = scope["method"], Headers(scope=scope)
        decision = admit(self.rules, method, scope["path"], headers)
        body: bytes | None = None
        if isinstance(decision, Admitted) and _carries_body(method, headers):
            decision, body = await self._body(decision, headers, receive)
        if isinstance(decision, Admitted):
            scope["psymesh.session"] = decision.session
            await self.app(scope, receive if body is None else _replay(body, receive), send)
            return
        refusal = decision
        client = scope.get("client")
        log.info("refused %s %s from %s: %s", method, scope["path"],
                 f"{client[0]}:{client[1]}" if client else "?", refusal.message)
        if refusal.check is Check.SIZE:
            await _linger(self.refuse(refusal), scope, receive, send)
        else:
            await self.refuse(refusal)(scope, receive, send)

    async def _body(self, admitted: Admitted, headers: Headers,
                    receive: Receive) -> tuple[Refusal | Admitted, bytes]:
        """The body's checks (module docstring, 6 and 7, and a form's CSRF token): the
        decision, and the body read for the app."""
        limit = self.rules.max_body
        declared = _declared_length(headers)
        if declared is not None and declared > limit:
            return _too_large(limit), b""
        body = await _read_body(receive, limit)
        if body is None:
            return _too_large(limit), b""
        if admitted.form_csrf:
            return check_form(admitted.form_csrf, body) or admitted, body
        return check_json(body) or admitted, body
