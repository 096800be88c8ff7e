"""The audit log: every gate decision, allowed or denied, in the node's database.

Each allowed decision is one row. Identical refusals (same peer, service, operation and
code) within `coalesce_s` are one row whose `count` says how many there were, so a peer
that repeats a refused request costs one row a window, not one a request.

Rows are written in batches by one writer (group commit): a decision appends to a buffer
in memory; `run()` (a daemon task, woken by the first row of a batch, asleep while nothing
is decided) commits the batch `flush_ms` later in one transaction, or as soon as
`batch_rows` wait. With a `writer` connection of its own, the batch is committed on a worker
thread, so the event loop serves requests meanwhile (a batch of 256 rows was ~2 ms of
SQLite on the loop, one round trip in 200 delayed by it); the daemon's connection only waits
for it if it writes during the batch's transaction (SQLite's write lock), which is kept to one
statement (`_write`).

The guarantee (docs/security.md): a row is committed within `flush_ms` of its decision (plus
the commit itself), before a query reads the log (`query` waits for the batch being written
and commits the rest), and on a clean stop (`run` commits the last rows as it ends); a crash
of the process loses at most the rows of the last `flush_ms` and the batch being committed, a
power cut those since the WAL was last synced. Without `run()` (a store opened by a tool or a
test) every row is committed as it is recorded.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
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
_BATCH = ("CREATE TEMP TABLE IF NOT EXISTS audit_batch (n INTEGER PRIMARY KEY, ts REAL, peer_id TEXT, protocol TEXT,"
          " operation TEXT, allowed INTEGER, code TEXT, reason TEXT, count INTEGER)")


@dataclass(slots=True)
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
    dirty: bool = True     # waits in a batch (new, or its count changed since it was taken)


class AuditLog:
    def __init__(self, conn: sqlite3.Connection, *, writer: sqlite3.Connection | None = None,
                 committed: Callable[[], None] | None = None, flush_ms: int = 200, batch_rows: int = 256,
                 coalesce_s: float = 60.0, max_rows: int = MAX_ROWS) -> None:
        """`conn`: the connection the log is read on (and written on, without `writer`).
        `writer`: a connection to the same database for the log's batches alone, which `run()`
        commits on a worker thread; the owner opens and closes it. Give it no trace callback
        (`open_db(on_write=...)`): one per row takes the GIL back from the loop at each row.
        `committed`: called after each batch written on `writer` (on the thread that wrote it)
        instead, e.g. to wake a checkpointer."""
        self.conn = conn
        ensure_schema(conn, SCHEMA)
        if "count" not in {r["name"] for r in conn.execute("PRAGMA table_info(audit)")}:  # a node.db from before
            conn.execute("ALTER TABLE audit ADD COLUMN count INTEGER NOT NULL DEFAULT 1")
        self._writer = writer if writer is not None else conn
        self._writer.execute("PRAGMA temp_store=MEMORY")  # the batch's staging table (`_write`)
        self._writer.execute(_BATCH)
        self._committed = committed
        self.flush_s = flush_ms / 1000
        self.batch_rows = batch_rows
        self.coalesce_s = coalesce_s
        self.max_rows = max_rows
        self._pending: list[_Row] = []          # rows (new, or with a new count) not yet taken into a batch
        self._windows: dict[tuple[str, str, str, str | None], _Row] = {}  # the open row of each refusal kind
        self._due: anyio.Event | None = None    # set when a batch is waiting; None: no writer running
        self._full: anyio.Event | None = None   # set when `batch_rows` wait: the writer does not wait `flush_ms`
        self._writing = threading.Lock()        # held while a batch is committed: one at a time, in order
        self._handed: list[_Row] | None = None  # the batch handed to the writer's thread, until one writes it
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
        if not allowed:
            key = (peer_id, protocol, operation, code)
            open_row = self._windows.get(key)
            if open_row is not None and now - open_row.ts < self.coalesce_s:
                open_row.count += 1
                if not open_row.dirty:
                    open_row.dirty = True
                    self._pending.append(open_row)
                self._wake()
                return False
            row = _Row(now, peer_id, protocol, operation, allowed, code, reason[:500])
            if self.coalesce_s > 0:
                self._windows[key] = row
        else:
            row = _Row(now, peer_id, protocol, operation, allowed, code, reason[:500])
        self._pending.append(row)
        self._wake()
        return True

    def _wake(self) -> None:
        if self._due is None:
            self.flush()  # no writer task: write as recorded
        elif threading.get_ident() != self._loop_thread:
            return  # (a row recorded on another thread waits for the next batch)
        elif not self._due.is_set():
            self._due.set()
        elif len(self._pending) >= self.batch_rows and self._full is not None:
            self._full.set()

    def flush(self) -> None:
        """Commit every buffered row (and count) now, on this thread: first the batch handed
        to the writer's thread, if that has not written it yet (or waits while it does)."""
        with self._writing:
            if self._handed is not None:
                rows, self._handed = self._handed, None
                self._write(rows)
            self._write(self._take())

    def _take(self) -> list[_Row]:
        """The batch to write (on the loop: rows are only ever changed there)."""
        rows, self._pending = self._pending, []
        for row in rows:
            row.dirty = False  # a count changed from here on waits for the next batch
        if self._windows:
            horizon = self._latest - self.coalesce_s  # by the decisions' clock (the gate's `now`)
            self._windows = {k: r for k, r in self._windows.items() if r.ts >= horizon}
        return rows

    def _write(self, rows: list[_Row]) -> None:
        """One transaction (with `_writing` held): new rows get the ids after the log's last, in
        the order they were decided; rows written before get their new count. The new rows go
        first into a temporary table of the writer's connection, outside the database's write
        lock, as one JSON text read by one statement: binding them row by row (`executemany`)
        takes the GIL back at every row, and the loop, wanting it meanwhile, may wait up to the
        interpreter's switch interval (5 ms) behind it. The transaction is then one
        `INSERT ... SELECT` run by SQLite alone: 0.3 ms for 256 rows here, where binding them
        under the lock held it 0.8-1.0 ms; a daemon connection writing meanwhile waits for it
        (SQLite's busy handler: 1 ms, then 2, then 5 ...)."""
        if not rows:
            return
        db = self._writer
        new = [row for row in rows if row.id is None]
        db.execute("DELETE FROM temp.audit_batch")
        db.execute("INSERT INTO temp.audit_batch SELECT key + 1, value ->> 0, value ->> 1, value ->> 2, value ->> 3,"
                   " value ->> 4, value ->> 5, value ->> 6, value ->> 7 FROM json_each(?)",
                   (json.dumps([(r.ts, r.peer_id, r.protocol, r.operation, int(r.allowed), r.code, r.reason, r.count)
                                for r in new]),))
        with contextlib.nullcontext() if db.in_transaction else transaction(db):
            last = db.execute("SELECT coalesce(max(id), 0) FROM main.audit").fetchone()[0]
            db.execute("INSERT INTO main.audit (id, ts, peer_id, protocol, operation, allowed, code, reason, count)"
                       " SELECT ? + n, ts, peer_id, protocol, operation, allowed, code, reason, count"
                       " FROM temp.audit_batch ORDER BY n", (last,))
            db.executemany("UPDATE main.audit SET count = ? WHERE id = ?",  # a few: one per refusal window
                           ((r.count, r.id) for r in rows if r.id is not None))
            if (self._written + len(new)) // TRIM_EVERY > self._written // TRIM_EVERY:
                db.execute("DELETE FROM main.audit WHERE id <= ? - ?", (last + len(new), self.max_rows))
        for n, row in enumerate(new, 1):
            row.id = last + n
        self._written += len(new)
        if self._committed is not None:
            self._committed()

    async def _commit(self) -> None:
        """Take the waiting rows and commit them: on a worker thread with a writer of our own
        (the loop's connection is used only on the loop), else here. `_writing` is held only
        by a thread that is writing, never across an await: a `query()` on the loop waits for
        a batch being written, and writes one that is still waiting for its thread itself."""
        rows = self._take()
        if not rows:
            return  # a query() took them first
        if self._writer is self.conn:
            self._write_batch(rows)
            return
        self._handed = rows
        await anyio.to_thread.run_sync(self._write_batch, rows)  # not abandoned if we are cancelled once it runs

    def _write_batch(self, rows: list[_Row]) -> None:
        with self._writing:
            if self._writer is not self.conn:
                if self._handed is not rows:
                    return  # flush() wrote it meanwhile
                self._handed = None
            try:
                self._write(rows)
            except sqlite3.Error as exc:  # a full disk, say: those rows are lost, the node keeps serving
                log.warning("audit rows not written: %s", storage_error(exc, None).message)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The one writer: commits each batch `flush_ms` after its first row, or once `batch_rows`
        wait; the last on stop."""
        self._loop_thread = threading.get_ident()
        self._due, self._full = anyio.Event(), anyio.Event()
        task_status.started()
        try:
            while True:
                await self._due.wait()
                if len(self._pending) < self.batch_rows:
                    with anyio.move_on_after(self.flush_s):
                        await self._full.wait()
                self._due, self._full = anyio.Event(), anyio.Event()
                await self._commit()
        finally:
            self._due = self._full = None
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
