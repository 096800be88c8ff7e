"""Real HTTP servers on 127.0.0.1 for the web exit's tests: a table of routes, served by
http.server in a thread, counting what was asked. A route can stall (before its headers, or
after them) until the test's end releases it, so a test can prove the exit gave up, or never
waited for a body, without a fixed sleep."""
from __future__ import annotations

import datetime
import ssl
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

CHUNK = 64 * 1024


@dataclass(frozen=True)
class Route:
    body: bytes = b""
    status: int = 200
    content_type: str | None = "text/html; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()
    chunked: bool = False                 # Transfer-Encoding: chunked, no Content-Length
    length: int | None = None             # the Content-Length to claim, if not the body's
    stall: Literal["headers", "body"] | None = None   # wait for `Site.release` before it


class Site:
    """The routes and the record of one test server."""

    def __init__(self, port: int, scheme: str) -> None:
        self.port = port
        self.scheme = scheme
        self.routes: dict[str, Route] = {}
        self.hits: Counter[str] = Counter()
        self.queries: list[str] = []
        self.heard: list[tuple[str, str]] = []   # each GET's (Host, Cookie): what a browser gave this server
        self.release = threading.Event()
        self._lock = threading.Lock()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def route(self, path: str, body: bytes | str = b"", **kw: object) -> str:
        """Serve `body` at `path`; its URL."""
        self.routes[path] = Route(body=body.encode() if isinstance(body, str) else body, **kw)  # type: ignore[arg-type]
        return self.url(path)

    def redirect(self, path: str, location: str, status: int = 302) -> str:
        return self.route(path, status=status, content_type=None, headers=(("Location", location),))

    def record(self, path: str, query: str) -> None:
        with self._lock:
            self.hits[path] += 1
            self.queries.append(query)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        site = self.server.site
        path, _, query = self.path.partition("?")
        site.record(path, query)
        site.heard.append((self.headers.get("Host", ""), self.headers.get("Cookie", "")))
        route = site.routes.get(path, Route(b"not here", status=404, content_type="text/plain"))
        if route.stall == "headers":
            site.release.wait()
        try:
            self._answer(route, site)
        except (BrokenPipeError, ConnectionResetError):   # the exit hung up: what these tests want
            self.close_connection = True

    def _answer(self, route: Route, site: Site) -> None:
        self.send_response(route.status)
        if route.content_type is not None:
            self.send_header("Content-Type", route.content_type)
        for name, value in route.headers:
            self.send_header(name, value)
        if route.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(len(route.body) if route.length is None else route.length))
        self.end_headers()
        if route.stall == "body":
            self.wfile.flush()
            site.release.wait()
            self.close_connection = True
            return
        if not route.chunked:
            self.wfile.write(route.body)
            return
        for start in range(0, len(route.body), CHUNK):
            piece = route.body[start:start + CHUNK]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    site: Site

    def handle_error(self, request: object, client_address: object) -> None:
        pass   # a refused TLS handshake or a hung-up exit is part of the tests


@contextmanager
def serving(tls: ssl.SSLContext | None = None) -> Iterator[Site]:
    """A site on 127.0.0.1 (TLS with `tls`), up for the block; stalled handlers are
    released before it shuts down."""
    server = _Server(("127.0.0.1", 0), _Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.site = Site(server.server_address[1], "https" if tls else "http")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.site
    finally:
        server.site.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def tls_contexts(folder: Path, hostname: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) TLS contexts: a test CA, a certificate for `hostname` signed by it;
    the client trusts only that CA and checks host names as usual."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey,
                    ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("psymesh test CA", ca_key, "psymesh test CA", ca_key, ca=True)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = certificate(hostname, leaf_key, "psymesh test CA", ca_key, ca=False)
    chain = folder / "site.pem"
    chain.write_bytes(leaf.public_bytes(serialization.Encoding.PEM) + leaf_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(chain)
    client = ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    return server, client


def long_page(size: int = 2 * 1024 * 1024 - 4096) -> bytes:
    """An article of plain paragraphs, about `size` bytes: its first paragraph says
    "first words", its last "last words" (what a cut at 1 MiB keeps, and loses)."""
    head = b"<html><head><title>Long tides</title></head><body><article><p>The first words of the tables.</p>"
    tail = b"<p>The last words of the tables.</p></article></body></html>"
    body, length, i = [head], len(head) + len(tail), 0
    while length < size - 200:
        i += 1
        body.append(b"<p>Entry %d: the tide tables for the bay are read at the pier each morning, beside the old "
                    b"lighthouse, and copied into the harbour log with the wind and the swell.</p>\n" % i)
        length += len(body[-1])
    return b"".join(body) + tail


def deep_page(depth: int) -> bytes:
    """A page whose article sits `depth` <div>s deep, then a closing paragraph after the nest."""
    return (b"<html><head><title>Deep tides</title></head><body>" + b"<div>" * depth
            + b"<article><p>High tide in the deep bay is at 07:20, low tide at 13:35, by the pier's own tables "
              b"that the harbour master posts.</p></article>"
            + b"</div>" * depth + b"<p>After the nest, the last words.</p></body></html>")
