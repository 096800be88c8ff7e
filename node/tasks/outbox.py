"""The submitter's durable record of tasks it delegated (the phone's outbox).

A task is kept until the executor accepts it (so it can be resent after a reconnect), with a mirror
of the executor's events keyed by (task_id, seq): a resent event is recognised and dropped, so each
one is stored, and handed to the app, exactly once. Calls are synchronous and short; each public
method that writes runs in its own `transaction` and must not be called inside another.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.db import ensure_schema, transaction
from ...protocol.errors import ErrorCode, ProtocolError
from ...protocol.tasks import ACTIVE_STATES, Outcome, TaskEvent, TaskSpec, TaskState
from .tasklog import (
    DEFAULT_PAGE,
    EventLog,
    TaskConflict,
    event_ddl,
    placeholders,
    resolve_now,
    spec_from_json,
    spec_to_json,
)

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
""" + event_ddl("outbox")



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
            spec=spec_from_json(row["spec"]), target=row["target"], accepted=bool(row["accepted"]),
            state=TaskState(row["state"]), last_seq=row["last_seq"], acked_seq=row["acked_seq"],
            created_at=row["created_at"], updated_at=row["updated_at"],
        )


# acked_seq never moves backwards and never past the log: one rule for one ack and a batch
_MARK_ACKED = "UPDATE outbox_tasks SET acked_seq = MAX(acked_seq, MIN(?, last_seq)) WHERE id = ?"


