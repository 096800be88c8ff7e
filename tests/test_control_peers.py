"""Who the daemon answers on its control socket: only processes of its own uid.

The socket's mode and directory keep other users out; these tests loosen both by hand
(as an owner might, by mistake) and check that the daemon itself still refuses a process
of another uid (SO_PEERCRED), with an audit row, while its owner is served. Tests run as
root, so "another uid" is a child that drops to nobody (65534) before it connects.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from psymesh.node.control.server import ControlServer
from psymesh.node.core.paths import socket_peer
from psymesh.protocol import control as c
from psymesh.protocol.framing import encode_frame
from psymesh.protocol.messages import pack

from conftest import run_nodes
from waiting import wait_until

NOBODY = 65534
pytestmark = pytest.mark.anyio
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user with setuid")

# Connects as nobody, sends a status request, prints what came back (hex) before EOF.
INTRUDER = r"""
import os, socket, sys
path, frame = sys.argv[1], bytes.fromhex(sys.argv[2])
os.setgid(65534)
os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(path)
data = b""
try:
    s.sendall(frame)
    while chunk := s.recv(65536):
        data += chunk
except (TimeoutError, ConnectionResetError, BrokenPipeError):
    pass
print(data.hex(), flush=True)
"""


def status_frame() -> bytes:
    return encode_frame(pack(c.StatusRequest()))


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory others may enter (pytest's tmp_path sits in a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="pm-cred-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@needs_root
async def test_another_uid_on_a_loosened_socket_is_refused_and_audited(open_tmp: Path) -> None:
    async with run_nodes(open_tmp, "home") as nodes:
        node = nodes["home"]
        sock = node.home.socket_path
        os.chmod(node.home.path, 0o755)  # loosened by hand: anyone may now reach the socket ...
        os.chmod(sock, 0o666)            # ... and open it
        try:
            intruder = await anyio.to_thread.run_sync(lambda: subprocess.run(
                [sys.executable, "-c", INTRUDER, str(sock), status_frame().hex()],
                capture_output=True, text=True, timeout=30))
            assert intruder.returncode == 0, intruder.stderr
            assert intruder.stdout.strip() == ""  # not one byte of an answer

            rows = node.audit.query(peer_id=f"uid:{NOBODY}", denied_only=True)
            assert [(r["protocol"], r["operation"], r["code"]) for r in rows] == [("control", "connect", "forbidden")]
            assert f"uid {NOBODY}" in rows[0]["reason"]

            from psymesh.node.control.client import Client
            async with Client(home=node.home.path) as owner:  # the owner is served meanwhile
                status = await owner.status()
            assert status.peer_id == node.identity.peer_id
        finally:
            os.chmod(node.home.path, 0o700)


@needs_root
def test_socket_peer_reports_the_uid_of_the_other_end(open_tmp: Path) -> None:
    """The credential check itself, on a real socket pair whose far end is another uid."""
    path = open_tmp / "s.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o777)
    listener.listen(1)
    child = subprocess.Popen([sys.executable, "-c", INTRUDER, str(path), ""], stdout=subprocess.PIPE, text=True)
    try:
        conn, _ = listener.accept()
        with conn:
            uid, pid = socket_peer(conn) or (None, None)
            assert uid == NOBODY and pid == child.pid
    finally:
        child.communicate(timeout=30)
        listener.close()


async def test_the_daemon_refuses_whom_the_credential_check_names(tmp_path: Path) -> None:
    """Without root: the seam on the check (`peer_of`) says another uid; nothing is read or
    answered and `refused` is told once per connection."""
    refused: list[tuple[int, int | None]] = []
    server = ControlServer(tmp_path / "c.sock", 1 << 20, refused=lambda uid, pid: refused.append((uid, pid)),
                           peer_of=lambda _sock: (os.geteuid() + 1, 4242))
    server.route(c.StatusRequest, lambda _req, _framed: pytest.fail("a refused client was served"))
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        for _ in range(3):
            async with await anyio.connect_unix(tmp_path / "c.sock") as stream:
                await stream.send(status_frame())
                with anyio.fail_after(10):
                    data = b""
                    try:
                        while chunk := await stream.receive():
                            data += chunk
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        pass
                assert data == b""
        await wait_until(lambda: len(refused) == 3, "three refusals")
        assert refused == [(os.geteuid() + 1, 4242)] * 3
        tg.cancel_scope.cancel()
