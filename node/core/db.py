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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import sniffio

from .paths import os_error, tighten
from ...protocol.errors import ErrorCode, PsymeshError

if TYPE_CHECKING:
    import outcome

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


# What a reset WAL is cut back to (`PRAGMA journal_size_limit`), and the size past which the
# checkpointer stops being polite (TRUNCATE instead of PASSIVE): [storage] wal_max_bytes.
WAL_MAX_BYTES = 4 * 1024 * 1024
# Statements that may write (what `on_write` hears of; an empty BEGIN ... COMMIT, as a housekeeping
# loop runs every second, writes nothing and wakes nobody).
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER", "WITH")
# How WalSync puts the WAL on disk: the file's data and the size it grew to, not its mtime
# (fdatasync, what SQLite itself uses on Linux); fsync where there is no fdatasync.
SYNC_FILE: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)


class Tally:
    """What a connection ran (`open_db(tally=...)`): statements, and transactions committed or
    rolled back (each BEGIN ... COMMIT, and each write outside one, which SQLite commits alone).
    The daemon keeps one for its connection; tests and benches read what a request costs."""

    def __init__(self) -> None:
        self.statements = 0    # every statement but BEGIN / COMMIT / ROLLBACK
        self.transactions = 0
        self._open = False

    def ran(self, head: str) -> None:
        """`head`: the statement's first 7 characters, upper case."""
        if head.startswith("BEGIN"):
            self._open = True
            self.transactions += 1
        elif head.startswith(("COMMIT", "ROLLBAC", "END")):
            self._open = False
        else:
            self.statements += 1
            if not self._open and head.startswith(_WRITES):
                self.transactions += 1


def open_db(path: Path | str, *, background_checkpoints: bool = False, wal_max_bytes: int = WAL_MAX_BYTES,
            on_write: Callable[[], None] | None = None, tally: Tally | None = None) -> sqlite3.Connection:
    """Open (creating if needed) a database tuned for a small always-on daemon.
    Every failure is a StorageError naming the file and the fix (see `storage_error`).

    Commits are `synchronous=NORMAL`: durable across a crash of the process at once, and
    across a power cut once the WAL is synced (at a checkpoint, or by `WalSync` before an
    answer that promises durability). A reset WAL is cut back to `wal_max_bytes`.

    `background_checkpoints`: this connection never checkpoints the WAL itself (a
    checkpoint syncs the database file: a stall of milliseconds in the middle of some
    request); the owner runs `Checkpointer` beside it instead. `on_write`: called (on the
    thread that runs it) as every statement that may write starts, so the checkpointer and
    `WalSync` learn that there is something to do without polling. `tally`: counts what the
    connection runs from here on."""
    path = Path(path)
    conn: sqlite3.Connection | None = None
    try:
        _private_db_file(path)
        conn = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")  # reads the header: a file that is no database fails here
        conn.execute("PRAGMA synchronous=NORMAL")  # the WAL is synced at checkpoints and by WalSync
        conn.execute(f"PRAGMA journal_size_limit={int(wal_max_bytes)}")
        if background_checkpoints:
            conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=10000")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # the schema page must be readable too
    except (sqlite3.Error, OSError) as exc:
        if conn is not None:
            conn.close()
        raise storage_error(exc, path) from None
    if on_write is not None or tally is not None:
        def trace(sql: str) -> None:
            head = sql.lstrip()[:7].upper()
            if tally is not None:
                tally.ran(head)
            if on_write is not None and head.startswith(_WRITES):
                on_write()

        conn.set_trace_callback(trace)
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
    """Copies the WAL back into the database after writes, on a thread of its own with its
    own connection, so the daemon's connection can run with `wal_autocheckpoint=0` and never
    stall on it.

    Driven by writes, not a clock: `wrote()` (the daemon's `open_db(on_write=...)`) wakes it;
    an idle node's thread sleeps on an event and never wakes up. Once woken it waits until
    `settle_s` pass without a write (at most `max_defer_s` under a sustained load, and no
    longer once the WAL is past `wal_max_bytes`), then checkpoints PASSIVE (never blocks the daemon's readers or writer). A PASSIVE checkpoint
    under continuous commits never catches up, so the WAL would never restart and only
    grow: past `wal_max_bytes` it checkpoints TRUNCATE instead (waits, up to `busy_s`, for
    the writer between two transactions, copies everything back and cuts the WAL to zero
    bytes; the daemon's writer waits meanwhile, a few ms per MiB)."""

    def __init__(self, path: Path, *, settle_s: float = 1.0, max_defer_s: float = 5.0,
                 wal_max_bytes: int = WAL_MAX_BYTES, busy_s: float = 2.0) -> None:
        self.path = path
        self.settle_s = settle_s
        self.max_defer_s = max_defer_s
        self.wal_max_bytes = wal_max_bytes
        self.busy_s = busy_s
        self.checkpoints = 0  # how many ran (tests and `status` read it)
        self._wrote = threading.Event()
        self._stop = threading.Event()
        self._checkpointed: tuple[int, int] | None = None  # the WAL's (size, mtime) after the last checkpoint

    def wrote(self) -> None:
        """Something was written (any thread): a checkpoint is due once the writes settle.
        Called as every write statement starts: the event's lock is taken only when it is not
        set already (a write that finds it set, just as the thread clears it, can at worst make
        a checkpoint come a settle sooner: the commit it starts lands long before, and is in it)."""
        if not self._wrote.is_set():
            self._wrote.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._stop.clear()
        thread = threading.Thread(target=self._loop, name="psymesh-checkpoint", daemon=True)
        thread.start()
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            self._stop.set()
            self._wrote.set()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(thread.join)

    def _loop(self) -> None:
        while True:
            self._wrote.wait()
            if self._stop.is_set():
                return
            give_up = time.monotonic() + self.max_defer_s
            while True:  # wait for the writes to settle
                self._wrote.clear()
                if self._stop.wait(self.settle_s):
                    return
                if not self._wrote.is_set() or time.monotonic() >= give_up or self.wal_bytes() > self.wal_max_bytes:
                    break
            try:
                if self._wal_state() != self._checkpointed and self.checkpoint():  # else: nothing was written
                    self._checkpointed = self._wal_state()
            except (sqlite3.Error, OSError) as exc:  # a full disk, say: the WAL grows; the node keeps serving
                log.warning("WAL checkpoint failed: %s", storage_error(exc, self.path).message)

    def _wal_state(self) -> tuple[int, int]:
        try:
            st = os.stat(f"{self.path}-wal")
        except FileNotFoundError:
            return (0, 0)
        return (st.st_size, st.st_mtime_ns)

    def wal_bytes(self) -> int:
        try:
            return os.stat(f"{self.path}-wal").st_size
        except FileNotFoundError:
            return 0

    def checkpoint(self) -> bool:
        """One checkpoint now: PASSIVE, or TRUNCATE when the WAL is past `wal_max_bytes`.
        Returns whether it copied the whole WAL back (else it runs again after the next settle)."""
        conn = sqlite3.connect(str(self.path), timeout=self.busy_s, isolation_level=None)
        try:
            conn.execute(f"PRAGMA journal_size_limit={int(self.wal_max_bytes)}")
            mode = "TRUNCATE" if self.wal_bytes() > self.wal_max_bytes else "PASSIVE"
            busy, frames, copied = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
            self.checkpoints += 1
        finally:
            conn.close()
        done = not busy and copied >= frames
        if not done:
            log.debug("WAL checkpoint (%s) did not finish (%d of %d frames); again after the next settle",
                      mode, copied, frames)
            self._wrote.set()
        return done


