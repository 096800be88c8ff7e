"""A revoked phone stops following its tasks (issue 8 item 6), between real daemons on loopback.

Before: after `psymesh revoke` on home, the phone's tasks stayed `working` for ever and its
follower re-attached every few seconds, each time a denied row in home's audit log. Now home
signs a `manifest.revoke` notice and hands it over before it disconnects; the phone ends every
task it delegated there (`forbidden`), stops following them and refuses new submissions to
home itself. A phone that misses the notice (lost, or the phone was off) learns the same from
home's `unknown_peer` answer to its next request, once, and stops as well.

"Stops" is checked on the submitter's own state (no follower, nothing left to re-attach to
or resend) and over several rounds of its resend loop, not by sleeping and hoping.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import anyio
import pytest

from waiting import wait_until
from conftest import pair, run_nodes
from psymesh.agent.acting.tools import tool_from_function
from psymesh.node.control.client import Client, TaskHandle
from psymesh.node.daemon import Node
from psymesh.node.door.gate import QueueLimits
from psymesh.protocol.errors import ErrorCode, RemoteError
from psymesh.protocol.limits import Limits
from psymesh.protocol.manifest import revocation
from psymesh.protocol.tasks import EventKind, Outcome, TaskEvent, TaskState

pytestmark = pytest.mark.anyio

CAPS = ["task.agent", "tool:test.*", "tool:system.info"]
ROOMY = Limits(requests_per_minute=100_000, concurrent_tasks=64, max_runtime_s=600, max_payload_bytes=1 << 20)


def _run_home(tmp_path: Path) -> contextlib.AbstractAsyncContextManager[dict[str, Node]]:
    return run_nodes(tmp_path, "home")


def _run_phone(tmp_path: Path) -> contextlib.AbstractAsyncContextManager[dict[str, Node]]:
    return run_nodes(tmp_path, "phone", profiles={"phone": "phone"})


def _long_running(home: Node) -> None:
    """`test.held` blocks until canceled; an agent task waits for an answer that never comes."""
    async def held() -> dict:
        await anyio.sleep_forever()
        return {}

    async def asks_forever(record: Any, emit: Any, ask: Any, tools: Any) -> Any:
        return await ask("May I send the report?", {})

    home.tools.register(tool_from_function(held, "test.held"))
    home.executor.agent_runner = asks_forever


async def _pair(home: Node, phone: Node) -> None:
    await pair(home.home.path, phone.home.path, grant="phone")
    async with Client(home.home.path) as h:
        await h.grant("phone", CAPS, limits=ROOMY)


async def _reach(handle: TaskHandle, state: TaskState) -> None:
    with anyio.fail_after(20):
        async for ev in handle.events():
            if ev.state is state:
                return
    raise AssertionError(f"task {handle.id} ended before it was {state.value}")


async def _events(handle: TaskHandle) -> list[TaskEvent]:
    with anyio.fail_after(20):  # the watch ends only once the task has ended on the phone
        return [ev async for ev in handle.events()]


def _ended_with(events: list[TaskEvent], state: TaskState, code: ErrorCode) -> Outcome:
    """Numbered 1..N, exactly one final event, last, with this state and code."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].kind is EventKind.ACCEPTED
    assert [e.state.terminal for e in events].count(True) == 1
    outcome = events[-1].outcome
    assert outcome is not None and outcome.state is state and outcome.code is code, outcome
    return outcome


def _audit_rows(home: Node, phone: Node) -> list[dict]:
    return home.audit.query(peer_id=phone.identity.peer_id, limit=10_000)


async def _working_and_asking(c: Client) -> tuple[TaskHandle, TaskHandle]:
    """A tool task that runs (working) and an agent task waiting for a yes (input-required)."""
    working = await c.delegate("home", tool="test.held")
    asking = await c.delegate("home", goal="Send the weekly report.")
    await _reach(working, TaskState.WORKING)
    await _reach(asking, TaskState.INPUT_REQUIRED)
    return working, asking


