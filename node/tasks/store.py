"""Durable delegated tasks in the node's SQLite database.

Two stores, one per side of a delegation:

* `ExecutorStore` (the home PC): every accepted task with its spec, submitter,
  state and deadline, and its append-only event log. An event and the state
  change it causes commit together, so after a crash (even SIGKILL between two
  statements) the log is contiguous and the task's state is its last event's.
  `recover()` at startup puts unfinished work back in the queue; nothing
  accepted is ever silently lost.
* `Outbox` (the phone): tasks it submitted, kept until the executor accepts them
  (so they can be resent after a reconnect), and a mirror of the executor's
  events keyed by (task_id, seq). A resent event is recognised and dropped, so
  each one is stored, and handed to the app, exactly once.

Calls are synchronous and short (the daemon is single-threaded trio); each public
method that writes runs in its own `transaction` and must not be called inside
another. Lifecycle rules live in `psymesh.protocol.tasks`; both stores apply them
through `next_state`, so the database can never hold an impossible history.
"""
from __future__ import annotations

import functools
import json
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.db import ensure_schema, transaction
from ...protocol.errors import ErrorCode, ProtocolError, PsymeshError
from ...protocol.tasks import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    EventKind,
    Outcome,
    TaskEvent,
    TaskKind,
    TaskSpec,
    TaskState,
    TaskStatus,
    next_state,
)

DEFAULT_PAGE = 1000


class TaskNotFound(PsymeshError):
    """No such task (or it belongs to another peer, which looks the same from outside)."""

    default_code = ErrorCode.NOT_FOUND


class TaskConflict(PsymeshError):
    """The task id is taken by a different spec (or a different peer)."""

    default_code = ErrorCode.CONFLICT


def _event_ddl(prefix: str) -> str:
    return f"""
CREATE TABLE IF NOT EXISTS {prefix}_events (
    task_id TEXT NOT NULL REFERENCES {prefix}_tasks(id) ON DELETE CASCADE,
    seq     INTEGER NOT NULL CHECK (seq >= 1),
    kind    TEXT NOT NULL,
    state   TEXT NOT NULL,
    at      REAL NOT NULL,
    data    TEXT NOT NULL,            -- JSON object
    PRIMARY KEY (task_id, seq)
) WITHOUT ROWID;
"""


EXECUTOR_DDL = """
CREATE TABLE IF NOT EXISTS exec_tasks (
    id         TEXT PRIMARY KEY,
    submitter  TEXT NOT NULL,          -- peer id from the authenticated connection
    kind       TEXT NOT NULL,
    spec       TEXT NOT NULL,          -- TaskSpec JSON, as submitted
    state      TEXT NOT NULL,
    last_seq   INTEGER NOT NULL DEFAULT 0,
    acked_seq  INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    deadline   REAL                    -- absolute, resolved at first acceptance
);
CREATE INDEX IF NOT EXISTS exec_tasks_by_state ON exec_tasks(state, created_at);
CREATE INDEX IF NOT EXISTS exec_tasks_by_submitter ON exec_tasks(submitter, state);
""" + _event_ddl("exec")

OUTBOX_DDL = """
CREATE TABLE IF NOT EXISTS outbox_tasks (
    id         TEXT PRIMARY KEY,
    target     TEXT NOT NULL,          -- executor peer id
    kind       TEXT NOT NULL,
    spec       TEXT NOT NULL,
    accepted   INTEGER NOT NULL DEFAULT 0,
    state      TEXT NOT NULL,          -- mirrored from the executor's events
    last_seq   INTEGER NOT NULL DEFAULT 0,
    acked_seq  INTEGER NOT NULL DEFAULT 0,  -- highest seq we told the executor we hold
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS outbox_tasks_by_target ON outbox_tasks(target, accepted, state);
""" + _event_ddl("outbox")


def _now(now: float | None) -> float:
    return time.time() if now is None else now


def _placeholders(values: Iterable[Any]) -> tuple[str, list[Any]]:
    items = list(values)
    return ",".join("?" * len(items)), items


