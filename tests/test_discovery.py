"""Discovery: the libp2p mDNS record (as psymesh, rust-libp2p, js-libp2p and py-libp2p write
it), real daemons finding each other inside network namespaces this test creates (never
on a real interface), a paired peer followed to its new address, and static peers.

The namespace tests need root and a kernel that allows network namespaces; where either
is missing they are skipped, saying which (checked when they run)."""
from __future__ import annotations

import ast
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import pytest
from hypothesis import given, settings, strategies as st
from zeroconf import DNSIncoming, DNSPointer, DNSText

import mdns_peer
from netns import netns_refusal
from conftest import pair
from psymesh.discovery.records import (
    MAX_ADDRS,
    SERVICE_TYPE,
    Announcement,
    advertised,
    dialable,
    encode_txt,
    instance_label,
    parse_announcement,
    txt_strings,
)
from psymesh.discovery.service import MAX_CHECKS, RETRY_S, Discovery
from psymesh.discovery.static import check_static_peers
from psymesh.protocol.backoff import BACKOFF_MAX_S, backoff_s
from psymesh.discovery.table import SeenTable
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.core.db import open_db
from psymesh.node.core.home import NodeConfig, NodeHome
from psymesh.node.control.process import DaemonProcess
from psymesh.node.door.trust import TrustStore
from psymesh.protocol import control as c
from psymesh.protocol.errors import ErrorCode, NetworkTimeout, ProtocolError, PsymeshError
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.messages import pack, unpack
from waiting import wait_until

PEER = peer_id_from_public_key(bytes(range(32)))
OTHER = peer_id_from_public_key(bytes(range(1, 33)))
RSA_PEER = "QmNPubsDWATVngE3d5WDSNe7eVrFLuk38qb9t6vdLnu2aK"  # js-libp2p's README example


def addr(ip: str, port: int = 4001, peer: str = PEER) -> str:
    return f"/ip4/{ip}/tcp/{port}/p2p/{peer}"


def announcements(packet: bytes) -> list[Announcement | None]:
    """What psymesh reads out of one mDNS packet, parsed by zeroconf (as the daemon's cache does)."""
    records = DNSIncoming(packet).answers()
    instances = [r.alias for r in records if isinstance(r, DNSPointer) and r.name.lower() == SERVICE_TYPE]
    return [parse_announcement([r.text for r in records if isinstance(r, DNSText) and r.name.lower() == i.lower()])
            for i in instances]


# ------------------------------------------------------------------------------ the record


def test_our_record_is_one_dnsaddr_string_per_address_and_reads_back() -> None:
    addrs = [addr("192.168.1.20"), addr("10.0.0.7", 4002)]
    data = encode_txt(addrs)
    assert txt_strings(data) == [f"dnsaddr={a}".encode() for a in addrs]
    assert parse_announcement([data]) == Announcement(PEER, tuple(addrs))


def test_instance_names_are_random_lowercase_labels_of_32_to_63_characters() -> None:
    names = {instance_label() for _ in range(200)}
    assert len(names) == 200
    assert all(32 <= len(n) <= 63 and n.isalnum() and n == n.lower() and n.isascii() for n in names)
    assert {len(n) for n in names} != {32}  # the length varies too, as in rust-libp2p


