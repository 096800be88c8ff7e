"""Delegated tasks between real nodes: libp2p on loopback, SQLite, llama.cpp on a tiny GGUF.

What a user of `Client.delegate()` relies on: events numbered 1..N in order, results
that match what streamed, refusals that are typed and leave nothing behind, cancel
and deadlines that really stop work, backpressure that loses nothing, idempotent
resubmits, failover to another home before a task is accepted, and a phone that
neither keeps calling a home about finished tasks nor keeps them forever.
(Process crashes: tests/test_chaos.py.)
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

import psymesh
from waiting import wait_until
from psymesh.protocol.session import SessionEnd
from conftest import run_nodes
from psymesh.agent.acting.tools import ToolContext, tool_from_function
from psymesh.node.control.client import Client, TaskHandle
from psymesh.node.daemon import Node
from psymesh.node.core.db import open_db
from psymesh.node.core.home import StorageSettings
from psymesh.node.core.home import NodeHome
from psymesh.node.models import ModelRegistry
from psymesh.node.control.process import DaemonProcess, pair_homes
from psymesh.node.door.gate import QueueLimits
from psymesh.node.tasks.store import TaskNotFound
from psymesh.protocol.control import TaskSubmitRequest, TaskSubmitted
from psymesh.protocol.errors import ErrorCode, RemoteError
from psymesh.protocol.limits import Limits
from psymesh.protocol.tasks import (
    EventKind,
    TaskAccepted,
    TaskAck,
    TaskAttach,
    TaskEvent,
    TaskSpec,
    TaskState,
    TaskStatus,
    TaskSubmit,
)

CAPS = ["task.infer", "tool:system.info", "tool:files.*", "tool:test.*"]
# Load tests need more than the phone preset's 60 requests/min and 2 unfinished tasks.
ROOMY = Limits(requests_per_minute=100_000, concurrent_tasks=64, max_runtime_s=600, max_payload_bytes=1 << 20)
GREEDY = {"ban_bytes": True, "seed": 1, "temperature": 0}


def _mesh(tmp_path: Path, *homes: str,
          share: dict[str, Path] | None = None) -> contextlib.AbstractAsyncContextManager[dict[str, Node]]:
    """In-process nodes: `homes` (with a share dir, if given) and a `phone`."""
    for name, directory in (share or {}).items():
        home = NodeHome(tmp_path / name)
        home.init(profile="home", name=name)
        home.save_config(home.load_config().model_copy(update={"share_dir": str(directory)}))
    return run_nodes(tmp_path, *homes, "phone", profiles={"phone": "phone"})


async def _pair_all(nodes: dict[str, Node], *homes: str, limits: Limits | None = ROOMY) -> None:
    for name in homes:
        await pair_homes(nodes[name].home.path, nodes["phone"].home.path, grant="phone")
        async with Client(nodes[name].home.path) as h:
            await h.grant("phone", CAPS, limits=limits)


async def _collect(handle: TaskHandle, after_seq: int = 0) -> list[TaskEvent]:
    with anyio.fail_after(60):
        return [ev async for ev in handle.events(after_seq)]


def _assert_log(events: list[TaskEvent], final: TaskState) -> None:
    """Numbered 1..N without gaps or repeats, one final event, and it is the last."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].kind is EventKind.ACCEPTED
    assert [e.state.terminal for e in events].count(True) == 1 and events[-1].state is final


def _register(node: Node, func: Any, name: str) -> None:
    node.tools.register(tool_from_function(func, name))


# --------------------------------------------------------------------------- end to end


