"""The blocking one-shot control client (node/control/oneshot.py), which `psymesh status` asks with:
against a listener that answers as a daemon would (an `error` reply, a hang-up, a wrong reply),
each gives the error the SDK gives for the same answer. Its happy path against a real daemon, and
its output beside the SDK's, are in tests/test_cli_startup.py; its socket checks against a
squatter in tests/test_local_hardening.py."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from psymesh.node.control.control_socket import DaemonNotRunning
from psymesh.node.control.oneshot import ask
from psymesh.node.core.paths import HomePaths
from psymesh.protocol.common import Error, Ping
from psymesh.protocol.errors import ConnectError, ConnectionLost, ErrorCode, ProtocolError, RemoteError
from psymesh.protocol.framing import FrameDecoder, encode_frame
from psymesh.protocol.messages import Message, pack, unpack


class Answering:
    """A listener on the home's control socket that reads one request and answers `reply`
    (None: hangs up without answering)."""

    def __init__(self, home: Path, reply: Message | None) -> None:
        home.mkdir(mode=0o700)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(HomePaths(home).socket_path))
        self.server.listen(1)
        self.reply = reply
        self.requests: list[Message] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            decoder = FrameDecoder()
            while (body := decoder.next_frame()) is None:
                decoder.feed(conn.recv(65536))
            self.requests.append(unpack(body))
            if self.reply is not None:
                conn.sendall(encode_frame(pack(self.reply)))

    def close(self) -> None:
        self.thread.join(timeout=30)
        self.server.close()


@pytest.fixture
def answering(tmp_path: Path) -> Iterator[Callable[[Message | None], Answering]]:
    made: list[Answering] = []

    def make(reply: Message | None) -> Answering:
        made.append(Answering(tmp_path / "home", reply))
        return made[-1]

    yield make
    for a in made:
        a.close()


def test_without_a_daemon_it_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DaemonNotRunning) as info:
        ask(tmp_path / "nobody", "control.status")
    assert "psymesh node start" in info.value.message


def test_a_refusal_is_the_remote_error_it_was(tmp_path: Path, answering) -> None:
    daemon = answering(Error.of(ErrorCode.FORBIDDEN, "not today", retry_after=3.0))
    with pytest.raises(RemoteError) as info:
        ask(tmp_path / "home", "control.status")
    assert (info.value.code, info.value.message, info.value.retry_after) == (ErrorCode.FORBIDDEN, "not today", 3.0)
    assert [r.type for r in daemon.requests] == ["control.status"]


def test_the_network_failing_under_the_daemon_is_a_network_error(tmp_path: Path, answering) -> None:
    answering(Error.of(ErrorCode.UNAVAILABLE, "could not reach home", details={"network": "connect"}))
    with pytest.raises(ConnectError, match="could not reach home"):
        ask(tmp_path / "home", "control.status")


def test_a_daemon_that_hangs_up_unanswered_is_a_lost_connection(tmp_path: Path, answering) -> None:
    answering(None)
    with pytest.raises(ConnectionLost):
        ask(tmp_path / "home", "control.status")


def test_a_reply_of_another_type_is_a_protocol_error(tmp_path: Path, answering) -> None:
    answering(Ping(seq=1))
    with pytest.raises(ProtocolError, match="not 'control.status_reply'"):
        ask(tmp_path / "home", "control.status")
