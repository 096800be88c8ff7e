"""What one web page may cost the exit (issue 20, finding 3): six concurrent fetches of a
2 MiB page of `<p>a</p>` repeated, served from 127.0.0.1, to a real exit daemon (a
subprocess, so its memory is its own). Before, the text extraction ran in the daemon's
threads, outside the fetch deadline, six at once: 2.64 GB peak. Now each page's text is
extracted in a child with a memory cap, two at once, within the deadline: the daemon's RSS
grows by at most 64 MB, each fetch is answered or refused within its deadline, and a
well-behaved page is served after.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest

from conftest import run_nodes
from psymesh.node.control.client import Client
from psymesh.node.core.home import NodeHome
from psymesh.node.control.process import DaemonProcess, pair_homes
from psymesh.node.web.exit import ExitSettings
from psymesh.node.core.websettings import WebSettings
from psymesh.protocol.errors import ErrorCode, PsymeshError
from websites import Site, serving

pytestmark = pytest.mark.anyio
MB = 1_000_000
BOMB = b"<html><body>" + b"<p>a</p>" * (2 * 1024 * 1024 // 8 - 4) + b"</body></html>"  # just under 2 MiB
PAGE = "<html><head><title>Tides</title></head><body><article><p>High tide is at 06:12.</p></article></body></html>"
TIMEOUT_S = 10.0


@pytest.fixture
def site() -> Iterator[Site]:
    with serving() as s:
        for i in range(6):
            s.route(f"/bomb{i}", BOMB)
        s.route("/tides", PAGE)
        yield s


def rss(pid: int) -> tuple[int, int]:
    """(the daemon's resident bytes, its extractor children's together)."""
    try:
        proc = psutil.Process(pid)
        children = sum(c.memory_info().rss for c in proc.children(recursive=True) if c.is_running())
        return proc.memory_info().rss, children
    except psutil.NoSuchProcess:
        return 0, 0


async def test_six_concurrent_adversarial_pages_cost_the_exit_a_bounded_amount(tmp_path: Path, site: Site) -> None:
    exit_home = NodeHome(tmp_path / "exit")
    exit_home.init(name="exit")
    exit_home.save_config(exit_home.load_config().model_copy(update={"web": WebSettings(
        exit=ExitSettings(enabled=True, allow_loopback=True, timeout_s=TIMEOUT_S, cache_entries=0))}))
    exit_node = DaemonProcess(exit_home.path, name="exit")
    await exit_node.start()
    try:
        assert exit_node.proc is not None
        pid = exit_node.proc.pid
        async with run_nodes(tmp_path, "phone", profiles={"phone": "phone"}) as nodes:
            phone_home = nodes["phone"].home.path
            await pair_homes(exit_home.path, phone_home, grant="phone")
            async with Client(phone_home) as phone:
                await phone.web_fetch(site.url("/tides"))  # warm: the exit's pools and one extractor
            base, _ = rss(pid)
            peak = [0, 0]
            outcomes: list[tuple[str, float]] = []
            done = anyio.Event()

            async def watch() -> None:
                while not done.is_set():
                    daemon, children = rss(pid)
                    peak[0], peak[1] = max(peak[0], daemon), max(peak[1], daemon + children)
                    await anyio.sleep(0.05)

            async def bomb(i: int) -> None:
                started = time.monotonic()
                async with Client(phone_home) as phone:
                    try:
                        page = await phone.web_fetch(site.url(f"/bomb{i}"))
                        outcome = f"answered ({len(page.text)} chars)"
                    except PsymeshError as exc:
                        outcome = exc.code.value
                outcomes.append((outcome, time.monotonic() - started))

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch)
                    async with anyio.create_task_group() as bombs:
                        for i in range(6):
                            bombs.start_soon(bomb, i)
                    async with Client(exit_home.path) as owner:  # the exit itself answers its owner
                        await owner.status()
                    await anyio.sleep(1.0)  # what it holds after the pages
                    done.set()
                after, children_after = rss(pid)
            async with Client(phone_home) as phone:
                page = await phone.web_fetch(site.url("/tides"))  # a good page still comes back
            assert "06:12" in page.text
        print(f"\nexit RSS: {base / MB:.0f} MB before, peak {peak[0] / MB:.0f} MB (+{(peak[0] - base) / MB:.0f}), "
              f"{after / MB:.0f} MB after; with extractor children: peak {peak[1] / MB:.0f} MB, "
              f"children after {children_after / MB:.0f} MB; outcomes {outcomes}")
        assert peak[0] - base <= 64 * MB
        assert len(outcomes) == 6
        for outcome, took in outcomes:
            assert outcome.startswith("answered") or outcome in (ErrorCode.TOO_LARGE.value, ErrorCode.TIMEOUT.value)
            assert took <= TIMEOUT_S + 3.0
    finally:
        await exit_node.stop()