@pytest.mark.anyio
async def test_tool_tasks_end_to_end(tmp_path: Path) -> None:
    share = tmp_path / "share"
    (share / "notes").mkdir(parents=True)
    (share / "notes" / "groceries.txt").write_text("milk\nsourdough bread\n")
    (share / "todo.md").write_text("- bake bread\n")
    async with _mesh(tmp_path, "home", share={"home": share}) as nodes:
        await _pair_all(nodes, "home")
        async with Client(nodes["phone"].home.path) as phone:
            info = await phone.delegate("home", tool="system.info")
            assert info.accepted and info.target == nodes["home"].identity.peer_id and info.target_name == "home"
            events = await _collect(info)
            _assert_log(events, TaskState.COMPLETED)
            assert [e.kind for e in events] == [EventKind.ACCEPTED, EventKind.STATE, EventKind.RESULT]
            value = await info.result()
            assert value["profile"] == "home" and value["share_dir"]["configured"] is True

            found = await phone.delegate("home", tool="files.search", args={"query": "BREAD"})
            result = await found.result()
            assert sorted((r["path"], r.get("line")) for r in result["results"]) == [
                ("notes/groceries.txt", 2), ("todo.md", 1)]
            _assert_log(await _collect(found), TaskState.COMPLETED)

            escape = await phone.delegate("home", tool="files.read", args={"path": "../home/node.db"})
            with pytest.raises(RemoteError) as err:
                await escape.result()
            assert err.value.code is ErrorCode.FORBIDDEN and "share dir" in err.value.message
            with pytest.raises(RemoteError) as err:  # a task this node never delegated has no result
                await phone.task("no-such-task").result()
            assert err.value.code is ErrorCode.NOT_FOUND

            listed = await phone.tasks()
        assert [t.state for t in listed.submitted] == ["completed", "completed", "failed"]
        assert all(t.target == "home" for t in listed.submitted)


@pytest.mark.anyio
async def test_a_task_that_ends_during_its_acceptance_is_answered_with_its_result(tmp_path: Path) -> None:
    """The home's worker runs a task while the sync before its `task.accepted` runs; a task that
    ended by then comes back whole with its acceptance, so `control.task_submitted` carries its
    final event and the SDK's result() asks nothing more. (The home's fsync here waits for the
    task's result row, as a slow disk would.)"""
    import sqlite3
    import time

    def fsync_once_the_task_ran(fd: int) -> None:  # on the sync's worker thread
        db = sqlite3.connect(tmp_path / "home" / "node.db")
        try:  # (other syncs, before the task exists, go through at once)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and db.execute(
                    "SELECT 1 FROM exec_tasks WHERE id = 'quick' AND state != 'completed'").fetchone():
                time.sleep(0.005)  # a condition, polled with a deadline (this thread has no event to wait on)
        finally:
            db.close()
        os.fsync(fd)

    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"},
                         fsyncs={"home": fsync_once_the_task_ran}) as nodes:
        await _pair_all(nodes, "home")
        async with Client(nodes["phone"].home.path) as sdk:
            reply = await sdk.request(TaskSubmitRequest(
                to="home", spec={"id": "quick", "kind": "tool", "tool": "system.info"}), TaskSubmitted)
            assert reply.accepted and reply.final is not None
            assert reply.final.seq == 3 and reply.final.state is TaskState.COMPLETED
            assert (await TaskHandle(sdk, reply).result())["profile"] == "home"
            later = await sdk.delegate("home", tool="system.info", task_id="quick")  # the same task again
            assert later.id == "quick" and (await later.result())["profile"] == "home"


