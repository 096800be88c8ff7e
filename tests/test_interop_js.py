"""Another implementation on the wire (issue 34 item 8): a js-libp2p peer against a real daemon.

tests/interop/peer.mjs is a small psymesh peer in JavaScript (js-libp2p 3, @chainsafe/libp2p-noise,
@chainsafe/libp2p-yamux, @libp2p/tcp; npm packages pinned by tests/interop/package-lock.json, installed
by scripts/bootstrap.sh), written from docs/protocol.md alone: its own canonical msgpack, SPAKE2, key
schedule and signatures, and the word list read from the document's Appendix A. It connects to an
in-process daemon on loopback, is refused as a stranger, pairs from an invite string, pings, runs a tool
task and sends letters; it checks the daemon's bytes and signatures itself (the pairing MAC, the grant's
signature, the receipt's), and this side checks what the daemon kept. Skipped, saying why, only where
Node or the npm packages cannot be had.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import anyio
import pytest

from conftest import run_nodes
from waiting import wait_until
from psymesh.node.control.client import Client
from psymesh.protocol import control as c

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
PEER_DIR = ROOT / "tests" / "interop"
PROTOCOL_MD = ROOT / "docs" / "protocol.md"


def _node_ready() -> str | None:
    """None when `node peer.mjs` can run; else why not (installing the pinned packages once if needed)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None:
        return "no `node` on PATH (scripts/bootstrap.sh installs nodejs and npm on Debian as root)"
    installed = PEER_DIR / "node_modules" / ".package-lock.json"  # npm writes it; older: the pins changed
    if not installed.exists() or installed.stat().st_mtime < (PEER_DIR / "package-lock.json").stat().st_mtime:
        if npm is None:
            return "no `npm` on PATH to install tests/interop's pinned packages"
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--fetch-retries=1"], cwd=PEER_DIR,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if line.startswith("npm error")][:3]
            return f"npm ci in tests/interop failed (is the npm registry reachable?): {' / '.join(errors)}"
    return None


@pytest.fixture(scope="module")
def js_peer() -> list[str]:
    """The command that runs the JavaScript peer (its arguments follow)."""
    if (why := _node_ready()) is not None:
        pytest.skip(why)
    return [shutil.which("node") or "node", str(PEER_DIR / "peer.mjs"), str(PROTOCOL_MD)]


async def run_peer(command: list[str], invite: str, letters: str) -> dict[str, dict]:
    """Run the peer to the end (bounded) and return its steps by name."""
    with anyio.fail_after(90):
        done = await anyio.run_process([*command, invite, letters], check=False, cwd=PEER_DIR)
    lines = [json.loads(line) for line in done.stdout.decode().splitlines() if line.startswith("{")]
    steps = {line["step"]: line for line in lines}
    assert "crashed" not in steps, steps["crashed"]["error"]
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return steps


async def inbox_bodies(client: Client) -> dict[str, dict]:
    return {m.id: {"text": m.text, "body": m.body, "sender": m.sender, "tseq": m.tseq}
            async for m in client.inbox(follow=False)}


async def test_a_js_libp2p_peer_is_refused_as_a_stranger_then_pairs_pings_runs_a_task_and_writes(
        tmp_path: Path, js_peer: list[str]) -> None:
    async with run_nodes(tmp_path, "home") as nodes:
        home = nodes["home"]
        invites: list[c.PairInviteReply] = []
        paired: list[c.PairedReply] = []

        async def invite_and_wait() -> None:  # as `psymesh pair invite` does: the inviter shows the words
            async with Client(home.home.path) as w:
                paired.append(await w.pair_invite_and_wait(invites.append, name="js-phone"))

        async with Client(home.home.path) as h, anyio.create_task_group() as tg:
            tg.start_soon(invite_and_wait)
            await wait_until(lambda: invites, "the invite")
            steps = await run_peer(js_peer, invites[0].invite, "float")
            await wait_until(lambda: paired, "the inviter to see the pairing")
            for name in ("examples", "connect", "stranger", "pair", "ping", "task", "letter:float", "done"):
                assert steps[name]["ok"], steps[name]
            assert steps["stranger"]["refusal"]["code"] == "unknown_peer"
            assert "tool:system.info" in steps["pair"]["capabilities"]
            assert steps["task"]["kinds"][0] == "accepted" and steps["task"]["state"] == "completed"

            js_id = steps["done"]["peer_id"]
            # the key schedule agrees: both sides show the same verification words
            words = steps["pair"]["words"].split()
            assert len(words) == 4 and re.findall(r"[a-z]+", paired[0].verification) == words
            assert (paired[0].peer_id, paired[0].name, paired[0].role) == (js_id, "js-phone", "node")
            peers = {p.peer_id: p for p in await h.peers()}
            assert peers[js_id].name == "js-phone"
            letter = (await inbox_bodies(h))[steps["letter:float"]["id"]]
            assert letter["sender"] == js_id and letter["text"] == "a float in the body"
            assert letter["body"] == {"ratio": 2.5, "nested": {"z": -0.125, "a": "x", "list": [1, 0.5, None]}}
            rows = {(r.operation, r.allowed, r.code) for r in await h.audit(peer=js_id, limit=100)}
            assert {("tool:system.info", True, None), ("msg.send", True, None), ("ping", True, None)} <= rows, rows
            assert ("/psymesh/session/1.0.0", False, "unknown_peer") in rows  # as a stranger


async def test_a_js_letter_with_whole_floats_and_big_integers_is_stored(tmp_path: Path, js_peer: list[str]) -> None:
    """What a non-Python encoder may write: 2.0 and 0.0 as float64, 2^64-1 as uint64, -2^63 as int64,
    a map built in another key order. Signed as §3 says, the letter must be stored (issue 34 item 1)
    and its values kept."""
    async with run_nodes(tmp_path, "home") as nodes:
        async with Client(nodes["home"].home.path) as h:
            invite = await h.pair_invite(name="js-phone")
            steps = await run_peer(js_peer, invite.invite, "whole")
            assert steps["letter:whole"]["ok"], steps["letter:whole"]
            body = (await inbox_bodies(h))[steps["letter:whole"]["id"]]["body"]
            assert body == {"whole": 2.0, "zero": 0.0, "big": 2**64 - 1, "small": -2**63, "m": {"a": 2, "b": 1}}
            assert isinstance(body["big"], int)  # not a float that lost the last bits
