"""A new user's first hour, second round (issue 34 items 12-16): the README's flows as a user
runs them, between real daemons on loopback, through the `psymesh` command where the user would.

Each test names the trap it closes: what the user saw before, and what they see now.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import pair, run_nodes
from test_first_hour import REPO, _cli, _command  # the CLI as the user runs it
from waiting import wait_until
from psymesh.node.control.client import Client
from psymesh.protocol.errors import ErrorCode, RemoteError
from psymesh.protocol.pairing import PairingCode, parse_invite

pytestmark = pytest.mark.anyio


class _Output:
    """What a running CLI process has written to one of its pipes so far."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.text = stream, ""

    async def pump(self) -> None:
        async for chunk in self.stream:
            self.text += chunk.decode()


# -- 12. an invite nobody watches dies; an expired one says so ----------------------------------


async def test_ctrl_c_in_pair_invite_cancels_the_invite(tmp_path: Path) -> None:
    """Before: Ctrl-C in `pair invite` left the invite valid, and a tablet joined it afterwards.
    Now the invite dies with the waiting command, and a device with its code is told so."""
    async with run_nodes(tmp_path, "home", "tablet") as nodes:
        home, tablet = nodes["home"].home.path, nodes["tablet"].home.path
        async with await anyio.open_process(_command(home, "pair", "invite"), cwd=REPO) as proc:
            out, err = _Output(proc.stdout), _Output(proc.stderr)
            async with anyio.create_task_group() as tg:
                tg.start_soon(out.pump)
                tg.start_soon(err.pump)
                await wait_until(lambda: "waiting for the device to join" in err.text, "the invite shown")
                proc.send_signal(signal.SIGINT)  # the user presses Ctrl-C
                with anyio.fail_after(30):
                    await proc.wait()
        assert "Traceback" not in err.text and "the invite is cancelled" in err.text, err.text
        invite = next(w for w in out.text.split() if w.startswith("psymesh1:"))
        rc, joined, err_text = await _cli(tablet, "pair", "join", invite)
        assert rc == 1 and joined["error"]["code"] == "canceled", (joined, err_text)
        assert "cancelled by the node that made it" in err_text
        assert not nodes["home"].trust.list()  # nobody paired


async def test_an_expired_invite_tells_the_joiner_it_expired(tmp_path: Path) -> None:
    """Before: a joiner with the right code for an expired invite read `bad_code: wrong pairing
    code` (the inviter knew it had expired). Now one who proves the code is told it expired;
    a wrong code still reads as a wrong code (nothing is told to one without the code)."""
    async with run_nodes(tmp_path, "home", "tablet") as nodes:
        async with Client(nodes["home"].home.path) as h, Client(nodes["tablet"].home.path) as t:
            invite = await h.pair_invite(grant="messaging", ttl_s=60)
            nodes["home"].pairing.clock = lambda: time.time() + 120  # its ten minutes went by
            ticket = parse_invite(invite.invite)
            wrong = PairingCode.from_bytes(ticket.code.nameplate, bytes(b ^ 1 for b in ticket.code.secret_bytes))
            with pytest.raises(RemoteError) as info:
                await t.pair_join(str(wrong), address=f"{ticket.addrs[0]}/p2p/{ticket.peer_id}")
            assert info.value.code is ErrorCode.BAD_CODE
            with pytest.raises(RemoteError) as info:
                await t.pair_join(invite.invite)
            assert info.value.code is ErrorCode.EXPIRED and "expired" in info.value.message
        rc, joined, err = await _cli(nodes["tablet"].home.path, "pair", "join", invite.invite, json_mode=False)
        assert rc == 1 and "this invite has expired; ask for a new code" in err and "wrong pairing code" not in err
        assert not nodes["home"].trust.list()


# -- 15. a grant made of +CAP alone has limits ------------------------------------------------------


