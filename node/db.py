"""The node's durable state: one SQLite database in the node home, in WAL mode.

Each store module (trust, tasks, audit, ...) declares its own tables as idempotent
DDL and calls `ensure_schema`; they share one connection per process so a single
transaction can span them. WAL lets the CLI read while the daemon writes.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path


def open_db(path: Path | str) -> sqlite3.Connection:
    """Open (creating if needed) a database tuned for a small always-on daemon."""
    conn = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes; WAL fsyncs at checkpoint
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def ensure_schema(conn: sqlite3.Connection, ddl: str) -> None:
    """Run idempotent DDL (CREATE ... IF NOT EXISTS) in one transaction."""
    conn.executescript("BEGIN;\n" + ddl + "\nCOMMIT;")


class transaction:
    """`with transaction(conn): ...` — BEGIN IMMEDIATE / COMMIT, ROLLBACK on error.

    IMMEDIATE takes the write lock up front so two writers never deadlock on upgrade.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb) -> None:
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
