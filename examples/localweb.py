"""A small local "web" for the demo: two pages and a search endpoint on 127.0.0.1.

The demo's exit (home) is configured to fetch from loopback because this is where its web
is; a real exit refuses loopback and private addresses unless its owner allows them.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

PAGES = {
    "/ferries": ("Island ferry timetable",
                 "<p>The island ferry leaves the harbour at 07:30, 12:15 and 18:45 every day.</p>"
                 "<p>The last boat back from the island is at 19:30. Tickets are sold on board.</p>"),
    "/market": ("Saturday market",
                "<p>The farmers' market on the square is open on Saturdays from 8 to 13.</p>"),
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/search":
            words = parse_qs(url.query).get("q", [""])[0].lower().split()
            hits = [{"title": title, "url": self.server.base + path, "snippet": body[3:80]}
                    for path, (title, body) in PAGES.items()
                    if any(w in (title + body).lower() for w in words)]
            self._send(json.dumps({"results": hits}).encode(), "application/json")
        elif url.path in PAGES:
            title, body = PAGES[url.path]
            page = f"<html><head><title>{title}</title></head><body><article><h1>{title}</h1>{body}</article></body></html>"
            self._send(page.encode(), "text/html; charset=utf-8")
        else:
            self.send_error(404)

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    base = ""


@contextmanager
def local_web() -> Iterator[str]:
    """Serve the pages and /search?q= on a free port of 127.0.0.1; yields the base URL."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="demo-web", daemon=True)
    thread.start()
    try:
        yield server.base
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