class WalSync:
    """Group commit for answers that promise durability (`Message.durable`): `await sync()`
    returns once every transaction committed before the call is on disk (the WAL file
    fdatasynced: what `synchronous=FULL` does at each commit), so a power cut cannot roll back
    what the answer acknowledged.

    One fsync serves every caller that arrived before it started: while one runs, later
    callers wait for it and share the next, so a burst of N answers pays about two syncs,
    not N. A sync with nothing written since the last is skipped (`wrote()`, from
    `open_db(on_write=...)`, counts writes). The fsync runs on a worker thread: the event
    loop serves other requests meanwhile. `fsync` is the seam a test uses to trace the
    syncs (or to model a power cut that keeps only what was synced).

    A failed fsync fails every later sync too, until the node restarts: after one, the kernel
    may have dropped the WAL's dirty pages and marked them clean (Linux does, "fsyncgate"), so
    a later fsync that succeeds proves nothing of what was written before it, and every later
    commit's frames build on those pages. Durable answers stop (each fails with the disk's
    error); what is on disk is what SQLite finds at the next start."""

    def __init__(self, path: Path, *, fsync: Callable[[int], None] = SYNC_FILE) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.syncs = 0  # fsyncs done (benches and tests read it)
        self._written = 0  # writes seen (a counter only ever compared, never reset)
        self._synced = 0  # writes known to be on disk
        self._running: _Sync | None = None
        self._fd: int | None = None  # the WAL's, kept open between syncs (`_wal_fd`)
        self._closing = False
        self._failed: str | None = None  # why durable answers stopped (the first failed fsync): each later
        # sync raises an error of its own with it; one object raised again and again would keep every
        # raise's frames (and the requests they hold) in its traceback until the node restarts

    def wrote(self) -> None:
        self._written += 1

    def mark(self) -> int:
        """Where the writes stand now: `sync(mark)` later waits for these and no more (a
        promise made after a commit need not wait for what was written since)."""
        return self._written

    async def sync(self, upto: int | None = None) -> None:
        """Returns once every write before the call (or before `mark()` returned `upto`)
        is on disk."""
        target = self._written if upto is None else upto
        while self._synced < target:
            self.refuse_if_failed()
            running = self._running or self._begin()
            await running.done.wait()  # it may have started before our commit: loop, maybe sync again
            if running.error is not None:
                raise running.error

    def refuse_if_failed(self) -> None:
        """Raise what every durable answer gets once an fsync failed (else nothing), for a caller
        about to do what it then could not acknowledge (the submitter, before a task leaves)."""
        if self._failed is not None:
            raise StorageError(self._failed)

    def start(self, upto: int | None = None) -> None:
        """Begin now, on a worker thread, the fsync a later `sync(upto)` waits for (unless one
        runs already, or nothing is left to sync): the caller does other work meanwhile (the
        submitter hands its task over) without a task of its own to drive the sync."""
        target = self._written if upto is None else upto
        if self._synced < target and self._running is None and self._failed is None:
            self._begin()

    def _begin(self) -> _Sync:
        """Start one fsync covering every write so far; it settles itself (`_Sync.done`), on the
        event loop, whoever waits for it or stops waiting: a cancelled waiter leaves nobody hanging.
        The WAL's descriptor is found here, on the event loop, so that the worker thread has one
        thing to do before the fsync: get the GIL once (each more it needs waits for the loop to
        let go of it, behind whatever the loop runs meanwhile, e.g. the worker of the very task
        whose answer waits)."""
        self._running = running = _Sync(self._written)

        def finished(error: BaseException | None) -> None:  # on the event loop
            self._running = None
            if error is None:
                self._synced = max(self._synced, running.covers)
            else:
                if self._failed is None:
                    reason = error.message if isinstance(error, PsymeshError) else str(error)  # its code once
                    self._failed = (f"{reason}; what was written since the last good sync may be lost, so this "
                                    "node gives no more durable answers until it is restarted (check the disk "
                                    "first: dmesg)")
                    log.error("syncing %s-wal failed: %s", self.path, self._failed)
                running.error = StorageError(self._failed)
            running.done.set()
            if self._closing:
                self.close()

        try:
            fd = self._wal_fd()
        except OSError as exc:  # no fsync ran (e.g. out of descriptors): this answer fails, not the next
            self._running, running.error = None, storage_error(exc, self.path)
            running.done.set()
            return running
        if fd is None:  # no WAL: everything is in the database file, which checkpoints sync
            finished(None)
            return running
        _in_thread_now(lambda: self._fsync_wal(fd), finished)
        return running

    def _wal_fd(self) -> int | None:
        """The WAL file's descriptor, kept open between syncs; opened again if the file it
        names was removed meanwhile (SQLite removes the WAL as the last connection closes,
        after copying it all into the database and syncing that: a later WAL is a new file)."""
        if self._fd is not None:
            try:
                if os.fstat(self._fd).st_nlink > 0:
                    return self._fd
            except OSError:
                pass
            self._close_fd()
        try:
            self._fd = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        return self._fd

    def close(self) -> None:
        """Let go of the WAL's descriptor (once the sync under way, if any, is done)."""
        self._closing = self._running is not None
        if not self._closing:
            self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _fsync_wal(self, fd: int) -> None:  # on the worker thread
        try:
            self.fsync(fd)
            self.syncs += 1
        except OSError as exc:
            raise storage_error(exc, self.path) from None


