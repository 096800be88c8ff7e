"""Reaching home from anywhere: circuit relay v2 through a trusted psymesh peer.

On loopback (in-process daemons): a relay serves only peers it granted `relay`, and
audits every reservation and circuit it decides. In network namespaces of our own
(subprocess daemons): home and phone with no route between them, a relay with a link
into each; the phone pairs with home through the relay, delegates through it, the relay
sees ciphertext only, and when a direct link appears the traffic moves to it with every
task completing exactly once.
"""
from __future__ import annotations

import logging
import socket
from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from netns import Namespaces, NetnsDaemon, daemons, namespaces  # noqa: F401  (a fixture, used by name)
from waiting import wait_until
from worktool import TOOL_NAME, tool_log, tool_runs  # noqa: F401  (tool_log: a fixture)
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.core.home import NodeHome
from psymesh.protocol.identity import peer_fingerprint
from psymesh.protocol.errors import ConnectError, ErrorCode, PsymeshError
from psymesh.protocol.limits import Limits
from psymesh.protocol.relay import CONNECT, HOP, RESERVE, RelaySettings
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeer
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

pytestmark = pytest.mark.anyio
ROOMY = Limits(requests_per_minute=10_000, concurrent_tasks=16, max_runtime_s=600, max_payload_bytes=1 << 20)
MARKER = "PLAINTEXT-TASK-MARKER"


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
            with pytest.raises(ConnectError, match="permission_denied") as refused:
                await phone.p2p.connect(circuit)
            # named as the phone paired it, with its fingerprint; home, a stranger to the phone, by its id
            assert f"relay relay ({peer_fingerprint(relay_id)}) refused the circuit to {home.identity.peer_id}" \
                in refused.value.message
            row = relay_rows(relay, phone, CONNECT)[-1]
            assert not row["allowed"] and row["code"] == ErrorCode.FORBIDDEN.value

            # Home down at its own address, and the relay refusing the phone: home's own address is
            # told first (the tour's phone was sent looking for a grant while home was simply stopped).
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                dead = f"/ip4/127.0.0.1/tcp/{probe.getsockname()[1]}"
            with pytest.raises(ConnectError) as unreachable:
                await phone.p2p.open_stream_any(home.identity.peer_id, [circuit, dead], HOP, who="home")
            assert unreachable.value.cause.startswith("connection refused at"), unreachable.value.message
            assert unreachable.value.cause.index("connection refused") < unreachable.value.cause.index(
                "through a relay: ") < unreachable.value.cause.index("permission_denied")

            await r.grant("phone", ["relay"])
            assert await phone.p2p.connect(circuit) == home.identity.peer_id
            assert phone.p2p.path(home.identity.peer_id) == "relayed"
            assert home.p2p.path(phone.identity.peer_id) == "relayed"
            assert relay_rows(relay, phone, CONNECT)[-1]["allowed"]



