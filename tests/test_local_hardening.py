"""Another local user against a node: its files, its control socket, its database.

Real daemons (subprocesses through the CLI, or in-process), real SQLite, real
sockets. Tests run as root in CI, so "another user" is uid 65534 (nobody): a
squatter that binds a socket and then drops to nobody, or files chowned to nobody.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from psymesh.node.control.client import Client, NotOurDaemon
from psymesh.node.core.db import open_db, storage_error
from psymesh.node.core.home import NodeHome
from psymesh.node.control.process import DaemonProcess
from psymesh.protocol.errors import ErrorCode, PsymeshError

from conftest import run_nodes

NOBODY = 65534
PSYMESH = str(Path(sys.executable).parent / "psymesh")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user with chown/setuid")
pytestmark = pytest.mark.anyio


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PSYMESH, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def short_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private stand-in for /tmp (short, so socket paths in it fit AF_UNIX), used as the
    temp dir by this process and its children: squatting it disturbs no other test."""
    d = Path(tempfile.mkdtemp(prefix="pm-", dir="/tmp"))
    os.chmod(d, 0o1777)  # world-writable and sticky, like /tmp
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def long_home(tmp_path: Path) -> Path:
    home = tmp_path / ("long-home-path-" + "x" * 100) / "node"
    assert NodeHome(home).socket_path.parent != NodeHome(home).path
    return home


# --------------------------------------------------------------------------- file modes


PRIVATE_FILES = ("identity.key", "config.toml", "node.db", "node.db-wal", "node.db-shm", "daemon.log")


async def test_a_real_daemon_keeps_its_files_private_in_a_0755_home(tmp_path: Path, umask_022: None) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    (home / "models" / "some--repo").mkdir(parents=True, mode=0o755)
    (home / "models" / "some--repo" / "m.gguf").write_bytes(b"GGUF")  # 0644 under umask 022
    (home / "config.tmp").write_text("left over")
    (home / "notes.txt").write_text("the owner's own file")
    assert mode(home) == 0o755 and mode(home / "config.tmp") == 0o644

    node = DaemonProcess(home, profile="phone")  # a phone also keeps device.db
    await node.start()
    try:
        assert mode(home) == 0o700
        for name in (*PRIVATE_FILES, "device.db"):
            assert mode(home / name) == 0o600, name
        assert not (home / "config.tmp").exists()  # reused (0600) for config.toml, then renamed
        assert stat.S_ISSOCK(os.lstat(home / "control.sock").st_mode) and mode(home / "control.sock") == 0o600
        assert mode(home / "models") == mode(home / "models" / "some--repo") == 0o700
        assert mode(home / "models" / "some--repo" / "m.gguf") == 0o600
        assert mode(home / "notes.txt") == 0o644  # not psymesh's: left alone
        async with node.client() as client:
            await client.status()
    finally:
        assert await node.stop() == 0


async def test_an_embedded_node_creates_private_files_whatever_the_umask(tmp_path: Path, umask_022: None) -> None:
    """No CLI (which also sets umask 077): the explicit modes alone must hold."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        for node in nodes.values():
            path = node.home.path
            assert mode(path) == 0o700
            for name in ("identity.key", "config.toml", "node.db", "node.db-wal", "node.db-shm"):
                assert mode(path / name) == 0o600, name
            assert mode(node.home.socket_path) == 0o600
        assert mode(nodes["phone"].home.path / "device.db") == 0o600


def test_odd_umask_still_gives_writable_private_files(tmp_path: Path) -> None:
    old = os.umask(0o277)  # would make a plain 0600 create read-only and a 0700 mkdir unwritable
    try:
        home = NodeHome(tmp_path / "h")
        home.init()
        conn = open_db(home.db_path)
        conn.execute("CREATE TABLE t (x)")
        conn.close()
    finally:
        os.umask(old)
    assert mode(home.path) == 0o700
    for path in (home.key_path, home.config_path, home.db_path):
        assert mode(path) == 0o600, path


def test_group_writable_home_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "shared"
    home.mkdir()
    os.chmod(home, 0o775)
    with pytest.raises(PsymeshError) as info:
        NodeHome(home).init()
    assert info.value.code is ErrorCode.FORBIDDEN and f"chmod 700 {home}" in info.value.message
    r = cli("node", "start", "--home", str(home))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(error_lines(r.stderr)) == 1 and f"chmod 700 {home}" in error_lines(r.stderr)[0]
    assert not (home / "identity.key").exists()  # nothing was written into it
    os.chmod(home, 0o1777)  # world-writable, even with the sticky bit
    with pytest.raises(PsymeshError, match="can be written by other users"):
        NodeHome(home).init()


@needs_root
def test_home_of_another_user_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "theirs"
    home.mkdir(mode=0o700)
    os.chown(home, NOBODY, NOBODY)
    with pytest.raises(PsymeshError) as info:
        NodeHome(home).init()
    assert info.value.code is ErrorCode.FORBIDDEN and f"belongs to uid {NOBODY}" in info.value.message


# --------------------------------------------------------------------------- control socket


SQUATTER = r"""
import json, os, select, socket, sys
path, how = sys.argv[1], sys.argv[2]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
if how == "chown":      # a socket file that belongs to someone else
    os.chown(path, 65534, 65534)
