"""A phone that cannot be dialed keeps its connection to home open, so home's letters reach it.

A phone on cellular sits behind a NAT: home can reach it only over a connection the phone
opened. When home gives that connection up (the phone slept through a liveness ping), the
phone dials again as soon as it runs, and home hands over what waits for it at once.

Real daemons in network namespaces of the test's own: home and phone joined by a veth pair,
the phone's namespace dropping every new TCP connection to it (nftables), as its NAT would.
The phone's sleep is SIGSTOP (none of its threads runs; its kernel still takes packets). And
the keeper's rules alone (node/reach/keep.py), at a hundredth of their scale: at once after a loss,
then a back-off; one ping on a connection quiet for `keep_alive_s`; which peers are kept.
"""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import anyio
import anyio.abc
import pytest

from conftest import pair
from netns import Namespaces, NetnsDaemon, namespaces  # noqa: F401  (a fixture, used by name)
from test_relay import daemons
from waiting import wait_until
from psymesh.node.control.process import DaemonProcess
from psymesh.node.core.home import NodeHome
from psymesh.node.reach.dialback import tcp_ports
from psymesh.node.reach.keep import KeepConnected
from psymesh.protocol.errors import ConnectError

pytestmark = pytest.mark.anyio


def undialable(netns: str) -> None:
    """Nobody opens a TCP connection into `netns` (connections it opened still pass)."""
    for rule in (["add", "table", "inet", "nat"],
                 ["add", "chain", "inet", "nat", "in", "{ type filter hook input priority 0; }"],
                 ["add", "rule", "inet", "nat", "in", "tcp", "flags", "syn", "ct", "state", "new", "drop"]):
        subprocess.run(["ip", "netns", "exec", netns, "nft", *rule], check=True, capture_output=True, timeout=10)


@pytest.mark.slow
async def test_a_phone_home_cannot_dial_gets_its_letter_after_sleeping_through_a_liveness_ping(
        namespaces: Namespaces, tmp_path: Path) -> None:
    home_ns, phone_ns = namespaces.add("h"), namespaces.add("p")
    namespaces.link(home_ns, "10.72.1.1", phone_ns, "10.72.1.2")
    home_dir = NodeHome(tmp_path / "home")
    home_dir.init(profile="home", name="home")
    # A second of silence under an open request and home gives the connection up (20 s by default).
    home_dir.save_config(home_dir.load_config().model_copy(update={"liveness_probe_s": 1.0}))
    home = NetnsDaemon(home_ns, tmp_path / "home", "home")
    phone = NetnsDaemon(phone_ns, tmp_path / "phone", "phone", profile="phone")

    async with daemons(home, phone), home.client() as h, phone.client() as p:
        await pair(home.home, phone.home)  # the phone joins: it dials home; home may send it letters
        undialable(phone_ns)
        inbox = p.inbox()
        await h.send("phone", "awake")
        assert (await inbox.__anext__()).text == "awake"

        async def phone_gone() -> bool:
            return not any(c.name == "phone" for c in (await h.status()).connected_peers)

        assert phone.proc is not None
        phone.proc.send_signal(signal.SIGSTOP)
        try:
            sent = await h.send("phone", "while you slept")
            await wait_until(phone_gone, "home to give up its connection to the sleeping phone", timeout=30)
        finally:
            phone.proc.send_signal(signal.SIGCONT)
        with anyio.fail_after(20):  # before: never, until the phone itself sent something
            letter = await inbox.__anext__()
        assert (letter.text, letter.id) == ("while you slept", sent.id)
        await inbox.aclose()
        assert [m.text async for m in p.inbox(follow=False)] == ["awake", "while you slept"]  # each once