async def test_a_first_grant_from_plus_cap_starts_from_its_presets_limits(tmp_path: Path) -> None:
    """Before: the README pairs with `pair join` (no --grant), so the phone grants home nothing;
    `grant home +msg.send` then made a grant with `limits: none`. Now a new grant told no
    limits takes its preset's (messaging's for letters, else phone's)."""
    from psymesh.protocol.manifest import PRESETS

    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"].home.path, nodes["phone"].home.path
        await pair(home, phone, grant="phone", grant_back=None)
        rc, r, err = await _cli(phone, "grant", "home", "+msg.send")
        assert rc == 0, err
        assert r["peer"]["granted"] == ["msg.send"]
        assert r["peer"]["granted_limits"] == PRESETS["messaging"][1].model_dump()
        rc, text, err = await _cli(phone, "grant", "home", "+tool:system.info", json_mode=False)
        assert rc == 0 and "limits: none" not in text, err  # an edit keeps the grant's limits
        async with run_nodes(tmp_path / "b", "pc", "tab") as more:
            await pair(more["pc"].home.path, more["tab"].home.path, grant="messaging", grant_back=None)
            rc, r, err = await _cli(more["tab"].home.path, "grant", "pc", "+task.agent")
            assert rc == 0 and r["peer"]["granted_limits"] == PRESETS["phone"][1].model_dump(), err
            rc, r, err = await _cli(more["tab"].home.path, "grant", "pc", "+msg.ask", "--limits",
                                    "concurrent_tasks=none")
            assert rc == 0 and r["peer"]["granted_limits"]["concurrent_tasks"] is None, err  # told so


# -- 13. a home that is away is named as away ---------------------------------------------------------


async def test_agent_run_with_home_stopped_says_home_is_unreachable_since_when(tmp_path: Path) -> None:
    """Before: `agent run --delegate auto` on a phone without a model, home stopped, said home
    "lacks model ...; run there with --delegate auto", which is what the user had just done.
    Now it says home is unreachable, since when and why, and that the phone cannot run it."""
    async with run_nodes(tmp_path, "phone", profiles={"phone": "phone"}) as phones:
        phone = phones["phone"].home.path
        async with run_nodes(tmp_path, "home") as homes:
            await pair(homes["home"].home.path, phone, grant="phone")
        # home is stopped now
        rc, text, err = await _cli(phone, "agent", "run", "what time is it?", "--delegate", "auto", json_mode=False)
        assert rc == 1
        assert "home is unreachable since" in err and "running here" in err, err
        assert "[unavailable]" in err and "this node cannot run the goal itself" in err, err
        assert "run there with --delegate auto" not in err
        rc, peers, err = await _cli(phone, "peers")
        assert rc == 0 and peers[0]["away"]["since"] > 0, err  # `peers --json` shows it too


# -- 14. --json is one document, --wait included --------------------------------------------------------


async def test_json_with_wait_prints_one_document(tmp_path: Path) -> None:
    """Before: `task send --wait --json` printed every event as its own JSON document, then the
    result as another; `pair invite --wait --json` the invite, then the pairing. Now stdout is
    one document in each, with what happened on the way inside it (README: --json)."""
    async with run_nodes(tmp_path, "home", "phone", "tablet", profiles={"phone": "phone"}) as nodes:
        home, phone, tablet = (nodes[n].home.path for n in ("home", "phone", "tablet"))
        await pair(home, phone, grant="phone")
        rc, doc, err = await _cli(phone, "task", "send", "--to", "home", "--tool", "system.info", "--wait")
        assert rc == 0, err  # _cli parses stdout whole: one document
        assert doc["state"] == "completed" and "psymesh_version" in doc["result"] and doc["target"]
        assert doc["events"] and doc["events"][-1]["state"] == "completed"
        rc, watched, err = await _cli(phone, "task", "watch", doc["task_id"])
        assert rc == 0 and watched["task_id"] == doc["task_id"] and watched["state"] == "completed", err
        assert [e["seq"] for e in watched["events"]] == [e["seq"] for e in doc["events"]]
        rc, listed, err = await _cli(phone, "task", "list", json_mode=False)
        assert rc == 0 and "system.info {}" in listed, err  # what each task asks (item 16)

        async with await anyio.open_process(_command(home, "pair", "invite", "--wait", "--json"),
                                            cwd=REPO) as proc:
            out, err_out = _Output(proc.stdout), _Output(proc.stderr)
            async with anyio.create_task_group() as tg:
                tg.start_soon(out.pump)
                tg.start_soon(err_out.pump)
                await wait_until(lambda: "waiting for the device to join" in err_out.text, "the invite shown")
                assert out.text == ""  # nothing on stdout until the end
                invite = next(w for w in err_out.text.split() if w.startswith("psymesh1:"))
                rc, joined, err = await _cli(tablet, "pair", "join", invite)
                assert rc == 0, err
                with anyio.fail_after(30):
                    assert await proc.wait() == 0, err_out.text
        doc = json.loads(out.text)
        assert doc["invite"]["invite"] == invite and doc["paired"]["verification"] == joined["verification"]


