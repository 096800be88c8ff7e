"""Durable delegated tasks in the node's SQLite database: an index of the two stores.

One store per side of a delegation, each in its own module:

* `ExecutorStore` (executor_store.py, the home PC): every accepted task with its spec, submitter,
  state, deadline and append-only event log; `recover()` at startup puts unfinished work back.
* `Outbox` (outbox.py, the phone): tasks it submitted, kept until the executor accepts them, and a
  mirror of the executor's events that stores each one exactly once.

What they share (errors, the event-log tables, row -> model) is written once in tasklog.py.
Lifecycle rules live in `psymesh.protocol.tasks`; both stores apply them through `next_state`, so
the database can never hold an impossible history. This module keeps the old import path for the
executor, the submitter and the daemon.
"""
from __future__ import annotations

from .executor_store import EXECUTOR_DDL, ExecutorStore, TaskRecord
from .outbox import OUTBOX_DDL, Outbox, OutboxTask
from .tasklog import DEFAULT_PAGE, TaskConflict, TaskNotFound

__all__ = [
    "DEFAULT_PAGE",
    "EXECUTOR_DDL",
    "OUTBOX_DDL",
    "ExecutorStore",
    "Outbox",
    "OutboxTask",
    "TaskConflict",
    "TaskNotFound",
    "TaskRecord",
]
