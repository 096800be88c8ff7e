"""The control API's typed replies, as the SDK and the CLI get them from a real daemon;
per-grant limits from the command line; the network failing, told apart from a refusal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from psymesh.agent.acting.tools import tool_from_function
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.control.process import DaemonProcess
from psymesh.protocol import control as c
from psymesh.protocol.common import Error
from psymesh.protocol.dialback import DialBackReply
from psymesh.protocol.errors import (
    ConnectError,
    ConnectionLost,
    NETWORK_FAILURES,
    ErrorCode,
    NetworkError,
    NetworkTimeout,
    ProtocolError,
    PsymeshError,
    RemoteError,
    raised,
)
from psymesh.protocol.limits import Limits
from psymesh.protocol.manifest import PRESETS
from psymesh.protocol.messages import pack, unpack
from psymesh.protocol.tasks import TaskKind, TaskState
from waiting import wait_until

pytestmark = pytest.mark.anyio

CAPS = ["tool:system.info", "task.agent", "msg.send"]


def hold_tasks(home: Node) -> None:
    """`test.held` runs until canceled: a task that stays in home's list (finished ones that the
    phone has fetched are purged by home's housekeeping)."""
    async def held() -> dict:
        await anyio.sleep_forever()
        return {}

    home.tools.register(tool_from_function(held, "test.held"))


async def working(client: Client, task_id: str) -> None:
    async def there() -> bool:
        return any(t.task_id == task_id and t.state is TaskState.WORKING for t in (await client.tasks()).submitted)

    await wait_until(there, f"task {task_id} to be working")


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "psymesh", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PSYMESH_HOME": str(home), "COLUMNS": "200"})  # tables unwrapped


async def run_cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: cli(home, *args))


# ---------------------------------------------------------------------------- the wire


def test_every_typed_reply_survives_the_wire_as_itself() -> None:
    peer = c.PeerView(peer_id="12D3KooWx", name="phone", role="phone", addrs=["/ip4/127.0.0.1/tcp/1"], paired_at=1.0,
                      granted=["msg.send"], granted_limits=Limits(concurrent_tasks=8), connected=True)
    replies = [
        c.PeersReply(peers=[peer]),
        c.PeerReply(peer=peer, delivered=True),
        c.AuditReply(rows=[c.AuditRow(id=1, ts=2.0, peer_id="p", protocol="/psymesh/session/1.0.0",
                                      operation="ping", allowed=False, code="forbidden", reason="no")]),
        c.TaskListReply(
            submitted=[c.SubmittedTaskView(task_id="t1", kind=TaskKind.TOOL, target="home", state=TaskState.WORKING,
                                           accepted=True, events=3, created_at=1.0, updated_at=2.0)],
            executing=[c.ExecutingTaskView(task_id="t2", kind=TaskKind.AGENT, submitter="phone",
                                           state=TaskState.COMPLETED, last_seq=9, acked_seq=9, created_at=1.0,
                                           updated_at=2.0)]),
        c.OffersReply(offers=[c.Offer(peer_id="h", name="home", models=["tiny"], tools=["system.info"])]),
        c.DoctorReply(listen=["/ip4/0.0.0.0/tcp/4001"], addrs=["/ip4/192.168.1.2/tcp/4001/p2p/x"],
                      reachability=c.Reachability(
                          direct=["/ip4/192.168.1.2/tcp/4001/p2p/x"], relayed=["/ip4/5.6.7.8/tcp/4001/p2p/r/p2p-circuit/p2p/x"],
                          confirmed=[c.ConfirmedAddr(addr="/ip4/1.2.3.4/tcp/4001/p2p/x", by="p", by_name="phone", at=3.0)]),
                      peers=[c.PeerDiagnosis(peer_id="p", name="phone", reachable=True, path="relayed", rtt_ms=9.5,
                                             clock_skew_s=-1.25, dialback=DialBackReply(observed=None))]),
    ]
    for reply in replies:
        again = unpack(pack(reply))
        assert again == reply and type(again) is type(reply)
    assert unpack(pack(replies[3])).submitted[0].state is TaskState.WORKING  # typed, not a str


def test_a_network_failure_crosses_the_control_socket_as_itself_and_a_refusal_stays_one() -> None:
    for exc, cls in ((ConnectError("home is unreachable"), ConnectError),
                     (NetworkTimeout("no answer"), NetworkTimeout),
                     (ConnectionLost("the session broke"), ConnectionLost),
                     (NetworkError("the transport did not say how"), NetworkError)):
        reply = unpack(pack(c.error_reply(exc)))
        assert isinstance(reply, Error) and reply.code == exc.code.value
        again = raised(reply.to_exception())
        assert type(again) is cls and again.code is exc.code and again.message == exc.message
        assert not isinstance(again, RemoteError)
    for refusal in (RemoteError("model not loaded", code=ErrorCode.UNAVAILABLE),   # the peer said so: not the network
                    PsymeshError("no paired peer named 'x'", code=ErrorCode.UNKNOWN_PEER),
                    ProtocolError("undecodable frame"),
                    ProtocolError("an old transport's code", code=ErrorCode.UNAVAILABLE)):  # only the class says "network"
        assert "network" not in c.error_reply(refusal).details
        assert type(raised(c.error_reply(refusal).to_exception())) is RemoteError


