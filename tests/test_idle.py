"""An idle node sleeps (issue 23): a paired phone and home, the session open, then nothing:
no timer of either node fires within a minute (what is left: hourly purges; nothing polls)."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import pair, run_nodes
from waiting import wait_until_no_timer_within
from psymesh.protocol.common import Ping, Pong
from psymesh.protocol.strangers import StrangerLimits

pytestmark = pytest.mark.anyio


async def test_an_idle_paired_phone_and_home_set_no_timer(tmp_path: Path) -> None:
    # One-shot timers that follow activity, shortened: a session's watcher rests after one
    # probe time, the pairing connection's stranger limit ends (it paired meanwhile).
    quick = {"liveness_probe_s": 1.0, "strangers": StrangerLimits(connection_s=10.0)}
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"},
                         configs={"home": quick, "phone": quick}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        pong = await phone.sessions.request(home.identity.peer_id, Ping(seq=1), Pong)
        assert pong.seq == 1
        await wait_until_no_timer_within(60, "an idle paired phone and home")
