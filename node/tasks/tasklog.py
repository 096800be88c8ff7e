"""What both task stores share: their errors, the event-log table pair and how a row becomes a model.

Each side of a delegation keeps a `<prefix>_tasks` table and a `<prefix>_events` log (`exec_` in
executor_store.py, `outbox_` in outbox.py); `EventLog` reads and appends that pair, applying
`psymesh.protocol.tasks.next_state`, so neither side can store an impossible history.
"""
from __future__ import annotations

import json
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ..core.db import transaction
from ...protocol.errors import ErrorCode, ProtocolError, PsymeshError
from ...protocol.tasks import TERMINAL_STATES, EventKind, Outcome, TaskEvent, TaskSpec, TaskState, next_state

DEFAULT_PAGE = 1000


class TaskNotFound(PsymeshError):
    """No such task (or it belongs to another peer, which looks the same from outside)."""

    default_code = ErrorCode.NOT_FOUND


class TaskConflict(PsymeshError):
    """The task id is taken by a different spec (or a different peer)."""

    default_code = ErrorCode.CONFLICT


def event_ddl(prefix: str) -> str:
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


def resolve_now(now: float | None) -> float:
    return time.time() if now is None else now


def placeholders(values: Iterable[Any]) -> tuple[str, list[Any]]:
    items = list(values)
    return ",".join("?" * len(items)), items


# -- the event log, shared by both sides ---------------------------------------------------
class EventLog:
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

    def append(self, last_seq: int, state: str, event: TaskEvent, now: float) -> None:
        """Store `event` and move the task to its state; call inside a transaction. `last_seq`
        and `state` are the task's as stored (its row's, or what this transaction wrote)."""
        self.append_all(last_seq, state, [event], now)

    def append_all(self, last_seq: int, state: str, events: list[TaskEvent], now: float, *,
                   accepted: bool = False) -> None:
        """`append` for events of one task in a row (each checked against the one before): their
        rows, then the task's row once, for the last. `accepted`: the same UPDATE marks the task
        accepted (the outbox's rows, which have that column: an event from the executor implies it)."""
        for event in events:
            next_state(TaskState(state) if last_seq else None, event.kind, event.state)
            if event.seq != last_seq + 1:
                raise ProtocolError(
                    f"task {event.task_id!r}: event {event.seq} does not follow {last_seq}",
                    code=ErrorCode.BAD_REQUEST,
                )
            last_seq, state = event.seq, event.state.value
        if not events:
            return
        self.insert_events(events)
        self.conn.execute(
            f"UPDATE {self.tasks} SET state = ?, last_seq = ?, updated_at = ?{', accepted = 1' if accepted else ''}"
            " WHERE id = ?",
            (state, last_seq, now, events[0].task_id),
        )

    def insert_events(self, events: list[TaskEvent]) -> None:
        """The events' rows alone, already checked, for a task row that says they are there."""
        self.conn.executemany(
            f"INSERT INTO {self.events} (task_id, seq, kind, state, at, data) VALUES (?, ?, ?, ?, ?, ?)",
            [(event.task_id, event.seq, event.kind.value, event.state.value, event.at,
              json.dumps(event.data, ensure_ascii=False, separators=(",", ":"))) for event in events],
        )

    def after(self, task_id: str, after_seq: int, limit: int) -> list[TaskEvent]:
        return self.news(task_id, after_seq, limit)[0]  # unknown task -> TaskNotFound, not an empty log

    def news(self, task_id: str, after_seq: int, limit: int) -> tuple[list[TaskEvent], bool]:
        """`after()`, and with no events whether the task has ended (from the row `after()`
        reads then anyway)."""
        rows = self.conn.execute(
            f"SELECT * FROM {self.events} WHERE task_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (task_id, after_seq, limit),
        ).fetchall()
        if rows:
            return [event_from_row(r) for r in rows], False
        return [], TaskState(self.row(task_id)["state"]) in TERMINAL_STATES

    def final(self, task_id: str) -> TaskEvent | None:
        """The task's final event, or None while it runs."""
        row = self.row(task_id)
        if TaskState(row["state"]) not in TERMINAL_STATES:
            return None
        last = self.conn.execute(
            f"SELECT * FROM {self.events} WHERE task_id = ? AND seq = ?", (task_id, row["last_seq"])
        ).fetchone()
        return event_from_row(last)

    def outcome(self, task_id: str) -> Outcome | None:
        final = self.final(task_id)
        return None if final is None else Outcome.from_event(final)

    def purge(self, now: float, retention_s: float, *, when_acked: bool) -> int:
        """Forget finished tasks older than retention (or, `when_acked`, fully acknowledged ones)."""
        marks, states = placeholders(s.value for s in TERMINAL_STATES)
        acked = "acked_seq >= last_seq OR " if when_acked else ""
        with transaction(self.conn):
            cur = self.conn.execute(
                f"DELETE FROM {self.tasks} WHERE state IN ({marks}) AND ({acked}updated_at < ?)",
                (*states, now - retention_s),
            )
        return cur.rowcount


def event_from_row(row: sqlite3.Row) -> TaskEvent:
    """Built, not validated again: every stored event was validated before it was stored (the
    executor's `_build_event`, the submitter's wire decoding), and this is read for every event
    a follower or a watcher is sent (its data's size check alone re-encodes it as JSON)."""
    return TaskEvent.model_construct(
        task_id=row["task_id"], seq=row["seq"], kind=EventKind(row["kind"]), state=TaskState(row["state"]),
        at=row["at"], data=json.loads(row["data"]),
    )


_SPECS: OrderedDict[str, TaskSpec] = OrderedDict()  # a row's spec text -> the (frozen) spec, newest last
_SPECS_KEPT = 1024


def spec_to_json(spec: TaskSpec) -> str:
    """`spec` as a row stores it. The row's reads then get this spec back (`spec_from_json`),
    not parsed and validated again: it was validated when it came (a peer's frame, the app's
    request), and the first read of a new task's row is on the path of every task."""
    text = spec.model_dump_json()
    _keep(text, spec)
    return text


def spec_from_json(text: str) -> TaskSpec:
    """(Cached: a task's row is read many times while it runs, and a TaskSpec is frozen.)"""
    spec = _SPECS.get(text)
    if spec is None:
        spec = TaskSpec.model_validate_json(text)
    _keep(text, spec)
    return spec


def _keep(text: str, spec: TaskSpec) -> None:
    _SPECS[text] = spec
    _SPECS.move_to_end(text)
    if len(_SPECS) > _SPECS_KEPT:
        _SPECS.popitem(last=False)