# ---------------------------------------------------------------------------- through a daemon


async def test_the_sdk_gets_typed_replies_from_a_real_daemon(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)  # home grants the phone preset
        hold_tasks(home)
        async with Client(home.home.path) as h, Client(phone.home.path) as p:
            [peer] = await h.peers()
            assert isinstance(peer, c.PeerView)
            assert (peer.name, peer.peer_id, peer.revoked_at) == ("phone", phone.identity.peer_id, None)
            assert peer.granted_limits == PRESETS["phone"][1] and "tool:system.info" in peer.granted
            assert peer.received == list(PRESETS["messaging"][0])  # what the phone granted back
            await h.grant("phone", [*CAPS, "tool:test.held"])

            task = await p.delegate("home", tool="system.info")
            assert (await task.result())["profile"] == "home"
            [sent] = (await p.tasks()).submitted
            assert isinstance(sent, c.SubmittedTaskView)
            assert (sent.task_id, sent.kind, sent.target, sent.state) == (task.id, TaskKind.TOOL, "home",
                                                                          TaskState.COMPLETED)
            assert sent.accepted and sent.events >= 2
            held = await p.delegate("home", tool="test.held")
            await working(p, held.id)
            [running] = [t for t in (await h.tasks()).executing if t.task_id == held.id]
            assert isinstance(running, c.ExecutingTaskView)
            assert (running.kind, running.submitter, running.state) == (TaskKind.TOOL, "phone", TaskState.WORKING)
            assert running.last_seq >= 2 and running.deadline is None

            async def phone_connected() -> bool:
                return [x.connected for x in await h.peers()] == [True]

            await wait_until(phone_connected, "home to list the phone as connected")
            [offer] = await p.offers("task.agent")
            assert isinstance(offer, c.Offer) and (offer.name, offer.peer_id) == ("home", home.identity.peer_id)
            assert "system.info" in offer.tools and offer.models == [] and offer.queue_depth == 1  # the held task

            rows = await h.audit(peer="phone")
            assert rows and all(isinstance(r, c.AuditRow) for r in rows)
            assert any(r.operation == "tool:system.info" and r.allowed and r.code is None for r in rows)

            revoked = await h.revoke("phone")
            assert isinstance(revoked, c.PeerReply) and revoked.peer.revoked_at is not None
            assert revoked.delivered  # the phone was there to take the notice


async def test_grant_limits_start_from_a_preset_or_the_current_grant_and_change_one_at_a_time(
        tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)

        def held_by_phone() -> Limits:
            received = phone.trust.get(home.identity.peer_id).received
            assert received is not None
            return received.limits

        async with Client(home.home.path) as h:
            phone_preset, messaging = PRESETS["phone"][1], PRESETS["messaging"][1]
            r = await h.grant("phone", CAPS, set_limits={"concurrent_tasks": 8})  # over the current (phone) limits
            assert r.delivered and r.peer.granted_limits == phone_preset.model_copy(update={"concurrent_tasks": 8})
            assert held_by_phone() == r.peer.granted_limits
            r = await h.grant("phone", CAPS)  # no limits named: the grant keeps its limits
            assert r.peer.granted_limits.concurrent_tasks == 8
            r = await h.grant("phone", CAPS, preset_limits="messaging", set_limits={"max_runtime_s": None})
            assert r.peer.granted_limits == messaging.model_copy(update={"max_runtime_s": None})
            r = await h.grant("phone", CAPS, limits=Limits(requests_per_minute=5), set_limits={"concurrent_tasks": 1})
            assert r.peer.granted_limits == Limits(requests_per_minute=5, concurrent_tasks=1)
            assert held_by_phone() == r.peer.granted_limits

            for bad, words in (({"tasks": 1}, "unknown limit 'tasks'"),
                               ({"concurrent_tasks": 0}, "concurrent_tasks=0: input should be greater than")):
                with pytest.raises(PsymeshError) as info:
                    await h.grant("phone", CAPS, set_limits=bad)
                assert info.value.code is ErrorCode.BAD_REQUEST and words in info.value.message
            with pytest.raises(RemoteError) as refused:
                await h.grant("phone", CAPS, preset_limits="roomy")
            assert refused.value.code is ErrorCode.BAD_REQUEST and "known: messaging, phone" in refused.value.message
            assert (await h.peers())[0].granted_limits == Limits(requests_per_minute=5, concurrent_tasks=1)