elif how == "setuid":   # a listener run by someone else (SO_PEERCRED reports who called listen())
    os.setgid(65534)
    os.setuid(65534)
listener.listen(8)
print("ready", flush=True)
received = []
while True:
    ready, _, _ = select.select([listener, sys.stdin], [], [])
    if listener in ready:
        conn, _ = listener.accept()
        conn.settimeout(10)
        data = b""
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except TimeoutError:
            pass
        received.append(data.hex())
        conn.close()
    else:
        break
print(json.dumps(received), flush=True)
"""


class Squatter:
    """A process listening on `path` that records every connection and what it sent."""

    def __init__(self, path: Path, how: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SQUATTER, str(path), how], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], 30)
        assert readable and self.proc.stdout.readline().strip() == "ready"

    def received(self) -> list[bytes]:
        """Stop it and return what each connection sent (b"" for one that sent nothing)."""
        out, _ = self.proc.communicate(timeout=30)
        return [bytes.fromhex(h) for h in json.loads(out)]


INVITE = "psy1-the-bearer-invite-string-hunter2"


@needs_root
@pytest.mark.parametrize("how", ["chown", "setuid"])
@pytest.mark.parametrize("command", [["pair", "join", INVITE], ["status"]], ids=["sdk", "one-shot"])
def test_client_sends_nothing_to_a_squatted_socket(tmp_path: Path, how: str, command: list[str]) -> None:
    """Both clients: the SDK (`pair join`) and the blocking one-shot (`status`,
    node/control/oneshot.py) make the same checks before sending."""
    home = NodeHome(tmp_path / "h")
    home.init()
    squatter = Squatter(home.socket_path, how)
    try:
        r = cli(*command, "--home", str(home.path))
    finally:
        received = squatter.received()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = error_lines(r.stderr)
    assert str(home.socket_path) in line and "nothing was sent" in line and "[forbidden]" in line
    assert f"uid {NOBODY}" in line
    # chown: refused by the socket file's owner, before connecting; setuid: refused by
    # SO_PEERCRED after connecting, before sending. Either way not one byte left.
    assert received == ([] if how == "chown" else [b""])


def test_the_squatter_would_see_an_invite_sent_to_it(tmp_path: Path) -> None:
    """The control for the test above: a listener that passes every check gets the request."""
    home = NodeHome(tmp_path / "h")
    home.init()
    squatter = Squatter(home.socket_path, "ours")
    try:
        r = cli("pair", "join", INVITE, "--home", str(home.path), timeout=30)
    finally:
        received = squatter.received()
    assert r.returncode == 1  # it never answers
    assert len(received) == 1 and INVITE.encode() in received[0]


async def test_a_long_home_puts_its_socket_in_a_private_runtime_dir(tmp_path: Path, short_tmp: Path) -> None:
    home = long_home(tmp_path)
    socket_path = NodeHome(home).socket_path
    assert socket_path.parent == short_tmp / f"psymesh-{os.geteuid()}"
    node = DaemonProcess(home)
    await node.start()
    try:
        assert mode(socket_path.parent) == 0o700 and os.lstat(socket_path.parent).st_uid == os.geteuid()
        assert mode(socket_path) == 0o600
    finally:
        assert await node.stop() == 0


async def test_xdg_runtime_dir_is_used_when_it_is_ours(tmp_path: Path, short_tmp: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = short_tmp / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    home = long_home(tmp_path)
    assert NodeHome(home).socket_path.parent == runtime / "psymesh"
    async with run_nodes(home.parent, home.name) as nodes:
        assert mode(runtime / "psymesh") == 0o700
        async with Client(nodes[home.name].home.path) as client:
            await client.status()
    os.chmod(runtime, 0o777)  # a runtime dir others may write is not used: back to the temp dir
    assert NodeHome(home).socket_path.parent == short_tmp / f"psymesh-{os.geteuid()}"


@needs_root
def test_a_squatted_runtime_dir_is_refused_by_daemon_and_client(tmp_path: Path, short_tmp: Path) -> None:
    home = long_home(tmp_path)
    socket_path = NodeHome(home).socket_path
    squat = socket_path.parent
    squat.mkdir(mode=0o755)
    squatter = Squatter(socket_path, "ours")  # listening, as root, inside the squatted dir
    os.chown(squat, NOBODY, NOBODY)
    try:
        daemon = cli("node", "start", "--home", str(home))
        assert daemon.returncode == 1, daemon.stderr
        assert "Traceback" not in daemon.stderr and "ExceptionGroup" not in daemon.stderr
        [line] = error_lines(daemon.stderr)
        assert f"{squat} belongs to uid {NOBODY}" in line and "XDG_RUNTIME_DIR" in line

        client = cli("pair", "join", INVITE, "--home", str(home))
        assert client.returncode == 1 and "Traceback" not in client.stderr
        [line] = error_lines(client.stderr)
        assert f"{squat} belongs to uid {NOBODY}" in line
    finally:
        received = squatter.received()
    assert received == []


@needs_root
async def test_the_sdk_refuses_a_squatted_socket_with_a_typed_error(tmp_path: Path) -> None:
    """The SDK refuses as the CLI does, with an error class a script can branch on."""
    home = NodeHome(tmp_path / "h")
    home.init()
    squatter = Squatter(home.socket_path, "chown")
    try:
        with pytest.raises(NotOurDaemon) as info:
            async with Client(home.path) as client:
                await client.pair_join(INVITE)
        assert info.value.code is ErrorCode.FORBIDDEN
    finally:
        assert squatter.received() == []


def test_a_file_at_the_socket_path_is_not_deleted_by_the_daemon(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "h")
    home.init()
    home.socket_path.write_text("not a socket")
    r = cli("node", "start", "--home", str(home.path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    [line] = error_lines(r.stderr)
    assert "is not a socket" in line and f"mv {home.socket_path}" in line
    assert home.socket_path.read_text() == "not a socket"


# --------------------------------------------------------------------------- storage errors


JUNK = b"this is not a database, it is a shopping list: eggs, milk\n" * 200


@pytest.mark.parametrize("command", [["node", "start"], ["model", "list"], ["model", "add", "x", "/nonexistent"],
                                     ["agent", "run", "hello", "--delegate", "never"], ["id"]])
def test_a_corrupt_database_is_one_clear_line_and_left_untouched(tmp_path: Path, command: list[str]) -> None:
    home = NodeHome(tmp_path / "h")
    home.init()
    home.db_path.write_bytes(JUNK)
    r = cli(*command, "--home", str(home.path))
    if command == ["id"]:  # does not open the database: unaffected
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr
        [line] = error_lines(r.stderr)
        assert f"node.db at {home.db_path} is not a SQLite database (corrupt or overwritten)" in line
        assert f"mv {home.db_path} {home.db_path}.broken" in line
    assert home.db_path.read_bytes() == JUNK
    assert not Path(f"{home.db_path}-wal").exists()


def test_a_corrupt_database_in_json_mode(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "h")
    home.init()
    home.db_path.write_bytes(JUNK)
    r = cli("model", "list", "--json", "--home", str(home.path))
    assert r.returncode == 1
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "unavailable" and "is not a SQLite database" in err["message"]


def test_storage_errors_say_what_happened_and_what_to_do(tmp_path: Path) -> None:
    """Each mapping is driven by a real SQLite failure, not a hand-made exception."""
    path = tmp_path / "node.db"
    conn = open_db(path)
    conn.execute("CREATE TABLE t (x)")

    other = sqlite3.connect(str(path), timeout=0, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.Error) as locked:
        other.execute("BEGIN IMMEDIATE")
    conn.execute("ROLLBACK")
    assert "locked by another process" in storage_error(locked.value, path).message

    conn.execute("PRAGMA max_page_count = 2")  # the database may not grow: as on a full disk
    with pytest.raises(sqlite3.Error) as full:
        conn.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    assert "disk is full" in storage_error(full.value, path).message

    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(sqlite3.Error) as readonly:
        ro.execute("INSERT INTO t VALUES (1)")
    assert "is read-only" in storage_error(readonly.value, path).message

    junk = tmp_path / "junk.db"
    junk.write_bytes(JUNK)
    with pytest.raises(PsymeshError) as corrupt:
        open_db(junk)
    assert corrupt.value.code is ErrorCode.UNAVAILABLE and f"mv {junk} {junk}.broken" in corrupt.value.message
    assert junk.read_bytes() == JUNK


def test_a_database_path_that_is_no_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "node.db").mkdir()
    with pytest.raises(PsymeshError, match="not a regular file"):
        open_db(tmp_path / "node.db")


# --------------------------------------------------------------------------- the bridges' API keys


@pytest.mark.parametrize("section", ["openai", "a2a"])
def test_an_api_key_file_others_may_read_is_refused_like_identity_key(tmp_path: Path, section: str,
                                                                      umask_022: None) -> None:
    """A key file of the owner's (api_key_file) or the one the node made in its home, once
    readable by others (mode 0644: a copy under umask 022), is refused, not tightened:
    another user may already have read it. One line, with the chmod to run."""
    home = tmp_path / "home"
    own = tmp_path / "my.key"
    own.write_text("k" * 32)
    assert mode(own) == 0o644
    refused = cli("serve", section, "--home", str(home), "--api-key-file", str(own), "--show-key")
    assert refused.returncode == 1 and refused.stdout == ""
    assert error_lines(refused.stderr) == [f"error [forbidden]: {own} is readable by others (mode 644); run: chmod "
                                           f"600 {own}"]
    assert mode(own) == 0o644  # left for the owner to look at

    made = json.loads(cli("serve", section, "--home", str(home), "--show-key", "--json").stdout)
    assert made["source"] == str(home / f"{section}.key") and mode(home / f"{section}.key") == 0o600
    os.chmod(home / f"{section}.key", 0o640)
    again = cli("serve", section, "--home", str(home), "--port", "0")  # would serve: refused before it listens
    assert again.returncode == 1 and error_lines(again.stderr) == [
        f"error [forbidden]: {home / f'{section}.key'} is readable by others (mode 640); run: chmod 600 "
        f"{home / f'{section}.key'}"]
    os.chmod(home / f"{section}.key", 0o600)
    assert json.loads(cli("serve", section, "--home", str(home), "--show-key", "--json").stdout) == made


@pytest.mark.parametrize("section", ["openai", "a2a"])
def test_a_key_comes_from_a_file_or_the_environment_never_the_command_line(tmp_path: Path, section: str) -> None:
    """`--api-key KEY` put the key in /proc/PID/cmdline, which every local user reads: it is
    refused with the two ways that stay private; $PSYMESH_..._API_KEY is one of them (a
    process's environment is its owner's: /proc/PID/environ is 0400)."""
    home = tmp_path / "home"
    old = cli("serve", section, "--home", str(home), "--api-key", "k" * 32)
    env = f"PSYMESH_{section.upper()}_API_KEY"
    assert old.returncode == 1 and old.stdout == ""
    [line] = error_lines(old.stderr)
    assert "--api-key is gone" in line and "/proc/PID/cmdline" in line and "--api-key-file" in line and env in line
    assert not home.exists()  # nothing made or served for a refused command

    shown = cli("serve", section, "--home", str(home), "--show-key", "--json", env={env: "e" * 24})
    assert json.loads(shown.stdout) == {"key": "e" * 24, "source": f"${env}"}
    short = cli("serve", section, "--home", str(home), "--show-key", env={env: "short"})
    assert short.returncode == 1 and "at least 16" in error_lines(short.stderr)[0]
    assert "--api-key " not in cli("serve", section, "--help").stdout  # not offered any more


def test_a_link_to_nothing_at_the_key_path_is_one_clear_error(tmp_path: Path) -> None:
    """The key is made with O_EXCL|O_NOFOLLOW: never through a link, and a dangling one is
    refused (it used to loop between 'missing' and 'exists')."""
    from psymesh.node.bridges.apikey import load_api_key
    from psymesh.node.core.bridgeconfig import OpenAIServe

    home = NodeHome(tmp_path / "home")
    home.init()
    (home.path / "openai.key").symlink_to(tmp_path / "nowhere")
    with pytest.raises(PsymeshError, match="a link to nothing; remove it"):
        load_api_key(OpenAIServe(enabled=True), home, {})
    assert not (tmp_path / "nowhere").exists()
