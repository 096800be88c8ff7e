"""The executor's durable tasks (the home PC): every accepted task with its spec, submitter, state
and deadline, and its append-only event log.

An event and the state change it causes commit together, so after a crash (even SIGKILL between two
statements) the log is contiguous and the task's state is its last event's. `recover()` at startup
puts unfinished work back in the queue; nothing accepted is ever silently lost. Calls are synchronous
and short; each public method that writes runs in its own `transaction` and must not be called
inside another.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.db import ensure_schema, transaction
from ..door.gate import QueueLoad
from ...protocol.errors import ErrorCode, ProtocolError
from ...protocol.tasks import (
    ACTIVE_STATES,
    EventKind,
    Outcome,
    TaskEvent,
    TaskKind,
    TaskSpec,
    TaskState,
    TaskStatus,
    next_state,
)
from .tasklog import (
    DEFAULT_PAGE,
    EventLog,
    TaskConflict,
    TaskNotFound,
    event_ddl,
    placeholders,
    resolve_now,
    spec_from_json,
    spec_to_json,
)

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
""" + event_ddl("exec")


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
            spec=spec_from_json(row["spec"]), submitter=row["submitter"], state=TaskState(row["state"]),
            last_seq=row["last_seq"], acked_seq=row["acked_seq"], created_at=row["created_at"],
            updated_at=row["updated_at"], deadline=row["deadline"],
        )


