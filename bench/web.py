"""Fetching a local page: directly with httpx, through one hop (an exit), through two (sealed, via a relay).

All in one run, on 127.0.0.1, each server in its own process:

- the page: a ~9 KB article served by a stdlib HTTP/1.1 server (keep-alive, TCP_NODELAY).
- direct: one `httpx.AsyncClient` kept open (keep-alive: the tuned baseline), GET the page.
  Also timed: the same GET plus the readable-text extraction an exit does (trafilatura, in
  this process), since a phone fetching for itself would need that text too.
- one hop: three daemons (exit, relay, phone), paired; `Client.web_fetch(url)` on the phone:
  SDK -> phone daemon -> session -> exit's door -> the exit fetches (httpx, address checks)
  and extracts the text -> back. The exit's cache is off: every fetch goes to the server.
- two hops: the same with `relay=`: sealed to the exit's HPKE key, through the relay.

Prints medians and p99 in ms and the ratios the issue sets: one hop <= 1.3x and two hops
<= 1.8x a direct fetch of the same page. Every loop is bounded by --runs.

Usage: .venv/bin/python bench/web.py [--runs N]
"""
from __future__ import annotations

import argparse
import tempfile
import textwrap
import time
from pathlib import Path

import anyio
import httpx
from _common import spawn_server, summarize

PAGE_SERVER = textwrap.dedent("""
    import socket
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    PARA = ("<p>The island ferry leaves the harbour at 07:30, 12:15 and 18:45 every day; the last boat "
            "back is at 19:30 and tickets are sold on board, cash or card. In winter the crossing "
            "takes forty minutes, a little longer when the wind is from the north-east.</p>")
    BODY = ("<html><head><title>Island ferry timetable</title></head><body><nav>Home | Timetables</nav>"
            "<article><h1>Island ferry timetable</h1>" + PARA * 32 + "</article>"
            "<footer>Harbour office</footer></body></html>").encode()
    class Page(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"          # keep-alive
        def setup(self):
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)
        def log_message(self, *a): pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
""")


async def bench_direct(url: str, runs: int) -> tuple[list[float], list[float]]:
    """(fetch only, fetch + readable text) in ms, one kept-open client."""
    import trafilatura

    fetch_ms: list[float] = []
    text_ms: list[float] = []
    async with httpx.AsyncClient() as client:
        for _ in range(10):
            (await client.get(url)).raise_for_status()
        for _ in range(runs):
            t0 = time.perf_counter()
            response = await client.get(url)
            body = response.text
            t1 = time.perf_counter()
            text = trafilatura.extract(body, include_comments=False)
            t2 = time.perf_counter()
            assert text and "19:30" in text
            fetch_ms.append((t1 - t0) * 1000)
            text_ms.append((t2 - t0) * 1000)
    return fetch_ms, text_ms


async def bench_mesh(tmp: Path, url: str, runs: int) -> tuple[list[float], list[float]]:
    """(one hop, two hops) in ms, through three real daemons."""
    from psymesh.node.home import NodeHome
    from psymesh.node.process import DaemonProcess, pair_homes
    from psymesh.node.webexit import ExitSettings
    from psymesh.node.websettings import WebSettings
    from psymesh.protocol.limits import Limits

    exit_home = NodeHome(tmp / "exit")
    exit_home.init(name="exit")
    settings = ExitSettings(enabled=True, allow_loopback=True, cache_entries=0, requests_per_minute=100_000)
    exit_home.save_config(exit_home.load_config().model_copy(update={"web": WebSettings(exit=settings)}))
    nodes = [DaemonProcess(tmp / name, name=name, profile="phone" if name == "phone" else "home")
             for name in ("exit", "relay", "phone")]
    exit_, relay, phone = nodes
    roomy = Limits(requests_per_minute=1_000_000)
    for node in nodes:
        await node.start()
    try:
        await pair_homes(exit_.home, relay.home, grant="messaging")
        await pair_homes(exit_.home, phone.home, grant="messaging")
        await pair_homes(relay.home, phone.home, grant="messaging")
        async with exit_.client() as e, relay.client() as r:
            await e.grant("phone", ["web.fetch"], limits=roomy)
            await e.grant("relay", ["web.fetch"], limits=roomy)
            await r.grant("phone", ["web.relay"], limits=roomy)
        one: list[float] = []
        two: list[float] = []
        async with phone.client() as client:
            for _ in range(10):
                await client.web_fetch(url, via="exit", hops=1)
                await client.web_fetch(url, via="exit", relay="relay")
            for _ in range(runs):  # interleaved: both see the same machine
                t0 = time.perf_counter()
                page = await client.web_fetch(url, via="exit", hops=1)
                t1 = time.perf_counter()
                sealed = await client.web_fetch(url, via="exit", relay="relay")
                t2 = time.perf_counter()
                assert "19:30" in page.text and not page.cached and sealed.text == page.text
                one.append((t1 - t0) * 1000)
                two.append((t2 - t1) * 1000)
        return one, two
    finally:
        for node in reversed(nodes):
            await node.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200, help="fetches of each kind to time")
    args = ap.parse_args()
    server, port = spawn_server(PAGE_SERVER)
    url = f"http://127.0.0.1:{port}/ferries"
    try:
        fetch_ms, text_ms = anyio.run(bench_direct, url, args.runs, backend="trio")
        with tempfile.TemporaryDirectory(prefix="psymesh-bench-web-") as tmp:
            one_ms, two_ms = anyio.run(bench_mesh, Path(tmp), url, args.runs, backend="trio")
    finally:
        server.terminate()
        server.wait()
    direct, direct_text, one, two = (summarize(s) for s in (fetch_ms, text_ms, one_ms, two_ms))
    print(f"GET of a {9}-KB local page, 127.0.0.1, {args.runs} each, same run          median ms   p99 ms")
    rows = [("direct: httpx, kept-open client", direct),
            ("direct: httpx + readable text (trafilatura)", direct_text),
            ("one hop: phone -> exit (SDK, daemons, text)", one),
            ("two hops: phone -> relay -> exit, sealed", two)]
    for label, (median, p99) in rows:
        print(f"{label:<62}{median:>9.3f}{p99:>9.3f}")
    print()
    print(f"one hop  / direct fetch            {one[0] / direct[0]:6.2f}x   (target <= 1.3x)")
    print(f"two hops / direct fetch            {two[0] / direct[0]:6.2f}x   (target <= 1.8x)")
    print(f"one hop  / direct fetch + text     {one[0] / direct_text[0]:6.2f}x   (the same work done on the phone)")
    print(f"two hops / direct fetch + text     {two[0] / direct_text[0]:6.2f}x")
    print(f"two hops / one hop                 {two[0] / one[0]:6.2f}x")


if __name__ == "__main__":
    main()