class _Sync:
    """One fsync under way: what it covers, and how it ended."""

    def __init__(self, covers: int) -> None:
        self.covers = covers
        self.done = anyio.Event()
        self.error: BaseException | None = None


def _in_thread_now(fn: Callable[[], None], finished: Callable[[BaseException | None], None]) -> None:
    """`fn()` on a worker thread, started now (before the caller yields), then `finished(error)`
    on the event loop. `anyio.to_thread` would first go once round the scheduler (its limiter's
    checkpoint), so every task made runnable before (e.g. the worker of the task whose
    `task.accepted` waits for this sync) ran, holding the GIL, before the fsync began, instead
    of beside it. Under trio: trio's thread cache; elsewhere a thread of its own."""
    if sniffio.current_async_library() != "trio":
        import asyncio

        loop = asyncio.get_running_loop()

        def run() -> None:
            error: BaseException | None = None
            try:
                fn()
            except BaseException as exc:  # raised in the task that waits
                error = exc
            try:
                loop.call_soon_threadsafe(finished, error)
            except RuntimeError:  # the loop closed meanwhile: as for trio below
                finished(error)

        threading.Thread(target=run, name="psymesh wal sync", daemon=True).start()
        return
    import trio

    token = trio.lowlevel.current_trio_token()

    def deliver(result: outcome.Outcome[None]) -> None:  # on the worker thread
        try:
            result.unwrap()
        except BaseException as exc:  # raised in the task that waits
            error: BaseException | None = exc
        else:
            error = None
        try:
            token.run_sync_soon(finished, error)
        except trio.RunFinishedError:  # the node stopped meanwhile: nobody waits, and no loop is
            finished(error)            # left to race with: settled here (a close() put off lets go)

    trio.lowlevel.start_thread_soon(fn, deliver, name="psymesh wal sync")
