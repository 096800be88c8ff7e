"""Durable letters in the node's SQLite database: the outbox (ours, until a receipt) and
the inbox (theirs, released to the app in thread order).

    outbox: letter written and signed -> pending -> delivered (the recipient's signed
            receipt, kept in msg_proofs) | refused (+ stub sent) | deposited (the
            recipient's mailbox holds it, sealed; still sent again directly, with backoff,
            until the recipient's receipt comes, directly or by `msg.ack`) -> delivered;
            `msg.missing` puts a deposited or delivered letter back to pending
    inbox:  stored on arrival (INSERT-or-ignore by id: a resend is dropped) -> released
            to the app when every earlier letter of its (sender, thread) is released;
            `release_seq` numbers released letters 1, 2, 3 ... across the inbox, so an app
            follows with a cursor and sees each letter once; letters that came through our
            mailbox owe their sender a receipt (msg_acks_due) until `msg.ack` takes it

Both sides commit before they answer (a receipt leaves only after the INSERT commits;
a letter leaves the outbox only after its receipt is recorded), so a SIGKILL of either
node loses nothing and duplicates nothing.
"""
from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from psymesh.node.db import ensure_schema, transaction
from psymesh.protocol.messaging import Letter, Receipt, missing, releasable

SCHEMA = """
CREATE TABLE IF NOT EXISTS msg_outbox (
    id          TEXT PRIMARY KEY,
    recipient   TEXT NOT NULL,
    thread      TEXT NOT NULL,
    tseq        INTEGER NOT NULL,
    letter      BLOB NOT NULL,          -- the signed letter, as JSON
    state       TEXT NOT NULL,          -- pending | delivered | refused | deposited
    code        TEXT,                   -- why it was refused
    reason      TEXT NOT NULL DEFAULT '',
    stub_sent   INTEGER NOT NULL DEFAULT 0,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    UNIQUE (recipient, thread, tseq)
);
CREATE INDEX IF NOT EXISTS msg_outbox_pending ON msg_outbox(recipient, state);
CREATE TABLE IF NOT EXISTS msg_inbox (
    id           TEXT NOT NULL,
    sender       TEXT NOT NULL,
    thread       TEXT NOT NULL,
    tseq         INTEGER NOT NULL,
    letter       BLOB NOT NULL,
    received_at  REAL NOT NULL,
    release_seq  INTEGER,               -- NULL while held (an earlier letter of its thread is missing)
    PRIMARY KEY (sender, id),
    UNIQUE (sender, thread, tseq)
);
CREATE UNIQUE INDEX IF NOT EXISTS msg_inbox_release ON msg_inbox(release_seq);
CREATE TABLE IF NOT EXISTS msg_receipts (
    rid      INTEGER PRIMARY KEY AUTOINCREMENT,
    receipt  BLOB NOT NULL              -- a recipient's signed Receipt, as JSON
);
CREATE TABLE IF NOT EXISTS msg_proofs (
    id   TEXT PRIMARY KEY,              -- an outbox letter, delivered ...
    rid  INTEGER NOT NULL               -- ... as this receipt says
);
CREATE TABLE IF NOT EXISTS msg_acks_due (
    sender  TEXT NOT NULL,
    id      TEXT NOT NULL,
    PRIMARY KEY (sender, id)
);
"""
_AWAITING = "state IN ('pending', 'deposited') OR (state = 'refused' AND stub_sent = 0)"


class LetterMaker(Protocol):
    """Builds the signed letter for a tseq (the store picks the number inside its transaction)."""

    def __call__(self, tseq: int) -> Letter: ...


