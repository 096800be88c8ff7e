"""Reaching home from anywhere: circuit relay v2 through a trusted psymesh peer.

On loopback (in-process daemons): a relay serves only peers it granted `relay`, and
audits every reservation and circuit it decides. In network namespaces of our own
(subprocess daemons): home and phone with no route between them, a relay with a link
into each; the phone pairs with home through the relay, delegates through it, the relay
sees ciphertext only, and when a direct link appears the traffic moves to it with every
task completing exactly once.
"""
from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.node.client import Client
from psymesh.node.daemon import Node
from psymesh.node.home import NodeHome
from psymesh.protocol.errors import ConnectError, ErrorCode, PsymeshError
from psymesh.protocol.relay import CONNECT, HOP, RESERVE, RelaySettings

pytestmark = pytest.mark.anyio


def home_with(path: Path, name: str, relay: RelaySettings, profile: str = "home") -> NodeHome:
    """A node home whose config has `relay` as its [relay] table."""
    home = NodeHome(path)
    home.init(profile=profile, name=name)  # type: ignore[arg-type]
    home.save_config(home.load_config().model_copy(update={"relay": relay}))
    return home


def relay_rows(relay: Node, peer: Node, what: str) -> list[dict]:
    return [r for r in relay.audit.query(peer_id=peer.identity.peer_id, limit=1000)
            if r["protocol"] == HOP and r["operation"] == what]


async def test_a_relay_serves_only_peers_it_granted_relay_and_audits_each_decision(tmp_path: Path) -> None:
    relay_home = home_with(tmp_path / "relay", "relay", RelaySettings(enabled=True))
    relay_id = relay_home.init().peer_id
    home_with(tmp_path / "home", "home", RelaySettings(relays=[relay_id]))
    async with run_nodes(tmp_path, "relay", "home", "phone") as nodes:
        relay, home, phone = nodes["relay"], nodes["home"], nodes["phone"]
        # A stranger to the relay cannot even open its HOP protocol (refused and audited).
        with pytest.raises(PsymeshError):
            await phone.p2p.open_stream(relay.p2p.addrs()[0], HOP)
        assert [(r["protocol"], r["allowed"], r["code"]) for r in relay.audit.query(peer_id=phone.identity.peer_id)] \
            == [(HOP, False, ErrorCode.UNKNOWN_PEER.value)]
        await phone.p2p.disconnect(relay.identity.peer_id)

        await pair(relay.home.path, home.home.path, grant="messaging")
        await pair(relay.home.path, phone.home.path, grant="messaging")

        # Paired, but not granted `relay`: the reservation is refused, and audited.
        await wait_until(lambda: relay_rows(relay, home, RESERVE), "the relay to decide home's reservation")
        row = relay_rows(relay, home, RESERVE)[0]
        assert not row["allowed"] and row["code"] == ErrorCode.FORBIDDEN.value
        assert home.p2p.reservation(relay_id) is None and not home.p2p.relayed_addrs()

        async with Client(relay.home.path) as r:
            await r.grant("home", ["relay"])
            await wait_until(lambda: home.p2p.reservation(relay_id) is not None, "home's reservation at the relay",
                             timeout=40)  # home retries with a backoff
            assert relay_rows(relay, home, RESERVE)[-1]["allowed"]
            circuit = home.p2p.relayed_addrs()[0]
            assert circuit.endswith(f"/p2p/{relay_id}/p2p-circuit/p2p/{home.identity.peer_id}")

            # The phone is not granted `relay`: its circuit is refused, and audited.
            with pytest.raises(ConnectError, match="permission_denied"):
                await phone.p2p.connect(circuit)
            row = relay_rows(relay, phone, CONNECT)[-1]
            assert not row["allowed"] and row["code"] == ErrorCode.FORBIDDEN.value

            await r.grant("phone", ["relay"])
            assert await phone.p2p.connect(circuit) == home.identity.peer_id
            assert phone.p2p.path(home.identity.peer_id) == "relayed"
            assert home.p2p.path(phone.identity.peer_id) == "relayed"
            assert relay_rows(relay, phone, CONNECT)[-1]["allowed"]



async def test_pairing_through_a_relay_then_the_direct_path_takes_over(tmp_path: Path) -> None:
    """On loopback every node can dial every other: the phone is given only home's relayed
    address, pairs through it, and moves to home's direct address once home tells it."""
    relay_home = home_with(tmp_path / "relay", "relay", RelaySettings(enabled=True))
    relay_id = relay_home.init().peer_id
    home_with(tmp_path / "home", "home", RelaySettings(relays=[relay_id]))
    home_with(tmp_path / "phone", "phone", RelaySettings(direct_retry_s=1, overlap_s=1), profile="phone")
    async with run_nodes(tmp_path, "relay", "home", "phone", profiles={"phone": "phone"}) as nodes:
        relay, home, phone = nodes["relay"], nodes["home"], nodes["phone"]
        await pair(relay.home.path, home.home.path, grant="messaging")
        await pair(relay.home.path, phone.home.path, grant="messaging")
        async with Client(relay.home.path) as r, Client(home.home.path) as h, Client(phone.home.path) as p:
            await r.grant("home", ["relay"])
            await r.grant("phone", ["relay"])
            await wait_until(lambda: home.p2p.relayed_addrs(), "home's reservation at the relay", timeout=40)
            invite = await h.pair_invite()
            assert any(a.endswith("/p2p-circuit") for a in invite_addrs(invite.invite))  # a relayed address
            await p.pair_join(invite.code, address=home.p2p.relayed_addrs()[0])
            assert phone.p2p.path(home.identity.peer_id) == "relayed"
            await h.grant("phone", ["tool:system.info"])
            task = await p.delegate("home", tool="system.info")
            assert (await task.result())["profile"] == "home"
            # home told the phone its addresses (its own, signed): the phone dials the direct one
            await wait_until(lambda: phone.p2p.path(home.identity.peer_id) == "direct", "the direct path", timeout=20)
            await wait_until(lambda: not phone.p2p._connections(home.identity.peer_id, direct=False),
                             "the relayed connection closed", timeout=20)
            task = await p.delegate("home", tool="system.info")
            assert (await task.result())["profile"] == "home"
            assert not [s for s in phone.sessions.sessions() if s.relayed]


def invite_addrs(invite: str) -> tuple[str, ...]:
    from psymesh.protocol.pairing import parse_invite

    return parse_invite(invite).addrs
