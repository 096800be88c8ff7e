"""The dashboard (node/control/dashboard.py): how long a page takes, and how long an event takes to
show in an open page. Measured, not asserted (targets: a page <= 100 ms; an event in the
page <= 250 ms after it happens).

Two real daemons on 127.0.0.1 (home, phone), paired; home grants the phone messaging only.
1. Page render: each page of home's dashboard fetched N times over HTTP with the session
   cookie (httpx from this process), timed from request to the last byte (p50 / p95).
   Before it, the phone makes home write ROWS audit rows (refused tool tasks), so the
   Activity page renders a full table (100 rows) out of a real log.
2. Event to page: an open Activity page (its server-sent events stream, read by httpx;
   and, when /usr/bin/chromium and Playwright are there, a real headless Chromium whose
   page script marks when it swapped the region in). The phone asks for a tool it was not
   granted; home's door refuses it, writing the audit row, and answers. The row is written
   between the phone's sending and its hearing the refusal, so the time to the region
   carrying the new row (in the stream; in the browser's DOM) is given from both: an upper
   and a lower bound.

Usage: .venv/bin/python bench/ui.py [--pages N] [--events N] [--rows N]
Every loop is bounded by these counts and by deadlines; the run takes under a minute.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import httpx

from psymesh.node.core.bridgeconfig import UiServe
from psymesh.node.control.client import Client
from psymesh.node.core.home import NodeHome
from psymesh.node.control.process import DaemonProcess, pair_homes
from psymesh.protocol.errors import RemoteError

PAGES = ["/", "/pair", "/peers", "/activity", "/agent", "/models"]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _line(what: str, samples_ms: list[float]) -> str:
    return (f"{what:<34} p50 {statistics.median(samples_ms):7.1f} ms   p95 {_p(samples_ms, 0.95):7.1f} ms   "
            f"max {max(samples_ms):7.1f} ms   (n={len(samples_ms)})")


_TOOLS = itertools.count()


async def _refused(phone: Client) -> tuple[float, float]:
    """One refused request at home: the wall times (sent, refusal heard). Home wrote the
    audit row in between, so an event-to-page time from the first is an upper bound, from
    the second a lower one. Each asks for a tool of its own: the audit log counts a repeated
    refusal into its open row (node/door/audit.py), which leaves the page as it was."""
    sent = time.time()
    try:
        await (await phone.delegate("home", tool=f"bench.{next(_TOOLS)}")).result()
    except RemoteError:
        return sent, time.time()
    raise AssertionError("home allowed a tool it never granted")


async def main(pages: int, events: int, rows: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="psymesh-bench-ui-"))
    daemons = []
    for name, profile in (("home", "home"), ("phone", "phone")):
        home = NodeHome(root / name)
        home.init(profile=profile, name=name)  # type: ignore[arg-type]
        home.save_config(home.load_config().model_copy(update={"ui": UiServe(port=0)}))
        daemons.append(DaemonProcess(home.path, profile=profile, name=name))
    for d in daemons:
        await d.start()
    try:
        await pair_homes(root / "home", root / "phone", grant="messaging")
        async with Client(root / "home") as home, Client(root / "phone") as phone:
            # the refusals below must not hit the grant's rate limit (a refusal of its own, but slower)
            await home.grant("phone", ["msg.send"], set_limits={"requests_per_minute": None})
            ui = await home.ui()
            link = urlsplit(ui.login_url)  # NAME.localhost: reached at 127.0.0.1, its name in Host
            async with httpx.AsyncClient(base_url=ui.url, timeout=30, headers={"Host": link.netloc}) as web:
                assert (await web.get(f"/login?{link.query}")).status_code == 200
                for _ in range(rows):
                    await _refused(phone)
                print(f"home's audit log: {rows} refused requests written first\n")
                print("1. page render (request to last byte, over HTTP on 127.0.0.1)")
                for path in PAGES:
                    samples = []
                    for _ in range(pages):
                        start = time.perf_counter()
                        r = await web.get(path)
                        samples.append((time.perf_counter() - start) * 1000)
                        assert r.status_code == 200, (path, r.status_code)
                    print("   " + _line(f"{path} ({len(r.content) // 1024} KiB)", samples))

                print("\n2. event to page (a refused request at home -> its audit row in the open Activity page)")
                print("   (from the request's sending: an upper bound; from its refusal heard: a lower one)")
                upper, lower = await _stream_latency(web, phone, events)
                print("   " + _line("SSE stream (httpx), upper", upper))
                print("   " + _line("SSE stream (httpx), lower", lower))
                if os.path.exists(CHROMIUM):
                    login_url = (await home.ui()).login_url  # a link works once: one for the browser
                    base = login_url.partition("/login")[0]
                    upper, lower = await _browser_latency(login_url, base, phone, events)
                    print("   " + _line("Chromium DOM swapped in, upper", upper))
                    print("   " + _line("Chromium DOM swapped in, lower", lower))
                else:
                    print(f"   (no {CHROMIUM}: the browser measurement was skipped)")
    finally:
        for d in daemons:
            await d.stop()


async def _stream_latency(web: httpx.AsyncClient, phone: Client, events: int) -> tuple[list[float], list[float]]:
    samples: list[float] = []
    lower: list[float] = []
    bounds: list[tuple[float, float]] = []
    async with web.stream("GET", "/events", params={"view": "/activity?decision=denied"}) as stream:
        lines = stream.aiter_lines()

        async def next_region() -> None:
            async for line in lines:
                if line == "event: region":
                    return
            raise AssertionError("the stream ended")

        with anyio.fail_after(10):
            await next_region()  # the first region: the page as it is now
        for _ in range(events):
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    arrived: list[float] = []

                    async def watch() -> None:
                        await next_region()
                        arrived.append(time.time())

                    tg.start_soon(watch)
                    bounds.append(await _refused(phone))
            samples.append((arrived[0] - bounds[-1][0]) * 1000)
            lower.append((arrived[0] - bounds[-1][1]) * 1000)
    return samples, lower


async def _browser_latency(login_url: str, base: str, phone: Client, events: int) -> tuple[list[float], list[float]]:
    from concurrent.futures import ThreadPoolExecutor

    from playwright.sync_api import sync_playwright

    thread = ThreadPoolExecutor(max_workers=1)
    state: dict = {}

    async def do(fn, *args):  # type: ignore[no-untyped-def]
        return await anyio.to_thread.run_sync(thread.submit(fn, *args).result)

    def start() -> None:
        state["pw"] = sync_playwright().start()
        state["ctx"] = state["pw"].chromium.launch_persistent_context(
            tempfile.mkdtemp(prefix="psymesh-chromium-"), executable_path=CHROMIUM, args=CHROMIUM_ARGS,
            headless=True)
        page = state["page"] = state["ctx"].new_page()
        page.goto(login_url)
        page.wait_for_url(base + "/")
        page.goto(base + "/activity?decision=denied")

    def updated() -> float:
        return float(state["page"].evaluate("Number(document.getElementById('live').dataset.updated || 0)"))

    def wait_newer(than: float) -> float:
        """Poll (wait_for_function would eval a string, which the page's CSP forbids); the
        time read is the page's own mark of the swap, so polling adds no error to it."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            shown = updated()
            if shown > than:
                return shown
            time.sleep(0.005)
        raise AssertionError("the page never showed the new row")

    await do(start)
    samples: list[float] = []
    lower: list[float] = []
    try:
        for _ in range(events):
            before = await do(updated)
            sent_at, refused_at = await _refused(phone)
            shown_ms = await do(wait_newer, before)
            samples.append(shown_ms - sent_at * 1000)
            lower.append(shown_ms - refused_at * 1000)
    finally:
        await do(lambda: (state["ctx"].close(), state["pw"].stop()))
        thread.shutdown()
    return samples, lower


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=20, help="fetches of each page")
    parser.add_argument("--events", type=int, default=20, help="events timed into the open page")
    parser.add_argument("--rows", type=int, default=150, help="audit rows written before")
    args = parser.parse_args()
    anyio.run(main, args.pages, args.events, args.rows, backend="trio")
