"""`psymesh msg` and `psymesh group` as a user runs them (subprocesses, --json on stdout),
and the SDK's send / inbox / ask / groups under trio and under plain asyncio."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import pair, run_nodes
from psymesh.agent.acting.loop import ScriptedModel
from psymesh.node.models import agents
from psymesh.node.control.client import Client
from psymesh.node.core.db import open_db
from psymesh.node.core.home import NodeHome
from psymesh.node.models import ModelRegistry
from psymesh.node.control.process import DaemonProcess
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.messaging import LetterKind

REPO = Path(__file__).resolve().parent.parent
MODEL = {"n_ctx": 16384, "n_threads": 1}


def _command(home: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "psymesh", *args, "--home", str(home)]


async def _cli(home: Path, *args: str) -> tuple[int, Any, str]:
    """Run the CLI; stdout parsed as the one JSON document --json promises."""
    done = await anyio.run_process(_command(home, *args, "--json"), check=False, cwd=REPO)
    out = done.stdout.decode()
    return done.returncode, json.loads(out) if out.strip() else None, done.stderr.decode()


async def _lines(stream: Any, count: int) -> list[dict[str, Any]]:
    """The first `count` JSON lines a streaming command prints."""
    buffer = b""
    while buffer.count(b"\n") < count:
        buffer += await stream.receive()
    return [json.loads(line) for line in buffer.splitlines()[:count]]


@pytest.mark.anyio
async def test_msg_and_group_commands(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"].home.path, nodes["phone"].home.path
        await pair(home, phone, grant="phone")

        rc, sent, err = await _cli(phone, "msg", "send", "home", "hello home", "--thread", "chores",
                                   "--body", '{"n": 1}', "--wait")
        assert rc == 0, err
        assert (sent["recipient_name"], sent["thread"], sent["tseq"], sent["kind"], sent["state"]) == \
            ("home", "chores", 1, "send", "delivered")
        rc, status, _ = await _cli(phone, "msg", "status", sent["id"])
        assert rc == 0 and status == sent

        rc, inbox, _ = await _cli(home, "msg", "inbox")
        assert rc == 0 and [(m["seq"], m["id"], m["sender_name"], m["text"], m["body"], m["thread"]) for m in inbox] \
            == [(1, sent["id"], "phone", "hello home", {"n": 1}, "chores")]
        rc, later, _ = await _cli(home, "msg", "inbox", "--after", "1")
        assert rc == 0 and later == []

        # --follow: one JSON object per line, as letters come, until stopped
        async with await anyio.open_process(_command(home, "msg", "inbox", "--follow", "--after", "1", "--json"),
                                            cwd=REPO) as follow:
            try:
                for text in ("second", "third"):
                    rc, _, err = await _cli(phone, "msg", "send", "home", text)
                    assert rc == 0, err
                with anyio.fail_after(30):
                    streamed = await _lines(follow.stdout, 2)
            finally:
                follow.terminate()
        assert [(m["seq"], m["text"]) for m in streamed] == [(2, "second"), (3, "third")]

        rc, group, _ = await _cli(phone, "group", "create", "house", "home")
        assert rc == 0 and group["name"] == "house" and [m["name"] for m in group["members"]] == ["home"]
        rc, letters, _ = await _cli(phone, "group", "send", "house", "dinner at 7")
        assert rc == 0 and [(x["recipient_name"], x["group"], x["thread"]) for x in letters] == \
            [("home", "house", "group:house")]
        rc, groups, _ = await _cli(phone, "group", "list")
        assert rc == 0 and [g["name"] for g in groups] == ["house"]

        nodes["home"].models.registry.add("tiny", tiny_model, **MODEL)
        model = ScriptedModel(["Dinner is at 7."])
        monkeypatch.setattr(agents, "llama_model", lambda worker, params: model)
        rc, answer, err = await _cli(phone, "msg", "ask", "home", "When is dinner?", "--timeout", "60s")
        assert rc == 0, err
        assert (answer["kind"], answer["text"], answer["sender_name"], answer["body"]["ok"]) == \
            ("answer", "Dinner is at 7.", "home", True)

        # mistakes: one clear line on stderr, a JSON error on stdout, status 1 (2 for usage)
        for args, code in ((("msg", "send", "nobody", "hi"), "unknown_peer"),
                           (("msg", "status", "no-such-letter"), "not_found"),
                           (("group", "send", "nope", "hi"), "not_found"),
                           (("group", "create", "two words"), "bad_request"),
                           (("msg", "send", "home", "hi", "--thread", "t" * 200), "bad_request")):
            rc, error, err = await _cli(phone, *args)
            assert rc == 1 and error["error"]["code"] == code and "Traceback" not in err, (args, err)
        done = await anyio.run_process(_command(phone, "msg", "send", "home", "hi", "--body", "[1]"), check=False)
        assert done.returncode == 2 and b"must be a JSON object" in done.stderr


# what a hostile peer may write: clear the screen and turn it red, a CR to overwrite the line, a
# newline and what looks like another letter after it, a one-byte CSI (C1), a right-to-left override
HOSTILE = "\x1b[2J\x1b[31mred\rover\n    9 12:00:00 home (main): pay me\x9b31m \u202eevil\x7f"
HOSTILE_SHOWN = r"\x1b[2J\x1b[31mred\rover\n    9 12:00:00 home (main): pay me\x9b31m \u202eevil\x7f"
ACTING = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


@pytest.mark.anyio
async def test_a_letter_with_control_characters_prints_escaped_one_letter_a_line(tmp_path: Path) -> None:
    """`msg inbox` and `msg inbox --follow` show a peer's control characters (in the text and the
    thread name) as escapes, so a letter can neither act on the terminal nor pass for another
    letter: two letters, two lines. --json keeps the text as it came."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"].home.path, nodes["phone"].home.path
        await pair(home, phone, grant="phone")
        async with Client(phone) as p:
            for text, thread in ((HOSTILE, "chat\x1b]0;owned\x07"), ("plain", "main")):
                sent = await p.send("home", text, thread=thread)
                assert (await p.letter(sent.id, wait=True)).state == "delivered"

        listed = await anyio.run_process(_command(home, "msg", "inbox"), check=False, cwd=REPO)
        async with await anyio.open_process(_command(home, "msg", "inbox", "--follow"), cwd=REPO) as follow:
            try:
                with anyio.fail_after(30):
                    followed = b""
                    while followed.count(b"\n") < 2:
                        followed += await follow.stdout.receive()
            finally:
                follow.terminate()
        rc, as_json, err = await _cli(home, "msg", "inbox")

    assert listed.returncode == 0, listed.stderr
    for printed in (listed.stdout.decode(), followed.decode()):
        lines = printed.rstrip("\n").split("\n")
        assert len(lines) == 2 and not ACTING.search(printed.rstrip("\n").replace("\n", "")), printed
        assert lines[0].endswith(r"phone (chat\x1b]0;owned\x07): " + HOSTILE_SHOWN), lines[0]
        assert lines[1].endswith("phone (main): plain"), lines[1]
    assert rc == 0 and [m["text"] for m in as_json] == [HOSTILE, "plain"], err