def test_what_we_announce_leaves_out_loopback_and_wildcards_and_names_us() -> None:
    listening = [f"/ip4/192.168.1.20/tcp/4001/p2p/{PEER}", f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}",
                 "/ip4/0.0.0.0/tcp/4001", "/ip6/::1/tcp/4001", "/ip4/10.0.0.7/tcp/4001"]
    assert advertised(listening, PEER) == [addr("192.168.1.20"), addr("10.0.0.7")]
    assert advertised([f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"], PEER) == []  # loopback only: nothing


def test_a_rust_libp2p_response_is_read() -> None:
    """rust-libp2p: PTR answer, one TXT record per address in the additional section, with
    the cache-flush bit, under a random mixed-case instance name."""
    addrs = [addr("192.168.1.30", 4001, OTHER), f"/ip4/192.168.1.30/udp/4001/quic-v1/p2p/{OTHER}"]
    packet = mdns_peer.rust_response("AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", addrs)
    assert announcements(packet) == [Announcement(OTHER, tuple(addrs))]


def test_a_js_libp2p_response_is_read_and_its_loopback_address_dropped() -> None:
    """js-libp2p: the PTR and every TXT record in the answer section; it sends loopback too."""
    addrs = [addr("192.168.1.40", 4001, RSA_PEER), addr("127.0.0.1", 4001, RSA_PEER)]
    packet = mdns_peer.js_response("x" * 40, addrs)
    assert announcements(packet) == [Announcement(RSA_PEER, (addrs[0],))]


def test_py_libp2p_dnsaddr2_keys_are_ignored() -> None:
    """py-libp2p 0.8.1 writes dnsaddr=, dnsaddr2=, ...: only the first is a dnsaddr."""
    data = mdns_peer.py_libp2p_txt([addr("192.168.1.50"), addr("192.168.1.51"), addr("192.168.1.52")], PEER)
    assert parse_announcement([data]) == Announcement(PEER, (addr("192.168.1.50"),))


def test_strings_that_are_not_a_dnsaddr_of_the_first_peer_are_skipped() -> None:
    strings = [b"", b"dnsaddr", b"other=1", "dnsaddr=/ip4/192.168.1.9/tcp/1/p2p/ünïcode".encode(),
               b"dnsaddr=/ip4/192.168.1.9/tcp/1", b"dnsaddr=/ip4/192.168.1.9/tcp/1/p2p/not-base58-0OIl",
               f"DNSADDR={addr('192.168.1.9')}".encode(), f"dnsaddr={addr('192.168.1.10', peer=OTHER)}".encode(),
               f"dnsaddr={addr('0.0.0.0')}".encode()]
    data = b"".join(bytes([len(s)]) + s for s in strings) + b"\xff truncated"
    assert parse_announcement([data]) == Announcement(PEER, (addr("192.168.1.9"),))
    assert parse_announcement([b"", b"\x05dnsad", encode_txt([addr("127.0.0.1")])]) is None


def test_one_announcement_holds_at_most_max_addrs() -> None:
    many = [encode_txt([addr(f"10.0.{i // 250}.{i % 250 + 1}")]) for i in range(1000)]
    assert len(parse_announcement(many).addrs) == MAX_ADDRS  # type: ignore[union-attr]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=8))
def test_any_bytes_parse_without_raising(records: list[bytes]) -> None:
    result = parse_announcement(records)
    assert result is None or all(a.endswith(f"/p2p/{result.peer_id}") for a in result.addrs)


def test_only_tcp_addresses_on_a_real_ip_are_dialable() -> None:
    assert dialable(addr("192.168.1.20"))
    assert dialable(f"/ip6/fd00::1/tcp/4001/p2p/{PEER}")
    for bad in (addr("127.0.0.1"), addr("0.0.0.0"), addr("224.0.0.251"), addr("192.168.1.20", 0),
                addr("192.168.1.20", 70000), f"/ip4/192.168.1.20/udp/4001/quic-v1/p2p/{PEER}",
                f"/ip6/192.168.1.20/tcp/4001/p2p/{PEER}", "/ip4/192.168.1.20/tcp/4001", f"/dns4/home/tcp/1/p2p/{PEER}"):
        assert not dialable(bad), bad


def test_the_discovery_package_imports_only_protocol_of_ours() -> None:
    """The daemon hands discovery the p2p host and the trust store; it never reaches into node/."""
    for path in (Path(__file__).parent.parent / "discovery").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                assert not name.startswith(("psymesh.node", "psymesh.agent", "libp2p")), f"{path.name} imports {name}"


def test_the_discover_reply_survives_the_wire_as_itself() -> None:
    reply = c.DiscoverReply(mdns=True, announced=[addr("192.168.1.2")], static_peers=1, nodes=[
        c.SeenNode(peer_id=PEER, fingerprint="MMG4-2KLG-YQZW-NEIS", addrs=[addr("192.168.1.20")], source="mdns",
                   first_seen=1.0, last_seen=2.0, paired=True, name="home")])
    again = unpack(pack(reply))
    assert again == reply and type(again) is c.DiscoverReply and again.nodes[0].source == "mdns"


# ------------------------------------------------------------------------- the seen table


def test_the_table_keeps_the_latest_addresses_and_is_bounded() -> None:
    table = SeenTable(max_nodes=3)
    table.saw("p1", ("a1",), "mdns", now=1.0)
    table.saw("p1", ("a2",), "mdns", now=5.0)
    seen = table.get("p1")
    assert seen is not None and (seen.addrs, seen.first_seen, seen.last_seen) == (("a2",), 1.0, 5.0)
    for i, peer in enumerate(["p2", "p3", "p4"]):
        table.saw(peer, (), "mdns", now=10.0 + i)
    assert [s.peer_id for s in table.all()] == ["p4", "p3", "p2"]  # p1, seen least recently, went first
    table.saw("p3", (), "static", now=20.0)
    table.forget("p3", "mdns")  # it was last seen another way: kept
    table.forget("p4", "mdns")
    assert [s.peer_id for s in table.all()] == ["p3", "p2"]


def test_backoff_doubles_up_to_five_minutes_with_jitter() -> None:
    assert [backoff_s(n, 0.0) for n in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff_s(50, 0.0) == BACKOFF_MAX_S == 300.0
    assert backoff_s(3, 0.999) == pytest.approx(4.004)


def test_static_peers_must_be_dialable_multiaddrs_of_another_node() -> None:
    assert check_static_peers([addr("192.168.1.20"), addr("192.168.1.20")], OTHER) == [(addr("192.168.1.20"), PEER)]
    for bad, words in ((["192.168.1.20:4001"], "not an /ip4/ or /ip6/ multiaddr"),
                       (["/ip4/192.168.1.20/tcp/4001"], "ending in /p2p/"),
                       ([addr("192.168.1.20", peer=RSA_PEER)], "ending in /p2p/"),
                       ([addr("192.168.1.20")], "this node itself"),
                       ([addr("10.0.0.1", p) for p in range(1, 66)], "at most 64")):
        with pytest.raises(PsymeshError, match=words) as info:
            check_static_peers(bad, PEER)
        assert info.value.code is ErrorCode.BAD_REQUEST


def test_a_bad_static_peer_stops_the_node_from_starting_with_a_clear_error(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "n")
    home.init(name="n")
    with pytest.raises(PsymeshError, match="static_peers: '192.168.1.20:4001'"):
        Node(home, home.load_config().model_copy(update={"static_peers": ["192.168.1.20:4001"]}))


# --------------------------------------- following a paired peer: the rule, with a real trust store


class _Host:
    """The p2p host as discovery sees it; who answers where is set by the test."""

    def __init__(self) -> None:
        self.live: dict[str, str] = {}      # peer id -> remote IP of its open connection
        self.answers: dict[str, str] = {}   # address -> the peer id whose key proves itself there
        self.dialed: list[str] = []
        self.stale: set[str] = set()       # peers whose open connection no longer answers
        self.probed: list[str] = []

    def addrs(self) -> list[str]:
        return []

    def remote_ip(self, peer_id: str) -> str | None:
        return self.live.get(peer_id)

    async def disconnect(self, peer_id: str) -> None:
        self.live.pop(peer_id, None)

    async def probe(self, peer_id: str) -> None:
        """A ping on the peer's open connection: answered unless the test made it stale."""
        self.probed.append(peer_id)
        if peer_id in self.stale:
            raise NetworkTimeout(f"{peer_id} did not answer ping")

    async def connect(self, address: str) -> str:
        self.dialed.append(address)
        if self.answers.get(address) != address.rsplit("/", 1)[1]:
            raise ProtocolError(f"cannot connect to {address}", code=ErrorCode.UNAVAILABLE)
        self.live[self.answers[address]] = address.split("/")[2]
        return self.answers[address]


@pytest.fixture
def follow(tmp_path: Path) -> Iterator[tuple[Discovery, _Host, TrustStore, list[float]]]:
    db = open_db(tmp_path / "node.db")
    trust = TrustStore(db)
    trust.add(PEER, name="phone", role="phone", addrs=[addr("192.168.1.20")], granted=None, received=None)
    host, now = _Host(), [1000.0]
    discovery = Discovery(OTHER, mdns=True, static_peers=[], host=host, peers=trust, probe=host.probe,
                          clock=lambda: now[0])
    yield discovery, host, trust, now
    db.close()


@pytest.mark.anyio
async def test_a_moved_peer_is_stored_at_its_new_address_once_a_dial_proves_it(follow) -> None:
    discovery, host, trust, _ = follow
    host.answers[addr("192.168.1.77")] = PEER
    discovery.table.saw(PEER, (addr("192.168.1.66"), addr("192.168.1.77")), "mdns", 1000.0)
    assert await discovery._follow_one(PEER)
    assert host.dialed == [addr("192.168.1.66"), addr("192.168.1.77")]
    assert trust.get(PEER).addrs == (addr("192.168.1.77"), addr("192.168.1.66"), addr("192.168.1.20"))


@pytest.mark.anyio
async def test_an_announcement_nobody_proves_never_reaches_the_trust_store(follow) -> None:
    discovery, host, trust, now = follow
    discovery.table.saw(PEER, (addr("192.168.1.66"),), "mdns", 1000.0)  # a liar: nobody answers as PEER there
    assert not await discovery._follow_one(PEER)
    assert not await discovery._follow_one(PEER)  # not again before RETRY_S
    assert host.dialed == [addr("192.168.1.66")]
    now[0] += RETRY_S
    assert not await discovery._follow_one(PEER)
    assert len(host.dialed) == 2 and trust.get(PEER).addrs == (addr("192.168.1.20"),)
    for _ in range(MAX_CHECKS - 3):
        now[0] += RETRY_S
        assert not await discovery._follow_one(PEER)
    now[0] += RETRY_S
    assert await discovery._follow_one(PEER)  # MAX_CHECKS: given up until the next announcement
    assert len(host.dialed) == MAX_CHECKS and trust.get(PEER).addrs == (addr("192.168.1.20"),)


@pytest.mark.anyio
async def test_a_live_connection_from_an_announced_ip_vouches_for_it(follow) -> None:
    discovery, host, trust, _ = follow
    host.live[PEER] = "192.168.1.66"  # it called us from the announced address: no dial, no ping
    discovery.table.saw(PEER, (addr("192.168.1.66"),), "mdns", 1000.0)
    assert await discovery._follow_one(PEER)
    assert (host.dialed, host.probed) == ([], [])
    assert trust.get(PEER).addrs == (addr("192.168.1.66"), addr("192.168.1.20"))


@pytest.mark.anyio
async def test_a_connection_that_still_answers_is_never_dropped_on_an_announcements_word(follow) -> None:
    discovery, host, trust, now = follow
    host.live[PEER] = "192.168.1.20"  # connected at the stored address, and it answers: the claim waits
    discovery.table.saw(PEER, (addr("192.168.1.66"),), "mdns", 1000.0)
    assert not await discovery._follow_one(PEER)
    assert not await discovery._follow_one(PEER)  # asked again no sooner than RETRY_S
    assert (host.probed, host.dialed, host.live) == ([PEER], [], {PEER: "192.168.1.20"})
    assert trust.get(PEER).addrs == (addr("192.168.1.20"),)

    host.stale.add(PEER)  # now it moved (a new lease) and the old connection is dead
    host.answers[addr("192.168.1.66")] = PEER
    now[0] += RETRY_S
    assert await discovery._follow_one(PEER)
    assert host.probed == [PEER, PEER] and host.dialed == [addr("192.168.1.66")]
    assert host.live == {PEER: "192.168.1.66"}
    assert trust.get(PEER).addrs == (addr("192.168.1.66"), addr("192.168.1.20"))


@pytest.mark.anyio
async def test_unpaired_and_revoked_nodes_are_listed_but_never_followed(follow) -> None:
    discovery, host, trust, _ = follow
    discovery.table.saw(RSA_PEER, (addr("192.168.1.5", peer=RSA_PEER),), "mdns", 1000.0)
    trust.revoke(PEER)
    discovery.table.saw(PEER, (addr("192.168.1.66"),), "mdns", 1000.0)
    assert await discovery._follow_one(RSA_PEER) and await discovery._follow_one(PEER)
    assert host.dialed == []
    reply = await discovery.discovered()
    assert [(n.peer_id, n.paired, n.fingerprint is None) for n in reply.nodes] == [(PEER, False, False),
                                                                                  (RSA_PEER, False, True)]


# ------------------------------------------------------------- network namespaces of our own


@dataclass
class Lan:
    """Two network namespaces joined by a veth pair: `a` (10.77.0.1, link `lana`) and `b`
    (10.77.0.2, link `lanb`), each with its own loopback, multicast routed onto the link."""

    a: str
    b: str

    @staticmethod
    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def move_b(self, old: str, new: str) -> None:
        """b's address changes, as a new DHCP lease would change it."""
        self.ip("-n", self.b, "addr", "del", f"{old}/24", "dev", "lanb")
        self.ip("-n", self.b, "addr", "add", f"{new}/24", "dev", "lanb")


@pytest.fixture
def lan() -> Iterator[Lan]:
    if (reason := netns_refusal()) is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    tag = secrets.token_hex(3)
    net = Lan(f"psy{tag}a", f"psy{tag}b")
    made: list[str] = []
    try:
        for ns in (net.a, net.b):
            Lan.ip("netns", "add", ns)
            made.append(ns)
        Lan.ip("link", "add", "lana", "netns", net.a, "type", "veth", "peer", "name", "lanb", "netns", net.b)
        for ns, dev, ip in ((net.a, "lana", "10.77.0.1"), (net.b, "lanb", "10.77.0.2")):
            Lan.ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            Lan.ip("-n", ns, "link", "set", "lo", "up")
            Lan.ip("-n", ns, "link", "set", dev, "up")
            Lan.ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)
        yield net
    finally:
        for ns in made:  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


class NetnsDaemon(DaemonProcess):
    """A daemon process inside a network namespace, with mDNS on, listening on every address
    there. Its control socket is a file, so the test (outside) drives it as usual."""

    def __init__(self, netns: str, home: Path, name: str) -> None:
        node_home = NodeHome(home)
        node_home.init(name=name)
        node_home.save_config(node_home.load_config().model_copy(update={"mdns": True}))
        super().__init__(home, name=name, listen=["/ip4/0.0.0.0/tcp/0"])
        self.netns = netns

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *super().command()]


@contextlib.asynccontextmanager
async def daemons(*procs: DaemonProcess) -> AsyncIterator[None]:
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True):
            for proc in procs:
                if proc.proc is not None:
                    await proc.stop()


