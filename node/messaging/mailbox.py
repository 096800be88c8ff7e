"""The mailbox: sealed letters held for paired peers that named this node, while they are away.

    mail.key      a peer's signed mail key, kept by every node: a sender looks up the
                  recipient's key and mailbox in it, a mailbox checks that a recipient named it
    mail.deposit  the door admits it (`admit_deposit` is the mailbox's part of that check:
                  the recipient named us; the sender's share has room) -> held -> mail.receipt
    mail.fetch    the caller's own mail, oldest first, then each new deposit as it comes,
                  for `wait_s` (a phone keeps one open while it can reach us, as IMAP IDLE)
    mail.ack      the caller stored everything up to `upto`: those rows are deleted
    mail.leave_receipt / mail.take_receipts
                  an owner's signed receipts, held for the senders it could not reach
                  (at most MAX_RECEIPTS_HELD per owner, the oldest dropped first: a lost
                  receipt costs its sender a resend, not a letter), each handed over once
    housekeeping  mail older than `keep_s` is dropped

A held row is: recipient, sender, ref (a hash, not the letter id), size, the time it came,
and the sealed bytes. Nothing here can open them: only the recipient holds its mail key.
A deposit commits before its receipt leaves, so a sender that has the receipt can forget
the letter; a re-deposit of the same letter (same recipient, sender and ref) is held once.
"""
from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.abc
import msgpack

from ..core.db import ensure_schema, transaction
from ..core.notify import Notifier
from ..net.session import Call
from ..door.trust import TrustStore
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.mailbox import (
    MailAck,
    MailAcked,
    MailDeposit,
    MailFetch,
    MailItem,
    MailKey,
    MailKeyOk,
    MailKeyPush,
    MailLeaveReceipt,
    MailReceipt,
    MailReceiptLeft,
    MailReceiptsTaken,
    MailSettings,
    MailTakeReceipts,
    MAX_RECEIPTS,
)
from ...protocol.messaging import Receipt
from ...protocol.messages import Message
from ...protocol.session import SessionEnd

log = logging.getLogger("psymesh.mailbox")

SCHEMA = """
CREATE TABLE IF NOT EXISTS mail_keys (
    owner   TEXT PRIMARY KEY,
    serial  INTEGER NOT NULL,
    key     BLOB NOT NULL                -- the signed MailKey, msgpack (ours too: what we published)
);
CREATE TABLE IF NOT EXISTS mail_held (
    seq       INTEGER PRIMARY KEY AUTOINCREMENT,
    recipient TEXT NOT NULL,
    sender    TEXT NOT NULL,
    ref       BLOB NOT NULL,
    size      INTEGER NOT NULL,
    at        REAL NOT NULL,             -- when we took it (our clock: expiry is ours to judge)
    sealed    BLOB NOT NULL,
    UNIQUE (recipient, sender, ref)
);
CREATE INDEX IF NOT EXISTS mail_held_for ON mail_held(recipient, seq);
CREATE INDEX IF NOT EXISTS mail_held_sender ON mail_held(sender);
CREATE INDEX IF NOT EXISTS mail_held_at ON mail_held(at);
CREATE TABLE IF NOT EXISTS mail_receipts (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    recipient TEXT NOT NULL,             -- the owner that signed it (the letters' recipient)
    sender    TEXT NOT NULL,             -- whom it is for
    receipt   BLOB NOT NULL              -- the signed Receipt, JSON
);
CREATE INDEX IF NOT EXISTS mail_receipts_for ON mail_receipts(sender, recipient);
"""
MAX_RECEIPTS_HELD = 1024
BATCH = 64                 # items per write on a fetch
BUSY_RETRY_S = 60.0        # a full share frees when the recipient fetches: not soon


@dataclass(frozen=True)
class Held:
    seq: int
    recipient: str
    sender: str
    ref: bytes
    size: int
    at: float
    sealed: bytes