@pytest.mark.anyio
async def test_a_task_costs_each_side_one_transaction_per_durable_step(tmp_path: Path) -> None:
    """What a user notices only as speed, counted instead of timed: a tool task costs the phone
    one transaction for its outbox row and one per batch of events that came together (one to
    three: the final event and those stored before it leave in one write), the home one for the
    task with its first event and one per later event; acks are one transaction a batch on each
    side (before: 6 on the phone, acceptance and each ack a transaction of their own, and 4 on the home).
    Audit rows are held off (they are one transaction a flush, a batch of decisions)."""
    tasks = 16
    held_audit = {"storage": StorageSettings(audit_flush_ms=60_000)}
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"},
                         configs={"home": held_audit, "phone": held_audit}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await _pair_all(nodes, "home")

        def all_acked() -> bool:
            return (all(t.acked_seq == t.last_seq and t.terminal for t in phone.submitter.outbox.list())
                    and all(r.acked_seq == r.last_seq for r in home.executor.store.list()))

        async with Client(phone.home.path) as sdk:
            assert await (await sdk.delegate("home", tool="system.info")).result()  # the session is open
            await wait_until(all_acked, "the warm-up task acknowledged on both sides")
            before = {name: node.db_tally.transactions for name, node in nodes.items()}
            syncs = phone.wal.syncs

            async def one() -> None:
                assert (await (await sdk.delegate("home", tool="system.info")).result())["profile"] == "home"

            async with anyio.create_task_group() as tg:
                for _ in range(tasks):
                    tg.start_soon(one)
            await wait_until(all_acked, "every task acknowledged on both sides")
        spent = {name: node.db_tally.transactions - before[name] for name, node in nodes.items()}
        print(f"\n{tasks} tasks: {spent['phone']} transactions on the phone, {spent['home']} on the home, "
              f"{phone.wal.syncs - syncs} WAL syncs on the phone")
        # 1 outbox row + 1 to 3 batches of events each, and the ack batches (a few in all here)
        assert 2 * tasks <= spent["phone"] <= 4 * tasks + tasks // 2
        # 1 (task + event 1) + 2 events each, and the batches of acks taken
        assert 3 * tasks < spent["home"] <= 3 * tasks + tasks // 2


@pytest.mark.anyio
async def test_infer_streams_tokens_that_add_up_to_the_result(tmp_path: Path, tiny_model: Path) -> None:
    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        nodes["home"].models.registry.add("tiny", tiny_model, n_ctx=1024, n_threads=1)
        async with Client(nodes["phone"].home.path) as phone:
            task = await phone.delegate("home", infer="Say hello.", model="tiny", max_tokens=48, params=GREEDY)
            events = await _collect(task)
            _assert_log(events, TaskState.COMPLETED)
            tokens = [e.data["text"] for e in events if e.kind is EventKind.TOKEN]
            result = await task.result()
            again = await phone.delegate("home", infer="Say hello.", model="tiny", max_tokens=48, params=GREEDY)
            assert (await again.result()).text == result.text  # greedy + seed: deterministic
        assert tokens and "".join(tokens) == result.text
        assert result.usage.completion_tokens <= 48 and result.finish_reason in ("stop", "length")


@pytest.mark.anyio
async def test_refusals_are_typed_and_leave_nothing_behind(tmp_path: Path, tiny_model: Path) -> None:
    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        home, phone = nodes["home"], nodes["phone"]
        _register(home, lambda: {"secret": 42}, "vault.open")  # offered, but never granted
        async with Client(phone.home.path) as c:
            with pytest.raises(RemoteError) as err:
                await c.delegate("home", tool="vault.open", task_id="t-forbidden")
            assert err.value.code is ErrorCode.FORBIDDEN
            with pytest.raises(TaskNotFound):
                home.executor.store.get("t-forbidden")
            with pytest.raises(TaskNotFound):
                phone.submitter.outbox.get("t-forbidden")
            assert (await c.tasks()).submitted == []

            ghost = await c.delegate("home", infer="hi", model="no-such-model", max_tokens=4)
            with pytest.raises(RemoteError) as err:
                await ghost.result()
            assert err.value.code is ErrorCode.NOT_FOUND and "no-such-model" in err.value.message


# --------------------------------------------------------------------------- stopping work


def _slow_tool(progress: list[int]):
    async def slow(steps: int = 200, *, ctx: ToolContext) -> dict:
        """Count slowly (async, so a cancel interrupts it between steps)."""
        for i in range(steps):
            progress.append(i)
            await anyio.sleep(0.02)  # a tool that takes time is the behaviour under test
        return {"counted": steps}
    return slow


