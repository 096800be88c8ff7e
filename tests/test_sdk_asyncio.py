"""The SDK from a plain asyncio script (pytest-asyncio), against a real daemon process."""
from __future__ import annotations

from pathlib import Path

import pytest

import psymesh
from psymesh.node.control.process import DaemonProcess


@pytest.mark.asyncio
async def test_status_and_ping_from_asyncio(tmp_path: Path) -> None:
    home, phone = DaemonProcess(tmp_path / "home"), DaemonProcess(tmp_path / "phone", profile="phone")
    home_status = await home.start()
    await phone.start()
    try:
        async with psymesh.Client(home=tmp_path / "home") as pc:
            invite = await pc.pair_invite(grant="phone")
        async with psymesh.Client(home=tmp_path / "phone") as node:
            paired = await node.pair_join(invite.invite)
            assert paired.peer_id == home_status.peer_id and len(paired.verification.split()) == 4
            status = await node.status()
            assert status.profile == "phone"
            reply = await node.ping(home_status.addrs[0], count=3)
            assert reply.peer_id == home_status.peer_id and len(reply.rtts_ms) == 3
            [home_peer] = await node.peers()  # typed, as under trio
            assert home_peer.peer_id == home_status.peer_id and home_peer.received and home_peer.revoked_at is None
        assert await home.stop() == 0
        async with psymesh.Client(home=tmp_path / "phone") as node:
            with pytest.raises(psymesh.NetworkError) as info:  # home is gone: the network, not a refusal
                await node.ping(home_status.peer_id, count=1)
            assert not isinstance(info.value, psymesh.RemoteError)
    finally:
        assert await phone.stop() == 0
        assert await home.stop() == 0