async def _assert_leaves_home_alone(home: Node, phone: Node) -> None:
    """Nothing of the phone's follows, re-attaches to or resends to home any more, not even
    after it resumes its outbox as it does at start, and home hears nothing from it."""
    home_id, submitter = home.identity.peer_id, phone.submitter
    await wait_until(lambda: submitter.following == 0, "the phone's task drivers to stop")
    assert submitter.outbox.resumable(home_id) == [] and submitter.outbox.pending(home_id) == []
    before = _audit_rows(home, phone)
    submitter.resume()
    assert submitter.following == 0
    assert _audit_rows(home, phone) == before


async def _assert_refuses_new_work_locally(home: Node, phone: Node, client: Client, task: TaskHandle) -> None:
    """Submitting to home, or answering its question, fails here, clearly, without asking it."""
    before = _audit_rows(home, phone)
    with pytest.raises(RemoteError) as err:
        await client.delegate("home", tool="system.info")
    assert err.value.code is ErrorCode.FORBIDDEN and "home revoked this node's access" in err.value.message
    with pytest.raises(RemoteError) as err:
        await task.respond({"approve": True})
    assert err.value.code is ErrorCode.FORBIDDEN and "revoked" in err.value.message
    assert not await client.offers("task.agent")  # home offers nothing to a node it revoked
    assert (await client.tasks()).submitted[-1].state in ("failed", "rejected")
    assert _audit_rows(home, phone) == before


# --------------------------------------------------------------------------- the notice


async def test_a_revoked_phone_ends_its_tasks_at_once_and_stops_calling_home(tmp_path: Path) -> None:
    async with _run_home(tmp_path) as h_nodes, _run_phone(tmp_path) as p_nodes:
        home, phone = h_nodes["home"], p_nodes["phone"]
        await _pair(home, phone)
        _long_running(home)
        async with Client(phone.home.path) as c:
            working, asking = await _working_and_asking(c)

            async with Client(home.home.path) as h:
                with anyio.fail_after(10):
                    revoked = await h.revoke("phone")
            assert revoked.peer.revoked_at is not None
            # home waited for the phone to take the notice: both tasks have ended there already
            assert all(phone.submitter.outbox.get(t.id).terminal for t in (working, asking))
            for task in (working, asking):
                outcome = _ended_with(await _events(task), TaskState.FAILED, ErrorCode.FORBIDDEN)
                assert outcome.message == "home revoked this node's access"
                with pytest.raises(RemoteError) as err:
                    await task.result()
                assert err.value.code is ErrorCode.FORBIDDEN
            listed = {t.task_id: t.state for t in (await c.tasks()).submitted}
            assert listed == {working.id: "failed", asking.id: "failed"}
            [home_peer] = await c.peers()
            assert home_peer.revoked_us_at is not None and home_peer.received == []

            await _assert_leaves_home_alone(home, phone)
            await _assert_refuses_new_work_locally(home, phone, c, asking)
        # home's side is as before: its tasks for the phone were canceled, the phone is refused
        assert {home.executor.store.get(t.id).state for t in (working, asking)} == {TaskState.CANCELED}
        notices = [r for r in phone.audit.query(peer_id=home.identity.peer_id, limit=100)
                   if r["operation"] == "manifest.revoke"]
        assert len(notices) == 1 and notices[0]["allowed"]


async def test_notices_that_must_change_nothing(tmp_path: Path) -> None:
    """An old notice (from before the phone paired again: its serial is below the grant the
    phone holds) is ignored; one not signed by the sender, or for another peer, is refused."""
    async with _run_home(tmp_path) as h_nodes, _run_phone(tmp_path) as p_nodes:
        home, phone = h_nodes["home"], p_nodes["phone"]
        await _pair(home, phone)
        _long_running(home)
        held = phone.trust.get(home.identity.peer_id).received
        assert held is not None
        stale = revocation(home.identity.peer_id, phone.identity.peer_id, held, now=held.not_before)
        stale = stale.model_copy(update={"serial": held.serial - 1}).sign(home.identity.private_key)
        for_other = revocation(home.identity.peer_id, home.identity.peer_id, held, now=held.not_before)
        unsigned = revocation(home.identity.peer_id, phone.identity.peer_id, held, now=held.not_before)
        async with Client(phone.home.path) as c:
            task = await c.delegate("home", tool="test.held")
            await _reach(task, TaskState.WORKING)
            for bad in (stale, for_other.sign(home.identity.private_key), unsigned):
                assert not await home._tell_subject(phone.identity.peer_id, bad, "a bad notice", timeout=5)
            peer = phone.trust.get(home.identity.peer_id)
            assert peer.revoked_us_at is None and peer.received == held
            assert phone.submitter.outbox.get(task.id).state is TaskState.WORKING
            await task.cancel()  # still home's to cancel: the phone was not cut off
            _ended_with(await _events(task), TaskState.CANCELED, ErrorCode.CANCELED)
        rows = phone.audit.query(peer_id=home.identity.peer_id, limit=100)
        revokes = [r for r in rows if r["operation"] == "manifest.revoke"]
        assert not any(r["allowed"] for r in revokes)
        assert sum(r["count"] for r in revokes) == 3  # identical refusals share a row, counted