async def _wait_working(handle: TaskHandle) -> None:
    with anyio.fail_after(20):
        async for ev in handle.events():
            if ev.state is TaskState.WORKING:
                return
    raise AssertionError("the task never started")


@pytest.mark.anyio
async def test_cancel_stops_a_running_task(tmp_path: Path) -> None:
    progress: list[int] = []
    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        _register(nodes["home"], _slow_tool(progress), "test.slow")
        async with Client(nodes["phone"].home.path) as c:
            task = await c.delegate("home", tool="test.slow")
            await _wait_working(task)
            await task.cancel()
            with pytest.raises(RemoteError) as err:
                await task.result()
            assert err.value.code is ErrorCode.CANCELED
            events = await _collect(task)
            _assert_log(events, TaskState.CANCELED)
            steps = len(progress)
            await wait_until(lambda: task.id not in nodes["home"].executor._running, "the executor to let go of it")
            assert len(progress) == steps < 200  # the work stopped, it was not just hidden: nothing runs it now
            await task.cancel()  # canceling a finished task is harmless
            assert len(await _collect(task)) == len(events)


@pytest.mark.anyio
async def test_cancel_stops_a_running_inference(tmp_path: Path, tiny_model: Path) -> None:
    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        nodes["home"].models.registry.add("tiny", tiny_model, n_ctx=4096, n_threads=1)
        async with Client(nodes["phone"].home.path) as c:
            task = await c.delegate("home", infer="Count.", model="tiny", max_tokens=4000, params=GREEDY)
            with anyio.fail_after(30):
                async for ev in task.events():
                    if ev.kind is EventKind.TOKEN:
                        break
            await task.cancel()
            with pytest.raises(RemoteError) as err:
                await task.result()
            assert err.value.code is ErrorCode.CANCELED
            _assert_log(await _collect(task), TaskState.CANCELED)
        worker = await nodes["home"].models.get("tiny")
        # The worker counts a generation's tokens, and its cancellation, when the generation ends.
        await wait_until(lambda: worker.stats.cancelled == 1, "the model worker to end the canceled generation")
        generated = worker.stats.generated_tokens
        assert worker.stats.cancelled == 1 and worker.stats.generated_tokens == generated < 4000
        assert worker.pending == 0  # and nothing of it waits to run


@pytest.mark.anyio
async def test_deadline_fails_a_slow_task_with_timeout(tmp_path: Path) -> None:
    progress: list[int] = []
    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        _register(nodes["home"], _slow_tool(progress), "test.slow")
        async with Client(nodes["phone"].home.path) as c:
            task = await c.delegate("home", tool="test.slow", deadline_s=0.5)
            with pytest.raises(RemoteError) as err:
                await task.result()
            assert err.value.code is ErrorCode.TIMEOUT
            _assert_log(await _collect(task), TaskState.FAILED)
        steps = len(progress)
        await wait_until(lambda: task.id not in nodes["home"].executor._running, "the executor to let go of it")
        assert len(progress) == steps < 200  # nothing runs it now


# --------------------------------------------------------------------------- backpressure and load


