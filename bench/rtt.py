"""Round-trip latency of a 32-byte request/response: psymesh vs plain HTTP/1.1 vs raw TCP.

All three run in the same session, on 127.0.0.1, each server in its own process, in turns
(`--rounds`, their order rotating) so that each meets the same load of the machine:

- psymesh: two real daemons (home, phone), paired; the phone pings home on its open
  session (`/psymesh/session/1.0.0`: one Noise+yamux stream, psymesh frames with request
  ids). Each ping is a request like any other: it passes home's door (admission, an
  audit row). The daemon times each round trip itself, so the figure is the mesh path,
  not the control socket. Also shown: opening the session (once per peer).
- HTTP/1.1: a stdlib server (keep-alive, TCP_NODELAY) answering POST with the body;
  the client keeps one connection (TCP_NODELAY). Without NODELAY this is ~44 ms here.
- raw TCP: an echo server; blocking client with TCP_NODELAY. The floor.
- through a relay (root only: it needs network namespaces of its own): home and phone in
  namespaces with no route between them, a third daemon relaying (circuit relay v2) with
  a veth link into each; the phone pings home through it. Then a direct veth link between
  home and phone appears, the phone moves to it (node/reach/relaying.py), and the same pings run
  direct, over the same kind of link, for the ratio. The target: relayed <= direct + one
  relay hop (the relay forwards each ping and pong once more, in its own process).

Usage: .venv/bin/python bench/rtt.py [--count N]
"""
from __future__ import annotations

import argparse
import http.client
import os
import secrets
import shutil
import socket
import subprocess
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




class HttpClient:
    """One keep-alive connection (TCP_NODELAY) to the echo server."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port)
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trips(self, count: int) -> list[float]:
        out = []
        for _ in range(count):
            t = time.perf_counter()
            self.conn.request("POST", "/", body=PAYLOAD, headers={"Content-Type": "application/octet-stream"})
            assert self.conn.getresponse().read() == PAYLOAD
            out.append((time.perf_counter() - t) * 1000)
        return out


class TcpClient:
    """One blocking connection (TCP_NODELAY) to the echo server."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trips(self, count: int) -> list[float]:
        out = []
        for _ in range(count):
            t = time.perf_counter()
            self.sock.sendall(PAYLOAD)
            got = b""
            while len(got) < len(PAYLOAD):
                got += self.sock.recv(65536)
            out.append((time.perf_counter() - t) * 1000)
        return out


async def bench_interleaved(count: int, rounds: int) -> tuple[list[float], list[float], list[float], float]:
    """(raw TCP, HTTP, psymesh) round trips and the session's opening time. The three run in
    `rounds` turns of `count / rounds` each, their order rotating, all servers up all along:
    each sees the same load of the machine (on a shared one it moves within seconds, and a
    baseline measured a few seconds apart swung the ratios of p99s by 10x)."""
    from psymesh.node.control.process import DaemonProcess, pair_homes
    from psymesh.protocol.limits import Limits

    tcp_proc, tcp_port = spawn_server(TCP_SERVER)
    http_proc, http_port = spawn_server(HTTP_SERVER)
    try:
        tcp_client, http_client = TcpClient(tcp_port), HttpClient(http_port)
        tcp_client.round_trips(50)  # warm-up
        http_client.round_trips(50)
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

                    async def mesh_round_trips(n: int) -> list[float]:
                        # the daemon times each round trip itself: the mesh path, not the control socket
                        return (await c.ping("home", count=n, payload_size=len(PAYLOAD))).rtts_ms

                    tcp: list[float] = []
                    http_: list[float] = []
                    mesh: list[float] = []
                    for turn in range(rounds):
                        n = count // rounds + (1 if turn < count % rounds else 0)
                        runs = [lambda: tcp.extend(tcp_client.round_trips(n)),
                                lambda: http_.extend(http_client.round_trips(n)), None]
                        for i in range(3):
                            run = runs[(i + turn) % 3]
                            if run is None:
                                mesh += await mesh_round_trips(n)
                            else:
                                run()
                return tcp, http_, mesh, session_open_ms
            finally:
                await phone.stop()
                await home.stop()
    finally:
        tcp_proc.kill()
        http_proc.kill()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


