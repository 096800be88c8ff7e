"""The node's durable state: one SQLite database in the node home, in WAL mode.

Each store module (trust, tasks, audit, ...) declares its own tables as idempotent
DDL and calls `ensure_schema`; they share one connection per process so a single
transaction can span them. WAL lets the CLI read while the daemon writes.

The database holds grants, the audit log and task arguments and results, so it is
private like the key: created 0600 before SQLite sees it (SQLite gives its -wal and
-shm files the database's own mode), and tightened if an older file is looser.
SQLite's exceptions are mapped here, at the boundary, to one sentence saying what
happened and what to do (`storage_error`); a database that cannot be read is never
replaced or recreated: only its owner decides to move it aside.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import stat
from pathlib import Path

import anyio
import anyio.abc

from psymesh.node.home import os_error, tighten
from psymesh.protocol.errors import ErrorCode, PsymeshError

log = logging.getLogger("psymesh.db")

# Primary result codes (the low byte of sqlite3.Error.sqlite_errorcode).
_SQLITE_PERM, _SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY = 3, 5, 6, 8
_SQLITE_IOERR, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 10, 11, 13, 14, 26


class StorageError(PsymeshError):
    """The node's database (or the disk under it) failed; the message says how to fix it."""

    default_code = ErrorCode.UNAVAILABLE


def storage_error(exc: sqlite3.Error | OSError, path: Path | None) -> PsymeshError:
    """What a SQLite (or OS) error on database `path` means for the node's owner, in one line.
    `path` None: the caller does not know which file (the message then says "the node database")."""
    if isinstance(exc, OSError):
        return os_error(exc, path) if path is not None else StorageError(f"the node database failed: {exc}")
    where = f"{path.name} at {path}" if path is not None else "the node database"
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code in (_SQLITE_NOTADB, _SQLITE_CORRUPT):
        fix = f"mv {path} {path}.broken" if path is not None else "move node.db aside (mv node.db node.db.broken)"
        return StorageError(f"{where} is not a SQLite database (corrupt or overwritten); move it aside to start "
                            f"fresh: {fix}")
    if code == _SQLITE_FULL:
        return StorageError(f"{where} cannot grow: the disk is full ({exc}); free some space, then retry")
    if code in (_SQLITE_READONLY, _SQLITE_PERM):
        return StorageError(f"{where} is read-only ({exc}); the file and its directory must be writable by "
                            "you (and the file system mounted read-write)")
    if code in (_SQLITE_BUSY, _SQLITE_LOCKED):
        return StorageError(f"{where} stayed locked by another process ({exc}); wait for it or stop it, "
                            "then retry")
    if code == _SQLITE_CANTOPEN:
        return StorageError(f"cannot open {where} ({exc}); its directory must exist and be writable by you")
    if code == _SQLITE_IOERR:
        return StorageError(f"reading or writing {where} failed with an I/O error ({exc}); check the disk, "
                            "then retry")
    return StorageError(f"{where} failed: {exc}")


def _private_db_file(path: Path) -> None:
    """Create `path` empty with mode 0600 if missing (SQLite takes an empty file as a new
    database), else check it is a regular file and tighten it and its -wal/-shm/-journal."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(f"{path} is not a regular file, so it cannot be the node database; move it "
                               f"aside: mv {path} {path}.broken") from None
        for suffix in ("", "-wal", "-shm", "-journal"):
            tighten(Path(f"{path}{suffix}"))
        return
    try:
        os.fchmod(fd, 0o600)  # exactly, whatever the umask
    finally:
        os.close(fd)


def open_db(path: Path | str, *, background_checkpoints: bool = False) -> sqlite3.Connection:
    """Open (creating if needed) a database tuned for a small always-on daemon.
    Every failure is a StorageError naming the file and the fix (see `storage_error`).

    `background_checkpoints`: this connection never checkpoints the WAL itself (a
    checkpoint syncs the database file: a stall of milliseconds in the middle of some
    request); the owner runs `Checkpointer` beside it instead."""
    path = Path(path)
    conn: sqlite3.Connection | None = None
    try:
        _private_db_file(path)
        conn = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")  # reads the header: a file that is no database fails here
        conn.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes; WAL fsyncs at checkpoint
        if background_checkpoints:
            conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=10000")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # the schema page must be readable too
    except (sqlite3.Error, OSError) as exc:
        if conn is not None:
            conn.close()
        raise storage_error(exc, path) from None
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


class Checkpointer:
    """Copies the WAL back into the database every `every_s` seconds, on a thread of its own
    with its own connection (PASSIVE: it never blocks the daemon's readers or writer), so
    the daemon's connection can run with `wal_autocheckpoint=0` and never stall on it."""

    def __init__(self, path: Path, every_s: float = 2.0) -> None:
        self.path = path
        self.every_s = every_s

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await anyio.sleep(self.every_s)
            try:
                await anyio.to_thread.run_sync(self._checkpoint)
            except (sqlite3.Error, OSError) as exc:  # a full disk, say: the WAL grows; the node keeps serving
                log.warning("WAL checkpoint failed: %s", storage_error(exc, self.path).message)

    def _checkpoint(self) -> None:
        conn = sqlite3.connect(str(self.path), timeout=1.0, isolation_level=None)
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            conn.close()