# ---------------------------------------------------------------------------- the command line


async def test_cli_json_keys_and_grant_limits(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        hold_tasks(home)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["tool:test.held"])
        async with Client(phone.home.path) as p:
            held = await p.delegate("home", tool="test.held")
            await working(p, held.id)
        where = home.home.path

        peers = await run_cli(where, "peers", "--json")
        assert peers.returncode == 0, peers.stderr
        [row] = json.loads(peers.stdout)
        assert set(row) == set(c.PeerView.model_fields) and row["name"] == "phone"
        assert row["granted_limits"] == PRESETS["phone"][1].model_dump()

        g = await run_cli(where, "grant", "phone", "msg.send", "tool:test.held", "--preset-limits", "messaging",
                          "--limits", "concurrent_tasks=4, max_runtime_s=none", "--json")
        assert g.returncode == 0, g.stderr
        granted = json.loads(g.stdout)
        assert set(granted) == {"peer", "delivered"} and granted["delivered"] is True
        assert granted["peer"]["granted"] == ["msg.send", "tool:test.held"]
        assert granted["peer"]["granted_limits"] == {"requests_per_minute": 30, "concurrent_tasks": 4,
                                                     "max_runtime_s": None, "max_payload_bytes": 64 * 1024,
                                                     "rpc_memory_mb": None}
        shown = await run_cli(where, "peers")
        assert shown.returncode == 0 and "4 at once" in shown.stdout and "30 req/min" in shown.stdout
        assert "64 KiB payload" in shown.stdout and "s/task" not in shown.stdout  # cleared: no runtime limit

        audit = await run_cli(where, "audit", "--json")
        assert audit.returncode == 0 and all(set(r) == set(c.AuditRow.model_fields) for r in json.loads(audit.stdout))
        tasks = await run_cli(where, "task", "list", "--json")
        listed = json.loads(tasks.stdout)
        assert set(listed) == {"submitted", "executing"} and listed["submitted"] == []
        [ran] = listed["executing"]
        assert set(ran) == set(c.ExecutingTaskView.model_fields)
        assert (ran["task_id"], ran["kind"], ran["submitter"], ran["state"]) == (held.id, "tool", "phone", "working")
        human = await run_cli(where, "task", "list")
        assert human.returncode == 0 and "phone" in human.stdout and "delegated by this node: none" in human.stdout

        for spec, words in (("tasks=1", "unknown limit 'tasks' (known: requests_per_minute, concurrent_tasks"),
                            ("concurrent_tasks=0", "concurrent_tasks=0: input should be greater than or equal to 1"),
                            ("concurrent_tasks=eight", "concurrent_tasks=eight: not a whole number"),
                            ("concurrent_tasks", "'concurrent_tasks' is not NAME=NUMBER")):
            bad = await run_cli(where, "grant", "phone", "msg.send", "--limits", spec, "--json")
            assert bad.returncode == 1, bad.stderr
            error = json.loads(bad.stdout)["error"]
            assert error["code"] == "bad_request" and words in error["message"], error
            assert bad.stderr.strip().splitlines() == [f"error [bad_request]: {error['message']}"]
        async with Client(where) as h:  # nothing changed by the refused ones
            assert (await h.peers())[0].granted_limits.concurrent_tasks == 4


async def test_a_peer_that_is_down_is_a_network_error_in_one_line(tmp_path: Path) -> None:
    home = DaemonProcess(tmp_path / "home")
    await home.start()
    try:
        async with run_nodes(tmp_path, "phone") as nodes:
            phone = nodes["phone"].home.path
            await pair(tmp_path / "home", phone)
            async with Client(phone) as p:
                await p.ping("home", count=1)
            assert await home.stop() == 0
            async with Client(phone) as p:
                with pytest.raises(NetworkError) as info:
                    await p.ping("home", count=1)
            assert info.value.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT) and "home" in info.value.message

            r = await run_cli(phone, "ping", "home", "--count", "1")
            assert r.returncode == 1 and r.stdout == ""
            [line] = r.stderr.strip().splitlines()
            assert line.startswith("network error [") and "home" in line
            assert line.endswith("is its daemon running and reachable? try again later, or see: psymesh peers")
            j = await run_cli(phone, "ping", "home", "--count", "1", "--json")
            error = json.loads(j.stdout)["error"]
            assert j.returncode == 1 and error["network"] in NETWORK_FAILURES and error["code"] == info.value.code

            refused = await run_cli(phone, "ping", "nobody")  # a refusal reads as one, not as the network
            assert refused.returncode == 1
            assert refused.stderr.strip().splitlines() == [  # the daemon's hint names its home (not the default)
                f"error [unknown_peer]: no paired peer named 'nobody'; see: psymesh peers --home {phone}"]
    finally:
        await home.stop()
