"""Durable delegated tasks on real SQLite: idempotent submit, contiguous event logs,
crash recovery (including SIGKILL mid-write), exactly-once mirroring, retention."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from psymesh.node.core.db import open_db
from psymesh.node.door.gate import QueueLoad
from psymesh.node.tasks.executor_store import ExecutorStore
from psymesh.node.tasks.outbox import Outbox
from psymesh.node.tasks.tasklog import EventLog, TaskConflict, TaskNotFound
from psymesh.protocol.errors import ErrorCode, ProtocolError, RemoteError
from psymesh.protocol.messages import pack, unpack
from psymesh.protocol.tasks import EventKind, IllegalTransition, TaskEvent, TaskSpec, TaskState, next_state

K, S = EventKind, TaskState
PHONE, OTHER, PC = "12D3KooWPhone", "12D3KooWOther", "12D3KooWHomePC"
T0 = 1_700_000_000.0


def spec(task_id: str = "t1", **kw: object) -> TaskSpec:
    return TaskSpec(**{"id": task_id, "kind": "tool", "tool": "fs.read", "args": {"path": "/notes"}, **kw})


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "node.db"


@pytest.fixture
def conn(db_path: Path) -> Iterator[sqlite3.Connection]:
    c = open_db(db_path)
    yield c
    c.close()


@pytest.fixture
def store(conn: sqlite3.Connection) -> ExecutorStore:
    return ExecutorStore(conn)


def run_to_completion(store: ExecutorStore, task_id: str, text: str = "hello") -> None:
    store.append_event(task_id, K.STATE, new_state=S.WORKING)
    for ch in text:
        store.append_event(task_id, K.TOKEN, {"text": ch})
    store.append_event(task_id, K.RESULT, {"result": text})


def assert_consistent(conn: sqlite3.Connection, prefix: str = "exec") -> int:
    """Every task's log is 1..last_seq, replays legally, and ends in the task's state."""
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    tasks = conn.execute(f"SELECT id, state, last_seq FROM {prefix}_tasks").fetchall()
    total = 0
    for task in tasks:
        rows = conn.execute(f"SELECT seq, kind, state FROM {prefix}_events WHERE task_id = ? ORDER BY seq",
                            (task["id"],)).fetchall()
        assert [r["seq"] for r in rows] == list(range(1, task["last_seq"] + 1))
        state = None
        for r in rows:
            state = next_state(state, EventKind(r["kind"]), TaskState(r["state"]))
        assert state == (TaskState(task["state"]) if rows else None)
        total += len(rows)
    assert conn.execute(f"SELECT COUNT(*) FROM {prefix}_events").fetchone()[0] == total  # no orphans
    return len(tasks)


# -- submit ------------------------------------------------------------------------------
def test_submit_is_idempotent_and_conflicts_on_a_different_spec(store: ExecutorStore) -> None:
    task, created = store.submit(spec(), PHONE, now=T0)
    assert created and task.state is S.SUBMITTED and task.submitter == PHONE and task.last_seq == 1
    [accepted] = store.events_after("t1")
    assert accepted.kind is K.ACCEPTED and accepted.seq == 1 and accepted.at == T0

    again, created = store.submit(spec(), PHONE, now=T0 + 5)
    assert not created and again == task
    assert len(store.events_after("t1")) == 1

    with pytest.raises(TaskConflict) as info:
        store.submit(spec(args={"path": "/etc"}), PHONE)
    assert info.value.code is ErrorCode.CONFLICT
    with pytest.raises(TaskConflict):
        store.submit(spec(), OTHER)  # another peer cannot adopt (or attach to) our task id
    assert store.get("t1") == task


def test_timeout_is_fixed_at_first_acceptance(store: ExecutorStore) -> None:
    task, _ = store.submit(spec(timeout=30), PHONE, now=T0)
    assert task.deadline == T0 + 30
    again, _ = store.submit(spec(timeout=30), PHONE, now=T0 + 20)
    assert again.deadline == T0 + 30


# -- event log ---------------------------------------------------------------------------
def test_event_log_is_numbered_contiguously_and_pages(store: ExecutorStore, conn: sqlite3.Connection) -> None:
    store.submit(spec(), PHONE, now=T0)
    run_to_completion(store, "t1", "abcdef")
    events = store.events_after("t1")
    assert [e.seq for e in events] == list(range(1, 10))
    assert [e.kind for e in events] == [K.ACCEPTED, K.STATE] + [K.TOKEN] * 6 + [K.RESULT]
    assert "".join(e.data["text"] for e in events if e.kind is K.TOKEN) == "abcdef"
    assert [e.seq for e in store.events_after("t1", 3, limit=2)] == [4, 5]
    assert store.events_after("t1", 9) == []
    assert store.get("t1").state is S.COMPLETED and store.get("t1").last_seq == 9
    assert store.outcome("t1").unwrap() == "abcdef"  # type: ignore[union-attr]
    assert_consistent(conn)


def test_illegal_or_invalid_events_change_nothing(store: ExecutorStore, conn: sqlite3.Connection) -> None:
    store.submit(spec(), PHONE, now=T0)
    with pytest.raises(IllegalTransition):
        store.append_event("t1", K.TOKEN, {"text": "too early"})
    store.append_event("t1", K.STATE, new_state=S.WORKING)
    with pytest.raises(ProtocolError) as info:
        store.append_event("t1", K.TOKEN, {"txt": "typo"})
    assert info.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(ProtocolError):
        store.append_event("t1", K.TOOL_RESULT, {"result": "x" * (2 * 1024 * 1024)})
    store.append_event("t1", K.ERROR, {"code": "internal", "message": "tool crashed"})
    for kind, state in [(K.RESULT, None), (K.STATE, S.WORKING), (K.PROGRESS, None)]:
        with pytest.raises(IllegalTransition):
            store.append_event("t1", kind, {"result": 1}, state)
    assert store.get("t1").last_seq == 3 and store.get("t1").state is S.FAILED
    assert_consistent(conn)


def test_unknown_and_foreign_tasks_are_not_found(store: ExecutorStore) -> None:
    store.submit(spec(), PHONE)
    for call in (lambda: store.get("nope"), lambda: store.events_after("nope"),
                 lambda: store.append_event("nope", K.PROGRESS), lambda: store.get("t1", submitter=OTHER),
                 lambda: store.mark_fetched("t1", 1, submitter=OTHER), lambda: store.cancel("nope")):
        with pytest.raises(TaskNotFound) as info:
            call()
        assert info.value.code is ErrorCode.NOT_FOUND


def test_input_required_goes_back_to_working(store: ExecutorStore) -> None:
    store.submit(spec("a", kind="agent", tool=None, args={}, goal="book a table"), PHONE)
    store.append_event("a", K.STATE, new_state=S.WORKING)
    store.append_event("a", K.TOOL_CALL, {"name": "web.search", "id": "c1", "arguments": {"q": "x"}})
    store.append_event("a", K.TOOL_RESULT, {"id": "c1", "ok": True, "result": ["r"]})
    store.append_event("a", K.STATE, {"reason": "which evening?"}, S.INPUT_REQUIRED)
    store.append_event("a", K.STATE, new_state=S.WORKING)
    store.append_event("a", K.RESULT, {"result": "booked"})
    assert [e.state for e in store.events_after("a", 4)] == [S.INPUT_REQUIRED, S.WORKING, S.COMPLETED]


def test_cancel_stops_unfinished_tasks_only(store: ExecutorStore) -> None:
    store.submit(spec("a"), PHONE)
    store.submit(spec("b"), PHONE)
    run_to_completion(store, "b")
    canceled = store.cancel("a", "user changed their mind")
    assert canceled.state is S.CANCELED
    assert store.outcome("a").code is ErrorCode.CANCELED  # type: ignore[union-attr]
    done = store.get("b")
    assert store.cancel("b") == done  # finished: unchanged, not an error
    assert store.cancel("a") == canceled  # canceling twice is harmless


def test_listing_and_backpressure_counts(store: ExecutorStore) -> None:
    for i in range(3):
        store.submit(spec(f"p{i}"), PHONE, now=T0 + i)
    store.submit(spec("o1"), OTHER, now=T0 + 10)
    run_to_completion(store, "p1")
    store.append_event("p2", K.STATE, new_state=S.WORKING)
    assert store.queue_depth() == 3
    assert store.active_for(PHONE) == 2 and store.active_for(OTHER) == 1 and store.active_for("x") == 0
    # what the door reads in one statement: held already?, the peer's unfinished tasks, everyone's
    assert store.load(PHONE, "p1") == QueueLoad(held=True, active_for_peer=2, depth=3)
    assert store.load(OTHER, "p1") == QueueLoad(held=False, active_for_peer=1, depth=3)
    assert store.load("x", "new") == QueueLoad(held=False, active_for_peer=0, depth=3)
    assert [t.id for t in store.list(states=[S.SUBMITTED])] == ["p0", "o1"]  # oldest first: the run queue
    assert [t.id for t in store.list(submitter=PHONE)] == ["p0", "p1", "p2"]
    assert [t.id for t in store.list(PHONE, [S.COMPLETED, S.WORKING])] == ["p1", "p2"]
    assert store.list(states=[]) == [] and len(store.list(limit=2)) == 2
    status = store.get("p2").status()
    assert status.state is S.WORKING and status.last_seq == 2 and status.kind.value == "tool"


# -- deadlines, restart, retention -------------------------------------------------------
def test_tasks_past_their_deadline_fail_with_timeout(store: ExecutorStore) -> None:
    store.submit(spec("slow", timeout=10), PHONE, now=T0)
    store.submit(spec("late", deadline=T0 + 5), PHONE, now=T0 + 1)
    store.submit(spec("free"), PHONE, now=T0)
    assert store.expire(now=T0 + 4) == []
    store.append_event("slow", K.STATE, new_state=S.WORKING, now=T0 + 1)
    expired = store.expire(now=T0 + 10)
    assert [t.id for t in expired] == ["slow", "late"] and all(t.state is S.FAILED for t in expired)
    with pytest.raises(RemoteError) as info:
        store.outcome("slow").unwrap()  # type: ignore[union-attr]
    assert info.value.code is ErrorCode.TIMEOUT
    assert store.get("free").state is S.SUBMITTED


def test_recover_requeues_what_a_crash_interrupted(db_path: Path) -> None:
    conn = open_db(db_path)
    store = ExecutorStore(conn)
    store.submit(spec("queued"), PHONE, now=T0)
    store.submit(spec("running"), PHONE, now=T0 + 1)
    store.submit(spec("asking", kind="agent", tool=None, args={}, goal="g"), PHONE, now=T0 + 2)
    store.submit(spec("done"), PHONE, now=T0 + 3)
    store.submit(spec("overdue", timeout=60), PHONE, now=T0 + 4)
    store.append_event("running", K.STATE, new_state=S.WORKING)
    store.append_event("running", K.TOKEN, {"text": "par"})
    store.append_event("asking", K.STATE, new_state=S.WORKING)
    store.append_event("asking", K.STATE, new_state=S.INPUT_REQUIRED)
    run_to_completion(store, "done")
    # The process dies inside a write: the event row is in, the task update is not.
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO exec_events VALUES ('running', 4, 'token', 'working', 0, '{\"text\": \"x\"}')")
    conn.close()

    conn = open_db(db_path)
    store = ExecutorStore(conn)
    assert_consistent(conn)
    queue = store.recover(now=T0 + 100)
    assert [t.id for t in queue] == ["queued", "running", "asking"]
    assert all(t.state is S.SUBMITTED for t in queue)
    last = store.events_after("running", 3)
    assert [(e.seq, e.kind) for e in last] == [(4, K.REQUEUED)] and "restart" in last[0].data["reason"]
    assert store.get("overdue").state is S.FAILED and store.outcome("overdue").code is ErrorCode.TIMEOUT  # type: ignore[union-attr]
    assert store.get("done").state is S.COMPLETED
    run_to_completion(store, "running")  # requeued work runs again from the start
    assert_consistent(conn)
    conn.close()


def test_purge_forgets_fetched_or_old_finished_tasks(store: ExecutorStore, conn: sqlite3.Connection) -> None:
    for name in ("fetched", "unfetched", "running"):
        store.submit(spec(name), PHONE, now=T0)
    run_to_completion(store, "fetched")
    run_to_completion(store, "unfetched")
    store.append_event("running", K.STATE, new_state=S.WORKING)
    last = store.get("fetched").last_seq
    assert store.mark_fetched("fetched", 3).acked_seq == 3
    assert store.mark_fetched("fetched", 1).acked_seq == 3  # never backwards
    assert store.mark_fetched("fetched", 999, submitter=PHONE).acked_seq == last  # clamped to the log
    assert store.mark_fetched("running", 99).acked_seq == 2  # acked but unfinished: kept

    retention = 7 * 24 * 3600.0
    assert store.purge(time.time(), retention) == 1
    assert [t.id for t in store.list()] == ["unfetched", "running"]
    assert store.purge(time.time() + retention + 1, retention) == 1
    assert [t.id for t in store.list()] == ["running"]
    assert conn.execute("SELECT COUNT(DISTINCT task_id) FROM exec_events").fetchone()[0] == 1
    assert_consistent(conn)


# -- SIGKILL mid-write -------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import sys, time
    from psymesh.node.core.db import open_db
    from psymesh.node.tasks.executor_store import ExecutorStore
    from psymesh.protocol.tasks import EventKind as K, TaskSpec, TaskState as S

    store = ExecutorStore(open_db(sys.argv[1]))
    rnd, announced, stop = sys.argv[2], False, time.monotonic() + 30
    queue = [t.id for t in store.recover()]
    for n in range(100_000):
        if time.monotonic() > stop:
            break
        tid = queue.pop() if queue else f"{rnd}-{n}"
        store.submit(TaskSpec(id=tid, kind="infer", model="m", prompt="p"), "12D3KooWPhone")
        store.append_event(tid, K.STATE, new_state=S.WORKING)
        for i in range(20):
            store.append_event(tid, K.TOKEN, {"text": f"tok{i} "})
            if i == 10:
                store.append_event(tid, K.STATE, new_state=S.INPUT_REQUIRED)
                store.append_event(tid, K.STATE, new_state=S.WORKING)
        store.append_event(tid, K.RESULT, {"result": {"text": "done"}})
        if not announced and n >= 3:
            print("writing", flush=True)
            announced = True
""")


