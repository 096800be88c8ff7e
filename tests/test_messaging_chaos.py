"""Letters survive a SIGKILL of either side: two daemon processes on loopback, a burst of
letters in three threads, one side killed while the burst is under way and started again.
Every letter arrives exactly once, each thread in the order it was written, and the
sender's outbox ends with every letter delivered."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import pytest

from p2p_helpers import unused_port
from waiting import wait_until
from psymesh.node.control.process import DaemonProcess, pair_homes
from psymesh.protocol.limits import Limits

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
LETTERS, THREADS = 300, 3


async def inbox_of(daemon: DaemonProcess) -> list:
    async with daemon.client() as c:
        return [m async for m in c.inbox(follow=False)]


async def delivered_by(daemon: DaemonProcess, ids: list[str]) -> int:
    async with daemon.client() as c:
        return sum([(await c.letter(i)).state == "delivered" for i in ids])


def assert_exactly_once_in_order(got: list, ids: list[str]) -> None:
    assert Counter(m.id for m in got) == Counter(ids), "each letter exactly once"
    last: dict[str, int] = {}
    for m in got:
        assert m.tseq == last.get(m.thread, 0) + 1, f"thread {m.thread} out of order at {m.tseq}"
        last[m.thread] = m.tseq
    assert [m.seq for m in got] == list(range(1, len(got) + 1))


async def assert_all_delivered_once_in_order(home: DaemonProcess, phone: DaemonProcess, ids: list[str]) -> None:
    async def all_arrived() -> bool:
        return len(await inbox_of(home)) >= LETTERS

    async def all_delivered() -> bool:
        return await delivered_by(phone, ids) == LETTERS

    await wait_until(all_arrived, "every letter at home", timeout=120)
    assert_exactly_once_in_order(await inbox_of(home), ids)
    await wait_until(all_delivered, "every receipt back at the phone", timeout=60)


async def start_pair(tmp_path: Path) -> tuple[DaemonProcess, DaemonProcess]:
    # fixed ports, so a restarted side is found where its peer remembers it
    home = DaemonProcess(tmp_path / "home", name="home", listen=[f"/ip4/127.0.0.1/tcp/{unused_port()}"])
    phone = DaemonProcess(tmp_path / "phone", profile="phone", name="phone",
                          listen=[f"/ip4/127.0.0.1/tcp/{unused_port()}"])
    await home.start()
    await phone.start()
    await pair_homes(home.home, phone.home)
    # 120 letters at once, then 2 a second: the burst is surely still under way when one
    # side is killed; open_the_gate() lets the rest through after the restart
    async with home.client() as h:
        await h.grant("phone", ["msg.send"], limits=Limits(requests_per_minute=120))
    return home, phone


async def open_the_gate(home: DaemonProcess) -> None:
    async with home.client() as h:
        await h.grant("phone", ["msg.send"], limits=Limits(requests_per_minute=1_000_000))


async def send_burst(phone: DaemonProcess) -> list[str]:
    async with phone.client() as c:
        return [(await c.send("home", f"letter {i}", thread=f"t{i % THREADS}", body={"i": i})).id
                for i in range(LETTERS)]


async def test_a_recipient_killed_mid_burst_gets_every_letter_once_in_order(tmp_path: Path) -> None:
    home, phone = await start_pair(tmp_path)
    try:
        ids: list[str] = []
        async with anyio.create_task_group() as tg:
            async def burst() -> None:
                ids.extend(await send_burst(phone))

            tg.start_soon(burst)

            async def some_arrived() -> bool:
                return len(await inbox_of(home)) >= 40

            await wait_until(some_arrived, "home to hold some letters", timeout=60)
            home.kill()  # SIGKILL: mid-transaction, mid-receipt, whatever it was doing
        async with phone.client() as c:  # the burst was still on its way when home died
            assert sum([(await c.letter(i)).state == "delivered" for i in ids]) < LETTERS
        await home.start()
        await open_the_gate(home)
        await wait_until(lambda: len(ids) == LETTERS, "the burst to be written")
        await assert_all_delivered_once_in_order(home, phone, ids)
    finally:
        await phone.stop()
        await home.stop()


async def test_a_sender_killed_mid_burst_sends_every_letter_once_in_order(tmp_path: Path) -> None:
    home, phone = await start_pair(tmp_path)
    try:
        ids = await send_burst(phone)  # durable in the phone's outbox when send() returns

        async def some_arrived() -> bool:
            return len(await inbox_of(home)) >= 40

        await wait_until(some_arrived, "home to hold some letters", timeout=60)
        phone.kill()
        at_kill = len(await inbox_of(home))
        assert at_kill < LETTERS, "the phone was killed mid-burst"
        await open_the_gate(home)
        await phone.start()  # its couriers resume from the outbox
        await assert_all_delivered_once_in_order(home, phone, ids)
    finally:
        await phone.stop()
        await home.stop()