class OutState(StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    REFUSED = "refused"
    DEPOSITED = "deposited"


@dataclass(frozen=True)
class Sent:
    letter: Letter
    state: OutState
    code: str | None
    reason: str
    stub_sent: bool


@dataclass(frozen=True)
class Gap:
    """A (sender, thread) whose held letters wait, since `since`, for the tseqs in `lacks`."""

    sender: str
    thread: str
    since: float
    lacks: list[int]


@dataclass(frozen=True)
class Received:
    letter: Letter
    received_at: float
    release_seq: int | None


class MessageStore:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        ensure_schema(conn, SCHEMA)

    # -- outbox ----------------------------------------------------------------------------
    def next_tseq(self, recipient: str, thread: str) -> int:
        row = self.conn.execute("SELECT MAX(tseq) FROM msg_outbox WHERE recipient = ? AND thread = ?",
                                (recipient, thread)).fetchone()
        return (row[0] or 0) + 1

    def write(self, make: LetterMaker, recipient: str, thread: str, now: float | None = None) -> Letter:
        """Number, sign (via `make(tseq)`) and store a letter in one transaction."""
        now = time.time() if now is None else now
        with transaction(self.conn):
            letter = make(self.next_tseq(recipient, thread))
            self.conn.execute(
                "INSERT INTO msg_outbox (id, recipient, thread, tseq, letter, state, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (letter.id, recipient, thread, letter.tseq, letter.model_dump_json(), OutState.PENDING.value,
                 now, now))
        return letter

    def pending(self, recipient: str, limit: int = 256) -> list[Sent]:
        """Letters for `recipient` awaiting its receipt (deposited ones too; refused ones
        whose stub is due), oldest first."""
        rows = self.conn.execute(f"SELECT * FROM msg_outbox WHERE recipient = ? AND ({_AWAITING})"
                                 " ORDER BY rowid LIMIT ?", (recipient, limit)).fetchall()
        return [_sent(row) for row in rows]

    def recipients_pending(self) -> list[str]:
        rows = self.conn.execute(f"SELECT DISTINCT recipient FROM msg_outbox WHERE {_AWAITING}").fetchall()
        return [r[0] for r in rows]

    def settle(self, delivered: Sequence[str] = (), stubs_done: Sequence[str] = (),
               refused: Sequence[tuple[str, str, str]] = (), proof: Receipt | None = None,
               now: float | None = None) -> None:
        """What a batch's receipts said, recorded in ONE transaction: letters delivered (as
        the recipient's signed `proof` says), stubs taken (or never to be), letters refused
        for good as (id, code, reason)."""
        now = time.time() if now is None else now
        with transaction(self.conn):
            self._delivered(delivered, proof, now)
            self.conn.executemany("UPDATE msg_outbox SET stub_sent = 1 WHERE id = ?", [(i,) for i in stubs_done])
            self.conn.executemany("UPDATE msg_outbox SET state = 'refused', code = ?, reason = ?, updated_at = ?"
                                  " WHERE id = ? AND state = 'pending'",
                                  [(code, reason[:500], now, i) for i, code, reason in refused])

    def _delivered(self, ids: Sequence[str], proof: Receipt | None, now: float,
                   recipient: str | None = None) -> list[str]:
        """Mark awaiting letters delivered (only `recipient`'s, if named) and file the proof."""
        done = [i for i in ids if self.conn.execute(
            "UPDATE msg_outbox SET state = 'delivered', updated_at = ? WHERE id = ? AND"
            " state IN ('pending', 'deposited') AND (? IS NULL OR recipient = ?)",
            (now, i, recipient, recipient)).rowcount]
        if done and proof is not None:
            rid = self.conn.execute("INSERT INTO msg_receipts (receipt) VALUES (?)",
                                    (proof.model_dump_json(),)).lastrowid
            self.conn.executemany("INSERT OR REPLACE INTO msg_proofs (id, rid) VALUES (?, ?)",
                                  [(i, rid) for i in done])
        return done

    def confirm(self, recipient: str, receipt: Receipt, now: float | None = None) -> list[str]:
        """`recipient`'s signed receipt came (`msg.ack`): its letters it names are delivered.
        Returns the ids that were still awaiting it."""
        with transaction(self.conn):
            return self._delivered(receipt.ids, receipt, time.time() if now is None else now, recipient)

    def proof(self, letter_id: str) -> Receipt | None:
        """The recipient's signed receipt for a delivered letter."""
        row = self.conn.execute("SELECT r.receipt FROM msg_proofs p JOIN msg_receipts r ON r.rid = p.rid"
                                " WHERE p.id = ?", (letter_id,)).fetchone()
        return None if row is None else Receipt.model_validate_json(row[0])

    def resend(self, recipient: str, thread: str, tseqs: Sequence[int], now: float | None = None) -> int:
        """`recipient` lacks these letters of `thread` (`msg.missing`): deposited or delivered
        ones go back to pending, refused ones owe their stub again. How many we hold."""
        now = time.time() if now is None else now
        count = 0
        with transaction(self.conn):
            for tseq in tseqs:
                count += self.conn.execute(
                    "UPDATE msg_outbox SET state = CASE WHEN state = 'refused' THEN state ELSE 'pending' END,"
                    " stub_sent = 0, updated_at = ? WHERE recipient = ? AND thread = ? AND tseq = ?",
                    (now, recipient, thread, tseq)).rowcount
        return count

    def deposited(self, letter_id: str, now: float | None = None) -> None:
        """The recipient's mailbox holds the letter (its receipt came back)."""
        self.conn.execute("UPDATE msg_outbox SET state = 'deposited', updated_at = ? WHERE id = ? AND state = 'pending'",
                          (time.time() if now is None else now, letter_id))

    def stub_done(self, letter_id: str) -> None:
        """The stub that replaces a refused letter was taken (or can never be): nothing left to send."""
        self.conn.execute("UPDATE msg_outbox SET stub_sent = 1 WHERE id = ?", (letter_id,))

    def sent(self, letter_id: str) -> Sent | None:
        row = self.conn.execute("SELECT * FROM msg_outbox WHERE id = ?", (letter_id,)).fetchone()
        return None if row is None else _sent(row)

    def outbox(self, limit: int = 100) -> list[Sent]:
        rows = self.conn.execute("SELECT id FROM msg_outbox ORDER BY rowid DESC LIMIT ?", (limit,)).fetchall()
        return [s for r in reversed(rows) if (s := self.sent(r[0])) is not None]

    # -- inbox -----------------------------------------------------------------------------
    def store(self, letter: Letter, now: float | None = None) -> list[Received]:
        """Keep a letter that arrived (a resend is ignored) and release what it completes:
        the letters, in order, that the app may now see."""
        return self.store_many([letter], now)

    def store_many(self, letters: Sequence[Letter], now: float | None = None) -> list[Received]:
        """Keep a batch of letters in ONE transaction (resends, in the batch or from before,
        are ignored) and release what they complete, thread by thread, in tseq order."""
        now = time.time() if now is None else now
        threads = dict.fromkeys((letter.sender, letter.thread) for letter in letters)
        released = 0
        with transaction(self.conn):
            self.conn.executemany(
                "INSERT OR IGNORE INTO msg_inbox (id, sender, thread, tseq, letter, received_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [(letter.id, letter.sender, letter.thread, letter.tseq, letter.model_dump_json(), now)
                 for letter in letters])
            base = self.conn.execute("SELECT COALESCE(MAX(release_seq), 0) FROM msg_inbox").fetchone()[0]
            for sender, thread in threads:
                released_upto, held = self._thread(sender, thread)
                go = releasable(held, released_upto)
                self.conn.executemany(
                    "UPDATE msg_inbox SET release_seq = ? WHERE sender = ? AND thread = ? AND tseq = ?",
                    [(base + released + i, sender, thread, tseq) for i, tseq in enumerate(go, start=1)])
                released += len(go)
        if not released:
            return []
        return self.released_after(base, limit=released)

    def released_after(self, cursor: int, limit: int = 500) -> list[Received]:
        """Released letters numbered above `cursor`, in release order (withdrawn stubs included:
        the reader skips them, but they advance its cursor)."""
        rows = self.conn.execute(
            "SELECT letter, received_at, release_seq FROM msg_inbox WHERE release_seq > ? ORDER BY release_seq"
            " LIMIT ?", (cursor, limit)).fetchall()
        return [Received(Letter.model_validate_json(r["letter"]), r["received_at"], r["release_seq"]) for r in rows]

    def last_released(self) -> int:
        """The highest `release_seq` so far (0 for an empty inbox): a reader that starts here
        sees only letters released from now on."""
        return self.conn.execute("SELECT COALESCE(MAX(release_seq), 0) FROM msg_inbox").fetchone()[0]

    def held(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM msg_inbox WHERE release_seq IS NULL").fetchone()[0]

    def _thread(self, sender: str, thread: str) -> tuple[int, list[int]]:
        """(the last tseq released, the tseqs held) of one (sender, thread)."""
        released_upto = self.conn.execute(
            "SELECT COALESCE(MAX(tseq), 0) FROM msg_inbox WHERE sender = ? AND thread = ?"
            " AND release_seq IS NOT NULL", (sender, thread)).fetchone()[0]
        held = [r[0] for r in self.conn.execute(
            "SELECT tseq FROM msg_inbox WHERE sender = ? AND thread = ? AND release_seq IS NULL", (sender, thread))]
        return released_upto, held

    def gaps(self) -> list[Gap]:
        """Each (sender, thread) holding letters behind a gap: since when, and what it lacks."""
        rows = self.conn.execute("SELECT sender, thread, MIN(received_at) FROM msg_inbox WHERE release_seq IS NULL"
                                 " GROUP BY sender, thread").fetchall()
        out = []
        for sender, thread, since in rows:
            released_upto, held = self._thread(sender, thread)
            lacks = missing(held, released_upto)
            if lacks:
                out.append(Gap(sender, thread, since, lacks))
        return out

    # -- receipts we owe for letters that came through our mailbox ----------------------------
    def owe(self, sender: str, ids: Sequence[str]) -> None:
        self.conn.executemany("INSERT OR IGNORE INTO msg_acks_due (sender, id) VALUES (?, ?)",
                              [(sender, i) for i in ids])

    def owed(self, sender: str, limit: int = 256) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT id FROM msg_acks_due WHERE sender = ? ORDER BY rowid"
                                                " LIMIT ?", (sender, limit))]

    def senders_owed(self) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT DISTINCT sender FROM msg_acks_due")]

    def paid(self, sender: str, ids: Sequence[str]) -> None:
        with transaction(self.conn):
            self.conn.executemany("DELETE FROM msg_acks_due WHERE sender = ? AND id = ?", [(sender, i) for i in ids])



def _sent(row: sqlite3.Row) -> Sent:
    return Sent(Letter.model_validate_json(row["letter"]), OutState(row["state"]), row["code"], row["reason"],
                bool(row["stub_sent"]))