class Outbox:
    """The phone's durable record of tasks it delegated.

        task = outbox.add(pc_peer, spec)                 # before sending task.submit
        for event in stream:                             # task.attach(after_seq=task.last_seq)
            if outbox.record_event(event, pc_peer):      # False for a resent duplicate; marks it accepted
                deliver(event)
        outbox.mark_acked_each([(spec.id, seq)])         # after the executor took the task.ack(s)
        outbox.pending(); outbox.resumable()             # after a reconnect
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        ensure_schema(conn, OUTBOX_DDL)
        self._log = EventLog(conn, "outbox")

    def add(self, target: str, spec: TaskSpec, now: float | None = None) -> OutboxTask:
        """Remember a task before submitting it; idempotent like the executor's submit."""
        now = resolve_now(now)
        inserted = self.conn.execute(  # one statement: a transaction of its own
            "INSERT INTO outbox_tasks (id, target, kind, spec, state, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
            (spec.id, target, spec.kind.value, spec_to_json(spec), TaskState.SUBMITTED.value, now, now),
        ).rowcount
        if inserted:
            return OutboxTask(spec=spec, target=target, accepted=False, state=TaskState.SUBMITTED, last_seq=0,
                              acked_seq=0, created_at=now, updated_at=now)  # as written: no read back
        task = OutboxTask.from_row(self._log.row(spec.id))
        if task.target != target or task.spec != spec:
            raise TaskConflict(f"task id {spec.id!r} is already used for a different task")
        return task

    def find(self, task_id: str) -> OutboxTask | None:
        """The task, or None if this node never delegated it (or forgot it)."""
        row = self.conn.execute("SELECT * FROM outbox_tasks WHERE id = ?", (task_id,)).fetchone()
        return None if row is None else OutboxTask.from_row(row)

    def mark_accepted(self, task_id: str, now: float | None = None) -> OutboxTask:
        """The executor holds the task: stop resending it."""
        with transaction(self.conn):
            self._log.row(task_id)
            self.conn.execute(
                "UPDATE outbox_tasks SET accepted = 1, updated_at = ? WHERE id = ?", (resolve_now(now), task_id)
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
        task (the submitter stores acceptance this way, with the first event, not on its
        own). Without `target` the event was written here (the task ended on this side).
        An event past a gap, one that breaks the lifecycle, or one from a peer that is
        not the task's executor is a ProtocolError: re-attach from `last_seq` instead
        of trusting it.
        """
        return bool(self.record_events(event.task_id, [event], target, now))

    def record_events(self, task_id: str, events: Iterable[TaskEvent], target: str | None = None,
                      now: float | None = None) -> int:
        """`record_event` for events of one task that came together (in order), in one
        transaction: all of them are stored or, on an error, none. Returns how many were new."""
        with transaction(self.conn):
            row = self._log.row(task_id)
            if target is not None and row["target"] != target:
                raise ProtocolError(f"peer sent an event for task {task_id!r} it does not run",
                                    code=ErrorCode.FORBIDDEN)
            fresh: list[TaskEvent] = []
            for event in events:
                if event.task_id != task_id:
                    raise ProtocolError(f"an event of task {event.task_id!r} among {task_id!r}'s")
                if event.seq > row["last_seq"] + len(fresh):  # (a resent one is at or below it: dropped)
                    fresh.append(event)
            # checks each against the one before (seq, transition), one UPDATE of the row for all
            self._log.append_all(row["last_seq"], row["state"], fresh, resolve_now(now),
                                 accepted=target is not None and not row["accepted"])
            return len(fresh)

    def mark_acked(self, task_id: str, upto_seq: int) -> OutboxTask:
        """We sent task.ack for events 1..upto_seq (never moves backwards)."""
        with transaction(self.conn):
            self._log.row(task_id)  # NOT_FOUND for a task never delegated
            self.conn.execute(_MARK_ACKED, (upto_seq, task_id))
            return OutboxTask.from_row(self._log.row(task_id))

    def mark_acked_each(self, acks: Iterable[tuple[str, int]]) -> None:
        """`mark_acked` for each (task_id, upto_seq) of one batch of acks, in one transaction
        (a task forgotten meanwhile is skipped)."""
        with transaction(self.conn):
            self.conn.executemany(_MARK_ACKED, [(upto, task_id) for task_id, upto in acks])

    def get(self, task_id: str) -> OutboxTask:
        return OutboxTask.from_row(self._log.row(task_id))

    def last_seq(self, task_id: str) -> int:
        """The number to re-attach after."""
        return self._log.row(task_id)["last_seq"]

    def events_after(self, task_id: str, after_seq: int = 0, limit: int = DEFAULT_PAGE) -> list[TaskEvent]:
        return self._log.after(task_id, after_seq, limit)

    def news(self, task_id: str, after_seq: int) -> tuple[list[TaskEvent], bool]:
        """What a watcher sends next: the events above `after_seq` and, when there are none,
        whether the task has ended."""
        return self._log.news(task_id, after_seq, DEFAULT_PAGE)

    def final(self, task_id: str) -> TaskEvent | None:
        """The task's final event (its outcome is `.outcome`), or None while it runs."""
        return self._log.final(task_id)

    def result(self, task_id: str) -> Outcome | None:
        """How the task ended (`.unwrap()` gives the value or raises), or None while it runs."""
        return self._log.outcome(task_id)

    def pending(self, target: str | None = None) -> list[OutboxTask]:
        """Tasks not yet accepted: resend their task.submit after (re)connecting."""
        return self._select("accepted = 0", target)

    def resumable(self, target: str | None = None) -> list[OutboxTask]:
        """Accepted tasks to re-attach to (running, or final events not yet acknowledged)."""
        marks, states = placeholders(s.value for s in ACTIVE_STATES)
        return self._select(f"accepted = 1 AND (state IN ({marks}) OR acked_seq < last_seq)", target, states)

    def list(self, target: str | None = None, states: Iterable[TaskState] | None = None) -> list[OutboxTask]:
        """Every task with its local state, oldest first."""
        if states is None:
            return self._select("1", target)
        marks, values = placeholders(TaskState(s).value for s in states)
        return self._select(f"state IN ({marks})" if values else "0", target, values)

    def purge(self, now: float | None, retention_s: float) -> int:
        """Forget tasks that finished more than `retention_s` ago (the app has had its chance)."""
        return self._log.purge(resolve_now(now), retention_s, when_acked=False)

    def _select(self, where: str, target: str | None, params: list[Any] | None = None) -> list[OutboxTask]:
        params = list(params or [])
        if target is not None:
            where += " AND target = ?"
            params.append(target)
        rows = self.conn.execute(f"SELECT * FROM outbox_tasks WHERE {where} ORDER BY created_at, rowid", params)
        return [OutboxTask.from_row(r) for r in rows]
