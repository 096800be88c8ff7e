"""`psymesh doctor`: each check with its status and next step. A listen port another
socket holds; a peer whose clock is two minutes ahead (two real daemons, one told by the
test-only PSYMESH_CLOCK_OFFSET_S to say so in its pongs); a dial-back that reaches us and one
that cannot; the disk nearly full (an injected disk_usage); a broken database and a key
others may read; the --json shape and the exit status."""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.node.control import doctor
from psymesh.node.control.client import Client
from psymesh.node.core.home import NodeHome
from psymesh.node.net.ping import CLOCK_OFFSET_ENV, clock_skew
from psymesh.node.control.process import DaemonProcess
from psymesh.protocol import control as c
from psymesh.protocol.dialback import DialBack, DialBackReply

REPO = Path(__file__).resolve().parent.parent


async def cli_doctor(home: Path, *args: str) -> tuple[int, dict[str, Any]]:
    done = await anyio.run_process([sys.executable, "-m", "psymesh", "doctor", "--home", str(home), "--json", *args],
                                   check=False, cwd=REPO)
    return done.returncode, json.loads(done.stdout.decode())


def by_name(checks: list[doctor.Check] | list[dict[str, Any]], name: str) -> Any:
    [found] = [ch for ch in checks if (ch["name"] if isinstance(ch, dict) else ch.name) == name]
    return found


def new_home(tmp_path: Path, listen: list[str]) -> NodeHome:
    home = NodeHome(tmp_path / "node")
    home.init(name="node")
    home.save_config(home.load_config().model_copy(update={"listen": listen}))
    return home


# ---------------------------------------------------------------- judgments, no network


def test_clock_skew_is_the_peer_time_against_ours_halfway_through_the_round_trip() -> None:
    assert clock_skew(sent_at=1000.0, rtt_s=0.2, peer_time=1000.1) == pytest.approx(0.0)
    assert clock_skew(sent_at=1000.0, rtt_s=0.2, peer_time=1120.1) == pytest.approx(120.0)
    assert [doctor.judge_skew("p", s).status for s in (0.3, -4.9, 5.5, -59.0, 61.0, -3600.0)] == \
        ["ok", "ok", "warn", "warn", "fail", "fail"]
    assert doctor.judge_skew("p", None).status == "warn"  # an older peer says no time
    assert "timedatectl set-ntp true" in doctor.judge_skew("p", 120.0).next_step


def test_the_disk_check_warns_under_500_mib_and_fails_under_50(tmp_path: Path) -> None:
    class Usage(NamedTuple):
        total: int
        used: int
        free: int

    home = new_home(tmp_path, ["/ip4/127.0.0.1/tcp/0"])
    mib = doctor.MiB
    for free, status in ((10 * 1024 * mib, "ok"), (499 * mib, "warn"), (49 * mib, "fail")):
        checks = anyio.run(lambda: doctor.run_checks(home, disk_usage=lambda path: Usage(0, 0, free)),
                           backend="trio")
        disk = by_name(checks, "disk")
        assert disk.status == status, disk
        assert str(home.path) in disk.detail and (disk.next_step != "") is (status != "ok")
    assert doctor.failed(checks)


# ---------------------------------------------------------------- the node's own state