async def discovered(home: Path) -> list:
    async with Client(home) as client:
        return (await client.discovered()).nodes


async def lists(home: Path, peer_id: str, fingerprint: str, *, paired: bool = False) -> bool:
    return any(n.peer_id == peer_id and n.fingerprint == fingerprint and n.paired == paired
               for n in await discovered(home))


def lan_addr(status, prefix: str) -> str:
    return next(a for a in status.addrs if a.startswith(prefix))


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "psymesh", *args, "--home", str(home)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})  # tables unwrapped


@pytest.mark.netns
@pytest.mark.anyio
async def test_two_daemons_on_a_lan_see_each_other_with_their_fingerprints(lan: Lan, tmp_path: Path) -> None:
    a = NetnsDaemon(lan.a, tmp_path / "a", "a")
    b = NetnsDaemon(lan.b, tmp_path / "b", "b")
    async with daemons(a, b):
        sa, sb = await a.start(), await b.start()
        await wait_until(lambda: lists(a.home, sb.peer_id, sb.fingerprint), "a lists b", timeout=30)
        await wait_until(lambda: lists(b.home, sa.peer_id, sa.fingerprint), "b lists a", timeout=30)

        done = await anyio.to_thread.run_sync(lambda: cli(a.home, "discover", "--json"))
        assert done.returncode == 0, done.stderr
        rows = json.loads(done.stdout)
        assert [(r["peer_id"], r["fingerprint"], r["source"], r["paired"], r["name"]) for r in rows] == [
            (sb.peer_id, sb.fingerprint, "mdns", False, None)]
        assert rows[0]["addrs"] == [lan_addr(sb, "/ip4/10.77.0.2/")]  # the LAN address only, never loopback
        human = await anyio.to_thread.run_sync(lambda: cli(a.home, "discover"))
        assert sb.fingerprint in human.stdout and "not paired" in human.stdout