# -- the event log, shared by both sides ---------------------------------------------------
class _EventLog:
    """Reads and appends one side's `<prefix>_tasks` / `<prefix>_events` pair."""

    def __init__(self, conn: sqlite3.Connection, prefix: str) -> None:
        self.conn = conn
        self.tasks = f"{prefix}_tasks"
        self.events = f"{prefix}_events"

    def row(self, task_id: str) -> sqlite3.Row:
        row = self.conn.execute(f"SELECT * FROM {self.tasks} WHERE id = ?", (task_id,)).fetchone()
        if row is None:
            raise TaskNotFound(f"no task {task_id!r}")
        return row

    def append(self, row: sqlite3.Row, event: TaskEvent, now: float) -> None:
        """Store `event` and move the task to its state; call inside a transaction."""
        current = TaskState(row["state"]) if row["last_seq"] else None
        next_state(current, event.kind, event.state)
        if event.seq != row["last_seq"] + 1:
            raise ProtocolError(
                f"task {event.task_id!r}: event {event.seq} does not follow {row['last_seq']}",
                code=ErrorCode.BAD_REQUEST,
            )
        self.conn.execute(
            f"INSERT INTO {self.events} (task_id, seq, kind, state, at, data) VALUES (?, ?, ?, ?, ?, ?)",
            (event.task_id, event.seq, event.kind.value, event.state.value, event.at,
             json.dumps(event.data, ensure_ascii=False, separators=(",", ":"))),
        )
        self.conn.execute(
            f"UPDATE {self.tasks} SET state = ?, last_seq = ?, updated_at = ? WHERE id = ?",
            (event.state.value, event.seq, now, event.task_id),
        )

    def after(self, task_id: str, after_seq: int, limit: int) -> list[TaskEvent]:
        rows = self.conn.execute(
            f"SELECT * FROM {self.events} WHERE task_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (task_id, after_seq, limit),
        ).fetchall()
        if not rows:
            self.row(task_id)  # unknown task -> TaskNotFound, not an empty log
        return [_event(r) for r in rows]

    def outcome(self, task_id: str) -> Outcome | None:
        row = self.row(task_id)
        if TaskState(row["state"]) not in TERMINAL_STATES:
            return None
        last = self.conn.execute(
            f"SELECT * FROM {self.events} WHERE task_id = ? AND seq = ?", (task_id, row["last_seq"])
        ).fetchone()
        return Outcome.from_event(_event(last))

    def purge(self, now: float, retention_s: float, *, when_acked: bool) -> int:
        """Forget finished tasks older than retention (or, `when_acked`, fully acknowledged ones)."""
        marks, states = _placeholders(s.value for s in TERMINAL_STATES)
        acked = "acked_seq >= last_seq OR " if when_acked else ""
        with transaction(self.conn):
            cur = self.conn.execute(
                f"DELETE FROM {self.tasks} WHERE state IN ({marks}) AND ({acked}updated_at < ?)",
                (*states, now - retention_s),
            )
        return cur.rowcount


def _event(row: sqlite3.Row) -> TaskEvent:
    return TaskEvent(
        task_id=row["task_id"], seq=row["seq"], kind=row["kind"], state=row["state"],
        at=row["at"], data=json.loads(row["data"]),
    )


@functools.lru_cache(maxsize=1024)
def _spec(text: str) -> TaskSpec:
    """(Cached: a task's row is read many times while it runs, and a TaskSpec is frozen.)"""
    return TaskSpec.model_validate_json(text)


# -- executor side -----------------------------------------------------------------------
@dataclass(frozen=True)
class TaskRecord:
    """An executor's view of one task (without its log)."""

    spec: TaskSpec
    submitter: str
    state: TaskState
    last_seq: int
    acked_seq: int
    created_at: float
    updated_at: float
    deadline: float | None

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def kind(self) -> TaskKind:
        return self.spec.kind

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def status(self) -> TaskStatus:
        return TaskStatus(
            task_id=self.id, kind=self.kind, state=self.state, last_seq=self.last_seq,
            acked_seq=self.acked_seq, created_at=self.created_at, updated_at=self.updated_at,
            deadline=self.deadline,
        )

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> TaskRecord:
        return cls(
            spec=_spec(row["spec"]), submitter=row["submitter"], state=TaskState(row["state"]),
            last_seq=row["last_seq"], acked_seq=row["acked_seq"], created_at=row["created_at"],
            updated_at=row["updated_at"], deadline=row["deadline"],
        )