async def test_a_relay_refusal_names_both_peers_by_label_and_fingerprint(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Before: `no reservation at relay 12D3KooW… (relay 12D3KooW… refused the reservation: ...)` on
    the phone, `refused a reservation to 12D3KooW…` on the relay: a paired peer by its raw id. Now each
    names the other as it was paired, with the fingerprint `psymesh id` prints on that device."""
    caplog.set_level(logging.INFO, logger="psymesh")
    caplog.set_level(logging.DEBUG, logger="psymesh.relay")  # the phone's retries after its first failure
    relay_home = home_with(tmp_path / "relay", "relay", RelaySettings(enabled=True))
    relay_id = relay_home.init().peer_id
    home_with(tmp_path / "phone", "phone", RelaySettings(relays=[relay_id]), profile="phone")
    async with run_nodes(tmp_path, "relay", "phone") as nodes:
        relay, phone = nodes["relay"], nodes["phone"]
        await pair(relay.home.path, phone.home.path, grant="messaging")  # paired, not granted `relay`
        relay_fp, phone_fp = peer_fingerprint(relay_id), peer_fingerprint(phone.identity.peer_id)

        def said(text: str) -> bool:
            return any(text in r.getMessage() for r in caplog.records)

        await wait_until(lambda: said("refused the reservation"), "the phone to log the relay's refusal")
        assert said(f"no reservation: relay relay ({relay_fp}) refused the reservation: permission_denied")
        assert said(f"refused a reservation to phone ({phone_fp}): not allowed")
        assert not any(f"relay {relay_id}" in r.getMessage() or f"to {phone.identity.peer_id}" in r.getMessage()
                       for r in caplog.records)


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
            await p.pair_join(invite.code, address=home.p2p.relayed_addrs()[0])  # the only address given
            # (no check that the path is still relayed here: once paired, each side dials the
            # other's direct addresses at once, woken by the pairing, not a second later)
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


async def test_one_peer_opening_circuits_without_end_leaves_room_for_the_rightful_one(tmp_path: Path) -> None:
    """A peer granted `relay` opens circuits into home as fast as it can and holds them:
    the relay counts them per source and per (source, destination), so it gets its share
    (2 into home, 4 in all) and the phone still gets its circuit to home."""
    relay_home = home_with(tmp_path / "relay", "relay", RelaySettings(enabled=True))
    relay_id = relay_home.init().peer_id
    home_with(tmp_path / "home", "home", RelaySettings(relays=[relay_id]))
    async with run_nodes(tmp_path, "relay", "home", "phone", "greedy") as nodes:
        relay, home, phone, greedy = nodes["relay"], nodes["home"], nodes["phone"], nodes["greedy"]
        for peer in (home, phone, greedy):
            await pair(relay.home.path, peer.home.path, grant="messaging")
        async with Client(relay.home.path) as r:
            for name in ("home", "phone", "greedy"):
                await r.grant(name, ["relay"], limits=ROOMY)
        await wait_until(lambda: home.p2p.relayed_addrs(), "home's reservation at the relay", timeout=40)
        circuit = home.p2p.relayed_addrs()[0]
        await greedy.p2p.connect(relay.p2p.addrs()[0])

        held: list[object] = []
        statuses: list[int] = []

        async def grab() -> None:  # one CONNECT on its own HOP stream, held open once granted
            stream = await greedy.p2p._host.new_stream(ID.from_base58(relay_id), [TProtocol(HOP)])
            await write_delimited_msg(stream, HopMessage(
                type=HopMessage.CONNECT, peer=CircuitPeer(id=ID.from_base58(home.identity.peer_id).to_bytes())))
            reply = await read_delimited_msg(stream, HopMessage)
            statuses.append(reply.status)
            held.append(stream)

        with anyio.fail_after(60):
            for _ in range(3):  # bounded: 3 rounds of 8 at once, each round taking all it can
                async with anyio.create_task_group() as tg:
                    for _ in range(8):
                        tg.start_soon(grab)
            ok = statuses.count(StatusCode.OK)
            assert ok == 2 and len(statuses) == 24  # its share into home; the rest refused at once
            assert relay.p2p._book.pairs[greedy.identity.peer_id, home.identity.peer_id] == 2
            assert phone.p2p.path(home.identity.peer_id) is None
            assert await phone.p2p.connect(circuit) == home.identity.peer_id  # the rightful peer gets in
            assert phone.p2p.path(home.identity.peer_id) == "relayed"
        assert len(relay_rows(relay, greedy, CONNECT)) == 24  # each CONNECT decided and audited at the gate
        for stream in held:
            await stream.reset()


def invite_addrs(invite: str) -> tuple[str, ...]:
    from psymesh.protocol.pairing import parse_invite

    return parse_invite(invite).addrs


# ------------------------------------------------------------- in network namespaces of our own

async def connection_to(client: Client, peer_id: str) -> list[str]:
    """The transport addresses of the connections `client`'s node has open to `peer_id`."""
    status = await client.status()
    return [a for p in status.connected_peers if p.peer_id == peer_id for a in p.addrs]


@pytest.mark.netns
async def test_home_behind_a_relay_is_reached_through_it_then_directly(namespaces: Namespaces, tmp_path: Path,
                                                                      tool_log: Path) -> None:
    # Home and phone share no network; the relay has a link into each.
    relay_ns, home_ns, phone_ns = namespaces.add("r"), namespaces.add("h"), namespaces.add("p")
    namespaces.link(relay_ns, "10.71.1.1", home_ns, "10.71.1.2")
    namespaces.link(relay_ns, "10.71.2.1", phone_ns, "10.71.2.2")
    relay_id = home_with(tmp_path / "relay", "relay", RelaySettings(enabled=True)).init().peer_id
    quick = {"direct_retry_s": 1.0, "overlap_s": 2.0}
    home_with(tmp_path / "home", "home", RelaySettings(relays=[relay_id], **quick))
    home_with(tmp_path / "phone", "phone", RelaySettings(**quick), profile="phone")
    relay = NetnsDaemon(relay_ns, tmp_path / "relay", "relay")
    home = NetnsDaemon(home_ns, tmp_path / "home", "home")
    phone = NetnsDaemon(phone_ns, tmp_path / "phone", "phone", profile="phone")

    async with daemons(relay, home, phone), relay.client() as r, home.client() as h, phone.client() as p:
        home_id = (await h.status()).peer_id
        await pair(relay.home, home.home, grant="messaging")
        await pair(relay.home, phone.home, grant="messaging")
        await r.grant("home", ["relay"])

        async def relayed_addrs() -> list[str]:
            return [a for a in (await h.status()).addrs if "/p2p-circuit/" in a]

        await wait_until(relayed_addrs, "home's reservation at the relay", timeout=40)
        invite = await h.pair_invite()

        # The relay has not granted the phone `relay`: no way to home, and the refusal is audited.
        with pytest.raises(ConnectError, match="permission_denied"):
            await p.pair_join(invite.invite, grant="messaging")
        refused = [row for row in await r.audit(peer="phone", denied_only=True) if row.operation == CONNECT]
        assert [row.code for row in refused] == [ErrorCode.FORBIDDEN.value]  # once, whatever address it tried

        # Granted: the phone pairs with home through the relay (the invite carries home's
        # relayed address), pings it and delegates to it.
        await r.grant("phone", ["relay"])
        await p.pair_join(invite.invite, grant="messaging")
        await h.grant("phone", ["tool:testwork.*"], limits=ROOMY)
        assert len((await p.ping("home", count=3)).rtts_ms) == 3
        first = await p.delegate("home", tool=TOOL_NAME, args={"tag": f"{MARKER}-1", "ms": 0})
        assert (await first.result())["tag"] == f"{MARKER}-1"
        assert all("/p2p-circuit/" in a for a in await connection_to(p, home_id))
        assert [row for row in await r.audit(peer="phone") if row.operation == CONNECT][-1].allowed

        # A task still running when a direct link appears ...
        second = await p.delegate("home", tool=TOOL_NAME, args={"tag": f"{MARKER}-2", "ms": 3000})
        await wait_until(lambda: f"start {MARKER}-2" in tool_log.read_text(), "the second task to start")
        namespaces.link(home_ns, "10.71.3.1", phone_ns, "10.71.3.2")

        # ... home tells the phone its new address, the phone dials it, the relayed connection closes.
        async def direct_only() -> bool:
            addrs = await connection_to(p, home_id)
            return bool(addrs) and not any("/p2p-circuit/" in a for a in addrs)

        await wait_until(direct_only, "the phone's connection to home to be direct only", timeout=30)
        assert (await second.result())["tag"] == f"{MARKER}-2"

        # Without the relay, the next task still gets through: it takes the direct path.
        await relay.stop()
        third = await p.delegate("home", tool=TOOL_NAME, args={"tag": f"{MARKER}-3", "ms": 0})
        assert (await third.result())["tag"] == f"{MARKER}-3"
        addrs = await connection_to(p, home_id)
        assert addrs and all("/ip4/10.71.3.1/" in a for a in addrs), addrs

    # Every task ran once and completed once, across the switch.
    runs = tool_runs(tool_log)
    assert runs == {f"{what} {MARKER}-{n}": 1 for what in ("start", "done") for n in (1, 2, 3)}
    # The relay carried every byte of the first task and none of its plaintext: not in its
    # log, its database (audit rows included) or its write-ahead log.
    relay_files = [relay.log_path, *(tmp_path / "relay").glob("node.db*")]
    assert all(MARKER.encode() not in f.read_bytes() for f in relay_files)


# ------------------------------------------------------------- address records (addrs.push)
def test_an_address_record_is_its_peers_own_word(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from psymesh.node.core.db import open_db
    from psymesh.node.door.trust import TrustStore
    from psymesh.protocol.addresses import AddrRecord
    from psymesh.protocol.identity import peer_id_from_public_key

    keys = [Ed25519PrivateKey.generate() for _ in range(2)]
    alice, mallory = (peer_id_from_public_key(k.public_key().public_bytes_raw()) for k in keys)
    addr = f"/ip4/10.0.0.7/tcp/4001/p2p/{alice}"
    record = AddrRecord(peer_id=alice, addrs=(addr,), seq=5).sign(keys[0])
    record.verify(sender=alice)
    for bad, sender in ((record, mallory),  # someone else's record, passed on
                        (record.model_copy(update={"addrs": (addr.replace("10.0.0.7", "10.0.0.8"),)}), alice),
                        (AddrRecord(peer_id=alice, addrs=(f"/ip4/10.0.0.7/tcp/1/p2p/{mallory}",), seq=6)
                         .sign(keys[0]), alice)):
        with pytest.raises(PsymeshError) as info:
            bad.verify(sender=sender)
        assert info.value.code in (ErrorCode.FORBIDDEN, ErrorCode.BAD_REQUEST)
    with pytest.raises(ValueError):
        AddrRecord(peer_id=alice, addrs=(addr,), seq=1).sign(keys[1])

    trust = TrustStore(open_db(tmp_path / "node.db"))
    trust.add(alice, name="alice", role="home", addrs=["/ip4/192.168.1.2/tcp/4001"], granted=None, received=None)
    assert trust.set_own_addrs(alice, [addr], 5) and trust.get(alice).addrs == (addr,)
    assert not trust.set_own_addrs(alice, ["/ip4/10.9.9.9/tcp/1"], 4)  # an older record changes nothing
    assert trust.get(alice).addrs == (addr,)