@pytest.mark.netns
@pytest.mark.anyio
async def test_a_paired_peer_that_moves_is_followed_without_pairing_again(lan: Lan, tmp_path: Path) -> None:
    a = NetnsDaemon(lan.a, tmp_path / "a", "a")
    b = NetnsDaemon(lan.b, tmp_path / "b", "b")
    async with daemons(a, b):
        await a.start()
        sb = await b.start()
        await pair(a.home, b.home)
        await wait_until(lambda: lists(a.home, sb.peer_id, sb.fingerprint, paired=True), "a lists b as paired",
                         timeout=30)

        await b.stop()
        lan.move_b("10.77.0.2", "10.77.0.3")  # a new lease
        moved = await b.start()               # and a new port (tcp/0)
        new = lan_addr(moved, "/ip4/10.77.0.3/")

        await wait_until(lambda: stored_first(a.home, sb.peer_id, new), "a's trust store follows b to its new address",
                         timeout=30)
        await pings(a.home, "b", sb.peer_id)


@pytest.mark.netns
@pytest.mark.anyio
async def test_a_paired_peer_whose_lease_changes_while_it_runs_is_followed(lan: Lan, tmp_path: Path) -> None:
    """b keeps running and gets a new address; a still holds the connection from b's old one,
    dead now: b announces again, a finds that connection silent, drops it and dials b anew."""
    a = NetnsDaemon(lan.a, tmp_path / "a", "a")
    b = NetnsDaemon(lan.b, tmp_path / "b", "b")
    async with daemons(a, b):
        await a.start()
        sb = await b.start()
        await pair(a.home, b.home)
        await wait_until(lambda: lists(a.home, sb.peer_id, sb.fingerprint, paired=True), "a lists b as paired",
                         timeout=30)
        async with Client(a.home) as client:
            assert sb.peer_id in [p.peer_id for p in (await client.status()).connected_peers]

        lan.move_b("10.77.0.2", "10.77.0.3")  # a new lease, under the running daemon
        new = lan_addr(sb, "/ip4/10.77.0.2/").replace("/ip4/10.77.0.2/", "/ip4/10.77.0.3/")
        await wait_until(lambda: stored_first(a.home, sb.peer_id, new), "a's trust store follows b to its new address",
                         timeout=60)
        await pings(a.home, "b", sb.peer_id)


