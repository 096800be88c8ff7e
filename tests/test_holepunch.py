"""Hole punching (DCUtR) between paired peers that reach each other through a relay.

On loopback (P2PNode on 127.0.0.1): the DCUtR exchange over a real relayed connection,
the address the relay tells each side it sees, and the roles on the connection it makes.
In network namespaces of our own, behind two real NATs (nftables masquerade in two router
namespaces that drop unsolicited inbound packets, as home routers do): home keeps a
reservation at a public relay, the phone reaches home through it, and with `[relay]
hole_punch` on both ends punch through their NATs to a direct connection that carries a
delegated task; with it off, the path stays relayed.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pair, run_nodes
from netns import Namespaces, NetnsDaemon, namespaces  # noqa: F401  (a fixture, used by name)
from p2p_helpers import PING, new_node, running
from test_p2p import ping, relay_node, relayed
from test_relay import ROOMY, connection_to, daemons, home_with
from waiting import wait_until
from worktool import TOOL_NAME, tool_log, tool_runs  # noqa: F401  (tool_log: a fixture)
from psymesh.node.daemon import Node
from psymesh.node.net.p2p import P2PNode
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.relay import DCUTR, HOLE_PUNCH, RelaySettings

pytestmark = pytest.mark.anyio


def punching_node() -> P2PNode:
    node = new_node()
    node.enable_hole_punch()
    return node


def direction(node: P2PNode, peer_id: str) -> str:
    """Whether `node`'s direct connection to `peer_id` is one it dialed or one it accepted."""
    conns = node._connections(peer_id, direct=True)
    assert len(conns) == 1, conns
    return conns[0].direction.name.lower()


# ------------------------------------------------------------- on loopback
async def test_dcutr_over_a_relayed_connection_ends_in_a_direct_one() -> None:
    relay, home, phone = relay_node(), punching_node(), punching_node()
    async with running(relay, home, phone):
        await relayed(relay, home, phone)
        # Home holds the reservation and the phone dialed the circuit: home is DCUtR's `B`.
        assert home.relayed_inbound(phone.peer_id) and not phone.relayed_inbound(home.peer_id)
        # The relay told each side where it sees it from; home dialed the relay from its
        # listening port (so that is what the relay saw), the phone is told what it used.
        home_port = home._listen_source()[1]
        assert home._observed == {relay.peer_id: f"/ip4/127.0.0.1/tcp/{home_port}"}
        assert list(phone._observed) == [relay.peer_id]
        assert phone._observed[relay.peer_id] in phone._punch_addrs()

        # The side that dialed the circuit does not start: the other refuses the roles.
        assert not await phone.hole_punch(home.peer_id)
        assert phone.path(home.peer_id) == "relayed"

        assert await home.hole_punch(phone.peer_id)
        assert home.path(phone.peer_id) == "direct" and phone.path(home.peer_id) == "direct"
        # DCUtR's roles, whoever's SYN won: the phone (it dialed the circuit) is the client.
        assert direction(phone, home.peer_id) == "outbound" and direction(home, phone.peer_id) == "inbound"
        assert await phone.drop_relayed(home.peer_id, idle_only=True)
        assert (await ping(phone, home.peer_id)).seq == 0
        assert (await ping(home, phone.peer_id, seq=1)).seq == 1


async def test_a_peer_without_hole_punching_keeps_the_relayed_path() -> None:
    relay, home, phone = relay_node(), punching_node(), new_node()
    async with running(relay, home, phone):
        await relayed(relay, home, phone)
        assert not await home.hole_punch(phone.peer_id)  # the phone answers DCUtR with `na`
        assert phone.path(home.peer_id) == "relayed" and home.path(phone.peer_id) == "relayed"
        assert (await ping(phone, home.peer_id)).seq == 0
        assert not await phone.hole_punch(home.peer_id)  # hole punching off here: nothing tried