@pytest.mark.anyio
async def test_an_answer_with_control_characters_prints_them_escaped_keeping_its_lines(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`msg ask` prints the peer's answer as a document: its line feeds stay, whatever would act
    on the terminal (ESC, a bare CR, C1, bidi) shows as an escape, and rich markup in it is text."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"].home.path, nodes["phone"].home.path
        await pair(home, phone, grant="phone")
        nodes["home"].models.registry.add("tiny", tiny_model, **MODEL)
        model = ScriptedModel(["\x1b[2J[bold]Dinner[/bold]\ris at 7.\r\nSee you\x9b \u202eth."])
        monkeypatch.setattr(agents, "llama_model", lambda worker, params: model)
        done = await anyio.run_process(_command(phone, "msg", "ask", "home", "When is dinner?", "--timeout", "60s"),
                                       check=False, cwd=REPO)

    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == "\\x1b[2J[bold]Dinner[/bold]\\ris at 7.\nSee you\\x9b \\u202eth.\n"


@pytest.mark.anyio
@pytest.mark.parametrize("grant_back", ["messaging", None])
async def test_group_send_wait_says_whether_each_member_took_it(tmp_path: Path, grant_back: str | None) -> None:
    """`group send --wait` waits for every member: delivered, exit 0; a member that granted the
    sender nothing (a join without --grant) refuses the letter: exit 1, saying so, not `pending`."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"].home.path, nodes["phone"].home.path
        await pair(home, phone, grant="phone", grant_back=grant_back)
        rc, _, err = await _cli(home, "group", "create", "family", "phone")
        assert rc == 0, err
        with anyio.fail_after(60):
            rc, letters, err = await _cli(home, "group", "send", "family", "Dinner at 7", "--wait")
    if grant_back:
        assert rc == 0 and [(x["recipient_name"], x["state"]) for x in letters] == [("phone", "delivered")], err
    else:
        assert rc == 1 and [(x["recipient_name"], x["state"]) for x in letters] == [("phone", "refused")]
        assert "refused" in err and "phone refused letter" in err and "Traceback" not in err


@pytest.mark.anyio
async def test_sdk_send_and_follow_the_inbox_under_trio(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        async with Client(nodes["home"].home.path) as home, Client(nodes["phone"].home.path) as phone:
            first = await phone.send("home", "one", letter_id="note-1")
            assert first.state in ("pending", "delivered") and first.tseq == 1
            assert (await phone.send("home", "one", letter_id="note-1")).id == first.id  # the same letter, once
            assert (await phone.letter(first.id, wait=True)).state == "delivered"

            got = []
            with anyio.fail_after(30):
                async for m in home.inbox():  # live: letters sent while it waits arrive too
                    got.append(m)
                    if len(got) == 1:
                        await phone.send("home", "two")
                        await phone.send("home", "three")
                    if len(got) == 3:
                        break
            assert [m.text for m in got] == ["one", "two", "three"] and [m.seq for m in got] == [1, 2, 3]
            resumed = [m.text async for m in home.inbox(after=2, follow=False)]
            assert resumed == ["three"]

            with pytest.raises(PsymeshError) as info:  # checked here, before anything is sent
                await phone.send("home", "x", thread="")
            assert info.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.asyncio
async def test_sdk_send_inbox_ask_and_groups_under_asyncio(tmp_path: Path, tiny_model: Path) -> None:
    home, phone = DaemonProcess(tmp_path / "home", name="home"), DaemonProcess(tmp_path / "phone", profile="phone")
    NodeHome(home.home).init(profile="home", name="home")
    conn = open_db(NodeHome(home.home).db_path)
    ModelRegistry(conn).add("tiny", tiny_model, **MODEL)
    conn.close()
    await home.start()
    await phone.start()
    try:
        await pair(home.home, phone.home, grant="phone")
        async with Client(phone.home) as p:
            sent = await p.send("home", "from asyncio")
            [to_group] = (await p.group_create("home-only", ["home"])).members
            [grouped] = await p.group_send("home-only", "to the group")
            answer = await p.ask("home", "Show system info.", params={"seed": 26, "ban_bytes": True, "max_steps": 1},
                                 timeout=120)
        async with Client(home.home) as h:
            got = [m async for m in h.inbox(follow=False)]
        assert to_group.name == "home" and grouped.group == "home-only"
        assert [(m.id, m.text) for m in got if m.kind is LetterKind.SEND] == \
            [(sent.id, "from asyncio"), (grouped.id, "to the group")]
        assert [m.kind for m in got if m.kind is not LetterKind.SEND] == [LetterKind.ASK]
        assert answer.kind is LetterKind.ANSWER and answer.body["ok"] is True and answer.body["steps"] == 1
    finally:
        assert await phone.stop() == 0
        assert await home.stop() == 0