async def stored_first(home: Path, peer_id: str, expected: str) -> bool:
    """Whether the trust store of the node at `home` lists `expected` first for `peer_id`."""
    async with Client(home) as client:
        return next(p for p in await client.peers() if p.peer_id == peer_id).addrs[:1] == [expected]


async def pings(home: Path, name: str, peer_id: str) -> None:
    """The node at `home` reaches its paired peer `name`, still paired, no pairing again."""
    async with Client(home) as client:
        pong = await client.ping(name, count=2)
        assert pong.peer_id == peer_id and len(pong.rtts_ms) == 2
        assert [p.revoked_at for p in await client.peers()] == [None]


@pytest.mark.netns
@pytest.mark.anyio
async def test_rust_and_js_libp2p_announcements_are_listed(lan: Lan, tmp_path: Path) -> None:
    """Packets byte for byte as rust-libp2p and js-libp2p send them, from the other namespace."""
    a = NetnsDaemon(lan.a, tmp_path / "a", "a")
    rust_addrs = [addr("10.77.0.2", 4001, OTHER), f"/ip4/10.77.0.2/udp/4001/quic-v1/p2p/{OTHER}"]
    js_addrs = [addr("10.77.0.2", 4002, RSA_PEER), addr("127.0.0.1", 4002, RSA_PEER)]
    async with daemons(a):
        await a.start()

        async def announced() -> bool:
            async with Client(a.home) as client:
                return bool((await client.discovered()).announced)

        await wait_until(announced, "a announces itself (its zeroconf runs)", timeout=30)

        def send(kind: str, addrs: list[str]) -> None:
            subprocess.run(["ip", "netns", "exec", lan.b, sys.executable, mdns_peer.__file__, "announce", kind,
                            secrets.token_hex(20), *addrs], check=True, timeout=30,
                           env={**os.environ, "MDNS_PEER_IP": "10.77.0.2"})

        async def heard() -> bool:
            await anyio.to_thread.run_sync(send, "rust", rust_addrs)
            await anyio.to_thread.run_sync(send, "js", js_addrs)
            found = {n.peer_id: n for n in await discovered(a.home)}
            return OTHER in found and RSA_PEER in found

        await wait_until(heard, "a lists the rust and the js peer", timeout=30)
        found = {n.peer_id: n for n in await discovered(a.home)}
        assert found[OTHER].addrs == rust_addrs and found[OTHER].fingerprint is not None
        assert found[RSA_PEER].addrs == js_addrs[:1] and found[RSA_PEER].fingerprint is None  # not an Ed25519 id