class MailStore:
    """Mail keys (every node's view of its peers', and its own) and held mail, in the node's db."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        ensure_schema(conn, SCHEMA)

    # -- mail keys -------------------------------------------------------------------------
    def key_of(self, owner: str) -> MailKey | None:
        row = self.conn.execute("SELECT key FROM mail_keys WHERE owner = ?", (owner,)).fetchone()
        return None if row is None else MailKey.model_validate(msgpack.unpackb(row[0], raw=False))

    def put_key(self, key: MailKey) -> int:
        """Keep `key` unless a newer one (larger serial) is held; the serial held after."""
        blob = msgpack.packb(key.model_dump(mode="python"), use_bin_type=True)
        with transaction(self.conn):
            self.conn.execute(
                "INSERT INTO mail_keys (owner, serial, key) VALUES (?, ?, ?) ON CONFLICT(owner) DO UPDATE SET"
                " serial = excluded.serial, key = excluded.key WHERE excluded.serial > mail_keys.serial",
                (key.owner, key.serial, blob))
            return self.conn.execute("SELECT serial FROM mail_keys WHERE owner = ?", (key.owner,)).fetchone()[0]

    # -- held mail -------------------------------------------------------------------------
    def holds(self, recipient: str, sender: str, ref: bytes) -> bool:
        return self.conn.execute("SELECT 1 FROM mail_held WHERE recipient = ? AND sender = ? AND ref = ?",
                                 (recipient, sender, ref)).fetchone() is not None

    def usage(self, sender: str) -> tuple[int, int]:
        """(items, bytes) held here from `sender`, for every recipient."""
        row = self.conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM mail_held WHERE sender = ?",
                                (sender,)).fetchone()
        return row[0], row[1]

    def hold(self, recipient: str, sender: str, ref: bytes, sealed: bytes, now: float) -> None:
        """Keep a sealed letter (a re-deposit of one held is ignored); committed on return."""
        self.conn.execute("INSERT OR IGNORE INTO mail_held (recipient, sender, ref, size, at, sealed)"
                          " VALUES (?, ?, ?, ?, ?, ?)", (recipient, sender, ref, len(sealed), now, sealed))

    def held_for(self, recipient: str, after: int, limit: int = BATCH) -> list[Held]:
        rows = self.conn.execute("SELECT * FROM mail_held WHERE recipient = ? AND seq > ? ORDER BY seq LIMIT ?",
                                 (recipient, after, limit)).fetchall()
        return [Held(r["seq"], r["recipient"], r["sender"], r["ref"], r["size"], r["at"], r["sealed"]) for r in rows]

    def release(self, recipient: str, upto: int) -> int:
        """The recipient stored its mail up to `upto`: forget it. Returns what is still held for it."""
        with transaction(self.conn):
            self.conn.execute("DELETE FROM mail_held WHERE recipient = ? AND seq <= ?", (recipient, upto))
            return self.conn.execute("SELECT COUNT(*) FROM mail_held WHERE recipient = ?", (recipient,)).fetchone()[0]

    def keep_receipt(self, receipt: Receipt) -> None:
        """Hold an owner's receipt for its sender (the owner's oldest beyond the cap dropped)."""
        with transaction(self.conn):
            self.conn.execute("INSERT INTO mail_receipts (recipient, sender, receipt) VALUES (?, ?, ?)",
                              (receipt.recipient, receipt.sender, receipt.model_dump_json()))
            self.conn.execute("DELETE FROM mail_receipts WHERE recipient = ? AND id NOT IN (SELECT id FROM"
                              " mail_receipts WHERE recipient = ? ORDER BY id DESC LIMIT ?)",
                              (receipt.recipient, receipt.recipient, MAX_RECEIPTS_HELD))

    def take_receipts(self, sender: str, recipient: str, limit: int = MAX_RECEIPTS) -> list[Receipt]:
        """`recipient`'s receipts for `sender`, oldest first, deleted as they are handed over."""
        with transaction(self.conn):
            rows = self.conn.execute("SELECT id, receipt FROM mail_receipts WHERE sender = ? AND recipient = ?"
                                     " ORDER BY id LIMIT ?", (sender, recipient, limit)).fetchall()
            self.conn.executemany("DELETE FROM mail_receipts WHERE id = ?", [(r[0],) for r in rows])
        return [Receipt.model_validate_json(r[1]) for r in rows]

    def purge(self, before: float) -> int:
        """Drop mail that came before `before`; how many letters were dropped."""
        return self.conn.execute("DELETE FROM mail_held WHERE at < ?", (before,)).rowcount