@pytest.mark.slow
async def test_a_recipient_that_comes_back_gets_its_letter_at_once_not_after_the_back_off(tmp_path: Path) -> None:
    home = DaemonProcess(tmp_path / "home", name="home")
    phone = DaemonProcess(tmp_path / "phone", profile="phone", name="phone")
    async with daemons(home, phone), home.client() as h:
        await pair(home.home, phone.home)
        async with phone.client() as p:
            [old_port] = tcp_ports((await p.status()).addrs)
        await phone.stop()
        # Where the phone was, connections are taken and closed at once: each of home's tries is
        # seen, and fails (as a circuit through a relay the phone left fails).
        tries: list[float] = []
        async with await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=old_port) as where_it_was:
            async def refuse(conn: anyio.abc.SocketStream) -> None:
                tries.append(anyio.current_time())
                await conn.aclose()

            async with anyio.create_task_group() as tg:
                tg.start_soon(where_it_was.serve, refuse)
                sent = await h.send("phone", "while you were away")
                # Two tries 6.4 s apart (0.2 s doubling): the next wait is 12.8 s.
                await wait_until(lambda: any(b - a >= 6.0 for a, b in zip(tries, tries[1:])),
                                 "home's courier to back off", timeout=60)
                tg.cancel_scope.cancel()
        await phone.start()  # it dials home as it starts (node/reach/keep.py)
        async with phone.client() as p:
            with anyio.fail_after(5):  # before: the rest of the courier's 12.8 s
                letter = await p.inbox().__anext__()
        assert letter.id == sent.id


# ------------------------------------------------------------------ the keeper's rules
class FakeLinks:
    def __init__(self) -> None:
        self.connected: set[str] = set()
        self._changes = anyio.Event()

    def changes(self) -> anyio.Event:
        return self._changes

    def path(self, peer_id: str) -> str | None:
        return "direct" if peer_id in self.connected else None

    def set(self, peer_id: str, up: bool) -> None:
        (self.connected.add if up else self.connected.discard)(peer_id)
        self._changes.set()
        self._changes = anyio.Event()


class FakeReacher:
    def __init__(self, links: FakeLinks) -> None:
        self.links = links
        self.reachable = True
        self.dials: list[float] = []
        self.pings: list[float] = []
        self.heard = 0.0

    async def open(self, peer_id: str) -> None:
        self.dials.append(anyio.current_time())
        if not self.reachable:
            raise ConnectError(f"{peer_id} is unreachable: connection refused")
        self.heard = anyio.current_time()
        self.links.set(peer_id, True)

    async def ping(self, peer_id: str) -> None:
        self.pings.append(anyio.current_time())
        self.heard = anyio.current_time()

    def quiet_for(self, peer_id: str, now: float) -> float:
        return now - self.heard


async def test_the_keeper_redials_at_once_then_backs_off_and_keeps_a_quiet_binding() -> None:
    """The rules at a hundredth of their scale (back-off 0.01 s doubling; keep-alive 0.3 s): the
    figures are lower bounds, as a busy machine only makes waits longer."""
    links = FakeLinks()
    reacher = FakeReacher(links)
    wanted = {"home"}
    looks = [0]

    def kept() -> set[str]:
        looks[0] += 1
        return set(wanted)

    keeper = KeepConnected(kept, links, reacher, keep_alive_s=0.3, backoff=lambda n, jitter: 0.01 * 2 ** n,
                           jitter=lambda: 0.0)
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        await wait_until(lambda: links.path("home"), "the first dial, as it starts")

        # Home gives the connection up: the phone dials again at once.
        links.set("home", False)
        await wait_until(lambda: len(reacher.dials) == 2, "a redial", timeout=5)

        # Unreachable: waits that double between tries; back as soon as it answers again.
        reacher.reachable = False
        links.set("home", False)
        await wait_until(lambda: len(reacher.dials) == 6, "four more dials")
        t = reacher.dials[2:]
        gaps = [b - a for a, b in zip(t, t[1:])]
        assert all(gap >= want for gap, want in zip(gaps, [0.01, 0.02, 0.04])), gaps
        reacher.reachable = True
        await wait_until(lambda: links.path("home"), "home reachable again")

        # Nothing heard for keep_alive_s: one ping, then quiet again for as long.
        quiet_from = reacher.heard = anyio.current_time()
        await wait_until(lambda: len(reacher.pings) >= 2, "two keep-alive pings")
        assert reacher.pings[0] - quiet_from >= 0.3 and reacher.pings[1] - reacher.pings[0] >= 0.3

        # A peer no longer kept (revoked, say) is not dialed after a loss.
        dials, seen = len(reacher.dials), looks[0]
        wanted.clear()
        keeper.poke()
        links.set("home", False)
        await wait_until(lambda: looks[0] > seen, "the keeper to look again")
        await wait_until(lambda: not keeper.busy, "the keeper to settle")
        assert len(reacher.dials) == dials
        tg.cancel_scope.cancel()
