"""Durable letters in the node's SQLite database: the outbox (ours, until a receipt) and
the inbox (theirs, released to the app in thread order).

    outbox: letter written and signed -> pending -> delivered (the recipient's signed
            receipt, kept in msg_proofs) | refused (+ stub sent) | deposited (the
            recipient's mailbox holds it, sealed; still sent again directly, with backoff,
            until the recipient's receipt comes, directly or by `msg.ack`) -> delivered, or
            refused (+ stub sent) when a direct offer is refused for good (e.g. `expired`);
            `msg.missing` puts a deposited or delivered letter back to pending
    inbox:  stored on arrival (a resend, the same letter again, is dropped; another letter
            with a used id or tseq is refused `conflict`) -> released to the app when every
            earlier letter of its (sender, thread) is released; `release_seq` numbers
            released letters 1, 2, 3 ... across the inbox, so an app follows with a cursor
            and sees each letter once; letters that came through our mailbox owe their
            sender a receipt (msg_acks_due) until `msg.ack` takes it

Each sender's share of the inbox is bounded (protocol/messaging.py `InboxSettings`,
config `[inbox]`): letters held behind a gap, in items and bytes (a letter past that is
refused `busy` and sent again later); released letters, in items and bytes (past that
the sender's oldest released ones go, as a mail spool's do); and a letter held longer
than `held_s` gives up its thread's gap: it and those behind it are released with
`skipped` saying how many letters never came, and a letter that comes later for a place
given up is refused `expired`.

Where each thread is released up to lives in `msg_threads` (else it is the highest tseq
of the thread's released letters here), so pruning released letters never re-opens a place
while the thread has a letter here. The threads whose place the inbox keeps are a share
too (`threads`): a letter that would open one more is refused `busy`, and a thread's row
goes with its last letter, so a sender writing each letter in a new thread costs at most
its letter shares. A thread forgotten so could take its old letters again; directly, only
a sender replaying its own letters after more than its share of later ones could send
them (a courier resends just the letters it has no receipt for, oldest first, at most 256
in flight), and a copy our mailbox kept is `stale` (the inbox remembers, per sender, the
newest `at` it pruned: a letter from the mailbox opening a thread, written no later than
that, was delivered directly, or its sender sends it so). A revoke removes the sender's
held letters and its threads' rows.

Both sides commit before they answer (a receipt leaves only after the INSERT commits;
a letter leaves the outbox only after its receipt is recorded), so a SIGKILL of either
node loses nothing and duplicates nothing.
"""
from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..core.db import ensure_schema, transaction
from ...protocol.courier import OutState
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.messaging import InboxSettings, Letter, LetterKind, Receipt, missing, releasable