@pytest.mark.netns
@pytest.mark.anyio
async def test_rust_and_js_libp2p_read_our_answer_to_their_query(lan: Lan, tmp_path: Path) -> None:
    a = NetnsDaemon(lan.a, tmp_path / "a", "a")
    async with daemons(a):
        sa = await a.start()
        ours = [lan_addr(sa, "/ip4/10.77.0.1/")]

        async def they_read_us() -> bool:
            done = await anyio.to_thread.run_sync(lambda: subprocess.run(
                ["ip", "netns", "exec", lan.b, sys.executable, mdns_peer.__file__, "query", "1.5"], check=True,
                timeout=30, capture_output=True, text=True, env={**os.environ, "MDNS_PEER_IP": "10.77.0.2"}))
            heard = json.loads(done.stdout)
            return all(ours in heard[reader].values() for reader in ("rust", "js"))

        await wait_until(they_read_us, "a rust and a js reader find a's address in its answer", timeout=45)


# ------------------------------------------------------------------- static peers (loopback)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """An in-process daemon that can be stopped on its own, and started again."""

    def __init__(self, tg: anyio.abc.TaskGroup, home: NodeHome, config: NodeConfig) -> None:
        self.tg, self.home, self.config = tg, home, config
        self.node: Node | None = None
        self._scope: anyio.CancelScope | None = None
        self._stopped = anyio.Event()

    async def start(self) -> Node:
        self.node, self._scope, self._stopped = Node(self.home, self.config), anyio.CancelScope(), anyio.Event()
        await self.tg.start(self._run, self.node, self._scope, self._stopped)
        return self.node

    @staticmethod
    async def _run(node: Node, scope: anyio.CancelScope, stopped: anyio.Event, *,
                   task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            with scope:
                await node.run(task_status=task_status)
        finally:
            stopped.set()

    async def stop(self) -> None:
        assert self._scope is not None
        self._scope.cancel()
        await self._stopped.wait()


def _home(tmp_path: Path, name: str, **config: object) -> tuple[NodeHome, NodeConfig]:
    home = NodeHome(tmp_path / name)
    home.init(name=name)
    return home, home.load_config().model_copy(update=config)


@pytest.mark.anyio
async def test_a_static_peer_is_dialed_at_start_and_again_after_it_restarts(tmp_path: Path) -> None:
    port = _free_port()
    b_home, b_config = _home(tmp_path, "b", listen=[f"/ip4/127.0.0.1/tcp/{port}"])
    async with anyio.create_task_group() as tg:
        b = Running(tg, b_home, b_config)
        b_node = await b.start()
        b_id = b_node.identity.peer_id
        a_home, a_config = _home(tmp_path, "a", listen=["/ip4/127.0.0.1/tcp/0"],
                                 static_peers=[f"/ip4/127.0.0.1/tcp/{port}/p2p/{b_id}"])
        assert not a_config.mdns  # mDNS is off unless turned on
        a = Running(tg, a_home, a_config)
        a_node = await a.start()
        a_id = a_node.identity.peer_id

        await wait_until(lambda: b_node.p2p.remote_ip(a_id) is not None, "a dials b at start")
        # b sees the connection a moment before a's dial returns and a records the sighting
        await wait_until(lambda: a_node.discovery.table.get(b_id) is not None, "a records where it reached b")
        async with Client(a_home.path) as client:
            reply = await client.discovered()
        assert (reply.mdns, reply.announced, reply.static_peers) == (False, [], 1)
        assert [(n.peer_id, n.fingerprint, n.source, n.addrs) for n in reply.nodes] == [
            (b_id, b_node.identity.fingerprint, "static", a_config.static_peers)]

        await b.stop()
        await wait_until(lambda: a_node.p2p.remote_ip(b_id) is None, "a notices b is gone")
        b_again = await b.start()
        await wait_until(lambda: b_again.p2p.remote_ip(a_id) is not None, "a dials b again", timeout=30)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_paired_static_peer_is_stored_at_its_configured_address(tmp_path: Path) -> None:
    """Paired on one port, then b moves to another; a's config names the new one: a dials it,
    stores it first, and the next request reaches b there, unpaired again never."""
    new_port = _free_port()
    b_home, b_config = _home(tmp_path, "b", listen=["/ip4/127.0.0.1/tcp/0"])
    a_home, a_config = _home(tmp_path, "a", listen=["/ip4/127.0.0.1/tcp/0"])
    async with anyio.create_task_group() as tg:
        a, b = Running(tg, a_home, a_config), Running(tg, b_home, b_config)
        await a.start()
        b_node = await b.start()
        b_id = b_node.identity.peer_id
        await pair(a_home.path, b_home.path)
        await a.stop()
        await b.stop()

        moved = f"/ip4/127.0.0.1/tcp/{new_port}/p2p/{b_id}"
        b.config = b_config.model_copy(update={"listen": [f"/ip4/127.0.0.1/tcp/{new_port}"]})
        a.config = a_config.model_copy(update={"static_peers": [moved]})
        await b.start()
        a_node = await a.start()
        await wait_until(lambda: a_node.trust.get(b_id).addrs[:1] == (moved,), "a stores b at its static address")
        async with Client(a_home.path) as client:
            assert (await client.ping("b", count=1)).peer_id == b_id
            assert [(n.peer_id, n.paired, n.name) for n in (await client.discovered()).nodes] == [(b_id, True, "b")]
        tg.cancel_scope.cancel()
