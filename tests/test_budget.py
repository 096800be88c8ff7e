"""The resource budget's disk rows (docs/security.md, "Resource budget"): what a flood of
refused requests, a sustained write load and a power cut do to a node's database.

Each test drives real in-process daemons on 127.0.0.1; every flood is bounded in count and
in time."""
from __future__ import annotations

import os
import shutil
import sqlite3
import time
from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.core.db import transaction
from psymesh.node.core.home import StorageSettings
from psymesh.protocol.common import Ping, Pong
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.tasks import TaskAccepted, TaskSpec, TaskSubmit

pytestmark = pytest.mark.anyio
MB = 1024 * 1024


def db_bytes(node: Node) -> int:
    path = node.home.db_path
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


async def test_a_flood_of_refusals_costs_the_refused_not_the_disk(tmp_path: Path) -> None:
    """A peer holding only the messaging preset asks for a tool it lacks, as fast as it can:
    its refusals are charged to a budget of their own (then answered rate_limited), counted
    into a few audit rows, and the database barely grows; its allowed requests, charged to
    its grant's rate, are served all along."""
    async with run_nodes(tmp_path, "home", "peer") as nodes:
        home, peer = nodes["home"], nodes["peer"]
        await pair(home.home.path, peer.home.path, grant="messaging", grant_back=None)
        home_id = home.identity.peer_id
        await peer.sessions.request(home_id, Ping(seq=0), Pong)
        home.audit.flush()
        before = db_bytes(home)
        codes: dict[str, int] = {}
        pings_served = 0
        deadline = time.monotonic() + 8.0
        limit = 3000  # refusals at most (the flood is bounded in count and time)

        async def lane(n: int) -> None:
            for i in range(limit // 6):
                if time.monotonic() > deadline:
                    return
                spec = TaskSpec(id=f"deny-{n}-{i}", kind="tool", tool="files.read", args={"path": "x"})
                try:
                    await peer.sessions.request(home_id, TaskSubmit(spec=spec), TaskAccepted, timeout=10)
                    raise AssertionError("a task the grant does not cover was accepted")
                except PsymeshError as exc:
                    codes[exc.code.value] = codes.get(exc.code.value, 0) + 1

        async def pinger() -> None:
            nonlocal pings_served
            for seq in range(1, 11):  # 10 pings: within the messaging preset's 30 a minute
                await peer.sessions.request(home_id, Ping(seq=seq), Pong, timeout=10)
                pings_served += 1
                await anyio.sleep(0.2)

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for n in range(6):
                tg.start_soon(lane, n)
            tg.start_soon(pinger)
        took = time.monotonic() - started
        refused = sum(codes.values())
        rows = home.audit.query(peer_id=peer.identity.peer_id, denied_only=True, limit=10_000)
        grown = db_bytes(home) - before
        print(f"\n{refused} refusals {codes}; {len(rows)} audit rows; node.db + WAL grew {grown / MB:.3f} MB; "
              f"pings served {pings_served}/10")

        assert refused >= 500, "the flood did not run"
        assert pings_served == 10  # allowed requests were served throughout
        assert set(codes) <= {"forbidden", "rate_limited"} and codes.get("rate_limited", 0) > 0
        budget = home.config.storage.refusals_per_minute
        assert codes["forbidden"] <= budget + budget * (took + 1) / 60 + 1  # the budget, and what refilled it meanwhile
        assert sum(r["count"] for r in rows) == refused  # every refusal is counted in the log...
        assert len(rows) <= 3  # ... in one row per kind and window (forbidden, and over the budget)
        assert grown <= 1 * MB  # the issue saw ~3.7 MB per second of this


async def test_the_audit_log_keeps_at_most_its_rows(tmp_path: Path) -> None:
    """Allowed requests are one row each: past [storage] audit_max_rows the oldest go (checked
    every 1,000 rows written), while the peer is served."""
    storage = StorageSettings(audit_max_rows=1000)
    async with run_nodes(tmp_path, "home", "peer", configs={"home": {"storage": storage}}) as nodes:
        home, peer = nodes["home"], nodes["peer"]
        await pair(home.home.path, peer.home.path)
        async with Client(home.home.path) as h:
            await h.grant("peer", ["tool:system.info"], set_limits={"requests_per_minute": 1_000_000})
        for seq in range(2100):  # bounded: 2,100 allowed pings (untrimmed, more than the bound below)
            await peer.sessions.request(home.identity.peer_id, Ping(seq=seq), Pong, timeout=10)
        rows = home.audit.query(peer_id=peer.identity.peer_id, limit=10_000)
        total = home.db.execute("SELECT count(*) FROM audit").fetchone()[0]
        assert rows[-1]["operation"] == "ping" and rows[-1]["allowed"]  # the newest is kept
        assert total <= 1000 + 1000  # the bound, and the rows written since the last trim


async def test_the_wal_stays_small_under_a_sustained_write_load(tmp_path: Path) -> None:
    """Commits without a pause (PASSIVE checkpoints never catch up with those): the WAL is
    truncated once past [storage] wal_max_bytes, so it stays within a bound during the load
    and ends at most wal_max_bytes once the writes stop."""
    limit = 256 * 1024
    storage = StorageSettings(wal_max_bytes=limit, checkpoint_settle_s=0.05, checkpoint_max_defer_s=0.3)
    async with run_nodes(tmp_path, "home", configs={"home": {"storage": storage}}) as nodes:
        home = nodes["home"]
        wal = Path(f"{home.home.db_path}-wal")
        home.db.execute("CREATE TABLE IF NOT EXISTS load (id INTEGER PRIMARY KEY, blob BLOB)")
        peak = 0
        written = 0
        deadline = time.monotonic() + 6.0
        for i in range(20_000):  # ~8 KiB a commit, as long as 6 s allow
            if time.monotonic() > deadline:
                break
            with transaction(home.db):
                home.db.execute("INSERT INTO load (blob) VALUES (?)", (os.urandom(8192),))
                home.db.execute("DELETE FROM load WHERE id < ?", (i - 50,))
            written += 8192
            peak = max(peak, wal.stat().st_size if wal.exists() else 0)
            await anyio.sleep(0.001)  # ~1,000 commits a second, the rate of the flood
        await wait_until(lambda: (wal.stat().st_size if wal.exists() else 0) <= limit,
                         "the WAL cut back to wal_max_bytes after the load")
        print(f"\nwrote {written / MB:.1f} MB in commits; WAL peak {peak / MB:.2f} MB "
              f"(limit {limit / MB:.2f} MB); {home.checkpointer.checkpoints} checkpoints")
        assert written >= 16 * limit, "the load did not run"
        assert peak <= 3 * MB  # a bound, whatever was written (before: it grew with every commit, to 48 MB here)


class PowerCut:
    """What the disk holds if the power fails now: a node's database files as they were at
    its last WAL sync (the fsync seam snapshots them just before syncing; nothing written
    later survives, as with LazyFS). Checkpoints are held off for the test (they write the
    database file through SQLite, which this does not trace)."""

    def __init__(self, db_path: Path, store: Path) -> None:
        self.db_path = db_path
        self.store = store
        self.syncs = 0
        store.mkdir(parents=True)

    def fsync(self, fd: int) -> None:
        self.snapshot()
        os.fsync(fd)

    def snapshot(self) -> None:
        self.syncs += 1
        for suffix in ("", "-wal"):
            source = Path(f"{self.db_path}{suffix}")
            if source.exists():
                shutil.copyfile(source, self.store / f"node.db{suffix}")

    def after(self, into: Path) -> sqlite3.Connection:
        """The database a restart after the power cut would find."""
        into.mkdir(parents=True)
        for name in ("node.db", "node.db-wal"):
            if (self.store / name).exists():
                shutil.copyfile(self.store / name, into / name)
        return sqlite3.connect(str(into / "node.db"))


async def test_acknowledged_tasks_and_letters_survive_a_power_cut(tmp_path: Path) -> None:
    """Every task.accepted, letter receipt and SDK "queued" or "delegated" the nodes answered is in what a
    power cut right after leaves on disk: each answer followed a sync of its transaction
    (before: synchronous=NORMAL answered after a commit the next checkpoint would sync).
    A burst of answers shares its syncs (group commit)."""
    no_checkpoints = {"storage": StorageSettings(checkpoint_settle_s=600.0, checkpoint_max_defer_s=3600.0)}
    cuts = {name: PowerCut(tmp_path / name / "node.db", tmp_path / f"{name}-disk") for name in ("home", "phone")}
    async with run_nodes(tmp_path, "home", "phone", configs={"home": no_checkpoints, "phone": no_checkpoints},
                         fsyncs={name: cut.fsync for name, cut in cuts.items()}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["tool:system.info", "msg.send"],
                          set_limits={"requests_per_minute": 10_000, "concurrent_tasks": 64})
        for cut in cuts.values():
            cut.snapshot()  # the disk as it stands before the burst
        syncs_before = home.wal.syncs

        accepted: list[str] = []

        async def submit(i: int) -> None:
            spec = TaskSpec(id=f"durable-{i}", kind="tool", tool="system.info")
            await phone.sessions.request(home.identity.peer_id, TaskSubmit(spec=spec, follow=False), TaskAccepted)
            accepted.append(spec.id)

        async with anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(submit, i)
        home_syncs = home.wal.syncs - syncs_before

        async with Client(phone.home.path) as p:
            letters = [(await p.send("home", f"letter {i}", thread="durable")).id for i in range(20)]
            for letter_id in letters:
                assert (await p.letter(letter_id, wait=True)).state == "delivered"
            delegated = [(await p.delegate("home", tool="system.info")).id for _ in range(10)]

    on_home = cuts["home"].after(tmp_path / "home-after")
    on_phone = cuts["phone"].after(tmp_path / "phone-after")
    tasks = {r[0] for r in on_home.execute("SELECT id FROM exec_tasks")}
    received = {r[0] for r in on_home.execute("SELECT id FROM msg_inbox")}
    queued = {r[0] for r in on_phone.execute("SELECT id FROM msg_outbox")}
    outbox = {r[0] for r in on_phone.execute("SELECT id FROM outbox_tasks")}
    print(f"\n32 tasks accepted with {home_syncs} syncs; after the cut: {len(set(accepted) & tasks)} tasks, "
          f"{len(set(letters) & received)} letters received, {len(set(letters) & queued)} queued")
    assert len(accepted) == 32 and set(accepted) <= tasks
    assert set(letters) <= queued  # each send() returned after its outbox row was synced
    assert set(letters) <= received  # each receipt (delivered) followed the recipient's sync
    assert 1 <= home_syncs < 32  # the burst shared its syncs
    # each delegate() returned after its outbox row was synced (while the task was on its way)
    assert set(delegated) <= outbox and set(delegated) <= tasks


async def test_a_wal_sync_the_disk_fails_fails_its_answer_and_every_later_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A durable answer whose fsync failed is not sent as if it held: the waiter gets the disk's
    error (raised on its worker thread). And no later answer is either, though the disk's next
    fsync would succeed: after a failed fsync the kernel may have dropped the WAL's pages, so a
    later success proves nothing (fsyncgate); the node says so and that a restart is needed,
    and its log says it once, at error, however many answers it then refuses."""
    import errno
    import logging

    from psymesh.node.core.db import WalSync, open_db

    failures = [OSError(errno.EIO, "Input/output error")]
    synced: list[int] = []

    def flaky(fd: int) -> None:
        if failures:
            raise failures.pop()
        os.fsync(fd)
        synced.append(fd)

    wal = WalSync(tmp_path / "node.db", fsync=flaky)
    conn = open_db(tmp_path / "node.db", on_write=wal.wrote)
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(PsymeshError, match="Input/output error"):
        await wal.sync()
    conn.execute("INSERT INTO t VALUES (2)")
    wal.start()
    with pytest.raises(PsymeshError, match="Input/output error.*until it is restarted"):
        await wal.sync()
    assert synced == [] and wal.syncs == 0  # no fsync was even tried
    with pytest.raises(PsymeshError, match="until it is restarted"):
        await wal.sync()
    told = [r for r in caplog.records if r.name == "psymesh.db" and r.levelno >= logging.WARNING]
    assert [(r.levelno, "until it is restarted" in r.getMessage()) for r in told] == [(logging.ERROR, True)]
    conn.close()
    wal.close()
    fresh = WalSync(tmp_path / "node.db", fsync=flaky)  # the node restarted
    conn = open_db(tmp_path / "node.db", on_write=fresh.wrote)
    conn.execute("INSERT INTO t VALUES (3)")
    await fresh.sync()
    assert fresh.syncs == 1
    conn.close()
    fresh.close()


async def test_a_wal_the_node_cannot_open_fails_only_that_answer(tmp_path: Path) -> None:
    """Out of descriptors, WalSync cannot open the WAL to sync it: that answer fails, but no
    fsync ran, so nothing of what the kernel knows of the disk was lost, and the next answer,
    a descriptor free again, is synced as usual (not refused until a restart, as after a
    failed fsync)."""
    import resource

    from psymesh.node.core.db import WalSync, open_db

    wal = WalSync(tmp_path / "node.db")
    conn = open_db(tmp_path / "node.db", on_write=wal.wrote)
    conn.execute("CREATE TABLE t (x)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.open(os.devnull, os.O_RDONLY)  # the descriptor the next open would get
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # so that open fails (EMFILE)
    try:
        with pytest.raises(PsymeshError, match="Too many open files") as raised:
            await wal.sync()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "restarted" not in str(raised.value) and wal.syncs == 0
    conn.execute("INSERT INTO t VALUES (1)")
    await wal.sync()
    assert wal.syncs == 1
    conn.close()
    wal.close()


async def test_a_node_whose_disk_failed_keeps_no_later_request_alive(tmp_path: Path) -> None:
    """After a failed fsync, every later durable answer fails, for hours maybe (a peer retries).
    Each failure is an error of its own: one error object raised again and again would gather
    each raise's frames in its traceback, and with them every refused request (its letter, its
    task's arguments), held by the node until it restarts. The message names the disk's error
    once, and its code once."""
    import errno
    import gc
    import weakref

    from psymesh.node.core.db import WalSync, open_db

    failures = [OSError(errno.EIO, "Input/output error")]

    def flaky(fd: int) -> None:
        if failures:
            raise failures.pop()
        os.fsync(fd)

    class Request:
        """What a refused answer's frames hold (a letter, say)."""

    wal = WalSync(tmp_path / "node.db", fsync=flaky)
    conn = open_db(tmp_path / "node.db", on_write=wal.wrote)
    conn.execute("CREATE TABLE t (x)")

    async def answer(request: Request) -> None:
        conn.execute("INSERT INTO t VALUES (1)")
        await wal.sync()

    seen: list[weakref.ref[Request]] = []
    messages: list[str] = []
    for _ in range(3):
        request = Request()
        seen.append(weakref.ref(request))
        with pytest.raises(PsymeshError, match="Input/output error") as raised:
            await answer(request)
        messages.append(str(raised.value))
        del request, raised
    gc.collect()
    assert [ref() for ref in seen] == [None, None, None]
    assert all(m.count("unavailable:") == 1 and m.count("Input/output error") == 1 for m in messages), messages
    conn.close()
    wal.close()


async def test_the_wal_sync_follows_a_new_wal_file(tmp_path: Path) -> None:
    """WalSync keeps the WAL's descriptor open between syncs; when the last connection closes,
    SQLite removes the WAL (after copying it all into the database), and the next sync must
    sync the new WAL file, not the removed one."""
    from psymesh.node.core.db import WalSync, open_db

    synced: list[tuple[int, int]] = []  # (inode, links) of each file synced: a removed one has none

    def traced(fd: int) -> None:
        os.fsync(fd)
        st = os.fstat(fd)
        synced.append((st.st_ino, st.st_nlink))

    wal = WalSync(tmp_path / "node.db", fsync=traced)
    wal_path = tmp_path / "node.db-wal"
    conn = open_db(tmp_path / "node.db", on_write=wal.wrote)
    conn.execute("CREATE TABLE t (x)")
    await wal.sync()
    first = wal_path.stat().st_ino
    conn.execute("INSERT INTO t VALUES (1)")
    await wal.sync()  # the same file, through the kept descriptor
    conn.close()  # the last connection: the WAL is gone
    assert not wal_path.exists()
    conn = open_db(tmp_path / "node.db", on_write=wal.wrote)
    conn.execute("INSERT INTO t VALUES (2)")
    await wal.sync()
    assert synced == [(first, 1), (first, 1), (wal_path.stat().st_ino, 1)]
    conn.close()
    wal.close()


def test_a_wal_sync_still_running_as_the_node_stops_lets_go_of_the_wal(tmp_path: Path) -> None:
    """WalSync.close() while an fsync runs puts the descriptor's close off until that fsync
    ends; if the event loop is gone by then (the node stopped), the worker thread settles
    it itself: no descriptor of the WAL (maybe a removed file, holding its disk space) is
    left open in the process."""
    import threading

    import trio

    from psymesh.node.core.db import WalSync, open_db

    release = threading.Event()
    held: list[tuple[int, int]] = []  # (fd, inode) the fsync was given

    def slow(fd: int) -> None:
        held.append((fd, os.fstat(fd).st_ino))
        release.wait(15)
        os.fsync(fd)

    wal = WalSync(tmp_path / "node.db", fsync=slow)
    conn = open_db(tmp_path / "node.db", on_write=wal.wrote)
    conn.execute("CREATE TABLE t (x)")

    async def node() -> None:
        wal.start()
        with trio.fail_after(15):
            while not held:
                await trio.sleep(0.01)
        wal.close()  # put off: the fsync holds the descriptor

    trio.run(node)
    conn.close()
    fd, inode = held[0]
    release.set()

    def still_open() -> bool:
        try:
            return os.fstat(fd).st_ino == inode
        except OSError:
            return False

    deadline = time.monotonic() + 15
    while still_open() and time.monotonic() < deadline:
        release.wait(0.01)
    assert not still_open()


async def test_a_task_refused_outright_stays_refused_across_a_power_cut(tmp_path: Path) -> None:
    """delegate() that the home refuses (no grant) raises, and the phone forgets the task: that
    forgetting is on disk before the refusal is told, so a power cut right after cannot bring
    the outbox row back for the driver to submit again after the restart (the row's own sync
    ran beside the hand-over; without a sync after the delete, the cut's disk still held it)."""
    no_checkpoints = {"storage": StorageSettings(checkpoint_settle_s=600.0, checkpoint_max_defer_s=3600.0)}
    cut = PowerCut(tmp_path / "phone" / "node.db", tmp_path / "phone-disk")
    async with run_nodes(tmp_path, "home", "phone", configs={"phone": no_checkpoints},
                         fsyncs={"phone": cut.fsync}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="messaging")
        async with Client(nodes["phone"].home.path) as p:
            refused, left = [], []
            for i in range(3):
                with pytest.raises(PsymeshError) as exc:
                    await p.delegate("home", tool="system.info")  # home granted no tool
                refused.append(exc.value)
                on_phone = cut.after(tmp_path / f"phone-after-{i}")  # the power fails as the refusal is told
                left.append(on_phone.execute("SELECT count(*) FROM outbox_tasks").fetchone()[0])
                on_phone.close()
    assert all(e.code is ErrorCode.FORBIDDEN for e in refused)
    assert left == [0, 0, 0]


class FailingDisk:
    """A node's WAL fsync seam (`fsyncs=`) that fails with EIO once `failing` is set."""

    def __init__(self) -> None:
        self.failing = False

    def fsync(self, fd: int) -> None:
        if self.failing:
            raise OSError(5, "Input/output error")
        os.fsync(fd)


async def test_a_phone_whose_disk_failed_holds_its_acks_and_keeps_serving(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Once the phone's WAL fsync failed, a task.ack (which promises the home that the events it
    covers are on disk) cannot be sent: the phone holds it, tries again later, and keeps serving
    what promises nothing (the task's result, pings); the home keeps the task for the ack that
    comes after the phone's restart. Before, the ack batch's sync raised out of its task and
    took the phone's daemon down at the first task that ended."""
    import logging

    caplog.set_level(logging.DEBUG, logger="psymesh.tasks")
    disk = FailingDisk()

    def acks_held() -> int:
        return sum("task.ack to" in r.getMessage() and "until it is restarted" in r.getMessage()
                   for r in caplog.records)

    async with run_nodes(tmp_path, "home", "phone", fsyncs={"phone": disk.fsync}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["tool:system.info"])
        disk.failing = True
        async with Client(phone.home.path) as p:
            with pytest.raises(PsymeshError, match="until it is restarted"):  # the row's sync failed
                await p.delegate("home", tool="system.info", task_id="after-the-failure")
            await wait_until(lambda: acks_held() >= 2, "the phone holding the task's ack, twice")
            views = [t for t in (await p.tasks()).submitted if t.task_id == "after-the-failure"]
            assert [v.state.terminal for v in views] == [True]  # its result is here all the same
            assert len((await p.ping("home", count=1)).rtts_ms) == 1
        held = home.executor.store.get("after-the-failure", submitter=phone.identity.peer_id)
        assert held.acked_seq < held.last_seq  # the home keeps its events for the ack to come



async def test_a_phone_whose_disk_failed_hands_over_no_new_task(tmp_path: Path) -> None:
    """Once the phone's WAL fsync failed, delegate() cannot promise a task's row, so it fails;
    and it fails before the task leaves: the home never hears of it, and nothing of it waits on
    the phone to be delivered later. Before, each such task went out, ran on the home and was
    followed by the phone, while its caller was told that delegate() had failed (and could only
    try again: the tool's effects twice). The task whose own row's fsync failed went out beside
    that fsync, before anyone knew."""
    from psymesh.node.tasks.executor_store import TaskNotFound

    disk = FailingDisk()

    async with run_nodes(tmp_path, "home", "phone", fsyncs={"phone": disk.fsync}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["tool:system.info"])
        disk.failing = True
        async with Client(phone.home.path) as p:
            for task_id in ("beside-the-failure", "after-the-failure"):
                with pytest.raises(PsymeshError, match="until it is restarted"):
                    await p.delegate("home", tool="system.info", task_id=task_id)
            on_phone = {t.task_id for t in (await p.tasks()).submitted}
        mine = phone.identity.peer_id
        assert home.executor.store.get("beside-the-failure", submitter=mine).spec.id == "beside-the-failure"
        with pytest.raises(TaskNotFound):
            home.executor.store.get("after-the-failure", submitter=mine)
    assert "after-the-failure" not in on_phone


async def test_a_phone_whose_disk_failed_writes_no_new_letter(tmp_path: Path) -> None:
    """As for tasks: once the phone's WAL fsync failed, send() and group_send() fail before the
    letter is written, so no courier delivers a letter its sender was told had failed (and
    might write again). The letter whose own fsync failed was queued before anyone knew."""
    disk = FailingDisk()

    async with run_nodes(tmp_path, "home", "phone", fsyncs={"phone": disk.fsync}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="messaging")
        async with Client(phone.home.path) as p:
            await p.group_create("family", ["home"])
            disk.failing = True
            for letter_id in ("beside-the-failure", "after-the-failure"):
                with pytest.raises(PsymeshError, match="until it is restarted"):
                    await p.send("home", "hello", letter_id=letter_id)
            with pytest.raises(PsymeshError, match="until it is restarted"):
                await p.group_send("family", "hello all")
            store = phone.messaging.store
            assert store.sent("beside-the-failure") is not None and store.sent("after-the-failure") is None
            assert [s.letter.id for s in store.outbox() if s.letter.group] == []
