"""Each sender's share of the inbox (issue 20, finding 2): letters held behind a gap that
never fills stop at the sender's quota and a revoke frees them; a gap waited for too long is
given up and the reader told; another letter under a used id or place is refused
`conflict`, never answered `stored` and dropped. The threads whose place the inbox keeps
(`msg_threads`) are a share too (issue 32, item 8): a sender opening threads past it is
refused `busy`, a thread's row goes with its last letter, and a revoke drops the rows.

Real daemons on loopback for the flood (bounded: 1,000 letters in 10 batches), real SQLite
with an injected clock (`now=`) for the store's rules.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path

import anyio
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from letters import inbox, letter_mesh
from waiting import wait_until
from psymesh.node.control.client import Client
from psymesh.node.core.db import open_db
from psymesh.node.messaging.store import MessageStore
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.limits import Limits
from psymesh.protocol.messaging import (
    InboxSettings, Letter, MsgReceipt, MsgReceipts, MsgSend, MsgSendMany, ReceiptStatus)

pytestmark = pytest.mark.anyio
ROOMY = Limits(requests_per_minute=100_000, max_payload_bytes=1 << 20)
HELD_BYTES = 256 * 1024
LETTER_TEXT = 4000


async def test_letters_into_a_gap_stop_at_the_senders_quota_and_a_revoke_frees_them(tmp_path: Path) -> None:
    inbox_settings = InboxSettings(held_bytes=HELD_BYTES)
    async with letter_mesh(tmp_path, "home", "greedy", "phone", limits=ROOMY,
                           configs={"home": {"inbox": inbox_settings}}) as nodes:
        home, greedy, phone = nodes["home"], nodes["greedy"], nodes["phone"]
        db = home.home.db_path
        size_before = db.stat().st_size + wal_size(db)

        def gap_letter(i: int) -> Letter:  # place 2 of a thread whose place 1 never comes
            return Letter(id=f"gap-{i}", sender=greedy.identity.peer_id, recipient=home.identity.peer_id,
                          thread=f"t{i}", tseq=2, text=os.urandom(LETTER_TEXT // 2).hex(),
                          at=int(time.time() * 1000)).sign(greedy.identity.private_key)

        statuses: list[tuple[ReceiptStatus, ErrorCode | None]] = []
        with anyio.fail_after(60):
            for batch in range(10):  # 1,000 letters, ~4 MB: 16x the quota
                letters = [gap_letter(batch * 100 + i) for i in range(100)]
                reply = await greedy.sessions.request(home.identity.peer_id, MsgSendMany(letters=letters), MsgReceipts)
                statuses += [(r.status, r.code) for r in reply.results]
                # a well-behaved sender is served meanwhile
                phone.messaging.send("home", f"hello {batch}", thread="main")
            got = await inbox(home, 10)
        assert [letter.text for letter in got] == [f"hello {i}" for i in range(10)]

        held_letters, held_bytes = home.messaging.store.share(greedy.identity.peer_id, held=True)
        assert held_bytes <= HELD_BYTES and held_letters < 1000
        stored = statuses.count((ReceiptStatus.STORED, None))
        assert stored == held_letters  # every letter answered `stored` is held, none silently dropped
        assert statuses.count((ReceiptStatus.REFUSED, ErrorCode.BUSY)) == 1000 - stored
        grown = db.stat().st_size + wal_size(db) - size_before
        print(f"greedy: {stored} of 1000 letters held ({held_bytes} bytes, quota {HELD_BYTES}); "
              f"node.db + WAL grew {grown / 1e6:.2f} MB")

        async with Client(home.home.path) as h:
            await h.revoke("greedy")
        assert home.messaging.store.share(greedy.identity.peer_id, held=True) == (0, 0)
        phone.messaging.send("home", "still here", thread="main")
        assert [letter.text for letter in await inbox(home, 11)][-1] == "still here"


async def test_threads_past_the_senders_share_wait_go_with_their_letters_and_a_revoke_frees_them(
        tmp_path: Path) -> None:
    threads, kept = 100, 150
    async with letter_mesh(tmp_path, "home", "greedy", "phone", limits=ROOMY,
                           configs={"home": {"inbox": InboxSettings(threads=threads, kept_letters=kept)}}) as nodes:
        home, greedy, phone = nodes["home"], nodes["greedy"], nodes["phone"]
        store, db, me = home.messaging.store, home.home.db_path, greedy.identity.peer_id

        def letter(thread: str, tseq: int) -> Letter:
            return Letter(id=f"{thread}-{tseq}", sender=me, recipient=home.identity.peer_id, thread=thread,
                          tseq=tseq, text="hi", at=int(time.time() * 1000)).sign(greedy.identity.private_key)

        async def send(letters: list[Letter]) -> list[tuple[str, ReceiptStatus, ErrorCode | None, str]]:
            reply = await greedy.sessions.request(home.identity.peer_id, MsgSendMany(letters=letters), MsgReceipts)
            return [(r.id, r.status, r.code, r.reason) for r in reply.results]

        size_before = db.stat().st_size + wal_size(db)
        results = []
        with anyio.fail_after(60):
            for batch in range(3):  # 300 letters, each opening a thread of its own
                results += await send([letter(f"t{batch * 100 + i}", 1) for i in range(100)])
                phone.messaging.send("home", f"hello {batch}", thread="main")  # a well-behaved sender is served
            await wait_until(lambda: store.share(phone.identity.peer_id, held=False)[0] == 3, "phone's letters")
        stored = [i for i, status, _, _ in results if status is ReceiptStatus.STORED]
        assert stored == [f"t{i}-1" for i in range(threads)]  # the first 100 threads, in order
        refusals = [(code, reason) for _, status, code, reason in results if status is ReceiptStatus.REFUSED]
        assert len(refusals) == 200 and {code for code, _ in refusals} == {ErrorCode.BUSY}
        assert "[inbox] threads" in refusals[0][1] and "100 threads" in refusals[0][1]
        assert store.threads(me) == threads and thread_rows(db, me) == threads
        print(f"greedy: 300 letters in 300 new threads, {len(stored)} stored, {len(refusals)} refused busy; "
              f"{thread_rows(db, me)} thread rows; node.db + WAL grew "
              f"{(db.stat().st_size + wal_size(db) - size_before) / 1e3:.0f} kB")

        # 100 more letters in its open thread t0: past kept_letters, its 50 oldest letters go, and the
        # 49 threads (t1 ... t49) left with no letter go with them
        more = [letter("t0", t) for t in range(2, 102)]
        with anyio.fail_after(30):
            assert {status for _, status, _, _ in await send(more)} == {ReceiptStatus.STORED}
        assert store.share(me, held=False)[0] == kept
        assert thread_rows(db, me) == store.threads(me) == threads - 49
        # ... which makes room for 49 new threads, and no more (the 49 let in then push out the next
        # 49 oldest letters, and their threads)
        with anyio.fail_after(30):
            again = await send([letter(f"n{i}", 1) for i in range(60)])
        assert [i for i, status, _, _ in again if status is ReceiptStatus.STORED] == [f"n{i}-1" for i in range(49)]
        assert thread_rows(db, me) == store.threads(me) == threads - 49
        # the places kept stay taken: a letter of t0 sent again is nothing new
        assert (await send(more[-1:]))[0][1] is ReceiptStatus.STORED
        assert [r.letter.tseq for r in store.released_after(0) if r.letter.thread == "t0"][-1] == 101

        size = db.stat().st_size + wal_size(db)
        async with Client(home.home.path) as h:
            await h.revoke("greedy")
        assert thread_rows(db, me) == 0 and thread_rows(db, phone.identity.peer_id) == 1
        print(f"revoke: greedy's thread rows {threads - 49} -> 0; node.db + WAL {size} -> "
              f"{db.stat().st_size + wal_size(db)} bytes (SQLite keeps freed pages for reuse)")
        phone.messaging.send("home", "still here", thread="main")
        await wait_until(lambda: [r.letter.text for r in store.released_after(0)][-1] == "still here", "phone again")


def thread_rows(db: Path, sender: str) -> int:
    """`sender`'s rows in msg_threads, read as another process would."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT COUNT(*) FROM msg_threads WHERE sender = ?", (sender,)).fetchone()[0]


