"""What changed while a peer was away reaches it when it is back (issue 34 item 2).

A grant edited while its subject was stopped, addresses that moved and an exit key made
while it was stopped: none of it could be pushed then. Once the peer runs again, with no
command from anyone, it holds all three (docs/protocol.md §5.11). Real daemon processes
on loopback, each peer at a fixed port except where the test moves one.
"""
from __future__ import annotations

import contextlib
import socket
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from conftest import pair
from waiting import wait_until
from psymesh.node.control.process import DaemonProcess
from psymesh.node.core.home import NodeHome
from psymesh.node.core.websettings import ExitSettings, WebSettings
from psymesh.protocol.messages import unpack
from psymesh.protocol.web import WebKeyPush

pytestmark = pytest.mark.anyio

BACK_WITHIN_S = 30.0  # the first retry after a restart comes within a few seconds (protocol/backoff.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _at(port: int) -> list[str]:
    return [f"/ip4/127.0.0.1/tcp/{port}"]


def _exit_key_held(home: Path, exit_id: str) -> bytes | None:
    """The public exit key `home`'s node holds for `exit_id` (read from its database)."""
    conn = sqlite3.connect(f"file:{home / 'node.db'}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT key FROM web_keys WHERE exit = ?", (exit_id,)).fetchone()
    except sqlite3.OperationalError:  # no table yet: no key ever came
        return None
    finally:
        conn.close()
    if row is None:
        return None
    push = unpack(row[0])
    assert isinstance(push, WebKeyPush)
    return push.key.public_key


async def _view_of(proc: DaemonProcess, peer_id: str):  # type: ignore[no-untyped-def]
    async with proc.client() as c:
        return next(p for p in await c.peers() if p.peer_id == peer_id)


@contextlib.asynccontextmanager
async def _paired_then_regranted_while_stopped(tmp_path: Path) -> AsyncIterator[tuple[DaemonProcess, DaemonProcess]]:
    """Home and a tablet, each at a fixed port, paired (messaging); then the tablet is stopped and
    home gives it `web.relay`, which it cannot hand over. Both stopped at the end."""
    home = DaemonProcess(tmp_path / "home", name="home", listen=_at(_free_port()))
    tablet = DaemonProcess(tmp_path / "tablet", name="tablet", listen=_at(_free_port()))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(home.start)
            tg.start_soon(tablet.start)
        await pair(home.home, tablet.home, grant="messaging")
        before = await _view_of(tablet, _id(home))
        assert "web.relay" not in before.received and _exit_key_held(tablet.home, _id(home)) is None
        await tablet.stop()
        async with home.client() as c:
            reply = await c.grant(_id(tablet), add=["web.relay"])
        assert not reply.delivered and "web.relay" in reply.peer.granted
        yield home, tablet
    finally:
        with anyio.CancelScope(shield=True):
            for proc in (home, tablet):
                if proc.running:
                    await proc.stop()


def _id(proc: DaemonProcess) -> str:
    return NodeHome(proc.home).init().peer_id


async def test_a_grant_addresses_and_exit_key_changed_while_a_peer_was_stopped_reach_it_when_it_is_back(
        tmp_path: Path) -> None:
    async with _paired_then_regranted_while_stopped(tmp_path) as (home, tablet):
        # While the tablet is stopped, home also restarts elsewhere (a new port), as an exit now:
        # new addresses, and a key the tablet never saw.
        await home.stop()
        config = NodeHome(home.home)
        config.save_config(config.load_config().model_copy(update={"web": WebSettings(exit=ExitSettings(enabled=True))}))
        home.listen = _at(_free_port())
        new_addrs = [a for a in (await home.start()).addrs if "/tcp/" in a]
        assert new_addrs

        # The tablet comes back where it was; nobody runs a command on either side.
        await tablet.start()

        async def caught_up() -> bool:
            view = await _view_of(tablet, _id(home))
            return ("web.relay" in view.received and set(view.addrs) == set(new_addrs)
                    and _exit_key_held(tablet.home, _id(home)) is not None)

        await wait_until(caught_up, "the tablet to hold its new grant, home's new addresses and its exit key",
                         timeout=BACK_WITHIN_S)


async def test_a_grant_changed_while_its_subject_was_stopped_reaches_it_as_it_starts(tmp_path: Path) -> None:
    """Home did not move: the tablet's own start reaches it, and that connection re-syncs."""
    async with _paired_then_regranted_while_stopped(tmp_path) as (home, tablet):
        await tablet.start()

        async def granted() -> bool:
            return "web.relay" in (await _view_of(tablet, _id(home))).received

        await wait_until(granted, "the tablet to hold the grant changed while it was stopped", timeout=10)
