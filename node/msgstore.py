"""Durable letters in the node's SQLite database: the outbox (ours, until a receipt) and
the inbox (theirs, released to the app in thread order).

    outbox: letter written and signed -> pending -> delivered (receipt) | refused (+ stub sent)
            | deposited (the recipient's mailbox holds it, sealed: handing it over is the
            mailbox's job now)
    inbox:  stored on arrival (INSERT-or-ignore by id: a resend is dropped) -> released
            to the app when every earlier letter of its (sender, thread) is released;
            `release_seq` numbers released letters 1, 2, 3 ... across the inbox, so an app
            follows with a cursor and sees each letter once

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
from psymesh.protocol.messaging import Letter, LetterKind, releasable

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
"""


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
        """Letters for `recipient` awaiting a receipt (refused ones whose stub is due too), oldest first."""
        rows = self.conn.execute(
            "SELECT * FROM msg_outbox WHERE recipient = ? AND"
            " (state = 'pending' OR (state = 'refused' AND stub_sent = 0)) ORDER BY rowid LIMIT ?",
            (recipient, limit)).fetchall()
        return [_sent(row) for row in rows]

    def recipients_pending(self) -> list[str]:
        rows = self.conn.execute("SELECT DISTINCT recipient FROM msg_outbox WHERE state = 'pending' OR"
                                 " (state = 'refused' AND stub_sent = 0)").fetchall()
        return [r[0] for r in rows]

    def settle(self, delivered: Sequence[str] = (), stubs_done: Sequence[str] = (),
               refused: Sequence[tuple[str, str, str]] = (), now: float | None = None) -> None:
        """What a batch's receipts said, recorded in ONE transaction: letters delivered,
        stubs taken (or never to be), letters refused for good as (id, code, reason)."""
        now = time.time() if now is None else now
        with transaction(self.conn):
            self.conn.executemany("UPDATE msg_outbox SET state = 'delivered', updated_at = ?"
                                  " WHERE id = ? AND state = 'pending'", [(now, i) for i in delivered])
            self.conn.executemany("UPDATE msg_outbox SET stub_sent = 1 WHERE id = ?", [(i,) for i in stubs_done])
            self.conn.executemany("UPDATE msg_outbox SET state = 'refused', code = ?, reason = ?, updated_at = ?"
                                  " WHERE id = ? AND state = 'pending'",
                                  [(code, reason[:500], now, i) for i, code, reason in refused])

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

    def asked(self, peer_id: str, ask_id: str) -> bool:
        """This node sent `peer_id` the ask `ask_id` (the gate admits its answer)."""
        sent = self.sent(ask_id)
        return sent is not None and sent.letter.recipient == peer_id and sent.letter.kind is LetterKind.ASK

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
                released_upto = self.conn.execute(
                    "SELECT COALESCE(MAX(tseq), 0) FROM msg_inbox WHERE sender = ? AND thread = ?"
                    " AND release_seq IS NOT NULL", (sender, thread)).fetchone()[0]
                held = [r[0] for r in self.conn.execute(
                    "SELECT tseq FROM msg_inbox WHERE sender = ? AND thread = ? AND release_seq IS NULL",
                    (sender, thread))]
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



def _sent(row: sqlite3.Row) -> Sent:
    return Sent(Letter.model_validate_json(row["letter"]), OutState(row["state"]), row["code"], row["reason"],
                bool(row["stub_sent"]))