@pytest.mark.anyio
async def test_full_queue_answers_busy_and_loses_no_accepted_task(tmp_path: Path) -> None:
    gate = anyio.Event()
    ran: Counter[str] = Counter()

    async def held(tag: str) -> dict:
        ran[tag] += 1
        await gate.wait()
        return {"tag": tag}

    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        home, phone = nodes["home"], nodes["phone"]
        home.gate.queue_limits = QueueLimits(max_queue=2, busy_retry_after=0.2)
        _register(home, held, "test.held")
        async with Client(phone.home.path) as c:
            first = [await c.delegate("home", tool="test.held", args={"tag": f"a{i}"}) for i in range(2)]
            assert all(t.accepted for t in first)
            # Straight onto the wire: the executor itself refuses with BUSY and a retry hint.
            spec = TaskSpec(id="t-direct", kind="tool", tool="test.held", args={"tag": "direct"})
            with pytest.raises(RemoteError) as err:
                await phone.sessions.request(home.identity.peer_id, TaskSubmit(spec=spec), TaskAccepted)
            assert err.value.code is ErrorCode.BUSY and err.value.retry_after and err.value.retry_after > 0
            with pytest.raises(TaskNotFound):
                home.executor.store.get("t-direct")
            # Through the SDK: stored in the outbox, queued for delivery, not refused.
            later = [await c.delegate("home", tool="test.held", args={"tag": f"b{i}"}) for i in range(6)]
            assert not any(t.accepted for t in later)

            def busy_answers() -> int:
                rows = home.audit.query(peer_id=phone.identity.peer_id, limit=10_000, denied_only=True)
                return sum(r["count"] for r in rows if r["code"] == ErrorCode.BUSY.value)  # counted per window

            refused = busy_answers()
            await wait_until(lambda: busy_answers() >= refused + 2 * len(later),
                             "two resend rounds of the queued tasks, refused busy while the queue stays full")
            assert home.executor.store.queue_depth() == 2
            gate.set()
            with anyio.fail_after(60):
                results = [await t.result() for t in first + later]
        assert [r["tag"] for r in results] == ["a0", "a1", *(f"b{i}" for i in range(6))]
        assert all(n == 1 for n in ran.values()) and len(ran) == 8


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.anyio
async def test_500_tasks_at_once_all_complete_in_bounded_memory(tmp_path: Path) -> None:
    calls: list[int] = []

    def noop(n: int) -> dict:
        calls.append(n)
        return {"n": n}

    async def burst(sock: Path, start: int, count: int, lanes: int = 10) -> list[Any]:
        handles: list[TaskHandle] = []

        async def submit(lane: int) -> None:
            async with Client(sock) as c:
                for n in range(start + lane, start + count, lanes):
                    handles.append(await c.delegate("home", tool="test.noop", args={"n": n}))

        async with anyio.create_task_group() as tg:
            for lane in range(lanes):
                tg.start_soon(submit, lane)
        results: list[Any] = []
        limiter = anyio.CapacityLimiter(32)

        async def fetch(h: TaskHandle) -> None:
            async with limiter:
                async with Client(sock) as c:
                    results.append(await c.task(h.id).result())

        async with anyio.create_task_group() as tg:
            for h in handles:
                tg.start_soon(fetch, h)
        return results

    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        home, phone = nodes["home"], nodes["phone"]
        _register(home, noop, "test.noop")
        with anyio.fail_after(60):
            await burst(phone.home.path, 0, 50)  # warm-up: caches, connections, SQLite pages
        rss = _rss_bytes()
        with anyio.fail_after(240):
            results = await burst(phone.home.path, 1000, 500)
        grown = _rss_bytes() - rss
        assert sorted(r["n"] for r in results) == list(range(1000, 1500))
        assert sorted(calls) == [*range(50), *range(1000, 1500)]  # each ran exactly once
        assert home.executor.store.queue_depth() == 0
        assert grown < 96 * 1024 * 1024, f"RSS grew by {grown / 2**20:.0f} MiB for 500 tasks"
        # nothing keyed by task id is left behind in memory once tasks are done and fetched
        await wait_until(lambda: phone.submitter.following == 0, "every driver to finish", timeout=10)
        assert len(home.executor._running) == 0
        assert len(home.executor.changed) == 0 and len(phone.submitter.changed) == 0


