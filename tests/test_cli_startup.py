"""CLI start-up (issue 22 item 13): a command that only asks the daemon imports only what it needs.

Scripts call `psymesh status` in loops, and on a phone CPU every module a command imports is felt on
every call. bench/cli.py measures the time; these tests check, in a fresh interpreter running the real
CLI against a real daemon, that the heavy modules stay out: trio and libp2p (the daemon's), cryptography,
rich under --json, llama_cpp, the node's config models and key (core/home.py), and the protocol modules of
letters, tasks, web queries and grants, which `status` has no message of. What is imported is behaviour
(it is what a user waits for), so this is no timed assertion.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from psymesh.node.control.client import Client
from psymesh.node.control.oneshot import ASKS
from psymesh.protocol.messages import message_types

# never needed by a command that only asks the daemon
HEAVY = ("trio", "libp2p", "cryptography", "llama_cpp", "pyhpke", "psymesh.node.core.home",
         "psymesh.protocol.messaging", "psymesh.protocol.tasks", "psymesh.protocol.web", "psymesh.protocol.manifest",
         "psymesh.protocol.mailbox")

# what `psymesh status` does without as well: it asks with the blocking one-shot client
# (node/control/oneshot.py), which builds no model and runs no event loop
SDK = ("pydantic", "asyncio", "anyio", "psymesh.node.control.client", "psymesh.protocol.messages")

ROOT = Path(__file__).resolve().parent.parent


async def cli_fresh(*args: str, heavy: tuple[str, ...] = (*HEAVY, "rich")) -> tuple[str, list[str]]:
    """Run `psymesh ARGS` in a new interpreter: (what it printed, which of `heavy` it imported)."""
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        sys.argv = ["psymesh", *{list(args)!r}]
        from psymesh.node.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main()
            except SystemExit as exc:
                assert not exc.code, exc.code
        held = [m for m in {heavy!r} if m in sys.modules]
        print(json.dumps({{"out": out.getvalue(), "held": held}}))
    """)
    done = await anyio.run_process([sys.executable, "-c", code], check=True)
    got = json.loads(done.stdout.decode().splitlines()[-1])
    return got["out"], got["held"]


@pytest.mark.anyio
async def test_status_json_imports_none_of_the_heavy_modules(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home") as nodes:
        out, held = await cli_fresh("status", "--json", "--home", str(nodes["home"].home.path),
                                    heavy=(*HEAVY, "rich", *SDK))
    assert json.loads(out)["peer_id"] == nodes["home"].p2p.peer_id
    assert held == []


@pytest.mark.anyio
async def test_status_for_people_loads_rich_to_print_and_nothing_else_heavy(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home") as nodes:
        out, held = await cli_fresh("status", "--home", str(nodes["home"].home.path), heavy=(*HEAVY, "rich", *SDK))
    assert nodes["home"].p2p.peer_id in out and "no connected peers" in out
    assert held == ["rich"]


@pytest.mark.anyio
async def test_status_without_the_sdk_says_what_the_sdk_says(tmp_path: Path) -> None:
    """The one-shot client hands `status` the daemon's reply as it was sent: `--json` is the
    SDK's model dump field for field (a connected, named peer; reachability), and the
    words for people name the peer."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path)
        async with Client(nodes["phone"].home.path) as phone:
            await phone.ping("home", count=1)
            sdk = (await phone.status()).model_dump(mode="json")
        out, _ = await cli_fresh("status", "--json", "--home", str(nodes["phone"].home.path))
        words, _ = await cli_fresh("status", "--home", str(nodes["phone"].home.path))
    got = json.loads(out)
    assert got.pop("uptime_s") >= sdk.pop("uptime_s")
    assert got == sdk and [p["name"] for p in got["connected_peers"]] == ["home"]
    assert "home" in words.split("connected peer")[1] and nodes["phone"].p2p.peer_id in words


def test_what_the_one_shot_client_asks_is_in_the_catalogue() -> None:
    """ASKS names requests and replies by their `type`: each must be a control message."""
    types = message_types()
    for request, reply in ASKS.items():
        assert request.startswith("control.") and request in types and reply in types


@pytest.mark.anyio
@pytest.mark.parametrize("command", [["peers", "--json"], ["audit", "--json", "--limit", "5"]])
async def test_other_commands_that_ask_the_daemon_stay_light_too(tmp_path: Path, command: list[str]) -> None:
    async with run_nodes(tmp_path, "home") as nodes:
        out, held = await cli_fresh(*command, "--home", str(nodes["home"].home.path))
    assert isinstance(json.loads(out), list)
    assert held == []


@pytest.mark.anyio
async def test_help_lists_every_command_without_loading_models_or_the_sdk() -> None:
    """`psymesh --help` imports every command's module to list them: none of those imports may
    build a model or reach for the SDK; that is what each command does when it runs."""
    out, held = await cli_fresh("--help", heavy=(*HEAVY, "rich", "pydantic", "psymesh.node.control.client",
                                                  "psymesh.protocol.control.node"))
    assert "status" in out and "agent" in out and "node" in out
    assert held == []


def test_the_control_catalogue_names_each_of_its_messages_once() -> None:
    """protocol/control/__init__.py finds a name's module in `_GROUPS`: every name a group module
    defines is listed under it, and only there, so `control.X` always finds X."""
    from psymesh.protocol import control

    for group, names in control._GROUPS.items():
        tree = ast.parse((ROOT / "protocol" / "control" / f"{group}.py").read_text())
        defined = set()
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
        assert sorted(names) == sorted(d for d in defined if not d.startswith("_")), group
        for name in names:
            assert getattr(control, name) is getattr(sys.modules[f"psymesh.protocol.control.{group}"], name)
    every = [n for names in control._GROUPS.values() for n in names]
    assert len(every) == len(set(every))


def test_a_reply_of_a_group_not_yet_imported_still_decodes() -> None:
    """A peer or daemon may send any message: unpack() imports the group it is in on first sight."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        import msgpack
        from psymesh.protocol import control
        from psymesh.protocol.messages import unpack
        assert "psymesh.protocol.control.trust" not in sys.modules
        reply = unpack(msgpack.packb({"v": 1, "type": "control.peers_reply", "peers": []}))
        print(type(reply).__module__)
    """)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "psymesh.protocol.control.trust"
