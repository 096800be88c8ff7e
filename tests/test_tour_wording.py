"""The README's tour read as a new user reads it (issue 22, "no step that misleads"): every
line names who said what, in words a person reads, between real daemons on loopback and
through the `psymesh` command.

Each test names what the user saw before, and what they see now.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import pair, run_nodes

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent


async def _cli(home: Path, *args: str, json_mode: bool = False) -> tuple[int, Any, str]:
    """Run the CLI as a user does; with --json, stdout parsed as its one JSON document."""
    command = [sys.executable, "-m", "psymesh", *args, "--home", str(home), *(["--json"] if json_mode else [])]
    done = await anyio.run_process(command, check=False, cwd=REPO)
    out = done.stdout.decode()
    return done.returncode, (json.loads(out) if json_mode and out.strip() else out), done.stderr.decode()


async def test_a_grant_that_expires_says_until_when_in_grant_and_peers(tmp_path: Path) -> None:
    """Before: `grant --expires 30d` showed the expiry nowhere but `--json`'s `granted_expires`.
    Now `grant` and `peers` both say until when."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home = nodes["home"].home.path
        await pair(home, nodes["phone"].home.path, grant="phone")
        rc, text, err = await _cli(home, "grant", "phone", "+msg.send")
        assert rc == 0 and "(until revoked)" in text, err
        rc, text, err = await _cli(home, "grant", "phone", "+msg.send", "--expires", "30d")
        assert rc == 0, err
        _, view, _ = await _cli(home, "peers", json_mode=True)
        until = time.strftime("%Y-%m-%d", time.localtime(view[0]["granted_expires"]))
        assert f"(until {until}" in text
        rc, text, err = await _cli(home, "peers", "--active")
        assert rc == 0 and "(until" in text and until in text, err  # folded at 80 columns


async def test_status_lines_label_the_profile_not_a_second_name(tmp_path: Path) -> None:
    """Before: `paired with friend (home)` and `friend (home) psymesh 0.1.0` read as if the
    node were called home. Now the profile is labelled: `friend (profile: home)`."""
    async with run_nodes(tmp_path, "friend", "phone", profiles={"phone": "phone"}) as nodes:
        rc, text, err = await _cli(nodes["friend"].home.path, "status")
        assert rc == 0 and "friend (profile: home) psymesh" in text, err
