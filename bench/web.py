"""Fetching a local page: directly with httpx, through one hop (an exit), through two (sealed, via a relay).

All in one run, on 127.0.0.1, each server in its own process:

- the page: a ~9 KB article served by a stdlib HTTP/1.1 server (keep-alive, TCP_NODELAY).
- direct fetch: one `httpx.AsyncClient` kept open (keep-alive), GET the page, read the body.
- direct fetch + text: the same GET, then the very function the exit runs on the body
  (`extractor.readable_text`: trafilatura), called inline (no child process): what a phone
  fetching for itself would need to do to get the same answer.

  Both are timed back to back first (--runs in a row, nothing else running: client, server
  and caches hot), then in turn with the kinds below, in one loop, so that a busy machine
  slows them all alike: there the first GET of a round follows the mesh's turn and runs
  cold (0.4-0.6 ms slower here), so a second one right after it is the warm baseline the
  issue's ratios are printed against (the back-to-back one, timed apart, swings with the
  machine's load between the phases).
- one hop: three daemons (exit, relay, phone), paired; `Client.web_fetch(url)` on the phone:
  SDK -> phone daemon -> session -> exit's door -> the exit fetches (httpx, address checks)
  and extracts the text (in a worker thread) -> back. The exit's cache is off: every fetch
  goes to the server.
- two hops: the same with `relay=`: sealed to the exit's HPKE key, through the relay.
- session round trip: a 32-byte ping from the phone to the exit on the same session, timed
  by the phone daemon: what one hop costs carrying no work (transport, door, audit row).

Then CPU per query, by process (Linux /proc, clock ticks, so averaged over --runs queries of
one kind in a row; "asker" is this process: the SDK, or httpx and the extraction when it
fetches itself): where the time goes, with far less noise than latency on a busy machine.
One more kind for CPU only: one hop to a second exit ("cached") that holds the page in its
cache, so it answers at once: the phone does the very same work, but the exit spends no 1.5 ms
extracting in between. On this 2-core machine that work runs beside the phone and leaves it
colder (and preempted more often): the phone's CPU per query there minus here is what sharing
the machine with its exit costs it, which a real phone (its exit elsewhere) does not pay.
And counted, not timed: the phone's context switches per query, voluntary (it waited: a
wakeup each) and involuntary (preempted by another process).

Prints medians and p99 in ms, the ratios the issue sets (one hop <= 1.3x and two hops <=
1.8x a direct fetch of the same page), and the same ratios against fetch + text. Every loop
is bounded by --runs.

Usage: .venv/bin/python bench/web.py [--runs N]
"""
from __future__ import annotations

import argparse
import os
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


KINDS = ("cold", "direct", "direct_text", "one", "two", "rtt")
CPU_KINDS = (("direct", "direct fetch + text"), ("one", "one hop"), ("cached", "one hop, a cached exit"),
             ("two", "two hops"), ("rtt", "session round trip"))
CPU_COLUMNS = ("asker", "phone", "relay", "exit", "exit workers", "page server")
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def cpu_ms(pid: int) -> tuple[float, float]:
    """(main thread, other threads) CPU time of process `pid` so far, in ms."""
    main = others = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        used = (int(fields[11]) + int(fields[12])) * TICK_MS   # utime + stime
        if task.name == str(pid):
            main = used
        else:
            others += used
    return main, others


def switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of process `pid` so far, all its threads."""
    voluntary = involuntary = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                involuntary += int(line.split()[1])
    return voluntary, involuntary


async def direct_fetch(http: httpx.AsyncClient, url: str) -> tuple[float, float, str]:
    """(fetch, fetch + text) in seconds and the text: one GET on a kept-open client, then the exit's extraction."""
    from psymesh.node.web.extractor import readable_text

    t0 = time.perf_counter()
    response = await http.get(url)
    body = response.content
    t1 = time.perf_counter()
    text = readable_text(body, "text/html", response.charset_encoding).text
    t2 = time.perf_counter()
    assert "19:30" in text
    return t1 - t0, t2 - t0, text