# acked_seq never moves backwards and never past the log: one rule for one ack and a batch
_MARK_FETCHED = "UPDATE exec_tasks SET acked_seq = MAX(acked_seq, MIN(?, last_seq)) WHERE id = ?"


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
        self._log = EventLog(conn, "exec")

    # -- writes ---------------------------------------------------------------------------
    def submit(self, spec: TaskSpec, submitter: str, now: float | None = None) -> tuple[TaskRecord, bool]:
        """Accept `spec` from `submitter`: (task, True) if new, (task, False) if a resubmit.

        The same id with a different spec, or from a different peer, is TaskConflict.
        A new task starts with event 1, `accepted`, in state submitted.
        """
        now = resolve_now(now)
        # event 1, checked as every event is (its state: the row's), written with the row
        event = _build_event(spec.id, 1, EventKind.ACCEPTED, next_state(None, EventKind.ACCEPTED, None), now, {})
        with transaction(self.conn):
            deadline = spec.resolve_deadline(now)
            inserted = self.conn.execute(
                "INSERT INTO exec_tasks (id, submitter, kind, spec, state, last_seq, created_at, updated_at, deadline)"
                " VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                (spec.id, submitter, spec.kind.value, spec_to_json(spec), event.state.value,
                 now, now, deadline),
            ).rowcount
            if not inserted:  # a resubmit (or a reuse of the id)
                record = TaskRecord.from_row(self._log.row(spec.id))
                if record.submitter != submitter or record.spec != spec:
                    raise TaskConflict(f"task id {spec.id!r} is already in use for a different task")
                return record, False
            self._log.insert_events([event])  # the row says last_seq 1 already: no UPDATE of it
            return TaskRecord(spec=spec, submitter=submitter, state=event.state, last_seq=event.seq, acked_seq=0,
                              created_at=now, updated_at=now, deadline=deadline), True  # as written: no read back

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
            return self._append(task_id, kind, data or {}, new_state, resolve_now(now))

    def cancel(self, task_id: str, reason: str = "", now: float | None = None) -> TaskRecord:
        """Move an unfinished task to canceled; a finished one is returned unchanged."""
        with transaction(self.conn):
            row = self._log.row(task_id)
            if TaskState(row["state"]) in ACTIVE_STATES:
                self._append(task_id, EventKind.STATE, {"reason": reason} if reason else {},
                             TaskState.CANCELED, resolve_now(now))
                row = self._log.row(task_id)
            return TaskRecord.from_row(row)

    def mark_fetched_each(self, acks: Iterable[tuple[str, int]], submitter: str) -> int:
        """`mark_fetched` for each (task_id, upto_seq) of one `task.acks`, in one transaction;
        returns how many were `submitter`'s tasks (the rest: forgotten already, or not its)."""
        with transaction(self.conn):
            return sum(self.conn.execute(_MARK_FETCHED + " AND submitter = ?", (upto, task_id, submitter)).rowcount
                       for task_id, upto in acks)

    def mark_fetched(self, task_id: str, upto_seq: int, submitter: str | None = None) -> TaskRecord:
        """Record that the submitter durably holds events 1..upto_seq (never moves backwards)."""
        with transaction(self.conn):
            self._owned_row(task_id, submitter)  # NOT_FOUND for an unknown task or another submitter's
            self.conn.execute(_MARK_FETCHED, (upto_seq, task_id))
            return TaskRecord.from_row(self._log.row(task_id))

    def expire(self, now: float | None = None) -> list[TaskRecord]:
        """Fail every unfinished task whose deadline has passed (error TIMEOUT); returns them."""
        now = resolve_now(now)
        marks, states = placeholders(s.value for s in ACTIVE_STATES)
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
        now = resolve_now(now)
        self.expire(now)
        marks, states = placeholders(s.value for s in ACTIVE_STATES)
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
        return self._log.purge(resolve_now(now), retention_s, when_acked=True)

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

    def news(self, task_id: str, after_seq: int) -> tuple[list[TaskEvent], bool]:
        """What a follower sends next: the events above `after_seq` and, when there are none,
        whether the task has ended (one read of its row, not two)."""
        return self._log.news(task_id, after_seq, DEFAULT_PAGE)

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

    def load(self, peer: str, task_id: str) -> QueueLoad:
        """`holds(peer, task_id)`, `active_for(peer)` and `queue_depth()` in one statement (the
        door asks all three of every task it admits)."""
        marks, states = placeholders(s.value for s in ACTIVE_STATES)
        row = self.conn.execute(
            "SELECT EXISTS (SELECT 1 FROM exec_tasks WHERE id = ? AND submitter = ?),"
            f" (SELECT COUNT(*) FROM exec_tasks WHERE submitter = ? AND state IN ({marks})),"
            f" (SELECT COUNT(*) FROM exec_tasks WHERE state IN ({marks}))",
            (task_id, peer, peer, *states, *states),
        ).fetchone()
        return QueueLoad(held=bool(row[0]), active_for_peer=row[1], depth=row[2])

    def next_deadline(self) -> float | None:
        """The earliest deadline among unfinished tasks: when the executor's expiry wakes next."""
        marks, states = placeholders(s.value for s in ACTIVE_STATES)
        row = self.conn.execute(
            f"SELECT MIN(deadline) FROM exec_tasks WHERE state IN ({marks})", states
        ).fetchone()
        return row[0]

    # -- internals ------------------------------------------------------------------------
    def _append(
        self, task_id: str, kind: EventKind, data: dict[str, Any], state: TaskState | None, now: float,
        head: tuple[int, str] | None = None,
    ) -> TaskEvent:
        """`head`: the task's (last_seq, state) when this transaction just wrote them (else read)."""
        if head is None:
            row = self._log.row(task_id)
            head = (row["last_seq"], row["state"])
        last_seq, stored = head
        current = TaskState(stored) if last_seq else None
        # next_state fills in the state the event carries; _log.append checks it again,
        # which is the one gate both sides' logs pass through.
        event = _build_event(task_id, last_seq + 1, kind, next_state(current, kind, state), now, data)
        self._log.append(last_seq, stored, event, now)
        return event

    def _filter(self, submitter: str | None, states: Iterable[TaskState] | None) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        if submitter is not None:
            clauses.append("submitter = ?")
            params.append(submitter)
        if states is not None:
            marks, values = placeholders(TaskState(s).value for s in states)
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