class ExecutorStore:
    """The home PC's durable task table and event logs.

    The service on top drives it like this::

        task, created = store.submit(spec, peer)            # idempotent; CONFLICT on reuse
        store.append_event(tid, EventKind.STATE, new_state=TaskState.WORKING)
        store.append_event(tid, EventKind.TOKEN, {"text": "Hel"})
        store.append_event(tid, EventKind.RESULT, {"result": {...}})
        store.events_after(tid, client_seq)                 # for attach
        store.expire(now); store.recover(now); store.purge(now, retention_s)
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        ensure_schema(conn, EXECUTOR_DDL)
        self._log = _EventLog(conn, "exec")

    # -- writes ---------------------------------------------------------------------------
    def submit(self, spec: TaskSpec, submitter: str, now: float | None = None) -> tuple[TaskRecord, bool]:
        """Accept `spec` from `submitter`: (task, True) if new, (task, False) if a resubmit.

        The same id with a different spec, or from a different peer, is TaskConflict.
        A new task starts with event 1, `accepted`, in state submitted.
        """
        now = _now(now)
        with transaction(self.conn):
            try:
                existing = self._log.row(spec.id)
            except TaskNotFound:
                existing = None
            if existing is not None:
                record = TaskRecord.from_row(existing)
                if record.submitter != submitter or record.spec != spec:
                    raise TaskConflict(f"task id {spec.id!r} is already in use for a different task")
                return record, False
            self.conn.execute(
                "INSERT INTO exec_tasks (id, submitter, kind, spec, state, created_at, updated_at, deadline)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (spec.id, submitter, spec.kind.value, spec.model_dump_json(), TaskState.SUBMITTED.value,
                 now, now, spec.resolve_deadline(now)),
            )
            self._append(spec.id, EventKind.ACCEPTED, {}, None, now)
            return TaskRecord.from_row(self._log.row(spec.id)), True

    def append_event(
        self,
        task_id: str,
        kind: EventKind,
        data: dict[str, Any] | None = None,
        new_state: TaskState | None = None,
        *,
        now: float | None = None,
    ) -> TaskEvent:
        """Append the next event (and its state change) atomically; returns it, numbered.

        IllegalTransition if the lifecycle forbids it (e.g. anything after a final
        event); ProtocolError (BAD_REQUEST) if `data` does not fit `kind` or the size limits.
        """
        with transaction(self.conn):
            return self._append(task_id, kind, data or {}, new_state, _now(now))

    def cancel(self, task_id: str, reason: str = "", now: float | None = None) -> TaskRecord:
        """Move an unfinished task to canceled; a finished one is returned unchanged."""
        with transaction(self.conn):
            row = self._log.row(task_id)
            if TaskState(row["state"]) in ACTIVE_STATES:
                self._append(task_id, EventKind.STATE, {"reason": reason} if reason else {},
                             TaskState.CANCELED, _now(now))
                row = self._log.row(task_id)
            return TaskRecord.from_row(row)

    def mark_fetched(self, task_id: str, upto_seq: int, submitter: str | None = None) -> TaskRecord:
        """Record that the submitter durably holds events 1..upto_seq (never moves backwards)."""
        with transaction(self.conn):
            row = self._owned_row(task_id, submitter)
            acked = max(row["acked_seq"], min(upto_seq, row["last_seq"]))
            self.conn.execute("UPDATE exec_tasks SET acked_seq = ? WHERE id = ?", (acked, task_id))
            return TaskRecord.from_row(self._log.row(task_id))

    def expire(self, now: float | None = None) -> list[TaskRecord]:
        """Fail every unfinished task whose deadline has passed (error TIMEOUT); returns them."""
        now = _now(now)
        marks, states = _placeholders(s.value for s in ACTIVE_STATES)
        with transaction(self.conn):
            ids = [r["id"] for r in self.conn.execute(
                f"SELECT id FROM exec_tasks WHERE state IN ({marks}) AND deadline <= ? ORDER BY created_at, rowid",
                (*states, now),
            )]
            for task_id in ids:
                self._append(task_id, EventKind.ERROR,
                             {"code": ErrorCode.TIMEOUT.value, "message": "deadline passed"}, None, now)
            return [TaskRecord.from_row(self._log.row(i)) for i in ids]

    def recover(self, now: float | None = None, max_interrupted_runs: int = 5) -> list[TaskRecord]:
        """At startup: requeue work a crash interrupted; returns the queue, oldest first.

        Overdue tasks fail with TIMEOUT. Every other unfinished task gets a `requeued`
        event (back to submitted: partial output seen so far is void) and is returned
        for the service to run again. A task found *running* (its node died under it,
        since a clean shutdown requeues running work itself) counts one interrupted
        run; one that has taken the node down `max_interrupted_runs` times fails with
        INTERNAL instead, so a task that crashes its executor cannot crash-loop it.
        """
        now = _now(now)
        self.expire(now)
        marks, states = _placeholders(s.value for s in ACTIVE_STATES)
        queue: list[str] = []
        with transaction(self.conn):
            rows = self.conn.execute(
                f"SELECT id, state FROM exec_tasks WHERE state IN ({marks}) ORDER BY created_at, rowid", states,
            ).fetchall()
            for row in rows:
                task_id, was_running = row["id"], row["state"] != TaskState.SUBMITTED.value
                if not was_running:
                    self._append(task_id, EventKind.REQUEUED, {"reason": "executor restarted"}, None, now)
                    queue.append(task_id)
                    continue
                runs = 1 + self.conn.execute(
                    "SELECT COUNT(*) FROM exec_events WHERE task_id = ? AND kind = ? "
                    "AND json_extract(data, '$.interrupted_run') = 1", (task_id, EventKind.REQUEUED.value),
                ).fetchone()[0]
                if runs >= max_interrupted_runs:
                    self._append(task_id, EventKind.ERROR, {
                        "code": ErrorCode.INTERNAL.value,
                        "message": f"the executor stopped {runs} times while running this task; not retrying it",
                    }, None, now)
                    continue
                self._append(task_id, EventKind.REQUEUED, {"reason": "executor restarted while running it",
                                                           "interrupted_run": True}, None, now)
                queue.append(task_id)
            return [TaskRecord.from_row(self._log.row(i)) for i in queue]

    def purge(self, now: float | None, retention_s: float) -> int:
        """Delete finished tasks that are fully fetched or older than `retention_s`; returns how many."""
        return self._log.purge(_now(now), retention_s, when_acked=True)

    # -- reads ----------------------------------------------------------------------------
    def get(self, task_id: str, submitter: str | None = None) -> TaskRecord:
        """The task; TaskNotFound if absent or (when `submitter` is given) someone else's."""
        return TaskRecord.from_row(self._owned_row(task_id, submitter))

    def _owned_row(self, task_id: str, submitter: str | None = None) -> sqlite3.Row:
        row = self._log.row(task_id)
        if submitter is not None and row["submitter"] != submitter:
            raise TaskNotFound(f"no task {task_id!r}")
        return row

    def events_after(self, task_id: str, after_seq: int = 0, limit: int = DEFAULT_PAGE) -> list[TaskEvent]:
        """Events numbered above `after_seq`, in order, at most `limit` (page until empty)."""
        return self._log.after(task_id, after_seq, limit)

    def outcome(self, task_id: str) -> Outcome | None:
        """How the task ended, or None while it runs."""
        return self._log.outcome(task_id)

    def list(
        self,
        submitter: str | None = None,
        states: Iterable[TaskState] | None = None,
        limit: int | None = None,
    ) -> list[TaskRecord]:
        """Tasks, oldest first; `states=[TaskState.SUBMITTED]` is the run queue."""
        where, params = self._filter(submitter, states)
        sql = f"SELECT * FROM exec_tasks{where} ORDER BY created_at, rowid"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return [TaskRecord.from_row(r) for r in self.conn.execute(sql, params)]

    def queue_depth(self) -> int:
        """Unfinished tasks on this node (for BUSY backpressure)."""
        return self._count(None)

    def active_for(self, peer: str) -> int:
        """Unfinished tasks submitted by `peer` (for per-peer quotas)."""
        return self._count(peer)

    def holds(self, peer: str, task_id: str) -> bool:
        """Whether `peer` already submitted `task_id` here (a resubmit costs it nothing)."""
        return self.conn.execute("SELECT 1 FROM exec_tasks WHERE id = ? AND submitter = ?",
                                 (task_id, peer)).fetchone() is not None

    def next_deadline(self) -> float | None:
        """The earliest deadline among unfinished tasks: when the executor's expiry wakes next."""
        marks, states = _placeholders(s.value for s in ACTIVE_STATES)
        row = self.conn.execute(
            f"SELECT MIN(deadline) FROM exec_tasks WHERE state IN ({marks})", states
        ).fetchone()
        return row[0]

    # -- internals ------------------------------------------------------------------------
    def _append(
        self, task_id: str, kind: EventKind, data: dict[str, Any], state: TaskState | None, now: float
    ) -> TaskEvent:
        row = self._log.row(task_id)
        current = TaskState(row["state"]) if row["last_seq"] else None
        # next_state fills in the state the event carries; _log.append checks it again,
        # which is the one gate both sides' logs pass through.
        event = _build_event(task_id, row["last_seq"] + 1, kind, next_state(current, kind, state), now, data)
        self._log.append(row, event, now)
        return event

    def _filter(self, submitter: str | None, states: Iterable[TaskState] | None) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        if submitter is not None:
            clauses.append("submitter = ?")
            params.append(submitter)
        if states is not None:
            marks, values = _placeholders(TaskState(s).value for s in states)
            clauses.append(f"state IN ({marks})" if values else "0")
            params.extend(values)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def _count(self, submitter: str | None) -> int:
        where, params = self._filter(submitter, ACTIVE_STATES)
        return self.conn.execute(f"SELECT COUNT(*) FROM exec_tasks{where}", params).fetchone()[0]


