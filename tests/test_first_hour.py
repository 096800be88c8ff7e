"""A new user's first hour (issue 22): the README's flows as a user runs them, between real
daemons on loopback, through the `psymesh` command (subprocesses) where the user would.

Each test names the trap it closes: what the user saw before, and what they see now.
"""
from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.node.control.client import Client
from psymesh.protocol.errors import NetworkError
from psymesh.protocol.manifest import revocation

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent


def _command(home: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "psymesh", *args, "--home", str(home)]


async def _cli(home: Path, *args: str, json_mode: bool = True) -> tuple[int, Any, str]:
    """Run the CLI; with --json, stdout parsed as the one JSON document it promises."""
    done = await anyio.run_process(_command(home, *args, *(["--json"] if json_mode else [])), check=False, cwd=REPO)
    out = done.stdout.decode()
    return done.returncode, (json.loads(out) if json_mode and out.strip() else out), done.stderr.decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stderr:
    """What a running CLI process has written to stderr so far."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc, self.text = proc, ""

    async def pump(self) -> None:
        assert self.proc.stderr is not None
        async for chunk in self.proc.stderr:
            self.text += chunk.decode()


# -- 1. a peer that is gone is named at once ------------------------------------------------


async def test_a_stopped_home_is_named_at_once_and_the_queued_work_is_delivered(tmp_path: Path) -> None:
    """Before: with home stopped, `task send --wait` printed "queued for home" and then
    nothing, `msg send --wait` nothing at all. Now both say at once that home is unreachable,
    since when and why, that the work is kept and delivered, and keep waiting; `task list`
    and `msg status` show it; once home is back both finish."""
    port = _free_port()
    home_config = {"home": {"listen": [f"/ip4/127.0.0.1/tcp/{port}"]}}
    async with run_nodes(tmp_path, "phone", profiles={"phone": "phone"}) as phones:
        phone = phones["phone"].home.path
        async with run_nodes(tmp_path, "home", configs=home_config) as homes:
            await pair(homes["home"].home.path, phone, grant="phone")
        # home is stopped now
        async with await anyio.open_process(_command(phone, "task", "send", "--to", "home", "--tool",
                                                     "system.info", "--wait"), cwd=REPO) as task_proc, \
                await anyio.open_process(_command(phone, "msg", "send", "home", "are you there?", "--wait"),
                                         cwd=REPO) as msg_proc:
            task_err, msg_err = _Stderr(task_proc), _Stderr(msg_proc)
            async with anyio.create_task_group() as tg:
                tg.start_soon(task_err.pump)
                tg.start_soon(msg_err.pump)
                await wait_until(lambda: "home is unreachable since" in task_err.text, "task send names home")
                assert "the task is kept here and delivered when home is back; waiting" in task_err.text
                await wait_until(lambda: "home is unreachable since" in msg_err.text, "msg send names home",
                                 timeout=30)
                assert "the letter is kept here and delivered when it is back; waiting" in msg_err.text

                rc, tasks, err = await _cli(phone, "task", "list")
                assert rc == 0, err
                queued = [t for t in tasks["submitted"] if not t["accepted"]]
                assert queued and queued[0]["away"]["since"] > 0 and queued[0]["target"] == "home"
                rc, human, _ = await _cli(phone, "task", "list", json_mode=False)
                assert "unreachable since" in human

                async with run_nodes(tmp_path, "home", configs=home_config):
                    with anyio.fail_after(60):
                        assert await task_proc.wait() == 0, task_err.text
                        assert await msg_proc.wait() == 0, msg_err.text
                tg.cancel_scope.cancel()
            assert task_proc.stdout is not None and msg_proc.stdout is not None
            assert "delivered" in (await msg_proc.stdout.receive()).decode()


async def test_a_node_back_on_another_port_tells_its_peers_where_it_is(tmp_path: Path) -> None:
    """The tour's friend listened on a port picked at each start: restarted, it was at a new one,
    and the phone, which only dials it, kept dialing the old one for good. Now a node that listens
    elsewhere than at its last run dials its paired peers once as it starts, and tells them."""
    async with run_nodes(tmp_path, "phone", profiles={"phone": "phone"}) as phones:
        phone = phones["phone"].home.path
        async with run_nodes(tmp_path, "friend") as first:
            await pair(first["friend"].home.path, phone, grant="phone")
            before = set(first["friend"].p2p.addrs())
        async with run_nodes(tmp_path, "friend") as second, Client(phone) as client:
            assert not before & set(second["friend"].p2p.addrs())  # another port

            async def reached() -> bool:
                try:
                    await client.ping("friend", count=1)
                except NetworkError:
                    return False
                return True

            await wait_until(reached, "the phone to reach friend at its new port", timeout=30)

            async def told() -> bool:  # on the connection friend opened (the ping may come first)
                [peer] = await client.peers()
                return bool(set(peer.addrs) & set(second["friend"].p2p.addrs()))

            await wait_until(told, "the phone to hold friend's new addresses", timeout=10)


# -- 2. the answer to an ask comes back with the README's pairing ------------------------------


class _Answers:
    """Home's agent, as the answering service calls it (`AgentTaskRunner.run`'s seam)."""

    async def run(self, goal: str, params: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {"answer": f"two invoices came this week (you asked: {goal})", "steps": 1, "stopped": "final",
                "tool_calls": []}


async def test_an_ask_is_answered_when_the_asker_granted_nothing_back(tmp_path: Path) -> None:
    """Before: the README pairs with `pair join psymesh1:...` (no --grant), so the phone grants
    home nothing, and refused home's answer letter ("this node has granted you nothing"):
    `msg ask` timed out promising an inbox delivery that never came. Now the answer to a
    question the phone asked is admitted as that (its id derives from the ask); any other
    letter from home is still refused."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        home.answering.agents = _Answers()
        await pair(home.home.path, phone.home.path, grant="phone", grant_back=None)  # the README's flow
        rc, answer, err = await _cli(phone.home.path, "msg", "ask", "home", "Which invoices came this week?",
                                     "--timeout", "60s")
        assert rc == 0, err
        assert answer["kind"] == "answer" and answer["sender_name"] == "home"
        assert answer["text"] == "two invoices came this week (you asked: Which invoices came this week?)"
        async with Client(home.home.path) as h:  # a plain letter from home: the phone granted it nothing
            sent = await h.send("phone", "unasked")
            refused = await h.letter(sent.id, wait=True)
        assert refused.state == "refused" and "phone has granted home nothing" in refused.reason
        rows = phone.audit.query(peer_id=home.identity.peer_id, limit=10)
        assert [(r["operation"], r["allowed"]) for r in rows][-2:] == [("msg.send", True), ("msg.send", False)]