async def test_the_gate_admits_dcutr_from_paired_peers_only_with_one_audit_row_each(tmp_path: Path) -> None:
    home_with(tmp_path / "home", "home", RelaySettings(hole_punch=True))
    async with run_nodes(tmp_path, "home", "phone", "stranger") as nodes:
        home, phone, stranger = nodes["home"], nodes["phone"], nodes["stranger"]
        await pair(home.home.path, phone.home.path, grant="messaging")
        with pytest.raises(PsymeshError):
            await stranger.p2p.open_stream(home.p2p.addrs()[0], DCUTR)

        def rows(peer: Node) -> list[tuple[str, str, bool, str | None]]:
            return [(r["protocol"], r["operation"], r["allowed"], r["code"])
                    for r in home.audit.query(peer_id=peer.identity.peer_id, limit=100) if r["protocol"] == DCUTR]

        assert rows(stranger) == [(DCUTR, HOLE_PUNCH, False, ErrorCode.UNKNOWN_PEER.value)]
        # A paired peer may run DCUtR over a relayed connection only: on this direct one the
        # door refuses it (nothing to punch), with one audit row (issue 19 item 6).
        with pytest.raises(PsymeshError):
            await phone.p2p.open_stream(home.p2p.addrs()[0], DCUTR)
        assert rows(phone) == [(DCUTR, HOLE_PUNCH, False, ErrorCode.BAD_REQUEST.value)]


# ------------------------------------------------------------- behind two NATs (nftables)
def nft_refusal() -> str | None:
    if shutil.which("nft") is None:
        return "nftables' `nft` is not installed (scripts/bootstrap.sh installs it as root)"
    return None


def run_in(ns: str, *command: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *command], check=True, capture_output=True, timeout=10)


def nat_router(ns: str, wan: str, ports: str | None) -> None:
    """Namespace `ns` forwards between its links and masquerades what leaves by `wan`, and
    drops packets arriving on `wan` that belong to no connection, as home routers do (it
    would otherwise answer a punching SYN that arrives first with a RST). `ports` None: the
    kernel keeps a source port when it is free, so home's listening port is mapped to itself.
    A range ("20000-29999"): every source port is changed, to the first port of the range free
    for that destination, so home's listening port is mapped to 20000 whatever the
    destination (endpoint-independent, but not the listening port: only the address the relay
    saw is right)."""
    run_in(ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    tcp = f'oifname "{wan}" meta l4proto tcp masquerade to :{ports}; ' if ports else ""
    rules = f"""
table ip nat {{
  chain postrouting {{ type nat hook postrouting priority srcnat; {tcp}oifname "{wan}" masquerade persistent; }}
}}
table ip filter {{
  chain input {{ type filter hook input priority filter; iifname "{wan}" ct state new drop; }}
  chain forward {{ type filter hook forward priority filter; iifname "{wan}" ct state new drop; }}
}}
"""
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, text=True, check=True,
                   capture_output=True, timeout=10)


def tcp_connect(ns: str, ip: str, port: int, timeout: float) -> str:
    """One plain TCP connect from namespace `ns`: `connected`, `refused` or `timeout`."""
    script = ("import socket,sys\n"
              "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])); print('connected')\n"
              "except ConnectionRefusedError: print('refused')\n"
              "except OSError: print('timeout')\n")
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", script, ip, str(port), str(timeout)],
                          capture_output=True, text=True, timeout=timeout + 10, check=True)
    return done.stdout.strip()


