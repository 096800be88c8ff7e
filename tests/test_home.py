"""Node home: identity created once with mode 0600, config defaults, readable fingerprint,
and everything psymesh keeps in a home private to its owner."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from psymesh.node.core.db import open_db
from psymesh.node.core.home import NodeHome
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.identity import peer_fingerprint, public_key_from_peer_id


def test_identity_created_once_with_private_mode(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "h")
    first = home.init()
    assert stat.S_IMODE(home.key_path.stat().st_mode) == 0o600
    assert home.init().peer_id == first.peer_id  # loaded, not regenerated
    assert first.peer_id.startswith("12D3KooW")
    assert public_key_from_peer_id(first.peer_id) == first.public_key
    assert peer_fingerprint(first.peer_id) == first.fingerprint
    assert home.config_path.exists()


def test_world_readable_key_is_refused(tmp_path: Path) -> None:
    home = NodeHome(tmp_path)
    home.init()
    os.chmod(home.key_path, 0o644)
    with pytest.raises(PsymeshError) as info:
        home.load_or_create_identity()
    assert "chmod 600" in info.value.message


def test_a_traceback_with_locals_does_not_show_the_identity_seed(tmp_path: Path) -> None:
    """repr(Identity) used to print the seed, so any traceback that shows locals (pytest
    --showlocals, rich tracebacks, an error reporter) leaked the node's private key."""
    identity = NodeHome(tmp_path / "h").init()

    def fails(identity: object) -> None:
        raise RuntimeError("boom")

    try:
        fails(identity)
    except RuntimeError as exc:
        shown = "".join(traceback.TracebackException.from_exception(exc, capture_locals=True).format())
    assert identity.peer_id in shown and identity.peer_id in repr(identity)
    for leak in (repr(identity.seed), identity.seed.hex(), str(list(identity.seed))[1:-1]):
        assert leak not in shown and leak not in repr(identity) and leak not in str(identity)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_loose_state_is_tightened_on_init_and_open(tmp_path: Path) -> None:
    """What an older psymesh (or a umask-022 copy) left readable by others is made owner-only;
    the owner's own files in the same directory keep their modes."""
    home = NodeHome(tmp_path / "h")
    home.init()
    conn = open_db(home.db_path)
    conn.execute("CREATE TABLE t (x)")  # the connection stays open: -wal and -shm exist
    wal, shm = Path(f"{home.db_path}-wal"), Path(f"{home.db_path}-shm")
    (home.models_dir / "repo").mkdir(parents=True)
    (home.models_dir / "repo" / "m.gguf").write_bytes(b"GGUF")
    (home.path / "notes.txt").write_text("mine")
    for path in (home.path, home.models_dir, home.models_dir / "repo"):
        os.chmod(path, 0o755)
    for path in (home.config_path, home.db_path, wal, shm, home.models_dir / "repo" / "m.gguf",
                 home.path / "notes.txt"):
        os.chmod(path, 0o644)

    home.init()
    assert mode(home.path) == mode(home.models_dir) == mode(home.models_dir / "repo") == 0o700
    for path in (home.config_path, home.db_path, wal, shm, home.models_dir / "repo" / "m.gguf"):
        assert mode(path) == 0o600, path
    assert mode(home.path / "notes.txt") == 0o644

    os.chmod(home.db_path, 0o644)
    os.chmod(wal, 0o640)
    open_db(home.db_path).close()  # the CLI opens the database without init(): tightened there too
    assert mode(home.db_path) == mode(wal) == 0o600
    conn.close()


def test_a_world_readable_key_stays_refused_when_the_rest_is_tightened(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "h")
    home.init()
    os.chmod(home.path, 0o755)
    os.chmod(home.key_path, 0o644)  # may already be copied: tightening it would hide that
    with pytest.raises(PsymeshError, match="chmod 600"):
        home.init()
    assert mode(home.key_path) == 0o644 and mode(home.path) == 0o700


def test_env_var_selects_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSYMESH_HOME", str(tmp_path / "env-home"))
    assert NodeHome().path == (tmp_path / "env-home").resolve()
    assert NodeHome(tmp_path / "explicit").path == (tmp_path / "explicit").resolve()


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    home = NodeHome(tmp_path)
    home.init()
    home.config_path.write_text('listen = "not-a-list"\nlisten_typo = 1\n')
    with pytest.raises(PsymeshError) as info:
        home.load_config()
    assert info.value.code == ErrorCode.BAD_REQUEST and "config.toml" in info.value.message


def test_long_home_paths_get_a_short_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 120)
    assert len(str(NodeHome(deep).socket_path)) <= 100


def test_cli_id_json(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "psymesh", "id", "--home", str(tmp_path), "--json"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["peer_id"].startswith("12D3KooW")
    assert len(data["fingerprint"].split("-")) == 4
