"""Node home: identity created once with mode 0600, config defaults, readable fingerprint."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from psymesh.node.home import NodeHome
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
