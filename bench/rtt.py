"""Round-trip latency of a 32-byte request/response: psymesh vs plain HTTP/1.1 vs raw TCP.

All three run in the same session, on 127.0.0.1, each server in its own process:

- psymesh: two real daemons (home, phone), paired; the phone pings home on its open
  session (`/psymesh/session/1.0.0`: one Noise+yamux stream, psymesh frames with request
  ids). Each ping is a request like any other: it passes home's door (admission, an
  audit row). The daemon times each round trip itself, so the figure is the mesh path,
  not the control socket. Also shown: opening the session (once per peer).
- HTTP/1.1: a stdlib server (keep-alive, TCP_NODELAY) answering POST with the body;
  the client keeps one connection (TCP_NODELAY). Without NODELAY this is ~44 ms here.
- raw TCP: an echo server; blocking client with TCP_NODELAY. The floor.

Usage: .venv/bin/python bench/rtt.py [--count N]
"""
from __future__ import annotations

import argparse
import http.client
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import anyio
from _common import spawn_server, summarize

PAYLOAD = b"x" * 32

HTTP_SERVER = textwrap.dedent("""
    import socket, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    class Echo(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"          # keep-alive
        def setup(self):
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a): pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
""")

TCP_SERVER = textwrap.dedent("""
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        d = c.recv(65536)
        if not d: break
        c.sendall(d)
""")




def bench_http(count: int) -> list[float]:
    proc, port = spawn_server(HTTP_SERVER)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for i in range(count + 50):
            t = time.perf_counter()
            conn.request("POST", "/", body=PAYLOAD, headers={"Content-Type": "application/octet-stream"})
            assert conn.getresponse().read() == PAYLOAD
            if i >= 50:  # warm-up
                out.append((time.perf_counter() - t) * 1000)
        conn.close()
        return out
    finally:
        proc.kill()


def bench_tcp(count: int) -> list[float]:
    proc, port = spawn_server(TCP_SERVER)
    try:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for i in range(count + 50):
            t = time.perf_counter()
            s.sendall(PAYLOAD)
            got = b""
            while len(got) < len(PAYLOAD):
                got += s.recv(65536)
            if i >= 50:
                out.append((time.perf_counter() - t) * 1000)
        s.close()
        return out
    finally:
        proc.kill()


async def bench_psymesh(count: int) -> tuple[list[float], float]:
    from psymesh.node.process import DaemonProcess, pair_homes
    from psymesh.protocol.limits import Limits

    with tempfile.TemporaryDirectory(prefix="psymesh-bench-") as tmp:
        home, phone = DaemonProcess(Path(tmp) / "home"), DaemonProcess(Path(tmp) / "phone", profile="phone")
        await home.start()
        await phone.start()
        try:
            await pair_homes(Path(tmp) / "home", Path(tmp) / "phone")
            async with home.client() as h:  # the phone preset allows 60 requests/min; a bench needs more
                await h.grant("phone", ["tool:system.info"], limits=Limits(requests_per_minute=1_000_000))
            async with phone.client() as c:
                session_open_ms = (await c.ping("home", count=50)).connect_ms  # warm-up; the session stays open
                rtts: list[float] = []
                while len(rtts) < count:
                    r = await c.ping("home", count=min(1000, count - len(rtts)), payload_size=len(PAYLOAD))
                    rtts += r.rtts_ms
            return rtts, session_open_ms
        finally:
            await phone.stop()
            await home.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2000)
    args = ap.parse_args()
    tcp = summarize(bench_tcp(args.count))
    http_ = summarize(bench_http(args.count))
    mesh_samples, session_open_ms = anyio.run(bench_psymesh, args.count, backend="trio")
    mesh = summarize(mesh_samples)
    print(f"32-byte request/response, {args.count} round trips each, 127.0.0.1, one open connection\n")
    print(f"{'transport':<34}{'median ms':>11}{'p99 ms':>10}")
    for name, (med, p99) in (("raw TCP (TCP_NODELAY)", tcp), ("HTTP/1.1 keep-alive (TCP_NODELAY)", http_),
                             ("psymesh session (Noise+yamux, framed, door)", mesh)):
        print(f"{name:<34}{med:>11.3f}{p99:>10.3f}")
    print(f"\nratio psymesh/HTTP  median {mesh[0] / http_[0]:.2f}x   p99 {mesh[1] / http_[1]:.2f}x")
    print(f"ratio psymesh/TCP   median {mesh[0] / tcp[0]:.2f}x   p99 {mesh[1] / tcp[1]:.2f}x")
    print(f"(psymesh: opening the session, once per peer, dial included: {session_open_ms:.2f} ms)")


if __name__ == "__main__":
    main()
