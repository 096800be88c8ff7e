"""The audit log: one row for every gate decision, allowed or denied, in the node's database."""
from __future__ import annotations

import sqlite3
import time

from psymesh.node.db import ensure_schema
from psymesh.node.notify import Pulse

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    id        INTEGER PRIMARY KEY,
    ts        REAL NOT NULL,
    peer_id   TEXT NOT NULL,
    protocol  TEXT NOT NULL,
    operation TEXT NOT NULL,
    allowed   INTEGER NOT NULL,
    code      TEXT,
    reason    TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS audit_peer_ts ON audit(peer_id, ts);
"""
MAX_ROWS = 200_000  # oldest rows beyond this are trimmed, so a chatty peer cannot fill the disk


class AuditLog:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        ensure_schema(conn, SCHEMA)
        self._writes = 0
        self.pulse: Pulse | None = None  # fired at each row (the dashboard's live audit view)

    def record(self, peer_id: str, protocol: str, operation: str, allowed: bool, code: str | None = None,
               reason: str = "", now: float | None = None) -> None:
        self.conn.execute(
            "INSERT INTO audit (ts, peer_id, protocol, operation, allowed, code, reason) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (time.time() if now is None else now, peer_id, protocol, operation, int(allowed), code, reason[:500]),
        )
        self._writes += 1
        if self.pulse is not None:
            self.pulse.fire()
        if self._writes % 1000 == 0:
            self.conn.execute("DELETE FROM audit WHERE id <= (SELECT MAX(id) FROM audit) - ?", (MAX_ROWS,))

    def query(self, *, peer_id: str | None = None, limit: int = 100, denied_only: bool = False) -> list[dict]:
        where, args = [], []
        if peer_id:
            where.append("peer_id = ?")
            args.append(peer_id)
        if denied_only:
            where.append("allowed = 0")
        sql = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT ?"
        rows = self.conn.execute(sql, (*args, limit)).fetchall()
        return [{**dict(r), "allowed": bool(r["allowed"])} for r in reversed(rows)]