def test_sigkill_mid_write_leaves_a_consistent_log(db_path: Path, tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    for rnd, pause in enumerate((0.05, 0.2, 0.4)):
        proc = subprocess.Popen([sys.executable, str(script), str(db_path), f"r{rnd}"],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
            time.sleep(pause)  # the behaviour under test: SIGKILL at a different point of the writing each round
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.stdout is not None
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL

        conn = open_db(db_path)
        try:
            assert assert_consistent(conn) >= 4
            store = ExecutorStore(conn)
            unfinished = store.list(states=[S.SUBMITTED, S.WORKING, S.INPUT_REQUIRED])
            assert len(unfinished) <= 1  # the writer works one task at a time
            assert [t.id for t in store.recover()] == [t.id for t in unfinished]
            assert_consistent(conn)
        finally:
            conn.close()


# -- the submitter's outbox --------------------------------------------------------------
@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[Outbox]:
    c = open_db(tmp_path / "phone.db")
    yield Outbox(c)
    c.close()


def over_the_wire(events: list[TaskEvent]) -> list[TaskEvent]:
    return [unpack(pack(e)) for e in events]  # type: ignore[misc]


def test_outbox_keeps_tasks_until_accepted(outbox: Outbox) -> None:
    task = outbox.add(PC, spec("a"), now=T0)
    assert outbox.add(PC, spec("a"), now=T0 + 1) == task  # re-adding is harmless
    with pytest.raises(TaskConflict):
        outbox.add(PC, spec("a", args={}))
    with pytest.raises(TaskConflict):
        outbox.add("12D3KooWElsewhere", spec("a"))
    outbox.add(PC, spec("b"), now=T0 + 2)
    assert [t.id for t in outbox.pending()] == ["a", "b"] and outbox.pending(target="x") == []
    assert outbox.mark_accepted("a").accepted
    assert [t.id for t in outbox.pending()] == ["b"]
    assert [t.id for t in outbox.resumable(PC)] == ["a"]


def test_outbox_mirrors_each_event_exactly_once(store: ExecutorStore, outbox: Outbox) -> None:
    outbox.add(PC, spec())
    store.submit(spec(), PHONE)
    run_to_completion(store, "t1", "hi!")
    log = store.events_after("t1")

    delivered: list[TaskEvent] = []
    # First attach: the stream drops after 3 events. Re-attach from an old cursor
    # (the ack was lost), and a proxy resends the last event twice.
    for batch in (log[:3], log[1:], log[-1:], log[-1:]):
        for e in over_the_wire(batch):
            if outbox.record_event(e, target=PC):
                delivered.append(e)
    assert delivered == log
    assert outbox.events_after("t1") == log and outbox.last_seq("t1") == len(log)
    task = outbox.get("t1")
    assert task.accepted and task.state is S.COMPLETED  # seeing events implies acceptance
    assert outbox.result("t1").unwrap() == "hi!"  # type: ignore[union-attr]

    assert [t.id for t in outbox.resumable()] == ["t1"]  # final events not yet acknowledged
    assert outbox.mark_acked("t1", len(log)).acked_seq == len(log)
    assert outbox.resumable() == []
    assert store.mark_fetched("t1", len(log)).acked_seq == len(log)


def test_an_event_log_marks_a_task_accepted_when_told_so_never_from_sql_text(store: ExecutorStore,
                                                                            outbox: Outbox) -> None:
    """`append_all(accepted=True)` is how the outbox stores an executor's event and its acceptance
    in one UPDATE; the flag is a bool, so no caller hands the log SQL to splice in."""
    store.submit(spec(), PHONE)
    [first] = store.events_after("t1")
    outbox.add(PC, spec(), now=T0)
    log = EventLog(outbox.conn, "outbox")
    log.append_all(0, S.SUBMITTED.value, [first], T0 + 1)  # written here: not accepted by it
    assert not outbox.get("t1").accepted
    run_to_completion(store, "t1")
    second = store.events_after("t1")[1]
    log.append_all(first.seq, first.state.value, [second], T0 + 2, accepted=True)
    task = outbox.get("t1")
    assert task.accepted and task.last_seq == 2 and task.updated_at == T0 + 2


def test_outbox_refuses_gaps_illegal_histories_and_strangers(store: ExecutorStore, outbox: Outbox) -> None:
    outbox.add(PC, spec())
    store.submit(spec(), PHONE)
    run_to_completion(store, "t1", "ab")
    log = store.events_after("t1")
    with pytest.raises(ProtocolError):
        outbox.record_event(log[1])  # event 2 before event 1
    with pytest.raises(ProtocolError) as info:
        outbox.record_event(log[0], target="12D3KooWImpostor")
    assert info.value.code is ErrorCode.FORBIDDEN
    assert outbox.record_event(log[0])
    skipped = TaskEvent(task_id="t1", seq=2, kind=K.RESULT, state=S.COMPLETED, at=T0, data={"result": 1})
    with pytest.raises(IllegalTransition):
        outbox.record_event(skipped)  # submitted -> completed without working
    with pytest.raises(TaskNotFound):
        outbox.record_event(TaskEvent(task_id="zz", seq=1, kind=K.ACCEPTED, state=S.SUBMITTED, at=T0))
    # events that came together are stored all or none: a gap after event 2 keeps event 2 out too
    with pytest.raises(ProtocolError):
        outbox.record_events("t1", [log[1], log[3]], target=PC)
    assert outbox.last_seq("t1") == 1 and outbox.result("t1") is None
    assert_consistent(outbox.conn, "outbox")
    assert outbox.record_events("t1", log, target=PC) == len(log) - 1  # event 1 was held already
    assert outbox.result("t1").unwrap() == "ab"  # type: ignore[union-attr]


def test_outbox_survives_restart_and_purges_by_age(tmp_path: Path, store: ExecutorStore) -> None:
    path = tmp_path / "phone.db"
    box = Outbox(open_db(path))
    box.add(PC, spec(), now=T0)
    store.submit(spec(), PHONE)
    run_to_completion(store, "t1", "x")
    for e in store.events_after("t1", 0, limit=2):
        box.record_event(e, target=PC)
    box.conn.close()

    box = Outbox(open_db(path))
    assert [(t.id, t.last_seq) for t in box.resumable()] == [("t1", 2)]  # re-attach after 2
    for e in store.events_after("t1", box.last_seq("t1")):
        assert box.record_event(e, target=PC, now=T0 + 10)
    assert [t.state for t in box.list(states=[S.COMPLETED])] == [S.COMPLETED]
    assert box.list(states=[S.WORKING]) == []
    assert box.purge(T0 + 50, retention_s=100) == 0
    assert box.purge(T0 + 200, retention_s=100) == 1
    assert box.list() == []
    box.conn.close()


def test_a_task_that_keeps_killing_its_executor_is_given_up(tmp_path: Path) -> None:
    """Crash-loop protection: a task found running at startup counts one interrupted run;
    a task requeued by a clean shutdown does not count."""
    from psymesh.node.core.db import open_db
    from psymesh.node.tasks.executor_store import ExecutorStore
    from psymesh.protocol.tasks import EventKind, TaskKind, TaskSpec, TaskState

    store = ExecutorStore(open_db(tmp_path / "node.db"))
    spec = TaskSpec(id="poison", kind=TaskKind.TOOL, tool="system.info")
    store.submit(spec, "12D3KooWJCevK34nNaipykeTiL258pTHkFv4WE4NJJQ34nC4TPVy")
    store.append_event("poison", EventKind.STATE, new_state=TaskState.WORKING)
    store.append_event("poison", EventKind.REQUEUED, {"reason": "executor shut down"})  # clean stop: free
    for run in range(1, 5):
        store.append_event("poison", EventKind.STATE, new_state=TaskState.WORKING)
        assert [r.id for r in store.recover(max_interrupted_runs=5)] == ["poison"], run  # crash `run`
    store.append_event("poison", EventKind.STATE, new_state=TaskState.WORKING)
    assert store.recover(max_interrupted_runs=5) == []  # the fifth crash under it: given up
    record = store.get("poison")
    assert record.state is TaskState.FAILED
    outcome = store.outcome("poison")
    assert outcome is not None and outcome.code == "internal" and "5 times" in outcome.message