RETRY_HELD_S = 30.0  # a letter refused for the sender's held share: when to send it again

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
CREATE TABLE IF NOT EXISTS msg_threads (
    sender        TEXT NOT NULL,
    thread        TEXT NOT NULL,
    released_upto INTEGER NOT NULL,     -- every tseq up to here is released (or its place given up)
    PRIMARY KEY (sender, thread)
);
CREATE TABLE IF NOT EXISTS msg_forgotten (
    sender   TEXT PRIMARY KEY,
    at_upto  INTEGER NOT NULL           -- the newest `at` of the sender's letters pruned here
);
"""
_AWAITING = "state IN ('pending', 'deposited') OR (state = 'refused' AND stub_sent = 0)"
# Columns added after the first release: (name, definition), added to older databases on open;
# then the indexes that count a sender's held and released letters (its shares).
_INBOX_COLUMNS = (("size", "INTEGER NOT NULL DEFAULT 0"),      # bytes of the stored letter
                  ("skipped", "INTEGER NOT NULL DEFAULT 0"))   # tseqs before it that never came


class LetterMaker(Protocol):
    """Builds the signed letter for a tseq (the store picks the number inside its transaction)."""

    def __call__(self, tseq: int) -> Letter: ...


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
    skipped: int = 0  # letters of its thread before it that never came (their place was given up)


@dataclass(frozen=True)
class Stored:
    """What a batch did to the inbox: the letters released (in release order) and, by id, the
    letters refused, each with why (a lone `msg.send` of it gets that error)."""

    released: list[Received]
    refused: dict[str, PsymeshError]


class MessageStore:
    def __init__(self, conn: sqlite3.Connection, settings: InboxSettings | None = None) -> None:
        self.conn = conn
        self.settings = settings or InboxSettings()
        ensure_schema(conn, SCHEMA)
        have = {row[1] for row in conn.execute("PRAGMA table_info(msg_inbox)")}
        with transaction(conn):
            for name, definition in _INBOX_COLUMNS:
                if name not in have:
                    conn.execute(f"ALTER TABLE msg_inbox ADD COLUMN {name} {definition}")
                    if name == "size":
                        conn.execute("UPDATE msg_inbox SET size = length(letter)")
            conn.execute("CREATE INDEX IF NOT EXISTS msg_inbox_held ON msg_inbox(sender, size) WHERE release_seq IS NULL")
            conn.execute("CREATE INDEX IF NOT EXISTS msg_inbox_kept ON msg_inbox(sender, size)"
                         " WHERE release_seq IS NOT NULL")

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
            # a deposited letter too: offered again directly, it may be refused for good (its place
            # given up while the mailbox withheld it: `expired`), and then its stub is due
            self.conn.executemany("UPDATE msg_outbox SET state = 'refused', code = ?, reason = ?, updated_at = ?"
                                  " WHERE id = ? AND state IN ('pending', 'deposited')",
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
        the letters, in order, that the app may now see. A refusal raises its PsymeshError."""
        stored = self.store_many([letter], now)
        if letter.id in stored.refused:
            raise stored.refused[letter.id]
        return stored.released

    def store_many(self, letters: Sequence[Letter], now: float | None = None) -> Stored:
        """Keep a batch of letters in ONE transaction and release what they complete, thread
        by thread, in tseq order. Resends (the same letter again, in the batch or from before)
        are ignored; refused, each with why: another letter under a used id or tseq
        (`conflict`), a place its thread gave up (`expired`), past the sender's share of
        held letters (`busy`, to be sent again once the gap fills)."""
        now = time.time() if now is None else now
        refused: dict[str, PsymeshError] = {}
        fresh: list[Letter] = []
        with transaction(self.conn):
            base = self._last_released()
            self._expire(now)
            taken: dict[tuple[str, str, int], Letter] = {}
            runs: dict[tuple[str, str], int] = {}  # per thread: the last tseq that will be released
            for letter in letters:
                thread = (letter.sender, letter.thread)
                known = self._by_id(letter.sender, letter.id)
                problem = self._conflict(letter, known, taken)
                if problem is None and ((*thread, letter.tseq) in taken or known is not None):
                    continue  # the same letter again (in this batch, or stored before): nothing to do
                if problem is None:
                    run = runs[thread] if thread in runs else self._released_upto(*thread)
                    if letter.tseq <= run:
                        problem = PsymeshError(
                            f"letter {letter.id}: place {letter.tseq} of thread {letter.thread!r} was given up "
                            f"after its successors waited {self.settings.held_s:g} s for it ([inbox] held_s)",
                            code=ErrorCode.EXPIRED)
                    elif letter.tseq == run + 1:
                        runs[thread] = letter.tseq  # continues its thread: never held (the usual case)
                    elif self._held_share_full(letter):
                        problem = self._held_share_refusal()
                if problem is not None:
                    refused[letter.id] = problem
                    continue
                taken[letter.sender, letter.thread, letter.tseq] = letter
                fresh.append(letter)
            opened: dict[str, list[str]] = {}  # per sender, the threads this batch opens (in order)
            for sender, thread in dict.fromkeys((letter.sender, letter.thread) for letter in fresh):
                if self._new_thread(sender, thread):
                    opened.setdefault(sender, []).append(thread)
            self.conn.executemany(
                "INSERT INTO msg_inbox (id, sender, thread, tseq, letter, received_at, size) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(letter.id, letter.sender, letter.thread, letter.tseq, js, now, len(js))
                 for letter in fresh for js in (letter.model_dump_json(),)])
            for sender, thread in dict.fromkeys((letter.sender, letter.thread) for letter in fresh):
                self._release(sender, thread, self._released_upto(sender, thread))
            for sender in dict.fromkeys(letter.sender for letter in fresh):
                refused.update(self._over_held_share(sender, [x for x in fresh if x.sender == sender]))
                refused.update(self._over_thread_share(sender, opened.get(sender, []), fresh))
                self._prune_released(sender)  # only what was let in pushes old letters out
        return Stored(self.released_after(base, limit=len(letters) + 10_000), refused)

    def expire_held(self, now: float | None = None) -> list[Received]:
        """Give up the gaps that letters have been held behind for longer than `held_s`:
        release them (and those they complete), each saying how many letters it skipped."""
        now = time.time() if now is None else now
        with transaction(self.conn):
            base = self._last_released()
            self._expire(now)
        return self.released_after(base, limit=100_000)

    def forget(self, sender: str) -> int:
        """Remove what `sender` has held here and its threads' rows (it was revoked): how many
        letters went. Its released letters stay for the app (and keep their threads' places)."""
        with transaction(self.conn):
            self.conn.execute("DELETE FROM msg_threads WHERE sender = ?", (sender,))
            return self.conn.execute("DELETE FROM msg_inbox WHERE sender = ? AND release_seq IS NULL",
                                     (sender,)).rowcount

    def share(self, sender: str, *, held: bool) -> tuple[int, int]:
        """(letters, bytes) of `sender`'s in the inbox, held or released."""
        row = self.conn.execute(
            f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM msg_inbox WHERE sender = ? AND"
            f" release_seq IS {'' if held else 'NOT '}NULL", (sender,)).fetchone()
        return row[0], row[1]

    def threads(self, sender: str) -> int:
        """How many threads of `sender`'s the inbox keeps a place for: those with a row in
        `msg_threads` or a letter here."""
        return self.conn.execute("SELECT COUNT(*) FROM (SELECT thread FROM msg_threads WHERE sender = ?"
                                 " UNION SELECT thread FROM msg_inbox WHERE sender = ?)",
                                 (sender, sender)).fetchone()[0]

    def thread_rows(self) -> int:
        """Rows in `msg_threads`, every sender's."""
        return self.conn.execute("SELECT COUNT(*) FROM msg_threads").fetchone()[0]

    def _conflict(self, letter: Letter, row: sqlite3.Row | None,
                  taken: dict[tuple[str, str, int], Letter]) -> PsymeshError | None:
        """Why `letter` may not be stored because another letter has its id (`row`, the one
        stored under it) or its place, if so."""
        earlier = taken.get((letter.sender, letter.thread, letter.tseq))
        if earlier is not None:
            return None if earlier == letter else _conflict(letter, f"letter {earlier.id} has its place")
        if row is not None:
            # the same letter is the same signed bytes, however its numbers were written
            if Letter.model_validate_json(row["letter"]).signing_bytes() != letter.signing_bytes():
                return _conflict(letter, "another letter was stored under this id")
            return None
        row = self.conn.execute("SELECT id FROM msg_inbox WHERE sender = ? AND thread = ? AND tseq = ?",
                                (letter.sender, letter.thread, letter.tseq)).fetchone()
        if row is not None:
            return _conflict(letter, f"letter {row['id']} has its place")
        return None

    def _by_id(self, sender: str, letter_id: str) -> sqlite3.Row | None:
        return self.conn.execute("SELECT letter FROM msg_inbox WHERE sender = ? AND id = ?",
                                 (sender, letter_id)).fetchone()

    def _released_upto(self, sender: str, thread: str) -> int:
        """Its row's, else the highest tseq released here (a thread's letters are released, and
        pruned, in tseq order; a revoke drops rows, and databases from before rows had none)."""
        return self.conn.execute(
            "SELECT COALESCE((SELECT released_upto FROM msg_threads WHERE sender = ? AND thread = ?),"
            " (SELECT MAX(tseq) FROM msg_inbox WHERE sender = ? AND thread = ? AND release_seq IS NOT NULL), 0)",
            (sender, thread, sender, thread)).fetchone()[0]

    def _new_thread(self, sender: str, thread: str) -> bool:
        """Whether the inbox keeps no place for this thread yet (no row, no letter)."""
        return self.conn.execute(
            "SELECT NOT EXISTS (SELECT 1 FROM msg_threads WHERE sender = ? AND thread = ?) AND"
            " NOT EXISTS (SELECT 1 FROM msg_inbox WHERE sender = ? AND thread = ?)",
            (sender, thread, sender, thread)).fetchone()[0] == 1

    def _last_released(self) -> int:
        return self.conn.execute("SELECT COALESCE(MAX(release_seq), 0) FROM msg_inbox").fetchone()[0]

    def _release(self, sender: str, thread: str, upto: int, *, give_up_to: int = 0) -> None:
        """Release the held letters of a thread that continue `upto` without a gap, after
        giving up every place up to `give_up_to` (letters held there go, with their gaps)."""
        held = [r[0] for r in self.conn.execute(
            "SELECT tseq FROM msg_inbox WHERE sender = ? AND thread = ? AND release_seq IS NULL ORDER BY tseq",
            (sender, thread))]
        forced = [tseq for tseq in held if tseq <= give_up_to]
        go = forced + releasable([t for t in held if t > give_up_to], max(upto, give_up_to) if forced else upto)
        if not go:
            return
        base = self._last_released()
        rows, previous = [], upto
        for i, tseq in enumerate(go, start=1):
            rows.append((base + i, tseq - previous - 1, sender, thread, tseq))
            previous = tseq
        self.conn.executemany("UPDATE msg_inbox SET release_seq = ?, skipped = ? WHERE sender = ? AND thread = ?"
                              " AND tseq = ?", rows)
        self.conn.execute("INSERT INTO msg_threads (sender, thread, released_upto) VALUES (?, ?, ?)"
                          " ON CONFLICT(sender, thread) DO UPDATE SET released_upto = excluded.released_upto",
                          (sender, thread, go[-1]))

    def _expire(self, now: float) -> None:
        cutoff = now - self.settings.held_s
        for row in self.conn.execute(
                "SELECT sender, thread, MAX(tseq) AS upto FROM msg_inbox WHERE release_seq IS NULL AND"
                " received_at <= ? GROUP BY sender, thread", (cutoff,)).fetchall():
            self._release(row["sender"], row["thread"], self._released_upto(row["sender"], row["thread"]),
                          give_up_to=row["upto"])

    def _held_share_full(self, letter: Letter) -> bool:
        """Whether `letter`, which would wait behind a gap, finds its sender's share full (so it
        is refused before a page is written; `_over_held_share` settles the exact count)."""
        count, size = self.share(letter.sender, held=True)
        return count >= self.settings.held_letters or size >= self.settings.held_bytes

    def _held_share_refusal(self) -> PsymeshError:
        s = self.settings
        return PsymeshError(
            f"this node holds {s.held_letters} letters or {s.held_bytes} bytes of yours behind a gap, the "
            "most it holds for one sender ([inbox] held_letters, held_bytes); send the missing letters first",
            code=ErrorCode.BUSY, retry_after=RETRY_HELD_S)

    def _over_held_share(self, sender: str, fresh: list[Letter]) -> dict[str, PsymeshError]:
        """Refuse (and un-store) this batch's letters of `sender` that are still held, newest
        place first, until its held letters fit its share again."""
        s = self.settings
        count, size = self.share(sender, held=True)
        refused: dict[str, PsymeshError] = {}
        for letter in sorted(fresh, key=lambda held: (held.tseq, held.thread), reverse=True):
            if count <= s.held_letters and size <= s.held_bytes:
                break
            row = self.conn.execute("SELECT size FROM msg_inbox WHERE sender = ? AND id = ? AND release_seq IS NULL",
                                    (sender, letter.id)).fetchone()
            if row is None:
                continue  # released: it filled a gap
            self.conn.execute("DELETE FROM msg_inbox WHERE sender = ? AND id = ?", (sender, letter.id))
            count, size = count - 1, size - row[0]
            refused[letter.id] = self._held_share_refusal()
        self._drop_spent_rows(sender, {letter.thread for letter in fresh if letter.id in refused})
        return refused

    def _over_thread_share(self, sender: str, opened: list[str], fresh: list[Letter]) -> dict[str, PsymeshError]:
        """Refuse (and un-store) the threads this batch `opened` for `sender`, the last opened
        first, until its threads fit its share again. (All their letters are this batch's.)"""
        if not opened:
            return {}
        live, limit = self.threads(sender), self.settings.threads
        refused: dict[str, PsymeshError] = {}
        for thread in reversed(opened):
            if live <= limit:
                break
            self.conn.execute("DELETE FROM msg_inbox WHERE sender = ? AND thread = ?", (sender, thread))
            self.conn.execute("DELETE FROM msg_threads WHERE sender = ? AND thread = ?", (sender, thread))
            live -= 1
            refused.update((letter.id, PsymeshError(
                f"this node keeps the places of {limit} threads of yours, the most it keeps for one sender "
                f"([inbox] threads): write in a thread you have open; a thread is forgotten when its last "
                f"letter here is pruned ([inbox] kept_letters)", code=ErrorCode.BUSY, retry_after=RETRY_HELD_S))
                for letter in fresh if letter.sender == sender and letter.thread == thread)
        return refused

    def _drop_spent_rows(self, sender: str, threads: set[str]) -> None:
        """The rows of these threads of `sender`'s that have no letter here any more go."""
        self.conn.executemany("DELETE FROM msg_threads WHERE sender = ? AND thread = ? AND NOT EXISTS"
                              " (SELECT 1 FROM msg_inbox WHERE sender = ? AND thread = ?)",
                              [(sender, thread, sender, thread) for thread in threads])

    def _prune_released(self, sender: str) -> None:
        """Past the sender's share of released letters, its oldest go (a mail spool's rule), and
        the rows of threads left with no letter go with them."""
        s = self.settings
        count, size = self.share(sender, held=False)
        if count <= s.kept_letters and size <= s.kept_bytes:
            return
        drop, threads, newest, left_count, left_size = [], set(), 0, count, size
        for row in self.conn.execute("SELECT release_seq, size, thread, json_extract(letter, '$.at') FROM msg_inbox"
                                     " WHERE sender = ? AND release_seq IS NOT NULL ORDER BY release_seq", (sender,)):
            if left_count <= s.kept_letters and left_size <= s.kept_bytes:
                break
            drop.append((row[0],))
            threads.add(row[2])
            newest = max(newest, row[3])
            left_count, left_size = left_count - 1, left_size - row[1]
        self.conn.executemany("DELETE FROM msg_inbox WHERE release_seq = ?", drop)
        self._drop_spent_rows(sender, threads)
        self.conn.execute("INSERT INTO msg_forgotten (sender, at_upto) VALUES (?, ?) ON CONFLICT(sender)"
                          " DO UPDATE SET at_upto = MAX(at_upto, excluded.at_upto)", (sender, newest))

    def stale(self, letter: Letter) -> bool:
        """Whether `letter` (a copy our mailbox kept) opens a thread the inbox keeps no place for
        and was written no later than a letter of its sender's pruned here: then it was
        delivered directly before, its thread forgotten since (or, never delivered, its sender,
        which holds it until our receipt, sends it directly)."""
        row = self.conn.execute("SELECT at_upto FROM msg_forgotten WHERE sender = ?", (letter.sender,)).fetchone()
        return row is not None and letter.at <= row[0] and self._new_thread(letter.sender, letter.thread)

    def released_after(self, cursor: int, limit: int = 500) -> list[Received]:
        """Released letters numbered above `cursor`, in release order (withdrawn stubs included:
        the reader skips them, but they advance its cursor)."""
        rows = self.conn.execute(
            "SELECT letter, received_at, release_seq, skipped FROM msg_inbox WHERE release_seq > ? ORDER BY"
            " release_seq LIMIT ?", (cursor, limit)).fetchall()
        return [Received(Letter.model_validate_json(r["letter"]), r["received_at"], r["release_seq"], r["skipped"])
                for r in rows]

    def last_released(self) -> int:
        """The highest `release_seq` so far (0 for an empty inbox): a reader that starts here
        sees only letters released from now on."""
        return self._last_released()

    def held(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM msg_inbox WHERE release_seq IS NULL").fetchone()[0]

    def _thread(self, sender: str, thread: str) -> tuple[int, list[int]]:
        """(the last tseq released, the tseqs held) of one (sender, thread)."""
        released_upto = self._released_upto(sender, thread)
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


def _conflict(letter: Letter, why: str) -> PsymeshError:
    return PsymeshError(f"letter {letter.id} (place {letter.tseq} of thread {letter.thread!r}) conflicts with one "
                        f"stored here: {why}", code=ErrorCode.CONFLICT)


def _sent(row: sqlite3.Row) -> Sent:
    return Sent(Letter.model_validate_json(row["letter"]), OutState(row["state"]), row["code"], row["reason"],
                bool(row["stub_sent"]))