def behind_nats(namespaces: Namespaces, ports: str | None) -> tuple[str, str, str]:
    """The relay in a public namespace; home and phone each in a private one behind a NAT
    router of its own, whose WAN link goes to the public namespace (it routes between them)."""
    public, home_nat, phone_nat = namespaces.add("pub"), namespaces.add("hn"), namespaces.add("pn")
    home_ns, phone_ns = namespaces.add("h"), namespaces.add("p")
    namespaces.link(public, "10.72.1.1", home_nat, "10.72.1.2")
    namespaces.link(public, "10.72.2.1", phone_nat, "10.72.2.2")
    namespaces.link(home_nat, "192.168.71.1", home_ns, "192.168.71.2")
    namespaces.link(phone_nat, "192.168.72.1", phone_ns, "192.168.72.2")
    run_in(public, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    for router, gateway in ((home_nat, "10.72.1.1"), (phone_nat, "10.72.2.1")):
        run_in(router, "ip", "route", "add", "default", "via", gateway)
        nat_router(router, f"to{public[-8:]}", ports)
    run_in(home_ns, "ip", "route", "add", "default", "via", "192.168.71.1")
    run_in(phone_ns, "ip", "route", "add", "default", "via", "192.168.72.1")
    return public, home_ns, phone_ns


@pytest.mark.netns
@pytest.mark.parametrize(("hole_punch", "ports"), [(True, None), (False, None), (True, "20000-29999")],
                         ids=["hole_punch_on", "hole_punch_off", "hole_punch_on_symmetric_nats"])
async def test_home_and_phone_behind_nats_punch_through_to_a_direct_path(
        namespaces: Namespaces, tmp_path: Path, tool_log: Path, hole_punch: bool, ports: str | None) -> None:
    """Port-keeping NATs: punched through, with hole punching on. NATs that give every
    connection a port of their own (Linux picks a random one in the range per destination:
    symmetric NATs) cannot be punched: home tries, fails, tries again later, and the relay
    carries the traffic all along."""
    if (reason := nft_refusal()) is not None:
        pytest.skip(f"no NAT test bed here: {reason}")
    public, home_ns, phone_ns = behind_nats(namespaces, ports)
    relay_id = home_with(tmp_path / "relay", "relay", RelaySettings(enabled=True)).init().peer_id
    quick = {"direct_retry_s": 1.0, "overlap_s": 2.0, "hole_punch": hole_punch}
    home_with(tmp_path / "home", "home", RelaySettings(relays=[relay_id], **quick))
    home_with(tmp_path / "phone", "phone", RelaySettings(**quick), profile="phone")
    relay = NetnsDaemon(public, tmp_path / "relay", "relay")
    home = NetnsDaemon(home_ns, tmp_path / "home", "home")
    phone = NetnsDaemon(phone_ns, tmp_path / "phone", "phone", profile="phone")

    async with daemons(relay, home, phone), relay.client() as r, home.client() as h, phone.client() as p:
        status = await h.status()
        home_id = status.peer_id
        home_port = int(next(a for a in status.addrs if a.startswith("/ip4/192.168.71.2/")).split("/")[4])
        # The NATs are real: nothing from outside gets through home's unasked, not even to the
        # port home listens on (its SYN is dropped, as home routers do: no answer at all).
        assert tcp_connect(phone_ns, "10.72.1.2", home_port, timeout=1.0) == "timeout"
        await pair(relay.home, home.home, grant="messaging")
        await pair(relay.home, phone.home, grant="messaging")
        await r.grant("home", ["relay"])
        await r.grant("phone", ["relay"])

        async def relayed_addrs() -> list[str]:
            return [a for a in (await h.status()).addrs if "/p2p-circuit/" in a]

        await wait_until(relayed_addrs, "home's reservation at the relay", timeout=40)
        invite = await h.pair_invite()
        await p.pair_join(invite.invite, grant="messaging")  # through the relay: no other way in
        await h.grant("phone", ["tool:testwork.*"], limits=ROOMY)

        async def asked() -> int:
            """DCUtR exchanges home started with the phone (the phone's gate audits each)."""
            rows = [row for row in await p.audit(peer="home") if row.operation == HOLE_PUNCH]
            assert all(row.allowed for row in rows)
            return len(rows)

        async def direct_only() -> bool:
            addrs = await connection_to(p, home_id)
            return bool(addrs) and not any("/p2p-circuit/" in a for a in addrs)

        punched = hole_punch and ports is None
        if punched:
            await wait_until(direct_only, "a direct connection, punched through both NATs", timeout=40)
            assert await asked() >= 1
        elif hole_punch:  # a second exchange starts only once the first one's rounds all failed
            async def asked_twice() -> bool:
                return await asked() >= 2

            await wait_until(asked_twice, "home to give up a hole punch and try again", timeout=60)
        task = await p.delegate("home", tool=TOOL_NAME, args={"tag": "task", "ms": 0})
        assert (await task.result())["tag"] == "task"
        addrs = await connection_to(p, home_id)
        if punched:
            # To home's NAT (the address the relay saw home at), and home sees the phone's NAT.
            assert addrs and all(a.startswith("/ip4/10.72.1.2/tcp/") for a in addrs), addrs
            from_phone = await connection_to(h, (await p.status()).peer_id)
            assert from_phone and all(a.startswith("/ip4/10.72.2.2/tcp/") for a in from_phone), from_phone
        else:
            assert addrs and all("/p2p-circuit/" in a for a in addrs), addrs
            assert hole_punch or await asked() == 0
    assert tool_runs(tool_log) == {"start task": 1, "done task": 1}