# --------------------------------------------------------------------------- without the notice


async def test_a_phone_that_misses_the_notice_learns_from_homes_refusal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _run_home(tmp_path) as h_nodes, _run_phone(tmp_path) as p_nodes:
        home, phone = h_nodes["home"], p_nodes["phone"]
        await _pair(home, phone)
        _long_running(home)

        async def lost(peer_id: str, message: Any, what: str, *, timeout: float) -> bool:
            return False  # the notice never reaches the phone

        monkeypatch.setattr(home, "_tell_subject", lost)
        async with Client(phone.home.path) as c:
            working, asking = await _working_and_asking(c)
            async with Client(home.home.path) as h:
                await h.revoke("phone")
            # home closed the connection; the followers re-attach and are refused: unknown_peer
            for task in (working, asking):
                outcome = _ended_with(await _events(task), TaskState.FAILED, ErrorCode.UNKNOWN_PEER)
                assert outcome.message.startswith("home refused this node:") and "revoked" in outcome.message
            await _assert_leaves_home_alone(home, phone)
            # one refusal taught the phone for all its tasks there (a follower already on its way may add one)
            denied = [r for r in _audit_rows(home, phone) if not r["allowed"]]
            assert 1 <= len(denied) <= 2 and {r["code"] for r in denied} == {"unknown_peer"}
            await _assert_refuses_new_work_locally(home, phone, c, asking)


async def test_a_phone_that_was_off_when_revoked_learns_when_it_comes_back(tmp_path: Path) -> None:
    async with _run_home(tmp_path) as h_nodes:
        home = h_nodes["home"]
        _long_running(home)
        async with _run_phone(tmp_path) as p_nodes:
            phone = p_nodes["phone"]
            await _pair(home, phone)
            home.gate.queue_limits = QueueLimits(max_queue=1, busy_retry_after=0.2)
            async with Client(phone.home.path) as c:
                running = await c.delegate("home", tool="test.held")
                await _reach(running, TaskState.WORKING)
                queued = await c.delegate("home", tool="test.held")  # home is full: kept for resending
                assert not queued.accepted
        # The phone is off. The notice cannot be delivered; revoke still returns promptly.
        async with Client(home.home.path) as h:
            with anyio.fail_after(Node.REVOCATION_NOTICE_S + 8):
                await h.revoke("phone")
        async with _run_phone(tmp_path) as p_nodes:
            phone = p_nodes["phone"]
            async with Client(phone.home.path) as c:
                # the follower's re-attach and the resend of the queued task are refused: both end
                running_events = await _events(c.task(running.id))
                queued_events = await _events(c.task(queued.id))
                _ended_with(running_events, TaskState.FAILED, ErrorCode.UNKNOWN_PEER)
                _ended_with(queued_events, TaskState.REJECTED, ErrorCode.UNKNOWN_PEER)
                await wait_until(lambda: phone.submitter.following == 0, "the phone's followers to stop")
                assert phone.trust.get(home.identity.peer_id).revoked_us_at is not None
                with pytest.raises(RemoteError) as err:
                    await c.delegate("home", tool="system.info")
                assert err.value.code is ErrorCode.FORBIDDEN and "revoked" in err.value.message