# -- 3. a revoked peer pairs again -------------------------------------------------------------


async def test_a_revoked_phone_pairs_again_with_a_new_invite(tmp_path: Path) -> None:
    """Before: after `psymesh revoke`, a new invite failed with "the inviter is unreachable"
    (home refused the phone's connection at the handshake), although security.md says it
    can get back in by pairing again. Now revocation ends the grant, not the key: the phone
    pairs again through the CLI, its old grant stays revoked, the new one works."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone", grant_back=None)
        old_grant = home.trust.get(phone.identity.peer_id).granted
        old_serial = old_grant.serial
        rc, _, err = await _cli(home.home.path, "revoke", "phone")
        assert rc == 0, err
        await wait_until(lambda: phone.trust.get(home.identity.peer_id).revoked_us_at is not None,
                         "the phone to take home's notice")
        rc, _, err = await _cli(phone.home.path, "ping", "home", "--count", "1")
        assert rc == 1 and "revoked" in err

        async with Client(home.home.path) as h:
            invite = await h.pair_invite(grant="phone")
        rc, joined, err = await _cli(phone.home.path, "pair", "join", invite.invite)
        assert rc == 0, err
        again = home.trust.get(phone.identity.peer_id)
        assert not again.revoked and again.granted.serial > old_serial
        rc, pings, err = await _cli(phone.home.path, "ping", "home", "--count", "1")
        assert rc == 0, err
        rc, shown, err = await _cli(phone.home.path, "ping", "home", "--count", "1", json_mode=False)
        assert rc == 0 and "bytes from home:" in shown, err  # the peer's name, not the start of its id
        # the old grant stays void: the notice that revoked it (replayed) cannot revoke the new one
        old_notice = revocation(home.identity.peer_id, phone.identity.peer_id, old_grant, now=0)
        assert old_notice.voids(old_grant)
        assert not old_notice.voids(phone.trust.get(home.identity.peer_id).received)


# -- 4. config.toml stays valid when the docs' sections are appended -----------------------------


async def test_an_appended_mcp_table_is_served_and_mcp_add_edits_the_config(tmp_path: Path) -> None:
    """Before: `psymesh id` wrote `mcp = []` (and every other default) into config.toml, so
    the `[[mcp]]` block docs/bridges.md says to append gave `Cannot mutate immutable
    namespace ('mcp',)` and the node would not start. Now config.toml holds only what
    differs from the defaults; the appended block is served, and `psymesh mcp add / list /
    remove` edit the file for people who would rather not."""
    home = tmp_path / "home"
    rc, ident, err = await _cli(home, "id")
    assert rc == 0, err
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "groceries.md").write_text("milk eggs bread")
    config = home / "config.toml"
    with config.open("a") as f:  # as docs/bridges.md says, word for word but for the paths
        f.write(f'\n[[mcp]]\nname = "notes"\ncommand = [{json.dumps(sys.executable)}, '
                f'{json.dumps(str(REPO / "examples" / "mcp_server.py"))}, {json.dumps(str(notes))}]\n')
    rc, listed, err = await _cli(home, "mcp", "list")
    assert rc == 0, err
    assert [m["name"] for m in listed] == ["notes"]
    async with run_nodes(tmp_path, "home") as nodes:
        await wait_until(lambda: any(name.startswith("mcp.notes.") for name in nodes["home"].tools.names()),
                         "the notes server's tools are mounted", timeout=60)

    added = await anyio.run_process([sys.executable, "-m", "psymesh", "mcp", "add", "--home", str(home), "echo",
                                     "--", sys.executable, "-c", "pass", "--flag"], check=False, cwd=REPO)
    assert added.returncode == 0, added.stderr.decode()
    assert "mcp server echo added" in added.stdout.decode()
    rc, listed, _ = await _cli(home, "mcp", "list")
    assert [(m["name"], m["command"]) for m in listed] == [
        ("notes", [sys.executable, str(REPO / "examples" / "mcp_server.py"), str(notes)]),
        ("echo", [sys.executable, "-c", "pass", "--flag"])]
    rc, _, err = await _cli(home, "mcp", "remove", "notes")
    assert rc == 0, err
    rc, listed, _ = await _cli(home, "mcp", "list")
    assert [m["name"] for m in listed] == ["echo"]
    rc, _, err = await _cli(home, "mcp", "remove", "notes", json_mode=False)
    assert rc == 1 and "no MCP server 'notes'" in err


async def test_a_bad_config_is_one_line_naming_file_line_and_key(tmp_path: Path) -> None:
    """Before: several lines of pydantic text and a URL. Now one line: file:line: key: why."""
    home = tmp_path / "home"
    assert (await _cli(home, "id"))[0] == 0
    with (home / "config.toml").open("a") as f:
        f.write('\n[[mcp]]\nname = "notes"\n')  # neither command nor url
    rc, _, err = await _cli(home, "mcp", "list", json_mode=False)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 1 and len(lines) == 1, err
    assert f"{home / 'config.toml'}:" in lines[0] and "mcp[0]" in lines[0] and "exactly one of command" in lines[0]
    assert "pydantic" not in err


# -- 5. grant adds and takes away one capability, or grants a preset ----------------------------


async def test_grant_adds_and_removes_single_capabilities_and_grants_presets(tmp_path: Path) -> None:
    """Before: the README's `grant` line replaced the whole grant, so the rest of the tour
    failed (`not allowed: tool:system.info`), and `grant home phone phone` said `unknown
    capability 'phone'`. Now +CAP / -CAP edit the grant, --preset grants one by name."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home = nodes["home"].home.path
        await pair(home, nodes["phone"].home.path, grant="phone", grant_back=None)
        rc, before, _ = await _cli(home, "peers")
        phone_caps = before[0]["granted"]
        assert "task.infer" in phone_caps and "tool:system.info" in phone_caps

        rc, r, err = await _cli(home, "grant", "phone", "-task.infer", "+task.infer:models=botpsy*", "--expires",
                                "30d", "--limits", "requests_per_minute=600,concurrent_tasks=8")
        assert rc == 0, err
        expected = [c for c in phone_caps if c != "task.infer"] + ["task.infer:models=botpsy*"]
        assert r["peer"]["granted"] == expected  # the rest of the phone preset stays
        assert r["peer"]["granted_limits"]["requests_per_minute"] == 600

        rc, r, err = await _cli(home, "grant", "phone", "--preset", "messaging")
        assert rc == 0, err
        assert r["peer"]["granted"] == ["msg.send", "msg.ask"]
        assert r["peer"]["granted_limits"]["requests_per_minute"] == 30

        rc, _, err = await _cli(home, "grant", "phone", "phone", json_mode=False)
        assert rc != 0 and "--preset phone" in err
        rc, _, err = await _cli(home, "grant", "phone", "-tool:files.*", json_mode=False)
        assert rc == 1 and "has no tool:files.* to remove (it has: msg.send, msg.ask)" in err


