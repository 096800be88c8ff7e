"""The README's tour read as a new user reads it (issue 22, "no step that misleads"): every
line names who said what, in words a person reads, between real daemons on loopback and
through the `psymesh` command.

Each test names what the user saw before, and what they see now.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.node.control.client import Client

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent


async def _cli(home: Path, *args: str, json_mode: bool = False,
               env: dict[str, str] | None = None) -> tuple[int, Any, str]:
    """Run the CLI as a user does; with --json, stdout parsed as its one JSON document."""
    command = [sys.executable, "-m", "psymesh", *args, "--home", str(home), *(["--json"] if json_mode else [])]
    done = await anyio.run_process(command, check=False, cwd=REPO, env={**os.environ, **(env or {})})
    out = done.stdout.decode()
    return done.returncode, (json.loads(out) if json_mode and out.strip() else out), done.stderr.decode()


async def test_a_grant_that_expires_says_until_when_in_grant_and_peers(tmp_path: Path) -> None:
    """Before: `grant --expires 30d` showed the expiry nowhere but `--json`'s `granted_expires`.
    Now `grant` and `peers` both say until when."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home = nodes["home"].home.path
        await pair(home, nodes["phone"].home.path, grant="phone")
        rc, text, err = await _cli(home, "grant", "phone", "+msg.send")
        assert rc == 0 and "the whole grant lasts until revoked" in text, err
        rc, text, err = await _cli(home, "grant", "phone", "+msg.send", "--expires", "30d")
        assert rc == 0, err
        _, view, _ = await _cli(home, "peers", json_mode=True)
        ends = view[0]["granted_expires"]
        until = time.strftime("%Y-%m-%d", time.localtime(ends))
        assert f"lasts until {until}" in text
        rc, text, err = await _cli(home, "peers", "--active")
        assert rc == 0 and "(all" in text and until in text, err  # folded at 80 columns

        # an edit keeps the end: `+CAP` must not turn a 30-day grant into one for good (the tour's MCP step)
        rc, text, err = await _cli(home, "grant", "phone", "+tool:mcp.notes.*")
        assert rc == 0 and f"lasts until {until}" in text, err
        _, view, _ = await _cli(home, "peers", json_mode=True)
        assert view[0]["granted_expires"] == pytest.approx(ends, abs=2)
        rc, text, err = await _cli(home, "grant", "phone", "-msg.send", "--expires", "never")
        assert rc == 0 and "lasts until revoked" in text, err
        _, view, _ = await _cli(home, "peers", json_mode=True)
        assert view[0]["granted_expires"] is None

        # `-CAP` with an h in it takes it away too: it was read as -w -e -b ... -h, printed the help, exit 0
        rc, text, err = await _cli(home, "grant", "phone", "+web.search")
        assert rc == 0, err
        rc, text, err = await _cli(home, "grant", "phone", "-web.search")
        assert rc == 0 and "Usage" not in text, (text, err)
        _, view, _ = await _cli(home, "peers", json_mode=True)
        assert "web.search" not in view[0]["granted"]


