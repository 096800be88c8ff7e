"""Each sender's share of the inbox (issue 20, finding 2): letters held behind a gap that
never fills stop at the sender's quota and a revoke frees them; a gap waited for too long is
given up and the reader told; another letter under a used id or place is refused
`conflict`, never answered `stored` and dropped.

Real daemons on loopback for the flood (bounded: 1,000 letters in 10 batches), real SQLite
with an injected clock (`now=`) for the store's rules.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from letters import inbox, letter_mesh
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