# -- 6. the context a model gets, and an eval that cannot fit ------------------------------------


async def test_model_add_takes_the_ggufs_context_and_eval_over_it_fails_naming_ctx(tmp_path: Path,
                                                                                   tiny_model: Path) -> None:
    """Before: `model add` gave every model 4096 tokens whatever its GGUF declared, and
    `eval` at a context too small scored 0 % (each case `too_large`) and exited 0. Now the
    declared context is taken (capped by memory), and such an eval stops at the first case
    with exit status 1 and the `--ctx` to use."""
    home = tmp_path / "home"
    rc, row, err = await _cli(home, "model", "add", "tiny", str(tiny_model))
    assert rc == 0, err
    assert row["n_ctx"] == 32768 and "the GGUF declares 32768" in err  # testmodel's tiny model declares 32768
    rc, row, err = await _cli(home, "model", "add", "small", str(tiny_model), "--ctx", "256")
    assert rc == 0 and row["n_ctx"] == 256, err

    rc, _, err = await _cli(home, "eval", str(REPO / "examples" / "eval_cases.jsonl"), "--model", "small",
                            json_mode=False)
    assert rc == 1, err
    assert "the context holds 256" in err and f"psymesh model add --home {home} small PATH.gguf --ctx 8192" in " ".join(err.split())