@pytest.mark.anyio
async def test_a_listen_port_another_socket_holds_fails_with_how_to_find_it(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        home = new_home(tmp_path, [f"/ip4/127.0.0.1/tcp/{port}", "/ip4/192.0.2.7/tcp/0"])
        rc, report = await cli_doctor(home.path)
    assert rc == 1 and report["ok"] is False
    taken, foreign = [ch for ch in report["checks"] if ch["name"] == "listen"]
    assert taken["status"] == "fail" and f"port {port} is taken" in taken["detail"]
    assert f"ss -ltnp 'sport = :{port}'" in taken["next_step"] and str(home.config_path) in taken["next_step"]
    assert foreign["status"] == "fail" and "192.0.2.7 is not an address of this machine" in foreign["detail"]
    assert by_name(report["checks"], "daemon")["status"] == "warn"
    # the --json shape: one object, every check with all four keys, next_step set unless ok
    assert set(report) == {"ok", "checks"}
    for check in report["checks"]:
        assert set(check) == {"name", "status", "detail", "next_step"} and check["status"] in ("ok", "warn", "fail")
        assert (check["next_step"] != "") is (check["status"] != "ok")


@pytest.mark.anyio
async def test_a_broken_database_and_a_key_others_can_read_fail_with_the_fix(tmp_path: Path) -> None:
    home = new_home(tmp_path, ["/ip4/127.0.0.1/tcp/0"])
    home.db_path.write_bytes(b"this is not a database" * 100)
    os.chmod(home.key_path, 0o644)
    checks = await doctor.run_checks(home)
    assert by_name(checks, "database").status == "fail"
    assert f"mv {home.db_path} {home.db_path}.broken" in by_name(checks, "database").next_step
    key = by_name(checks, "home")
    assert key.status == "fail" and key.next_step == f"run: chmod 600 {home.key_path}"


# ---------------------------------------------------------------- through the daemons


@pytest.mark.anyio
async def test_the_daemon_probes_each_peer_path_round_trip_clock_and_dial_back(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(phone.home.path) as p:
            before = await p.status()
            assert before.reachability.confirmed == [] and before.listen == ["/ip4/127.0.0.1/tcp/0"]
            assert before.reachability.direct == before.addrs
            reply = await p.doctor()
            [seen] = reply.peers
            assert (seen.name, seen.reachable, seen.path, seen.error) == ("home", True, "direct", "")
            assert seen.rtt_ms is not None and abs(seen.clock_skew_s) < 1.0
            assert seen.dialback is not None and seen.dialback.observed == "127.0.0.1"
            [reached] = seen.dialback.results
            assert reached.ok and reached.addr == f"/ip4/127.0.0.1/tcp/{doctor.tcp_endpoint(before.addrs[0]).port}"
            after = await p.status()
            [confirmed] = after.reachability.confirmed
            assert (confirmed.by_name, confirmed.addr) == ("home", f"{reached.addr}/p2p/{phone.identity.peer_id}")
        checks = await doctor.run_checks(phone.home)
        assert [by_name(checks, n).status for n in ("daemon", "listen", "peer:home", "clock:home", "dialback:home")] \
            == ["ok"] * 5

        # a port where nothing listens: the peer says so, and the check says what to do
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
            refused = await phone.sessions.request(home.identity.peer_id, DialBack(ports=[port]), DialBackReply)
        [result] = refused.results
        assert not result.ok and result.error and result.addr == f"/ip4/127.0.0.1/tcp/{port}"
        verdict = doctor.judge_dialback(c.PeerDiagnosis(peer_id="x", name="home", reachable=True, dialback=refused), "phone")
        assert verdict is not None and verdict.status == "warn" and f"forward TCP port {port}" in verdict.next_step

        # a peer that is gone: unreachable is a warning with a next step, not a failure
        async with Client(home.home.path) as h:
            await h.shutdown()
        checks = await doctor.run_checks(phone.home, timeout_s=5)
        gone = by_name(checks, "peer:home")
        assert gone.status == "warn" and "unreachable" in gone.detail and "psymesh status" in gone.next_step
        assert gone.detail.count("unreachable") == 1, gone.detail  # not "home is unreachable: home is unreachable: ..."


@pytest.mark.anyio
async def test_a_peer_whose_clock_runs_two_minutes_ahead_fails_the_clock_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = DaemonProcess(tmp_path / "home", name="home")
    phone = DaemonProcess(tmp_path / "phone", profile="phone", name="phone")
    monkeypatch.setenv(CLOCK_OFFSET_ENV, "120")  # read by the home daemon, which is spawned now
    await home.start()
    monkeypatch.delenv(CLOCK_OFFSET_ENV)
    try:
        await phone.start()
        await pair(home.home, phone.home)
        rc, report = await cli_doctor(phone.home)
        assert rc == 1 and report["ok"] is False
        clock = by_name(report["checks"], "clock:home")
        assert clock["status"] == "fail" and "s ahead of ours" in clock["detail"]
        skew = float(clock["detail"].split("clock is ")[1].split(" s")[0])
        assert 115 < skew < 125
        assert "timedatectl set-ntp true" in clock["next_step"]
        assert by_name(report["checks"], "peer:home")["status"] == "ok"
        assert [ch["name"] for ch in report["checks"] if ch["status"] == "fail"] == ["clock:home"]
    finally:
        await phone.stop()
        await home.stop()


@pytest.mark.anyio
async def test_status_lists_the_relayed_address_a_reservation_gives(tmp_path: Path) -> None:
    from psymesh.node.cli.output import Output
    from psymesh.node.cli.status import _reachability_lines
    from psymesh.protocol.relay import RelaySettings

    relay_home = NodeHome(tmp_path / "relay")
    relay_id = relay_home.init(name="relay").peer_id
    relay_home.save_config(relay_home.load_config().model_copy(update={"relay": RelaySettings(enabled=True)}))
    home_home = NodeHome(tmp_path / "home")
    home_home.init(name="home")
    home_home.save_config(home_home.load_config().model_copy(update={"relay": RelaySettings(relays=[relay_id])}))
    async with run_nodes(tmp_path, "relay", "home") as nodes:
        relay, home = nodes["relay"], nodes["home"]
        await pair(relay.home.path, home.home.path, grant="messaging")
        async with Client(relay.home.path) as r, Client(home.home.path) as h:
            await r.grant("home", ["relay"])
            await wait_until(lambda: home.p2p.relayed_addrs(), "home's reservation at the relay", timeout=40)
            reach = (await h.status()).reachability
            assert reach.relayed == home.p2p.relayed_addrs() and reach.relayed[0].endswith(
                f"/p2p/{relay_id}/p2p-circuit/p2p/{home.identity.peer_id}")
            assert f"{reach.relayed[0]} (through a relay)" in _reachability_lines(reach, Output())
            [seen] = (await h.doctor()).peers
            assert (seen.name, seen.reachable, seen.path) == ("relay", True, "direct")


def test_a_peer_reached_through_a_relay_is_shown_so_and_cannot_dial_back() -> None:
    relayed = c.PeerDiagnosis(peer_id="h", name="home", reachable=True, path="relayed", rtt_ms=80.0,
                              clock_skew_s=0.1, dialback=DialBackReply(observed=None))
    assert doctor.judge_peer(relayed, "phone").detail == "home is reachable (relayed, round trip 80.0 ms)"
    verdict = doctor.judge_dialback(relayed, "phone")
    assert verdict is not None and verdict.status == "warn" and "through a relay only" in verdict.detail
    assert doctor.judge_dialback(relayed.model_copy(update={"reachable": False}), "phone") is None


def test_exposure_asks_a_home_pc_for_an_address_and_a_phone_for_none(tmp_path: Path) -> None:
    """A home PC on loopback only, or on a port picked at each start, is told how to be reached;
    a phone is not told to open a port: it dials its peers and relays itself."""
    from psymesh.node.control.doctor import judge_exposure

    config = tmp_path / "config.toml"
    cases = {("home", "/ip4/127.0.0.1/tcp/4001"): "warn", ("home", "/ip4/0.0.0.0/tcp/0"): "warn",
             ("home", "/ip4/0.0.0.0/tcp/4001"): "ok", ("phone", "/ip4/127.0.0.1/tcp/0"): "ok",
             ("phone", "/ip4/0.0.0.0/tcp/0"): "ok"}
    for (profile, listen), status in cases.items():
        [check] = judge_exposure([listen], config, profile)
        assert check.status == status, (profile, listen, check)
        assert profile == "home" or "0.0.0.0" not in (check.next_step or "")
    # the address it is told to listen on keeps its own port (friend on 4002 is not sent to home's 4001)
    [check] = judge_exposure(["/ip4/127.0.0.1/tcp/4002"], config, "home")
    assert '"/ip4/0.0.0.0/tcp/4002"' in (check.next_step or "")