def wal_size(db: Path) -> int:
    wal = db.with_name(db.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


async def test_a_used_id_or_place_with_other_content_is_refused_conflict(tmp_path: Path) -> None:
    async with letter_mesh(tmp_path, "home", "phone", limits=ROOMY) as nodes:
        home, phone = nodes["home"], nodes["phone"]

        def letter(letter_id: str, tseq: int, text: str) -> Letter:
            return Letter(id=letter_id, sender=phone.identity.peer_id, recipient=home.identity.peer_id,
                          thread="c", tseq=tseq, text=text, at=1).sign(phone.identity.private_key)

        first = letter("c-1", 1, "the original")
        await phone.sessions.request(home.identity.peer_id, MsgSend(letter=first), MsgReceipt)
        # the same letter again: stored (a resend)
        again = await phone.sessions.request(home.identity.peer_id, MsgSendMany(letters=[first]), MsgReceipts)
        assert [(r.status, r.code) for r in again.results] == [(ReceiptStatus.STORED, None)]
        # its id with new content, and a new id in its place: refused, conflict
        reply = await phone.sessions.request(home.identity.peer_id, MsgSendMany(
            letters=[letter("c-1", 1, "rewritten"), letter("c-other", 1, "squatter")]), MsgReceipts)
        assert [(r.status, r.code) for r in reply.results] == [(ReceiptStatus.REFUSED, ErrorCode.CONFLICT)] * 2
        with pytest.raises(PsymeshError) as info:
            await phone.sessions.request(home.identity.peer_id, MsgSend(letter=letter("c-1", 1, "again")), MsgReceipt)
        assert info.value.code is ErrorCode.CONFLICT
        assert [r.letter.text for r in home.messaging.store.released_after(0)] == ["the original"]


# --------------------------------------------------------------------- the store, told the time

def keys() -> tuple[Ed25519PrivateKey, str, str]:
    key = Ed25519PrivateKey.generate()
    return (key, peer_id_from_public_key(key.public_key().public_bytes_raw()),
            peer_id_from_public_key(Ed25519PrivateKey.generate().public_key().public_bytes_raw()))


def test_a_gap_waited_for_too_long_is_given_up_and_the_reader_told(tmp_path: Path) -> None:
    store = MessageStore(open_db(tmp_path / "db"), InboxSettings(held_s=3600))
    key, sender, me = keys()

    def letter(tseq: int) -> Letter:
        return Letter(id=f"l{tseq}", sender=sender, recipient=me, thread="t", tseq=tseq, text=str(tseq),
                      at=1).sign(key)

    t0 = 1_000_000.0
    assert store.store(letter(1), now=t0)[0].skipped == 0
    assert store.store(letter(3), now=t0) == [] and store.store(letter(4), now=t0 + 10) == []  # 2 never comes
    assert store.expire_held(now=t0 + 3599) == []
    released = store.expire_held(now=t0 + 3600)
    assert [(r.letter.tseq, r.skipped) for r in released] == [(3, 1), (4, 0)]
    assert store.held() == 0
    with pytest.raises(PsymeshError) as info:  # 2 comes after all: its place was given up
        store.store(letter(2), now=t0 + 3700)
    assert info.value.code is ErrorCode.EXPIRED
    assert [r.letter.tseq for r in store.store(letter(5), now=t0 + 3700)] == [5]  # the thread goes on
    assert store.store(letter(4), now=t0 + 3700) == []  # a resend of a released letter: nothing


def test_released_letters_past_the_senders_share_go_oldest_first_without_reopening_their_place(
        tmp_path: Path) -> None:
    store = MessageStore(open_db(tmp_path / "db"), InboxSettings(kept_letters=3))
    key, sender, me = keys()
    letters = [Letter(id=f"k{t}", sender=sender, recipient=me, thread="k", tseq=t, at=1).sign(key)
               for t in range(1, 7)]
    store.store_many(letters, now=1.0)
    assert [r.letter.tseq for r in store.released_after(0)] == [4, 5, 6]
    assert store.share(sender, held=False)[0] == 3
    with pytest.raises(PsymeshError) as info:  # a pruned letter sent again is not let in twice
        store.store(letters[0], now=2.0)
    assert info.value.code is ErrorCode.EXPIRED
    nxt = Letter(id="k7", sender=sender, recipient=me, thread="k", tseq=7, at=1).sign(key)
    assert [r.letter.tseq for r in store.store(nxt, now=3.0)] == [7]


def test_a_sender_writing_each_letter_in_a_new_thread_costs_at_most_its_letter_shares(tmp_path: Path) -> None:
    """The flood of issue 32 (12,032 tiny letters, each in a thread of its own, left 12,032
    rows), with the default shares: the rows stop at kept_letters, and none is refused."""
    conn = open_db(tmp_path / "db")
    store = MessageStore(conn)
    key, sender, me = keys()
    total, refused = 12_032, 0
    for start in range(0, total, 256):  # bounded: 47 batches
        letters = [Letter(id=f"x{i}", sender=sender, recipient=me, thread=f"x{i}", tseq=1, at=1).sign(key)
                   for i in range(start, min(start + 256, total))]
        refused += len(store.store_many(letters, now=float(start)).refused)
    kept = InboxSettings().kept_letters
    assert refused == 0
    assert store.threads(sender) == store.thread_rows() == store.share(sender, held=False)[0] == kept
    assert [r.letter.thread for r in store.released_after(0)][:1] == [f"x{total - kept}"]
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    print(f"{total} letters in {total} threads: {store.thread_rows()} thread rows, node.db "
          f"{(tmp_path / 'db').stat().st_size / 1e6:.2f} MB")


def test_an_older_inbox_gets_its_sizes_and_thread_places(tmp_path: Path) -> None:
    """A database from before the quotas: the new columns are added and each thread's place is
    taken from what it had released, so nothing released before comes in again."""
    conn = open_db(tmp_path / "db")
    conn.executescript("""
        CREATE TABLE msg_inbox (id TEXT NOT NULL, sender TEXT NOT NULL, thread TEXT NOT NULL, tseq INTEGER NOT NULL,
            letter BLOB NOT NULL, received_at REAL NOT NULL, release_seq INTEGER,
            PRIMARY KEY (sender, id), UNIQUE (sender, thread, tseq));""")
    key, sender, me = keys()
    old = Letter(id="o1", sender=sender, recipient=me, thread="o", tseq=1, text="old", at=1).sign(key)
    conn.execute("INSERT INTO msg_inbox VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (old.id, sender, "o", 1, old.model_dump_json(), 1.0, 1))
    store = MessageStore(conn)
    assert store.share(sender, held=False) == (1, len(old.model_dump_json()))
    assert store.store(old) == []
    nxt = Letter(id="o2", sender=sender, recipient=me, thread="o", tseq=2, at=1).sign(key)
    assert [(r.letter.tseq, r.release_seq) for r in store.store(nxt)] == [(2, 2)]


def test_a_thread_keeps_its_place_while_it_has_letters_here_rows_or_not(tmp_path: Path) -> None:
    """A revoke drops the sender's rows; a thread with letters still here keeps its place
    (the highest tseq released), so a re-paired sender goes on where it was, exactly once."""
    store = MessageStore(open_db(tmp_path / "db"))
    key, sender, me = keys()
    letters = [Letter(id=f"a{t}", sender=sender, recipient=me, thread="a", tseq=t, at=1).sign(key) for t in range(1, 5)]
    store.store_many(letters[:3], now=1.0)
    assert store.forget(sender) == 0 and store.thread_rows() == 0 and store.threads(sender) == 1
    assert store.store(letters[1], now=2.0) == []  # sent again: nothing new
    assert [r.letter.tseq for r in store.store(letters[3], now=2.0)] == [4]  # goes on, not held
    assert [r.letter.tseq for r in store.released_after(0)] == [1, 2, 3, 4]


def test_a_mailbox_copy_of_a_letter_whose_thread_was_forgotten_is_stale(tmp_path: Path) -> None:
    """A thread goes with its last letter; a copy of one of its letters that our mailbox kept
    (fetched after days of direct letters) is told apart by its `at`: no later than a letter
    of its sender's pruned here, it is stale, so it is not delivered twice."""
    store = MessageStore(open_db(tmp_path / "db"), InboxSettings(kept_letters=3))
    key, sender, me = keys()
    places = [("s0", 1), ("s0", 2), ("s2", 1), ("s3", 1), ("s4", 1)]
    letters = [Letter(id=f"{thread}-{tseq}", sender=sender, recipient=me, thread=thread, tseq=tseq,
                      at=1000 + i).sign(key) for i, (thread, tseq) in enumerate(places)]
    store.store_many(letters, now=1.0)  # the oldest two go, and thread s0 with them
    assert store.thread_rows() == 3 and not store.stale(letters[4])
    assert store.stale(letters[0]) and store.stale(letters[1])  # s0, forgotten
    later = Letter(id="s9", sender=sender, recipient=me, thread="s0", tseq=1, at=1002).sign(key)
    assert not store.stale(later)  # written after what was pruned: a new letter