class Mailbox:
    """This node as a mailbox for its peers: the door's check on a deposit, the four
    services, and the housekeeping timer (start with `tg.start(mailbox.run)`)."""

    HOUSEKEEPING_S = 3600.0

    def __init__(self, local_peer_id: str, store: MailStore, trust: TrustStore, settings: MailSettings, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.local_peer_id = local_peer_id
        self.store = store
        self.trust = trust
        self.settings = settings
        self.clock = clock
        self.arrived = Notifier()   # recipient -> "mail came for it"

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self.housekeep(self.clock())
            await anyio.sleep(min(self.HOUSEKEEPING_S, self.settings.keep_s / 4))

    def housekeep(self, now: float) -> int:
        """Drop mail older than `keep_s` (its recipient did not come for it in time)."""
        dropped = self.store.purge(now - self.settings.keep_s)
        if dropped:
            log.info("dropped %d letter(s) held longer than %.0f s", dropped, self.settings.keep_s)
        return dropped

    # -- the door's check ------------------------------------------------------------------
    def admit_deposit(self, sender: str, deposit: MailDeposit) -> None:
        """Called by the gate, after the sender's `mail.deposit` capability: may this deposit
        be held? The recipient must be a peer of ours that named us its mailbox (FORBIDDEN);
        the letter must fit the sender's share at all (TOO_LARGE) and now (BUSY)."""
        key = self.store.key_of(deposit.recipient)
        peer = self.trust.get(deposit.recipient)
        if key is None or key.mailbox != self.local_peer_id or peer is None or peer.revoked:
            raise PsymeshError(f"{deposit.recipient} has not named this node its mailbox", code=ErrorCode.FORBIDDEN)
        if self.store.holds(deposit.recipient, sender, deposit.ref):
            return  # a re-deposit (its receipt was lost): already held, already counted
        items, size = self.store.usage(sender)
        limits = self.settings
        if len(deposit.sealed) > limits.max_bytes_per_sender:
            raise PsymeshError(f"a letter of {len(deposit.sealed)} bytes is over the {limits.max_bytes_per_sender}-byte"
                               " share a sender has here", code=ErrorCode.TOO_LARGE)
        if items >= limits.max_items_per_sender or size + len(deposit.sealed) > limits.max_bytes_per_sender:
            raise PsymeshError(f"this mailbox holds {items} letter(s), {size} bytes, from you: the most it takes;"
                               " retry later", code=ErrorCode.BUSY, retry_after=BUSY_RETRY_S)

    def admit_receipt(self, owner: str) -> None:
        """Called by the gate for `mail.leave_receipt`: only a peer that named us its mailbox
        leaves receipts here (FORBIDDEN)."""
        key = self.store.key_of(owner)
        if key is None or key.mailbox != self.local_peer_id:
            raise PsymeshError(f"{owner} has not named this node its mailbox", code=ErrorCode.FORBIDDEN)

    # -- services (each admitted by the door first) ------------------------------------------
    async def receive_key(self, call: Call) -> Message:
        """A peer's mail key (the door checked it is the peer's own, signed)."""
        assert isinstance(call.request, MailKeyPush)
        return MailKeyOk(serial=self.store.put_key(call.request.key))

    async def deposit(self, call: Call) -> Message:
        request = call.request
        assert isinstance(request, MailDeposit)
        self.hold(call.peer_id, request.recipient, request.ref, request.sealed)
        return MailReceipt(ref=request.ref)

    def hold(self, sender: str, recipient: str, ref: bytes, sealed: bytes) -> None:
        """Keep one sealed letter (committed on return) and wake the recipient's fetch, if open.
        Also how this node keeps its own letters for a peer that named it."""
        self.store.hold(recipient, sender, ref, sealed, self.clock())
        self.arrived.notify(recipient)

    async def fetch(self, call: Call) -> Message:
        """The caller's own mail, and nobody else's: the recipient is the peer the Noise session
        authenticated, never a field of the request."""
        request = call.request
        assert isinstance(request, MailFetch)
        cursor = request.after
        deadline = anyio.current_time() + request.wait_s
        while True:
            held = self.store.held_for(call.peer_id, cursor)
            if held:
                await call.send(*(MailItem(seq=h.seq, sender=h.sender, ref=h.ref, at=h.at, sealed=h.sealed)
                                  for h in held))
                cursor = held[-1].seq
                continue
            left = deadline - anyio.current_time()
            if left <= 0:
                return SessionEnd(reason="no more mail for now")
            with anyio.move_on_after(left):
                await self.arrived.wait(call.peer_id)

    async def leave_receipt(self, call: Call) -> Message:
        """An owner's receipt for a sender it could not reach (the door checked it is the owner's)."""
        assert isinstance(call.request, MailLeaveReceipt)
        self.store.keep_receipt(call.request.receipt)
        return MailReceiptLeft()

    async def take_receipts(self, call: Call) -> Message:
        """The caller's receipts from `recipient`: whose they are is the Noise session's peer."""
        assert isinstance(call.request, MailTakeReceipts)
        return MailReceiptsTaken(receipts=self.store.take_receipts(call.peer_id, call.request.recipient))

    async def ack(self, call: Call) -> Message:
        request = call.request
        assert isinstance(request, MailAck)
        return MailAcked(upto=request.upto, held=self.store.release(call.peer_id, request.upto))