def test_the_memory_cap_keeps_a_long_declared_context_in_bounds(tiny_model: Path) -> None:
    from psymesh.node.models import default_context

    assert default_context(tiny_model).declared == 32768
    assert default_context(tiny_model, memory_bytes=1 << 20).n_ctx == 2048  # never below 2048
    # 2 layers, attention in every 2nd: 1 x 1 KV head x (32 + 32) x 2 bytes = 128 bytes a token
    assert default_context(tiny_model, memory_bytes=16 * 128 * 4096).n_ctx == 4096


# -- 7. --listen is remembered; serve reaches a running daemon ------------------------------------


async def test_listen_is_remembered_and_serve_turns_the_endpoint_on_in_the_running_daemon(tmp_path: Path) -> None:
    """Before: `node start --listen ...` held for that run only, so `serve openai`, `serve a2a`
    and the unit `node install` writes came up on a random port; and `serve openai` refused
    while the daemon ran ("another daemon is already serving"). Now the address is saved in
    config.toml, and `serve` against a running daemon turns the endpoint on in it."""
    import httpx

    from psymesh.node.core.home import NodeHome
    from psymesh.node.control.process import DaemonProcess

    home = tmp_path / "home"
    port = _free_port()
    daemon = DaemonProcess(home, name="home", listen=[f"/ip4/127.0.0.1/tcp/{port}"])
    await daemon.start()
    try:
        assert NodeHome(home).load_config().listen == [f"/ip4/127.0.0.1/tcp/{port}"]
        rc, unit, err = await _cli(home, "node", "install", "--dry-run", "--platform", "linux", json_mode=False)
        assert rc == 0, err
        assert "--listen" not in unit  # the unit's `node start` reads the saved address

        http_port = _free_port()
        rc, served, err = await _cli(home, "serve", "openai", "--port", str(http_port))
        assert rc == 0, err
        assert served["url"] == f"http://127.0.0.1:{http_port}/v1" and not served["already"]
        rc, shown, err = await _cli(home, "serve", "openai", "--show-key")  # the key the daemon's endpoint took
        assert rc == 0, err
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {shown['key']}"}) as http:
            models = await http.get(f"{served['url']}/models")
        assert models.status_code == 200 and models.json()["object"] == "list"
        rc, again, err = await _cli(home, "serve", "openai")
        assert rc == 0 and again["already"] and again["url"] == served["url"], err
        async with daemon.client() as client:  # the daemon still listens where it was told
            assert any(f"/tcp/{port}/" in a for a in (await client.status()).addrs)
    finally:
        await daemon.stop()
    # a node `serve` runs in the foreground listens where `node start` was told, too
    async with await anyio.open_process(_command(home, "serve", "a2a", "--port", str(_free_port())),
                                        cwd=REPO) as proc:
        try:
            async def listening() -> bool:
                try:
                    async with Client(home) as client:
                        return any(f"/tcp/{port}/" in a for a in (await client.status()).addrs)
                except Exception:
                    return False

            await wait_until(listening, "the foreground node listens on the saved address", timeout=60)
        finally:
            proc.terminate()
            await proc.wait()