async def test_a_revoked_peer_is_shown_with_no_capabilities(tmp_path: Path) -> None:
    """Before: after `revoke phone`, `peers` still listed phone's last grant under "may ask us" (and
    `--json` its `granted`), as if it could still ask them. Now the table says revoked there, and the
    JSON grants it nothing (`granted: []`, no end, no limits; `revoked_at` says when)."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home = nodes["home"].home.path
        await pair(home, nodes["phone"].home.path, grant="phone")
        rc, _, err = await _cli(home, "grant", "phone", "+msg.send", "--expires", "30d")
        assert rc == 0, err
        rc, _, err = await _cli(home, "revoke", "phone")
        assert rc == 0, err
        rc, text, err = await _cli(home, "peers")
        assert rc == 0, err
        [row] = [line for line in text.splitlines() if "phone" in line]
        cells = [cell.strip() for cell in row.split("│")]
        assert cells[4:6] == ["revoked", "revoked"], row  # state, may ask us (no limits under it)
        assert "task.infer" not in text and "(all until" not in text, text  # of its grant, not a word
        rc, view, err = await _cli(home, "peers", json_mode=True)
        assert rc == 0, err
        assert view[0]["revoked_at"] is not None and view[0]["granted"] == [] and view[0]["granted_expires"] is None
        assert all(v is None for v in view[0]["granted_limits"].values())


async def test_the_peers_table_wraps_between_capabilities_at_80_columns(tmp_path: Path) -> None:
    """Before: at 80 columns (a pipe's, or a small terminal) each capability column was a few
    characters wide and `task.infer:models=botpsy*` came out as `task.infer:mo` over `dels=botpsy*`,
    two lines that read as two capabilities. Now the columns wrap after a comma, between
    capabilities, and the table still fits in 80 columns."""
    many = ["tool:files.search", "tool:files.read", "task.infer:models=botpsy*", "tool:mcp.notes.*", "web.fetch",
            "web.search", "msg.send", "msg.ask", "task.agent", "tool:system.info", "mail.deposit"]
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home = nodes["home"].home.path
        await pair(home, nodes["phone"].home.path, grant="phone")
        rc, _, err = await _cli(home, "grant", "phone", *many, "--expires", "30d",
                                "--limits", "requests_per_minute=600,concurrent_tasks=8")
        assert rc == 0, err
        rc, text, err = await _cli(home, "peers", env={"COLUMNS": "80"})
        assert rc == 0, err
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= 80, text
        column = [line.split("│")[5].strip() for line in lines if line.startswith("│")]  # may ask us
        shown = [cap.strip() for cap in " ".join(column).split(",")]
        for cap in many:  # each whole on one line, one after the other, a comma between them
            assert any(cap in line.replace(",", " ").split() for line in column), (cap, text)
        assert shown[0] == many[0] and shown[len(many) - 1].startswith(many[-1]), shown
        assert "600 req/min" in column and "8 at once" in column, text  # its limits, below, each whole


async def test_status_lines_label_the_profile_not_a_second_name(tmp_path: Path) -> None:
    """Before: `paired with friend (home)` and `friend (home) psymesh 0.1.0` read as if the
    node were called home. Now the profile is labelled: `friend (profile: home)`."""
    async with run_nodes(tmp_path, "friend", "phone", profiles={"phone": "phone"}) as nodes:
        rc, text, err = await _cli(nodes["friend"].home.path, "status")
        assert rc == 0 and "friend (profile: home) psymesh" in text, err


async def test_a_refusal_says_who_refused_and_doctor_names_this_node_in_its_next_step(tmp_path: Path) -> None:
    """Before: the phone printed `this node is not a web exit` (home said it, about home), home's
    `doctor` said `phone refused a ping: this node has granted you nothing`, then `dialback:phone
    ... no answer`, with the next step `psymesh grant THIS-NODE ... on phone`. Now the refusing
    side names itself, doctor says the phone refused the dial-back too, and names home."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"].home.path, nodes["phone"].home.path
        await pair(home, phone, grant="phone", grant_back=None)  # the README's flow: the phone grants nothing
        rc, text, err = await _cli(home, "doctor")
        said = text + err
        assert "it refused a ping: phone has granted home nothing" in said, said
        assert "this node" not in said and "THIS-NODE" not in said
        assert "psymesh grant home +CAP on phone" in said
        assert "dialback:phone: phone refused to dial back: phone has granted home nothing" in said
        rc, text, err = await _cli(phone, "web", "fetch", "http://127.0.0.1:9/", "--via", "home")
        assert rc != 0 and "home is not a web exit" in err and "this node" not in err, err