# -- 16. the dashboard says which box does what, what was refused, what each task is -------------------

from test_ui import UI, Browser, _login, browser_test  # noqa: E402  (Chromium via Playwright, as test_ui)


@browser_test
async def test_dashboard_explains_boxes_audits_the_refusal_and_details_tasks(tmp_path: Path) -> None:
    """Before: the Peers page showed `tool:web.fetch` and `web.fetch` as two look-alike boxes;
    the audit said `web.search allowed` for a search then refused because home was no exit;
    task rows said only `tool on home`. Now each box says what it lets the peer do, the
    refusal has its row, and a task row says what the task asks (and why it failed)."""
    from psymesh.protocol.errors import PsymeshError

    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"},
                         configs={"home": UI, "phone": UI}) as nodes, \
            Browser.running() as browser, Client(nodes["phone"].home.path) as phone:
        home = nodes["home"]
        await pair(home.home.path, nodes["phone"].home.path, grant="phone")
        async with Client(home.home.path) as h:
            await h.grant("phone", add=["tool:web.fetch"])  # beside the phone preset's web.fetch
        with pytest.raises(PsymeshError) as refused:
            await phone.web_search("weather in lyon", via="home")
        assert "not a web exit" in refused.value.message
        done = await phone.delegate("home", tool="system.info", args={})
        await done.result()
        failed = await phone.delegate("home", tool="files.read", args={"path": "no-such-file.txt"})
        with pytest.raises(PsymeshError):
            await failed.result()

        def look() -> dict[str, Any]:
            page = browser.page()
            base = _login(page, home)
            page.goto(base + "/peers")
            helps = {page.inner_text(f"label.cap:has(input[value='{cap}']) .cap-help")
                     for cap in ("tool:web.fetch", "web.fetch")}
            page.goto(base + "/activity")
            audit = page.inner_text("#audit")
            ran = page.inner_text("#tasks-run")
            phone_page = browser.page()
            phone_page.goto(_login(phone_page, nodes["phone"]) + "/activity")
            return {"helps": helps, "audit": audit, "ran": ran, "sent": phone_page.inner_text("#tasks")}

        seen = await browser.do(look)
    tool_help, exit_help = sorted(seen["helps"], key=lambda h: "inside a task" not in h)
    assert "inside a task" in tool_help and "exit to the web" in exit_help and "not the tool:web.fetch" in exit_help
    assert "search 'weather in lyon'" in seen["audit"] and "not a web exit" in seen["audit"]
    assert "system.info {}" in seen["ran"] and 'files.read {"path": "no-such-file.txt"}' in seen["ran"]
    assert "system.info {}" in seen["sent"] and "no-such-file.txt" in seen["sent"], seen["sent"]
    assert "failed" in seen["sent"] and ":" in seen["sent"].split("no-such-file.txt", 1)[1]  # and why
