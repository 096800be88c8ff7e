"""When audit rows reach the disk (docs/security.md, "Audit rows, when they are written"): the
log's one writer commits them in batches on a connection of its own, off the event loop; a row
is on disk a flush after its decision without anyone reading the log, and every row is on disk
after a clean stop, however long the flush interval.

Real daemons on 127.0.0.1 and the real node.db, read by a connection of the test's own (what a
crash, or `sqlite3 node.db`, would find)."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.node.control.process import DaemonProcess
from psymesh.node.core.db import open_db
from psymesh.node.door.audit import AuditLog
from psymesh.node.core.home import NodeHome, StorageSettings
from psymesh.protocol.common import Ping, Pong

pytestmark = pytest.mark.anyio


def pings_on_disk(db_path: Path, peer_id: str) -> int:
    """Allowed ping rows of `peer_id` committed to the database, read as another process would."""
    with sqlite3.connect(db_path) as conn:
        return conn.execute("SELECT count(*) FROM audit WHERE peer_id = ? AND operation = 'ping' AND allowed = 1",
                            (peer_id,)).fetchone()[0]


async def test_a_decision_is_on_disk_a_flush_later_without_anyone_reading_the_log(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        for seq in range(5):
            await phone.sessions.request(home.identity.peer_id, Ping(seq=seq), Pong)
        await wait_until(lambda: pings_on_disk(home.home.db_path, phone.identity.peer_id) == 5,
                         "the five pings' rows committed by the writer, with no query to force it")


async def test_a_clean_stop_commits_every_row_however_long_the_flush_interval(tmp_path: Path) -> None:
    """With a flush a minute away, the rows wait in memory; SIGTERM writes them all."""
    home_dir, phone_dir = tmp_path / "home", tmp_path / "phone"
    node_home = NodeHome(home_dir)
    node_home.init(profile="home", name="home")
    node_home.save_config(node_home.load_config().model_copy(
        update={"storage": StorageSettings(audit_flush_ms=60_000)}))
    home, phone = DaemonProcess(home_dir), DaemonProcess(phone_dir, profile="phone")
    await home.start()
    try:
        await phone.start()
        await pair(home_dir, phone_dir)
        async with phone.client() as client:
            phone_id = (await client.status()).peer_id
            reply = await client.ping("home", count=20)
        assert len(reply.rtts_ms) == 20
        assert pings_on_disk(node_home.db_path, phone_id) == 0  # held for the next flush, a minute away
    finally:
        await phone.stop()
        status = await home.stop()
    assert status == 0  # a clean stop...
    assert pings_on_disk(node_home.db_path, phone_id) == 20  # ... commits every row it held


async def test_a_query_while_every_worker_thread_is_busy_still_returns_every_decision(tmp_path: Path) -> None:
    """The writer's batch waits for a worker thread (all of them busy: slow syncs, say); a read
    of the log meanwhile writes that batch itself instead of waiting for a thread that the
    blocked loop could never start (it hung the node before)."""
    path = tmp_path / "node.db"
    conn, writer = open_db(path), open_db(path)
    audit = AuditLog(conn, writer=writer, flush_ms=1)
    limiter = anyio.to_thread.current_default_thread_limiter()
    holders = [object() for _ in range(int(limiter.total_tokens))]
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(audit.run)
            for holder in holders:  # every worker thread taken
                await limiter.acquire_on_behalf_of(holder)
            try:
                for seq in range(5):
                    audit.record("peer", "/psymesh/session/1.0.0", "ping", True, reason=str(seq))
                await wait_until(lambda: limiter.statistics().tasks_waiting == 1, "the batch waiting for a thread")
                assert [r["reason"] for r in audit.query(peer_id="peer")] == ["0", "1", "2", "3", "4"]
                assert pings_on_disk(path, "peer") == 5
            finally:
                for holder in holders:
                    limiter.release_on_behalf_of(holder)
            audit.record("peer", "/psymesh/session/1.0.0", "ping", True, reason="5")
            await wait_until(lambda: pings_on_disk(path, "peer") == 6, "the next batch written by the thread")
            tg.cancel_scope.cancel()
    finally:
        writer.close()
        conn.close()