@pytest.mark.anyio
async def test_resubmitting_the_same_task_id_is_the_same_task(tmp_path: Path) -> None:
    calls: list[str] = []

    def once(tag: str) -> dict:
        calls.append(tag)
        return {"tag": tag}

    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        _register(nodes["home"], once, "test.once")
        async with Client(nodes["phone"].home.path) as c:
            a = await c.delegate("home", tool="test.once", args={"tag": "x"}, task_id="t-same")
            b = await c.delegate("home", tool="test.once", args={"tag": "x"}, task_id="t-same")
            assert a.id == b.id == "t-same" and b.target == a.target
            assert await a.result() == await b.result() == {"tag": "x"}
            c2 = await c.delegate("home", tool="test.once", args={"tag": "x"}, task_id="t-same")
            assert await c2.result() == {"tag": "x"}
            with pytest.raises(RemoteError) as err:  # the same id for another task
                await c.delegate("home", tool="test.once", args={"tag": "y"}, task_id="t-same")
            assert err.value.code is ErrorCode.CONFLICT
            assert len((await c.tasks()).submitted) == 1
        assert calls == ["x"]


# --------------------------------------------------------------------------- choosing a home


async def _listening(port: int) -> bool:
    try:
        sock = await anyio.connect_tcp("127.0.0.1", port)
    except OSError:
        return False
    await sock.aclose()
    return True


@pytest.mark.anyio
async def test_failover_to_another_home_before_acceptance(tmp_path: Path) -> None:
    async with _mesh(tmp_path, "home-a", "home-b") as nodes:
        await _pair_all(nodes, "home-a", "home-b")
        # Which home answers first is a race (node/tasks/homes.py takes the first that fits): make
        # one unfit each time, and the task must go to the other.
        async with Client(nodes["phone"].home.path) as c:
            # home-a busy: the task goes to home-b.
            nodes["home-a"].gate.queue_limits = QueueLimits(max_queue=0)
            busy = await c.delegate(tool="system.info")
            assert busy.accepted and busy.target_name == "home-b"
            assert (await busy.result())["profile"] == "home"
            nodes["home-a"].gate.queue_limits = QueueLimits()
            # home-b down: the task goes to home-a.
            port = int(nodes["home-b"].p2p.addrs()[0].split("/tcp/")[1].split("/")[0])
            nodes["home-b"].stop()

            async def stopped_listening() -> bool:
                return not await _listening(port)

            await wait_until(stopped_listening, "home-b to stop listening", timeout=10)
            moved = await c.delegate(tool="system.info")
            assert moved.accepted and moved.target_name == "home-a"
            _assert_log(await _collect(moved), TaskState.COMPLETED)


# --------------------------------------------------------------------------- re-attaching


@pytest.mark.anyio
async def test_a_finished_task_missing_only_its_ack_gets_acked(tmp_path: Path) -> None:
    """A submitter that stored the final event but died before acknowledging it re-attaches
    after its last event: the executor must say "nothing more" and take the ack, not wait."""
    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        home, phone = nodes["home"], nodes["phone"]
        async with Client(phone.home.path) as c:
            task = await c.delegate("home", tool="system.info")
            await task.result()
        last = home.executor.store.get(task.id).last_seq
        home_id = home.identity.peer_id
        for after in (last, last + 5):  # a client may also hold a bogus cursor
            with anyio.fail_after(5):
                async with phone.sessions.stream(home_id, TaskAttach(task_id=task.id, after_seq=after)) as replies:
                    answer = [m async for m in replies]
                status = await phone.sessions.request(home_id, TaskAck(task_id=task.id, upto_seq=last), TaskStatus)
            assert [type(m) for m in answer] == [SessionEnd]  # "nothing more", at once
            assert status.state is TaskState.COMPLETED and status.acked_seq == last
        # The same state as the phone's own follower sees it after such a crash: it must
        # just acknowledge (the executor keeps an unacknowledged task for days).
        phone.db.execute("UPDATE outbox_tasks SET acked_seq = 0 WHERE id = ?", (task.id,))
        home.db.execute("UPDATE exec_tasks SET acked_seq = 0 WHERE id = ?", (task.id,))
        phone.submitter.resume()  # what it does at start after such a crash
        await wait_until(lambda: home.executor.store.get(task.id).acked_seq == last, "the ack", timeout=5)
        assert phone.submitter.outbox.get(task.id).acked_seq == last


