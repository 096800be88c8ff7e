"""Hints that name a psymesh command name it for the home the user gave (issue 22's tour).

Before: a command run with `--home ~/psy-home` printed `see: psymesh task watch t18...`,
`clients need its key: psymesh serve openai --show-key`, `restart the daemon to apply it:
psymesh node stop, then psymesh node start`; run as printed, each went to the default home.
Now each hint repeats the --home given (not one that came from $PSYMESH_HOME, which the next
command sees as well), and the command as printed does what it says. Real CLI processes,
against an in-process daemon on loopback where the hint needs one.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import sys
from pathlib import Path

import anyio
import pytest

from conftest import run_nodes
from psymesh.node.cli.output import Output
from psymesh.node.core.commands import Commands

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if k != "PSYMESH_HOME"}


async def _psymesh(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    done = await anyio.run_process([sys.executable, "-m", "psymesh", *args], check=False, cwd=REPO,
                                   env=env or ENV)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def _hinted(text: str, command: str) -> list[str]:
    """The psymesh command a hint in `text` names, starting `psymesh COMMAND`, as argv."""
    found = re.search(rf"psymesh {command}\b[^,)\n]*", text)
    assert found, text
    return shlex.split(found.group(0))


def test_a_suggested_command_repeats_the_home_between_the_command_and_its_arguments() -> None:
    assert Output(home="/tmp/psy phone").suggest("task watch", "t1") == "psymesh task watch --home '/tmp/psy phone' t1"
    assert Output(home="psy-home").suggest("mcp add", "NAME -- COMMAND ...") == \
        "psymesh mcp add --home psy-home NAME -- COMMAND ..."
    assert Output().suggest("peers") == "psymesh peers"


async def test_hints_name_the_home_given_on_the_command_line_and_work_as_printed(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home") as nodes:
        home = str(nodes["home"].home.path)
        rc, _, err = await _psymesh("mcp", "add", "--home", home, "notes", "--", sys.executable, "-c", "pass")
        assert rc == 0, err
        assert f"restart the daemon to apply it: psymesh node stop --home {home}, then " \
               f"psymesh node start --home {home}" in " ".join(err.split())

        rc, out, err = await _psymesh("serve", "openai", "--home", home, "--port", "0")
        assert rc == 0, err
        key_command = _hinted(" ".join(err.split()), "serve openai")
        assert key_command == ["psymesh", "serve", "openai", "--home", home, "--show-key"]
        rc, key, err = await _psymesh(*key_command[1:])  # as printed: the key of this home's endpoint
        assert rc == 0, err
        rc, out, err = await _psymesh("doctor", "--home", home)  # its next steps too (node/control/doctor.py)
        assert rc in (0, 1) and f"pair one: psymesh pair invite --home {home})" in " ".join(out.split()), out + err
        endpoint = nodes["home"].openai
        assert endpoint is not None and key.strip() == endpoint.key.value


async def test_hints_keep_a_home_from_the_environment_implicit(tmp_path: Path) -> None:
    home = str(tmp_path / "desk")
    rc, out, _ = await _psymesh("model", "list", "--home", home)
    assert rc == 0 and f"psymesh model add --home {home} NAME PATH.gguf" in " ".join(out.split())
    rc, out, _ = await _psymesh("model", "list", env={**ENV, "PSYMESH_HOME": home})
    assert rc == 0 and "psymesh model add NAME PATH.gguf" in " ".join(out.split())


def test_the_daemon_names_a_home_only_when_it_is_not_the_default(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # where the platform's default home is
    assert Commands.of((tmp_path / "data" / "psymesh").resolve())("peers") == "psymesh peers"
    assert Commands.of(tmp_path / "desk")("group add", "family PEER") == \
        f"psymesh group add --home {tmp_path / 'desk'} family PEER"


async def test_the_daemons_own_hints_name_its_home_and_work_as_printed(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Before: a daemon in ~/psy-home answered `no group named 'family'; see: psymesh group list` and
    logged `its key: ...; psymesh serve openai --show-key`: run as printed, each went to the default
    home. Now what the daemon writes for its owner names its home, and runs as printed."""
    caplog.set_level(logging.INFO, logger="psymesh")
    async with run_nodes(tmp_path, "home") as nodes:
        home = str(nodes["home"].home.path)
        rc, _, err = await _psymesh("group", "send", "--home", home, "family", "hi")  # refused by the daemon
        assert rc == 1 and f"see: psymesh group list --home {home}" in err, err
        rc, out, err = await _psymesh(*_hinted(" ".join(err.split()), "group list")[1:])
        assert rc == 0, err
        rc, _, err = await _psymesh("task", "send", "--home", home, "--to", "nobody", "--tool", "system.info")
        assert rc == 1 and f"see: psymesh peers --home {home}" in err, err

        rc, _, err = await _psymesh("serve", "openai", "--home", home, "--port", "0")
        assert rc == 0, err
        logged = " ".join(r.getMessage() for r in caplog.records if "OpenAI-compatible endpoint" in r.getMessage())
        assert _hinted(logged, "serve openai") == ["psymesh", "serve", "openai", "--home", home, "--show-key"], logged