async def bench_relayed(count: int) -> tuple[list[float], list[float]] | None:
    """(relayed, direct) round trips between a home and a phone in network namespaces of
    our own; None without root (or iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return None
    from psymesh.node.core.home import NodeHome
    from psymesh.node.control.process import DaemonProcess, pair_homes
    from psymesh.protocol.limits import Limits
    from psymesh.protocol.relay import RelaySettings

    class NetnsDaemon(DaemonProcess):
        def __init__(self, netns: str, home: Path, profile: str) -> None:
            super().__init__(home, profile=profile, name=home.name, listen=["/ip4/0.0.0.0/tcp/0"])
            self.netns = netns

        def command(self) -> list[str]:
            return ["ip", "netns", "exec", self.netns, *super().command()]

    tag = secrets.token_hex(3)
    spaces = {name: f"psyb{tag}{name[0]}" for name in ("relay", "home", "phone")}
    made: list[str] = []
    with tempfile.TemporaryDirectory(prefix="psymesh-bench-") as tmp:
        try:
            for ns in spaces.values():
                _ip("netns", "add", ns)
                made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")

            def link(a: str, a_ip: str, b: str, b_ip: str) -> None:
                _ip("link", "add", f"to{b}", "netns", spaces[a], "type", "veth", "peer", "name", f"to{a}",
                    "netns", spaces[b])
                for ns, dev, addr in ((spaces[a], f"to{b}", a_ip), (spaces[b], f"to{a}", b_ip)):
                    _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                    _ip("-n", ns, "link", "set", dev, "up")

            link("relay", "10.72.1.1", "home", "10.72.1.2")
            link("relay", "10.72.2.1", "phone", "10.72.2.2")
            homes = {name: NodeHome(Path(tmp) / name) for name in spaces}
            for name, home in homes.items():
                home.init(profile="phone" if name == "phone" else "home", name=name)
            relay_id = homes["relay"].init().peer_id
            settings = {"relay": RelaySettings(enabled=True), "home": RelaySettings(relays=[relay_id]),
                        "phone": RelaySettings(direct_retry_s=1.0, overlap_s=1.0)}
            for name, home in homes.items():
                home.save_config(home.load_config().model_copy(update={"relay": settings[name]}))
            procs = {name: NetnsDaemon(spaces[name], homes[name].path, "phone" if name == "phone" else "home")
                     for name in spaces}
            for proc in procs.values():
                await proc.start()
            relay, home, phone = procs["relay"].home, procs["home"].home, procs["phone"].home
            await pair_homes(relay, home, grant="messaging")
            await pair_homes(relay, phone, grant="messaging")
            async with procs["relay"].client() as r, procs["home"].client() as h, procs["phone"].client() as p:
                await r.grant("home", ["relay"])
                await r.grant("phone", ["relay"])
                home_id = (await h.status()).peer_id
                with anyio.fail_after(60):  # home's reservation (it retries with a backoff)
                    while not any("/p2p-circuit/" in a for a in (await h.status()).addrs):
                        await anyio.sleep(0.1)
                invite = await h.pair_invite()
                await p.pair_join(invite.invite, grant="messaging")
                await h.grant("phone", ["tool:system.info"], limits=Limits(requests_per_minute=1_000_000))

                async def pings() -> list[float]:
                    await p.ping("home", count=50)  # warm-up
                    rtts: list[float] = []
                    while len(rtts) < count:
                        rtts += (await p.ping("home", count=min(1000, count - len(rtts)),
                                              payload_size=len(PAYLOAD))).rtts_ms
                    return rtts

                async def paths() -> set[bool]:  # relayed? per connection to home
                    status = await p.status()
                    return {"/p2p-circuit/" in a for c in status.connected_peers if c.peer_id == home_id
                            for a in c.addrs}

                assert await paths() == {True}
                relayed = await pings()
                link("home", "10.72.3.1", "phone", "10.72.3.2")
                with anyio.fail_after(60):  # home tells the phone its new address; the phone moves
                    while await paths() != {False}:
                        await anyio.sleep(0.1)
                direct = await pings()
            for proc in procs.values():
                await proc.stop()
            return relayed, direct
        finally:
            for ns in made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10, help="turns the three transports take (default 10)")
    args = ap.parse_args()
    tcp_samples, http_samples, mesh_samples, session_open_ms = anyio.run(
        bench_interleaved, args.count, max(1, args.rounds), backend="trio")
    tcp, http_, mesh = summarize(tcp_samples), summarize(http_samples), summarize(mesh_samples)
    print(f"32-byte request/response, {args.count} round trips each in {args.rounds} interleaved turns, "
          f"127.0.0.1, one open connection (load average {os.getloadavg()[0]:.2f})\n")
    print(f"{'transport':<34}{'median ms':>11}{'p99 ms':>10}")
    for name, (med, p99) in (("raw TCP (TCP_NODELAY)", tcp), ("HTTP/1.1 keep-alive (TCP_NODELAY)", http_),
                             ("psymesh session (Noise+yamux, framed, door)", mesh)):
        print(f"{name:<34}{med:>11.3f}{p99:>10.3f}")
    print(f"\nratio psymesh/HTTP  median {mesh[0] / http_[0]:.2f}x   p99 {mesh[1] / http_[1]:.2f}x")
    print(f"ratio psymesh/TCP   median {mesh[0] / tcp[0]:.2f}x   p99 {mesh[1] / tcp[1]:.2f}x")
    print(f"(psymesh: opening the session, once per peer, dial included: {session_open_ms:.2f} ms)")
    pair_ = anyio.run(bench_relayed, args.count, backend="trio")
    if pair_ is None:
        print("\nthrough a relay: skipped (it needs root, for network namespaces of its own)")
        return
    relayed, direct = summarize(pair_[0]), summarize(pair_[1])
    print(f"\npsymesh between network namespaces (veth links), {args.count} round trips each")
    print(f"{'path':<34}{'median ms':>11}{'p99 ms':>10}")
    for name, (med, p99) in (("direct link", direct), ("through a relay (circuit v2)", relayed)):
        print(f"{name:<34}{med:>11.3f}{p99:>10.3f}")
    print(f"ratio relayed/direct  median {relayed[0] / direct[0]:.2f}x   p99 {relayed[1] / direct[1]:.2f}x")
    print(f"the relay hop costs   median {relayed[0] - direct[0]:+.3f} ms a round trip "
          f"(target: at most one more hop; raw TCP round trip here: {tcp[0]:.3f} ms)")


if __name__ == "__main__":
    main()
