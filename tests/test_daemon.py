"""The daemon as users see it: control API, status, ping, clean shutdown, bad input survived."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.node.control.client import Client, DaemonNotRunning
from psymesh.node.core.home import NodeHome
from psymesh.node.control.process import DaemonProcess
from psymesh.protocol.errors import ConnectError, ErrorCode, RemoteError

pytestmark = pytest.mark.anyio


async def test_status_and_ping_between_two_in_process_nodes(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path)
        async with Client(nodes["home"].home.path) as home:
            home_status = await home.status()
        assert home_status.peer_id == nodes["home"].identity.peer_id
        assert home_status.addrs and home_status.addrs[0].endswith(home_status.peer_id)
        async with Client(nodes["phone"].home.path) as phone:
            reply = await phone.ping(home_status.addrs[0], count=5)
            assert reply.peer_id == home_status.peer_id
            assert len(reply.rtts_ms) == 5 and reply.min_ms <= reply.median_ms <= reply.max_ms
            status = await phone.status()
        assert home_status.peer_id in [p.peer_id for p in status.connected_peers]


async def test_ping_unreachable_peer_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ghost = NodeHome(tmp_path / "ghost").init().peer_id  # a valid id nobody serves
    async with run_nodes(tmp_path, "phone") as nodes:
        async with Client(nodes["phone"].home.path) as phone:
            with pytest.raises(ConnectError) as info:  # the network failed (a dial): not a refusal
                await phone.ping(f"/ip4/127.0.0.1/tcp/{port}/p2p/{ghost}", count=1)
            assert info.value.code is ErrorCode.UNAVAILABLE and f"connection refused at 127.0.0.1:{port}" in info.value.message
            with pytest.raises(RemoteError) as refused:  # our own id is a request that makes no sense
                await phone.ping(f"/ip4/127.0.0.1/tcp/{port}/p2p/{nodes['phone'].identity.peer_id}", count=1)
            assert refused.value.code is ErrorCode.BAD_REQUEST
            assert (await phone.status()).name == "phone"  # still serving


async def test_garbage_on_the_control_socket_is_answered_and_survived(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home") as nodes:
        path = nodes["home"].home.socket_path
        for garbage in (b"\x00\x00\x00\x03\xc1\xc1\xc1", b"\xff\xff\xff\xff", b"\x00\x00\x00\x01\x90"):
            stream = await anyio.connect_unix(path)
            async with stream:
                await stream.send(garbage)
                reply = await stream.receive(65536)
            assert b"error" in reply
        async with Client(nodes["home"].home.path) as client:
            assert (await client.status()).name == "home"


async def test_client_without_daemon_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DaemonNotRunning) as info:
        async with Client(tmp_path / "nobody"):
            pass
    assert "psymesh node start" in info.value.message


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_daemon_process_shuts_down_cleanly_on_signal(tmp_path: Path, signum: int) -> None:
    node = DaemonProcess(tmp_path / "home")
    status = await node.start()
    port = int(status.addrs[0].split("/tcp/")[1].split("/")[0])
    assert node.proc is not None
    proc = node.proc
    proc.send_signal(signum)
    await wait_until(lambda: proc.poll() is not None, "the daemon to exit", timeout=15)
    assert node.proc.returncode == 0, node.log_tail()
    assert not node.client().socket_path.exists()
    with socket.socket() as s:  # the listening port is closed
        assert s.connect_ex(("127.0.0.1", port)) != 0
    log = node.log_tail(50)
    assert "Traceback" not in log and "node stopped" in log


async def test_restart_after_sigkill_reuses_identity_and_replaces_stale_socket(tmp_path: Path) -> None:
    node = DaemonProcess(tmp_path / "home")
    first = await node.start()
    node.kill()
    assert node.client().socket_path.exists()  # left behind, as after a crash
    second = await node.start()
    assert second.peer_id == first.peer_id
    assert await node.stop() == 0


async def test_second_daemon_on_same_home_is_refused(tmp_path: Path) -> None:
    node = DaemonProcess(tmp_path / "home")
    await node.start()
    try:
        twin = subprocess.run([sys.executable, "-m", "psymesh", "node", "start", "--home", str(tmp_path / "home")],
                              capture_output=True, text=True, timeout=60)
        assert twin.returncode != 0
        assert "already" in twin.stderr
        async with node.client() as client:
            await client.status()  # the first one is unharmed
    finally:
        await node.stop()


async def test_cli_status_and_ping_json(tmp_path: Path) -> None:
    home, phone = DaemonProcess(tmp_path / "home"), DaemonProcess(tmp_path / "phone", profile="phone")
    home_status = await home.start()
    await phone.start()
    try:
        await pair(tmp_path / "home", tmp_path / "phone")
        env = {**os.environ, "PSYMESH_HOME": str(tmp_path / "phone")}
        st = subprocess.run([sys.executable, "-m", "psymesh", "status", "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["profile"] == "phone"
        pg = subprocess.run([sys.executable, "-m", "psymesh", "ping", home_status.addrs[0], "--count", "3", "--json"],
                            env=env, capture_output=True, text=True, timeout=60)
        assert pg.returncode == 0, pg.stderr
        data = json.loads(pg.stdout)
        assert data["peer_id"] == home_status.peer_id and len(data["rtts_ms"]) == 3
        bad = subprocess.run([sys.executable, "-m", "psymesh", "ping", "not-an-addr", "--json"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1
        assert "error" in json.loads(bad.stdout) and "Traceback" not in bad.stderr
    finally:
        await phone.stop()
        await home.stop()


async def test_log_json_lines_and_node_stop(tmp_path: Path) -> None:
    node = DaemonProcess(tmp_path / "home", extra_args=["--log-json"])
    await node.start()
    stop = subprocess.run([sys.executable, "-m", "psymesh", "node", "stop", "--home", str(tmp_path / "home"),
                           "--json"], capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and json.loads(stop.stdout) == {"stopped": True}
    proc = node.proc
    assert proc is not None
    await wait_until(lambda: proc.poll() is not None, "the daemon to exit", timeout=15)
    assert node.proc.returncode == 0
    lines = [json.loads(line) for line in node.log_tail(50).splitlines() if line.strip()]
    assert any(entry["msg"].startswith("node ") and "(12D3KooW" in entry["msg"] and "profile: " in entry["msg"]
               and entry["level"] == "info" for entry in lines)  # `node home (12D3..., profile: home) listening`
    assert lines[-1]["msg"] == "node stopped"