@pytest.mark.anyio
async def test_tasks_that_end_on_the_phone_do_not_keep_calling_the_home(tmp_path: Path) -> None:
    """Refused on resend, or canceled before delivery: the outcome is the phone's own, and the
    phone must not keep attaching to a home that never held the task."""
    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        home, phone = nodes["home"], nodes["phone"]
        home.gate.queue_limits = QueueLimits(max_queue=0, busy_retry_after=0.2)  # everything is BUSY
        async with Client(phone.home.path) as c:
            refused = await c.delegate("home", tool="system.info")
            dropped = await c.delegate("home", tool="system.info")
            assert not refused.accepted and not dropped.accepted
            await dropped.cancel()
            with pytest.raises(RemoteError) as err:
                await dropped.result()
            assert err.value.code is ErrorCode.CANCELED
            async with Client(home.home.path) as h:  # the owner withdraws system.info, then frees the queue
                await h.grant("phone", ["task.infer"], limits=ROOMY)
            home.gate.queue_limits = QueueLimits()
            with anyio.fail_after(10), pytest.raises(RemoteError) as err:
                await refused.result()
            assert err.value.code is ErrorCode.FORBIDDEN
            _assert_log(await _collect(refused), TaskState.REJECTED)
            _assert_log(await _collect(dropped), TaskState.CANCELED)
        # Nothing is left on the phone that would call the home about them: no driver, no ack
        # batch, and both settled in the outbox (a restart's drivers have nothing to send).
        submitter = phone.submitter
        await wait_until(lambda: submitter.following == 0, "the phone's drivers for both tasks to end")
        assert not submitter._acks
        for task in (refused, dropped):
            held = submitter.outbox.get(task.id)
            assert held.terminal and held.acked_seq == held.last_seq, held


# --------------------------------------------------------------------------- the SDK under asyncio


@pytest.mark.asyncio
async def test_sdk_delegates_from_asyncio_to_daemon_processes(tmp_path: Path, tiny_model: Path) -> None:
    home = DaemonProcess(tmp_path / "home", name="home")
    phone = DaemonProcess(tmp_path / "phone", profile="phone", name="phone")
    await home.start()
    await phone.start()
    try:
        await pair_homes(home.home, phone.home, grant="phone")
        conn = open_db(home.home / "node.db")  # `psymesh model add`: the running daemon sees it
        ModelRegistry(conn).add("tiny", tiny_model, n_ctx=1024, n_threads=1)
        conn.close()
        async with psymesh.Client(home=phone.home) as node:
            info = await node.delegate("home", tool="system.info")
            assert (await info.result())["profile"] == "home"
            chat = await node.delegate(infer="Say hello.", model="tiny", max_tokens=32, params=GREEDY)
            assert chat.target_name == "home"  # to=None: the only paired node that offers the model
            events = [ev async for ev in chat.events()]
            _assert_log(events, TaskState.COMPLETED)
            text = "".join(ev.data["text"] for ev in events if ev.kind is EventKind.TOKEN)
            assert text and text == (await chat.result()).text
            assert [t.state for t in (await node.tasks()).submitted] == ["completed", "completed"]
    finally:
        assert await phone.stop() == 0
        assert await home.stop() == 0


@pytest.mark.anyio
async def test_the_phone_forgets_finished_tasks_after_the_retention_period(tmp_path: Path) -> None:
    async with _mesh(tmp_path, "home") as nodes:
        await _pair_all(nodes, "home")
        phone = nodes["phone"]
        async with Client(phone.home.path) as c:
            task = await c.delegate("home", tool="system.info")
            await task.result()
            assert len((await c.tasks()).submitted) == 1
            phone.submitter.set_retention(0.2, 0.1)  # instead of a week

            async def forgotten() -> bool:
                return not (await c.tasks()).submitted

            await wait_until(forgotten, "the phone to forget the finished task", timeout=10)
        assert phone.db.execute("SELECT COUNT(*) FROM outbox_events").fetchone()[0] == 0