def _build_event(task_id: str, seq: int, kind: EventKind, state: TaskState, at: float,
                 data: dict[str, Any]) -> TaskEvent:
    """Validate like a receiver would, so the executor never stores what it could not send."""
    try:
        return TaskEvent.model_validate(
            {"task_id": task_id, "seq": seq, "kind": kind, "state": state, "at": at, "data": data}
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ProtocolError(f"invalid {kind.value!r} event for task {task_id!r}: {exc}",
                            code=ErrorCode.BAD_REQUEST) from None


# -- submitter side ----------------------------------------------------------------------
@dataclass(frozen=True)
class OutboxTask:
    """A submitter's view of one delegated task."""

    spec: TaskSpec
    target: str
    accepted: bool        # the executor confirmed it holds the task
    state: TaskState      # as of the last mirrored event
    last_seq: int         # events mirrored locally (re-attach after this)
    acked_seq: int        # events we told the executor we hold
    created_at: float
    updated_at: float

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> OutboxTask:
        return cls(
            spec=_spec(row["spec"]), target=row["target"], accepted=bool(row["accepted"]),
            state=TaskState(row["state"]), last_seq=row["last_seq"], acked_seq=row["acked_seq"],
            created_at=row["created_at"], updated_at=row["updated_at"],
        )


class Outbox:
    """The phone's durable record of tasks it delegated.

        task = outbox.add(pc_peer, spec)                 # before sending task.submit
        outbox.mark_accepted(spec.id)                    # on task.accepted
        for event in stream:                             # task.attach(after_seq=task.last_seq)
            if outbox.record_event(event):               # False for a resent duplicate
                deliver(event)
        outbox.mark_acked(spec.id, seq)                  # after sending task.ack
        outbox.pending(); outbox.resumable()             # after a reconnect
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        ensure_schema(conn, OUTBOX_DDL)
        self._log = _EventLog(conn, "outbox")

    def add(self, target: str, spec: TaskSpec, now: float | None = None) -> OutboxTask:
        """Remember a task before submitting it; idempotent like the executor's submit."""
        now = _now(now)
        with transaction(self.conn):
            try:
                task = OutboxTask.from_row(self._log.row(spec.id))
            except TaskNotFound:
                self.conn.execute(
                    "INSERT INTO outbox_tasks (id, target, kind, spec, state, created_at, updated_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (spec.id, target, spec.kind.value, spec.model_dump_json(), TaskState.SUBMITTED.value, now, now),
                )
                return OutboxTask.from_row(self._log.row(spec.id))
            if task.target != target or task.spec != spec:
                raise TaskConflict(f"task id {spec.id!r} is already used for a different task")
            return task

    def mark_accepted(self, task_id: str, now: float | None = None) -> OutboxTask:
        """The executor holds the task: stop resending it."""
        with transaction(self.conn):
            self._log.row(task_id)
            self.conn.execute(
                "UPDATE outbox_tasks SET accepted = 1, updated_at = ? WHERE id = ?", (_now(now), task_id)
            )
            return OutboxTask.from_row(self._log.row(task_id))

    def retarget(self, task_id: str, target: str) -> OutboxTask:
        """Address a task no executor has accepted yet to another one (failover); an
        accepted task stays where it is."""
        with transaction(self.conn):
            self.conn.execute("UPDATE outbox_tasks SET target = ? WHERE id = ? AND accepted = 0", (target, task_id))
            return OutboxTask.from_row(self._log.row(task_id))

    def forget(self, task_id: str) -> bool:
        """Drop a task refused before any executor accepted it, as if never submitted."""
        with transaction(self.conn):
            cur = self.conn.execute("DELETE FROM outbox_tasks WHERE id = ? AND accepted = 0 AND last_seq = 0",
                                    (task_id,))
            return cur.rowcount == 1

    def record_event(self, event: TaskEvent, target: str | None = None, now: float | None = None) -> bool:
        """Mirror one event: True if new (deliver it), False if already held.

        `target` is the executor it came from: an event from it implies it accepted the
        task. Without `target` the event was written here (the task ended on this side).
        An event past a gap, one that breaks the lifecycle, or one from a peer that is
        not the task's executor is a ProtocolError: re-attach from `last_seq` instead
        of trusting it.
        """
        with transaction(self.conn):
            row = self._log.row(event.task_id)
            if target is not None and row["target"] != target:
                raise ProtocolError(f"peer sent an event for task {event.task_id!r} it does not run",
                                    code=ErrorCode.FORBIDDEN)
            if event.seq <= row["last_seq"]:
                return False
            self._log.append(row, event, _now(now))  # checks seq contiguity and the transition
            if target is not None:
                self.conn.execute("UPDATE outbox_tasks SET accepted = 1 WHERE id = ?", (event.task_id,))
            return True

    def mark_acked(self, task_id: str, upto_seq: int) -> OutboxTask:
        """We sent task.ack for events 1..upto_seq (never moves backwards)."""
        with transaction(self.conn):
            row = self._log.row(task_id)
            acked = max(row["acked_seq"], min(upto_seq, row["last_seq"]))
            self.conn.execute("UPDATE outbox_tasks SET acked_seq = ? WHERE id = ?", (acked, task_id))
            return OutboxTask.from_row(self._log.row(task_id))

    def get(self, task_id: str) -> OutboxTask:
        return OutboxTask.from_row(self._log.row(task_id))

    def last_seq(self, task_id: str) -> int:
        """The number to re-attach after."""
        return self._log.row(task_id)["last_seq"]

    def events_after(self, task_id: str, after_seq: int = 0, limit: int = DEFAULT_PAGE) -> list[TaskEvent]:
        return self._log.after(task_id, after_seq, limit)

    def result(self, task_id: str) -> Outcome | None:
        """How the task ended (`.unwrap()` gives the value or raises), or None while it runs."""
        return self._log.outcome(task_id)

    def pending(self, target: str | None = None) -> list[OutboxTask]:
        """Tasks not yet accepted: resend their task.submit after (re)connecting."""
        return self._select("accepted = 0", target)

    def resumable(self, target: str | None = None) -> list[OutboxTask]:
        """Accepted tasks to re-attach to (running, or final events not yet acknowledged)."""
        marks, states = _placeholders(s.value for s in ACTIVE_STATES)
        return self._select(f"accepted = 1 AND (state IN ({marks}) OR acked_seq < last_seq)", target, states)

    def list(self, target: str | None = None, states: Iterable[TaskState] | None = None) -> list[OutboxTask]:
        """Every task with its local state, oldest first."""
        if states is None:
            return self._select("1", target)
        marks, values = _placeholders(TaskState(s).value for s in states)
        return self._select(f"state IN ({marks})" if values else "0", target, values)

    def purge(self, now: float | None, retention_s: float) -> int:
        """Forget tasks that finished more than `retention_s` ago (the app has had its chance)."""
        return self._log.purge(_now(now), retention_s, when_acked=False)

    def _select(self, where: str, target: str | None, params: list[Any] | None = None) -> list[OutboxTask]:
        params = list(params or [])
        if target is not None:
            where += " AND target = ?"
            params.append(target)
        rows = self.conn.execute(f"SELECT * FROM outbox_tasks WHERE {where} ORDER BY created_at, rowid", params)
        return [OutboxTask.from_row(r) for r in rows]
