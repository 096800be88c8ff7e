"""The audit log: every gate decision, allowed or denied, in the node's database.

Each allowed decision is one row. Identical refusals (same peer, service, operation and
code) within `coalesce_s` are one row whose `count` says how many there were, so a peer
that repeats a refused request costs one row a window, not one a request.

Rows are written in batches by one writer (group commit): a decision appends to a buffer
in memory; `run()` (a daemon task, woken by the first row of a batch, asleep while nothing
is decided) commits the batch `flush_ms` later in one transaction, or at once when
`batch_rows` wait. The guarantee (docs/security.md): a row is committed within `flush_ms`
of its decision, before a query reads the log (`query` flushes first), and on a clean stop
(`run` flushes as it ends); a crash of the process loses at most the last `flush_ms` of
rows, a power cut those since the WAL was last synced. Without `run()` (a store opened by a
tool or a test) every row is committed as it is recorded.
"""
from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass

import anyio
import anyio.abc

from ..core.db import ensure_schema, storage_error, transaction
from ..core.notify import Pulse

log = logging.getLogger("psymesh.audit")

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    id        INTEGER PRIMARY KEY,
    ts        REAL NOT NULL,
    peer_id   TEXT NOT NULL,
    protocol  TEXT NOT NULL,
    operation TEXT NOT NULL,
    allowed   INTEGER NOT NULL,
    code      TEXT,
    reason    TEXT NOT NULL DEFAULT '',
    count     INTEGER NOT NULL DEFAULT 1  -- identical refusals within the window, counted here
);
CREATE INDEX IF NOT EXISTS audit_peer_ts ON audit(peer_id, ts);
"""
MAX_ROWS = 200_000  # oldest rows beyond this are trimmed ([storage] audit_max_rows)
TRIM_EVERY = 1000   # rows written between two trims


@dataclass
class _Row:
    ts: float
    peer_id: str
    protocol: str
    operation: str
    allowed: bool
    code: str | None
    reason: str
    count: int = 1
    id: int | None = None  # set once written
    dirty: bool = True     # its count changed since it was written


class AuditLog:
    def __init__(self, conn: sqlite3.Connection, *, flush_ms: int = 200, batch_rows: int = 256,
                 coalesce_s: float = 60.0, max_rows: int = MAX_ROWS) -> None:
        self.conn = conn
        ensure_schema(conn, SCHEMA)
        if "count" not in {r["name"] for r in conn.execute("PRAGMA table_info(audit)")}:  # a node.db from before
            conn.execute("ALTER TABLE audit ADD COLUMN count INTEGER NOT NULL DEFAULT 1")
        self.flush_s = flush_ms / 1000
        self.batch_rows = batch_rows
        self.coalesce_s = coalesce_s
        self.max_rows = max_rows
        self._pending: list[_Row] = []          # rows (new, or with a new count) not yet written
        self._windows: dict[tuple[str, str, str, str | None], _Row] = {}  # the open row of each refusal kind
        self._due: anyio.Event | None = None    # set when a batch is waiting; None: no writer running
        self._loop_thread: int | None = None
        self._written = 0
        self._latest = 0.0  # the latest decision's time
        self.pulse: Pulse | None = None  # fired at each decision (the dashboard's live audit view; it reads through query())

    def record(self, peer_id: str, protocol: str, operation: str, allowed: bool, code: str | None = None,
               reason: str = "", now: float | None = None) -> bool:
        """One decision. Returns False when it was counted into an open row (a repeated refusal)."""
        now = time.time() if now is None else now
        self._latest = max(self._latest, now)
        if self.pulse is not None:
            self.pulse.fire()
        key = (peer_id, protocol, operation, code)
        if not allowed:
            open_row = self._windows.get(key)
            if open_row is not None and now - open_row.ts < self.coalesce_s:
                open_row.count += 1
                if not open_row.dirty:
                    open_row.dirty = True
                    self._pending.append(open_row)
                self._wake()
                return False
        row = _Row(now, peer_id, protocol, operation, allowed, code, reason[:500])
        if not allowed and self.coalesce_s > 0:
            self._windows[key] = row
        self._pending.append(row)
        self._wake()
        return True

    def _wake(self) -> None:
        if self._due is None:
            self.flush()  # no writer task: write as recorded
        elif len(self._pending) >= self.batch_rows:
            self.flush()
        elif not self._due.is_set() and threading.get_ident() == self._loop_thread:
            self._due.set()  # (a row recorded on another thread waits for the next flush)

    def flush(self) -> None:
        """Commit every buffered row (and count) in one transaction."""
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        with contextlib.nullcontext() if self.conn.in_transaction else transaction(self.conn):
            for row in rows:
                if row.id is None:
                    cur = self.conn.execute(
                        "INSERT INTO audit (ts, peer_id, protocol, operation, allowed, code, reason, count)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (row.ts, row.peer_id, row.protocol, row.operation, int(row.allowed), row.code, row.reason,
                         row.count))
                    row.id = cur.lastrowid
                    self._written += 1
                    if self._written % TRIM_EVERY == 0:
                        self.conn.execute("DELETE FROM audit WHERE id <= ? - ?", (row.id, self.max_rows))
                else:
                    self.conn.execute("UPDATE audit SET count = ? WHERE id = ?", (row.count, row.id))
                row.dirty = False
        if self._windows:
            horizon = self._latest - self.coalesce_s  # by the decisions' clock (the gate's `now`)
            self._windows = {k: r for k, r in self._windows.items() if r.ts >= horizon}

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The one writer: commits each batch `flush_ms` after its first row; the last on stop."""
        self._loop_thread = threading.get_ident()
        self._due = due = anyio.Event()
        task_status.started()
        try:
            while True:
                await due.wait()
                await anyio.sleep(self.flush_s)
                self._due = due = anyio.Event()
                try:
                    self.flush()
                except sqlite3.Error as exc:  # a full disk, say: those rows are lost, the node keeps serving
                    log.warning("audit rows not written: %s", storage_error(exc, None).message)
        finally:
            self._due = None
            self.flush()

    def query(self, *, peer_id: str | None = None, limit: int = 100, denied_only: bool = False) -> list[dict]:
        self.flush()
        where, args = [], []
        if peer_id:
            where.append("peer_id = ?")
            args.append(peer_id)
        if denied_only:
            where.append("allowed = 0")
        sql = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT ?"
        rows = self.conn.execute(sql, (*args, limit)).fetchall()
        return [{**dict(r), "allowed": bool(r["allowed"])} for r in reversed(rows)]