# -- 10. one name, one peer ----------------------------------------------------------------------


async def test_a_second_joiner_with_a_taken_name_is_renamed_and_told(tmp_path: Path) -> None:
    """Before: a second joiner named `phone` was accepted as `phone`, and every name-based
    command became ambiguous. Now it is stored as `phone-2`, and both sides are told."""
    async with run_nodes(tmp_path, "home", "phone", "tablet", profiles={"phone": "phone"},
                         configs={"tablet": {"name": "phone"}}) as nodes:
        home = nodes["home"]
        await pair(home.home.path, nodes["phone"].home.path, grant="phone", grant_back=None)
        send, receive = anyio.create_memory_object_stream[Any](1)
        paired: list[Any] = []

        async def inviter() -> None:  # as `pair invite` waits for the device to join
            async with Client(home.home.path) as h:
                paired.append(await h.pair_invite_and_wait(send.send_nowait, grant="messaging"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(inviter)
            invite = await receive.receive()
            rc, joined, err = await _cli(nodes["tablet"].home.path, "pair", "join", invite.invite)
            assert rc == 0, err
        assert paired[0].name == "phone-2" and paired[0].asked_name == "phone"  # the inviter is told
        async with Client(home.home.path) as h:
            names = sorted(p.name for p in await h.peers())
            assert names == ["phone", "phone-2"]
            rc, r, err = await _cli(home.home.path, "grant", "phone-2", "+msg.send")
            assert rc == 0 and r["peer"]["peer_id"] == nodes["tablet"].identity.peer_id, err


# -- 9. output: names, whole words, one unit of time ------------------------------------------------


async def test_output_names_peers_wraps_tables_and_keeps_one_unit_of_time(tmp_path: Path) -> None:
    """Before: `doctor` printed `peer☎ phone` (rich read `:phone:` as an emoji code), tables cut
    text at 80 columns (`task.inf…`), `audit` showed peer ids, the phone's `peers` still said
    "paired" after home revoked it, and `msg inbox --json` gave `at` in ms beside `received_at`
    in seconds."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"].home.path, nodes["phone"].home.path
        await pair(home, phone, grant="phone")
        rc, text, err = await _cli(phone, "doctor", json_mode=False)
        assert "peer:home" in text + err and "☎" not in text + err
        rc, text, _ = await _cli(home, "peers", json_mode=False)  # a pipe: 80 columns
        assert "phone" in text and "…" not in text  # folded over lines, never cut
        rc, sent, err = await _cli(phone, "msg", "send", "home", "hi", "--wait")
        assert rc == 0, err
        rc, letters, _ = await _cli(home, "msg", "inbox")
        assert abs(letters[0]["at"] - letters[0]["received_at"]) < 60  # both Unix seconds
        rc, text, _ = await _cli(home, "audit", "--limit", "5", json_mode=False)
        assert "phone" in text and nodes["phone"].identity.peer_id[:16] not in text
        rc, _, err = await _cli(home, "revoke", "phone")
        assert rc == 0, err
        await wait_until(lambda: nodes["phone"].trust.get(nodes["home"].identity.peer_id).revoked_us_at is not None,
                         "the phone to take home's notice")
        rc, text, _ = await _cli(phone, "peers", json_mode=False)
        assert "revoked us" in text


# -- 11. on a LAN, a code alone pairs -------------------------------------------------------------

from test_discovery import Lan, NetnsDaemon, daemons, lan  # noqa: E402,F401  (the two-namespace LAN fixture)


@pytest.mark.netns
async def test_on_a_lan_a_bare_code_finds_its_inviter_and_discover_returns_at_once(lan: Lan, tmp_path: Path) -> None:
    """Before: with mDNS on, `pair join CODE` said "a bare pairing code needs the inviter's
    address too" although `discover` had just listed the inviter, and `discover --wait 5`
    waited the full 5 s with the inviter already listed. Now the joiner tries the unpaired
    nodes it discovered, and discover answers as soon as it has something to show."""
    home = NetnsDaemon(lan.a, tmp_path / "home", "home")
    phone = NetnsDaemon(lan.b, tmp_path / "phone", "phone")
    async with daemons(home, phone):
        sh = await home.start()
        await phone.start()
        t0 = anyio.current_time()
        rc, nodes, err = await _cli(phone.home, "discover", "--wait", "30")  # returns with the first node seen
        assert rc == 0, err
        assert [n["peer_id"] for n in nodes] == [sh.peer_id] and anyio.current_time() - t0 < 25
        t0 = anyio.current_time()
        rc, nodes, err = await _cli(phone.home, "discover", "--wait", "5")  # it holds the node: at once
        assert rc == 0 and nodes and anyio.current_time() - t0 < 4, err

        send, receive = anyio.create_memory_object_stream[Any](1)
        paired: list[Any] = []

        async def inviter() -> None:
            async with Client(home.home) as h:
                paired.append(await h.pair_invite_and_wait(send.send_nowait, grant="phone"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(inviter)
            invite = await receive.receive()
            rc, joined, err = await _cli(phone.home, "pair", "join", invite.code)  # the code alone
            assert rc == 0, err
        assert joined["peer_id"] == sh.peer_id and joined["name"] == "home"
        assert paired[0].verification == joined["verification"]
        rc, pong, err = await _cli(phone.home, "ping", "home", "--count", "1")
        assert rc == 0, err


# -- 12. a relay added after pairing -----------------------------------------------------------------

from netns import Namespaces, ip, namespaces  # noqa: E402,F401  (a fixture, used by name)
from netns import NetnsDaemon as NsDaemon  # noqa: E402


@pytest.mark.netns
async def test_a_phone_paired_before_home_had_a_relay_reaches_home_through_it(namespaces: Namespaces,
                                                                             tmp_path: Path) -> None:
    """Before: a phone paired over a direct link before home took a reservation at a relay
    only ever dialed home's old addresses (and 127.0.0.1:4001, its own listener), so once the
    direct link was gone `task send --wait` waited in silence. Now a peer not reached at its
    stored addresses is tried through the relays this node is paired with."""
    from psymesh.node.core.home import NodeHome
    from psymesh.protocol.relay import RelaySettings

    relay_ns, home_ns, phone_ns = namespaces.add("r"), namespaces.add("h"), namespaces.add("p")
    namespaces.link(relay_ns, "10.72.1.1", home_ns, "10.72.1.2")
    namespaces.link(relay_ns, "10.72.2.1", phone_ns, "10.72.2.2")
    namespaces.link(home_ns, "10.72.3.1", phone_ns, "10.72.3.2")
    relay_home = NodeHome(tmp_path / "relay")
    relay_home.init(name="relay")
    relay_home.save_config(relay_home.load_config().model_copy(update={"relay": RelaySettings(enabled=True)}))
    relay = NsDaemon(relay_ns, tmp_path / "relay", "relay")
    home = NsDaemon(home_ns, tmp_path / "home", "home")
    phone = NsDaemon(phone_ns, tmp_path / "phone", "phone", profile="phone")
    async with daemons(relay, home, phone):
        await relay.start()
        home_id = (await home.start()).peer_id
        await phone.start()
        await pair(home.home, phone.home, grant="phone", grant_back=None)  # over the direct link
        await pair(relay.home, home.home, grant="messaging")
        await pair(relay.home, phone.home, grant="messaging")
        async with relay.client() as r:
            await r.grant("home", ["relay"])
            await r.grant("phone", ["relay"])

        # The direct link goes; home restarts keeping a reservation at the relay (a new port, too).
        await home.stop()
        ip("-n", home_ns, "link", "del", f"to{phone_ns[-8:]}")
        config = NodeHome(tmp_path / "home").load_config()
        NodeHome(tmp_path / "home").save_config(config.model_copy(update={"relay": RelaySettings(relays=["relay"])}))
        await home.start()

        async def reserved() -> bool:
            async with home.client() as h:
                return any("/p2p-circuit/" in a for a in (await h.status()).addrs)

        await wait_until(reserved, "home's reservation at the relay", timeout=40)
        with anyio.fail_after(90):
            rc, result, err = await _cli(phone.home, "task", "send", "--to", "home", "--tool", "system.info",
                                         "--wait", json_mode=False)
        assert rc == 0 and "psymesh_version" in result, err
        async with phone.client() as p:
            connections = {c.peer_id: c.addrs for c in (await p.status()).connected_peers}
        assert all("/p2p-circuit/" in a for a in connections[home_id])


def test_a_peers_loopback_address_is_dialed_only_when_it_is_this_host() -> None:
    from psymesh.protocol.addresses import dial_addresses

    home, relay = "12D3KooWHome", "12D3KooWRelay"
    lan, loop = f"/ip4/10.0.0.2/tcp/4001/p2p/{home}", f"/ip4/127.0.0.1/tcp/4001/p2p/{home}"
    circuit = f"/ip4/10.9.0.1/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{home}"
    elsewhere = dial_addresses(home, [lan, loop], [(relay, ["/ip4/10.9.0.1/tcp/4001"])], frozenset({"10.0.0.9"}))
    assert elsewhere == [lan, circuit]  # its 127.0.0.1 would be our own listener
    assert dial_addresses(home, [lan, loop], [], frozenset({"10.0.0.2"})) == [lan, loop]  # it is this host
    assert dial_addresses(home, [loop], [], frozenset()) == [loop]  # nothing else to go by
    assert dial_addresses(home, [circuit], [(relay, ["/ip4/10.9.0.1/tcp/4001"])], frozenset()) == [circuit]