async def back_to_back(url: str, runs: int, server_pid: int
                       ) -> tuple[list[float], list[float], dict[str, float]]:
    """(fetch, fetch + text) in ms, `runs` in a row, nothing else running; and the CPU ms
    per fetch + text of this process (the asker) and of the page server."""
    fetch_ms: list[float] = []
    text_ms: list[float] = []
    async with httpx.AsyncClient() as http:
        for _ in range(10):
            await direct_fetch(http, url)
        asker, server = time.process_time(), sum(cpu_ms(server_pid))
        for _ in range(runs):
            fetch_s, text_s, _ = await direct_fetch(http, url)
            fetch_ms.append(fetch_s * 1000)
            text_ms.append(text_s * 1000)
        used = {"asker": (time.process_time() - asker) * 1000, "page server": sum(cpu_ms(server_pid)) - server}
    return fetch_ms, text_ms, {name: used.get(name, 0.0) / runs for name in CPU_COLUMNS}


async def bench(tmp: Path, url: str, runs: int, server_pid: int
                ) -> tuple[dict[str, list[float]], dict[str, dict[str, float]], dict[str, tuple[float, float]]]:
    """Each kind's latencies in ms, timed in turn, `runs` rounds, through three real daemons (and
    a fourth, the cached exit, for CPU only); then each mesh kind's CPU ms per query by process
    (CPU_COLUMNS) and the phone's context switches per query (voluntary, involuntary)."""
    from psymesh.node.core.home import NodeHome
    from psymesh.node.control.process import DaemonProcess, pair_homes
    from psymesh.node.web.exit import ExitSettings
    from psymesh.node.core.websettings import WebSettings
    from psymesh.protocol.limits import Limits

    exit_home = NodeHome(tmp / "exit")
    exit_home.init(name="exit")
    settings = ExitSettings(enabled=True, allow_loopback=True, cache_entries=0, requests_per_minute=100_000)
    exit_home.save_config(exit_home.load_config().model_copy(update={"web": WebSettings(exit=settings)}))
    cached_home = NodeHome(tmp / "cached")
    cached_home.init(name="cached")
    caching = settings.model_copy(update={"cache_entries": 8})
    cached_home.save_config(cached_home.load_config().model_copy(update={"web": WebSettings(exit=caching)}))
    nodes = [DaemonProcess(tmp / name, name=name, profile="phone" if name == "phone" else "home")
             for name in ("exit", "relay", "phone", "cached")]
    exit_, relay, phone, cached = nodes
    roomy = Limits(requests_per_minute=1_000_000)
    for node in nodes:
        await node.start()
    try:
        await pair_homes(exit_.home, relay.home, grant="messaging")
        await pair_homes(exit_.home, phone.home, grant="messaging")
        await pair_homes(relay.home, phone.home, grant="messaging")
        await pair_homes(cached.home, phone.home, grant="messaging")
        async with exit_.client() as e, relay.client() as r, cached.client() as k:
            await k.grant("phone", ["web.fetch"], limits=roomy)
            await e.grant("phone", ["web.fetch"], limits=roomy)
            await e.grant("relay", ["web.fetch"], limits=roomy)
            await r.grant("phone", ["web.relay"], limits=roomy)
        ms: dict[str, list[float]] = {kind: [] for kind in KINDS}
        async with httpx.AsyncClient() as http, phone.client() as client:
            for _ in range(10):
                (await http.get(url)).raise_for_status()
                await client.web_fetch(url, via="exit", hops=1)
                await client.web_fetch(url, via="exit", relay="relay")
            for _ in range(runs):
                cold_s, _, _ = await direct_fetch(http, url)    # the first GET after the mesh's turn
                fetch_s, text_s, text = await direct_fetch(http, url)
                t0 = time.perf_counter()
                page = await client.web_fetch(url, via="exit", hops=1)
                t1 = time.perf_counter()
                sealed = await client.web_fetch(url, via="exit", relay="relay")
                t2 = time.perf_counter()
                ping = await client.ping("exit", count=1)
                assert page.text == text and not page.cached and sealed.text == text
                for kind, value in zip(KINDS, (cold_s, fetch_s, text_s, t1 - t0, t2 - t1)):
                    ms[kind].append(value * 1000)
                ms["rtt"].extend(ping.rtts_ms)
            cpu: dict[str, dict[str, float]] = {}
            assert phone.proc and relay.proc and exit_.proc and cached.proc
            served = {"phone": phone.proc.pid, "relay": relay.proc.pid, "exit": exit_.proc.pid, "page server": server_pid}
            for _ in range(10):  # the cached exit holds the page after the first
                assert (await client.web_fetch(url, via="cached", hops=1)).text == text
            calls = {"one": lambda: client.web_fetch(url, via="exit", hops=1),
                     "cached": lambda: client.web_fetch(url, via="cached", hops=1),
                     "two": lambda: client.web_fetch(url, via="exit", relay="relay"),
                     "rtt": lambda: client.ping("exit", count=1)}
            switched: dict[str, tuple[float, float]] = {}
            for kind, call in calls.items():
                pids = {**served, "exit": cached.proc.pid} if kind == "cached" else served
                before = {name: cpu_ms(pid) for name, pid in pids.items()}
                asker, phone_switches = time.process_time(), switches(phone.proc.pid)
                for _ in range(runs):
                    await call()
                used = {"asker": (time.process_time() - asker) * 1000}
                after = switches(phone.proc.pid)
                switched[kind] = ((after[0] - phone_switches[0]) / runs, (after[1] - phone_switches[1]) / runs)
                for name, pid in pids.items():
                    (main0, others0), (main1, others1) = before[name], cpu_ms(pid)
                    used[name] = main1 - main0 + (others1 - others0 if name != "exit" else 0.0)
                    if name == "exit":
                        used["exit workers"] = others1 - others0
                cpu[kind] = {name: value / runs for name, value in used.items()}
        return ms, cpu, switched
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
        hot_ms, hot_text_ms, direct_cpu = anyio.run(back_to_back, url, args.runs, server.pid, backend="trio")
        with tempfile.TemporaryDirectory(prefix="psymesh-bench-web-") as tmp:
            ms, cpu, switched = anyio.run(bench, Path(tmp), url, args.runs, server.pid, backend="trio")
    finally:
        server.terminate()
        server.wait()
    hot, hot_text = summarize(hot_ms), summarize(hot_text_ms)
    cold, direct, direct_text, one, two, rtt = (summarize(ms[kind]) for kind in KINDS)
    print(f"GET of a 9-KB local page, 127.0.0.1, {args.runs} of each, same run           median ms   p99 ms")
    rows = [("direct fetch (httpx, kept-open client), back to back", hot),
            ("direct fetch + text (the exit's extraction), back to back", hot_text),
            ("direct fetch, in turn, cold (first after the mesh's turn)", cold),
            ("direct fetch, in turn, warm (right after a first)", direct),
            ("direct fetch + text, in turn, warm", direct_text),
            ("one hop: phone -> exit (SDK, daemons, text), in turn", one),
            ("two hops: phone -> relay -> exit, sealed, in turn", two),
            ("session round trip phone -> exit, 32 B (no work), in turn", rtt)]
    for label, (median, p99) in rows:
        print(f"{label:<64}{median:>9.3f}{p99:>9.3f}")
    print()
    print(f"one hop  / direct fetch, in turn, warm    {one[0] / direct[0]:6.2f}x   the issue's target: <= 1.3x")
    print(f"two hops / direct fetch, in turn, warm    {two[0] / direct[0]:6.2f}x   the issue's target: <= 1.8x")
    print(f"one hop  / direct fetch, back to back     {one[0] / hot[0]:6.2f}x   (a baseline timed apart: load may differ)")
    print(f"two hops / direct fetch, back to back     {two[0] / hot[0]:6.2f}x")
    print(f"one hop  / direct fetch + text, in turn   {one[0] / direct_text[0]:6.2f}x   (the same work, done on the phone)")
    print(f"two hops / direct fetch + text, in turn   {two[0] / direct_text[0]:6.2f}x")
    print(f"two hops / one hop                        {two[0] / one[0]:6.2f}x")
    print(f"one hop - (fetch + text), in turn = {one[0] - direct_text[0]:.3f} ms, of which a bare session round"
          f" trip is {rtt[0]:.3f} ms")
    print()
    print(f"CPU ms per query ({args.runs} in a row)  " + "".join(f"{c:>13}" for c in CPU_COLUMNS))
    cpu["direct"] = direct_cpu
    for kind, label in CPU_KINDS:
        print(f"{label:<35}" + "".join(f"{cpu[kind][c]:>13.3f}" for c in CPU_COLUMNS))
    print(f"(cached: the exit column is the cached exit's; the phone's cost of sharing this machine with a busy"
          f" exit: {cpu['one']['phone'] - cpu['cached']['phone']:+.3f} ms a query)")
    print()
    print("phone context switches per query (counted)   voluntary  involuntary")
    for kind, label in CPU_KINDS[1:]:
        voluntary, involuntary = switched[kind]
        print(f"{label:<45}{voluntary:>10.2f}{involuntary:>13.2f}")


if __name__ == "__main__":
    main()