async def test_an_unreachable_peer_is_named_once_with_a_short_cause(tmp_path: Path) -> None:
    """Before: `home (12D3…) is unreachable: cannot connect to /ip4/…/p2p/12D3…: unable to
    connect to 12D3…, no addresses established a successful connection (with exceptions)
    (Error 1: …)`, the peer id four times, ~30 lines in `task list`'s state column. Now:
    `home is unreachable since 14:02:01 (connection refused at 127.0.0.1:PORT; …)`."""
    async with run_nodes(tmp_path, "phone", profiles={"phone": "phone"}) as phones:
        phone = phones["phone"].home.path
        async with run_nodes(tmp_path, "home") as homes:
            home_id = homes["home"].identity.peer_id
            await pair(homes["home"].home.path, phone, grant="phone")
        # home is stopped now: its port refuses connections
        rc, text, err = await _cli(phone, "task", "send", "--to", "home", "--tool", "system.info")
        assert rc == 0, err
        line = next(l for l in err.splitlines() if "unreachable" in l)
        assert "warning: home is unreachable since" in line and "(connection refused at 127.0.0.1:" in line, err
        assert home_id[:12] not in err and "Error 1" not in err and "no addresses" not in err
        rc, text, err = await _cli(phone, "task", "list")
        assert rc == 0 and "unreachable since" in text and "refused" not in text, err


async def test_discover_with_discovery_off_says_so_at_once(tmp_path: Path) -> None:
    """Before: `discover --wait 5` with mDNS off waited the whole 5 s, then said `discovery is
    off`. Now it says so at once: with nothing to listen on, there is nothing to wait for."""
    async with run_nodes(tmp_path, "home") as nodes:
        with anyio.fail_after(40):  # a bound on the test, well short of the 60 s it would wait
            rc, text, err = await _cli(nodes["home"].home.path, "discover", "--wait", "60")
        assert rc == 0 and "discovery is off" in err, err


async def test_a_joiner_whose_name_is_taken_is_told_its_name_at_the_inviter(tmp_path: Path) -> None:
    """Before: a second `phone` was stored as `phone-2` at home, and the README said "and told",
    but `pair join` said nothing of it. Now its output says under which name home knows it."""
    async with run_nodes(tmp_path, "home", "phone", "tablet", profiles={"phone": "phone"},
                         configs={"tablet": {"name": "phone"}}) as nodes:
        home = nodes["home"]
        await pair(home.home.path, nodes["phone"].home.path, grant="phone", grant_back=None)
        send, receive = anyio.create_memory_object_stream[Any](1)

        async def inviter() -> None:  # as `pair invite` waits for the device to join
            async with Client(home.home.path) as h:
                await h.pair_invite_and_wait(send.send_nowait, grant="messaging")

        async with anyio.create_task_group() as tg:
            tg.start_soon(inviter)
            invite = await receive.receive()
            rc, text, err = await _cli(nodes["tablet"].home.path, "pair", "join", invite.invite)
        assert rc == 0 and "home knows this node as phone-2" in text, err


async def test_log_lines_name_paired_peers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: `letter … refused by 12D3…`, `denied msg.send to 12D3…` though both peers are
    paired and named. Now the log names them, with a short id: `phone (…Ufwj3kQa)`."""
    caplog.set_level(logging.INFO, logger="psymesh")
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone", grant_back=None)
        home_id, phone_id = nodes["home"].identity.peer_id, nodes["phone"].identity.peer_id
        async with Client(nodes["home"].home.path) as h:  # the phone granted home nothing
            sent = await h.send("phone", "unasked")
            await h.letter(sent.id, wait=True)
        await wait_until(lambda: any("refused by phone" in r.getMessage() for r in caplog.records), "home's log")
        lines = [r.getMessage() for r in caplog.records]
        assert any(f"refused by phone (…{phone_id[-8:]})" in line for line in lines), lines
        assert any(f"denied msg.send to home (…{home_id[-8:]})" in line for line in lines), lines
        assert not any(f"refused by {phone_id}" in line or f"to {home_id}" in line for line in lines)
