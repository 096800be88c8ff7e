"""The trust store: who this node is paired with, what each may ask of us, what we may ask of them.

Backed by SQLite (the node's WAL database), so the CLI can read it while the daemon
runs and a daemon picks up a new pairing without restart. Rows are never deleted
on revocation: a revoked peer keeps its history (and its audit trail).

Revocation has two directions: `revoked_at` says we revoked the peer (it may ask
nothing of us), `revoked_us_at` that the peer revoked us (we may ask nothing of it;
we learned it from its signed notice or its refusal). Only pairing again clears either.
"""
from __future__ import annotations

import functools
import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from ..core.commands import Commands
from ..core.db import ensure_schema, transaction
from ...protocol.control import PeerAway, PeerView
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.identity import peer_fingerprint
from ...protocol.limits import Limits
from ...protocol.manifest import Manifest

SCHEMA = """
CREATE TABLE IF NOT EXISTS peers (
    peer_id    TEXT PRIMARY KEY,
    name       TEXT NOT NULL,
    role       TEXT NOT NULL,
    addrs      TEXT NOT NULL DEFAULT '[]',   -- JSON list of multiaddrs
    paired_at  REAL NOT NULL,
    revoked_at REAL,                          -- we revoked them
    granted    BLOB,                          -- msgpack Manifest we issued: what they may ask of us
    received   BLOB,                          -- msgpack Manifest they issued: what we may ask of them
    revoked_us_at REAL,                       -- they revoked us (their grant is void, `received` cleared)
    revocation_told_at REAL                   -- we revoked them and they took our signed notice
);
CREATE INDEX IF NOT EXISTS peers_name ON peers(name);
"""


def _add_column(conn: sqlite3.Connection, table: str, column_ddl: str) -> None:
    """ALTER TABLE ADD COLUMN unless the column exists (SQLite has no IF NOT EXISTS for columns);
    a daemon and a CLI opening the same old database at once may race to add it."""
    name = column_ddl.split()[0]
    if any(row["name"] == name for row in conn.execute(f"PRAGMA table_info({table})")):
        return
    try:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column_ddl}")
    except sqlite3.OperationalError as exc:
        if "duplicate column" not in str(exc):
            raise


def _encode_manifest(m: Manifest | None) -> bytes | None:
    return None if m is None else msgpack.packb(m.model_dump(mode="python"), use_bin_type=True)




@functools.lru_cache(maxsize=256)
def _decode_manifest(blob: bytes | None) -> Manifest | None:
    """Manifests are read often (the door: after each change of the store) and change rarely:
    decode (and validate) each stored blob once. Safe to share: a Manifest is frozen."""
    return None if blob is None else Manifest.model_validate(msgpack.unpackb(blob, raw=False))


@dataclass(frozen=True)
class Peer:
    """One row of the peers table. Immutable all through (a tuple of addresses, frozen
    Manifests): the store hands the same object to every reader until it changes, so a reader
    that could change it would change what every other reader, the door included, sees."""

    peer_id: str
    name: str
    role: str
    addrs: tuple[str, ...]
    paired_at: float
    revoked_at: float | None
    granted: Manifest | None
    received: Manifest | None
    revoked_us_at: float | None
    revocation_told_at: float | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def shut_out(self) -> bool:
        """Revoked, and it took the notice: refused already at the connection from now on.
        (Until it knows, it may still connect, to hear `unknown_peer` or the notice.)"""
        return self.revoked_at is not None and self.revocation_told_at is not None

    def refuse_if_revoked_us(self) -> None:
        """FORBIDDEN, saying why, if this peer revoked our pairing: asking it would only be refused."""
        if self.revoked_us_at is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.revoked_us_at))
            raise PsymeshError(f"{self.name} revoked this node's access at {when}; pair again to use it",
                               code=ErrorCode.FORBIDDEN)

    def view(self, *, connected: bool = False, away: PeerAway | None = None) -> PeerView:
        """This peer as the control API shows it to the owner (`connected`: the p2p host knows;
        `away`: the sessions' last failed try to reach it).
        A revoked peer may ask nothing: its view grants nothing, whatever its last grant said (the
        row keeps that grant, for the revocation notice that voids it)."""
        granted = None if self.revoked else self.granted
        return PeerView(
            peer_id=self.peer_id,
            name=self.name,
            role=self.role,
            addrs=list(self.addrs),
            paired_at=self.paired_at,
            revoked_at=self.revoked_at,
            granted=granted.grants() if granted else [],
            granted_expires=granted.expires if granted else None,
            granted_limits=granted.limits if granted else Limits(),
            received=self.received.grants() if self.received else [],
            received_expires=self.received.expires if self.received else None,
            revoked_us_at=self.revoked_us_at,
            connected=connected,
            away=away,
        )


class TrustStore:
    def __init__(self, conn: sqlite3.Connection, *, commands: Commands | None = None) -> None:
        self.conn = conn
        self.commands = commands or Commands()  # how its refusals spell the command to run next
        self._listeners: list[Callable[[], None]] = []
        # Bumped after every write of this store has committed: a row read while it had a
        # value is current until it changes (the door keeps each peer's row on it). Every
        # write of the peers table goes through this store (the CLI asks the daemon's).
        self.version = 0
        # Rows read at a version, kept until it changes (paired peers only: one entry per row, and
        # per name that resolved): the door reads its peer's row on every request, the submitter
        # its target's on every task. A revocation or a new grant is seen on the very next read.
        self._rows: dict[str, tuple[int, Peer]] = {}
        self._named: dict[str, tuple[int, Peer]] = {}
        ensure_schema(conn, SCHEMA)
        _add_column(conn, "peers", "revoked_us_at REAL")  # databases made before they existed
        _add_column(conn, "peers", "revocation_told_at REAL")
        _add_column(conn, "peers", "addrs_seq INTEGER")  # seq of the peer's own record the addrs came from

    @staticmethod
    def _peer(row: sqlite3.Row) -> Peer:
        return Peer(row["peer_id"], row["name"], row["role"], tuple(json.loads(row["addrs"])), row["paired_at"],
                    row["revoked_at"], _decode_manifest(row["granted"]), _decode_manifest(row["received"]),
                    row["revoked_us_at"], row["revocation_told_at"])

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever a peer is paired, granted, revoked, or revokes us (what a
        service that waits on the set of peers needs, instead of a rescan timer)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def get(self, peer_id: str) -> Peer | None:
        version = self.version  # before the read (no write can land during it: one thread writes)
        cached = self._rows.get(peer_id)
        if cached is not None and cached[0] == version:
            return cached[1]
        row = self.conn.execute("SELECT * FROM peers WHERE peer_id = ?", (peer_id,)).fetchone()
        if row is None:
            self._rows.pop(peer_id, None)
            return None
        peer = self._peer(row)
        self._rows[peer_id] = (version, peer)
        return peer

    def names(self) -> dict[str, str]:
        """Every paired peer's name by peer id, revoked ones too: what output shows for an id."""
        return {row["peer_id"]: row["name"] for row in self.conn.execute("SELECT peer_id, name FROM peers")}

    def name_of(self, peer_id: str) -> str:
        """A peer as a table shows it: its name when paired (revoked too), else its whole id."""
        peer = self.get(peer_id)
        return peer_id if peer is None else peer.name

    def label(self, peer_id: str, *, fingerprint: bool = False) -> str:
        """A peer as log lines name it: `home (…gX2u9mU)` when paired (revoked too), else its
        whole id (a stranger has no other name). `fingerprint`: `home (MFZW-IZLT-OQQG-S3TL)`, the
        fingerprint `psymesh id` prints on that device, for a message that sends its reader
        to check the peer itself (a relay's refusal)."""
        peer = self.get(peer_id)
        if peer is None:
            return peer_id
        return f"{peer.name} ({peer_fingerprint(peer_id) if fingerprint else '…' + peer_id[-8:]})"

    def resolve(self, name_or_id: str) -> Peer:
        """A paired peer by peer id or name (names are for people; ambiguity is an error)."""
        version = self.version
        named = self._named.get(name_or_id)
        if named is not None and named[0] == version:  # (then no peer had this id at this version either)
            return named[1]
        peer = self.get(name_or_id)
        if peer is not None:
            return peer
        rows = self.conn.execute("SELECT * FROM peers WHERE name = ? ORDER BY paired_at DESC", (name_or_id,)).fetchall()
        live = [r for r in rows if r["revoked_at"] is None] or rows
        if not live:
            raise PsymeshError(f"no paired peer named {name_or_id!r}; see: {self.commands('peers')}", code=ErrorCode.UNKNOWN_PEER)
        if len(live) > 1:
            raise PsymeshError(f"{len(live)} peers are named {name_or_id!r}; use a peer id", code=ErrorCode.CONFLICT)
        peer = self._peer(live[0])
        self._named[name_or_id] = (version, peer)
        return peer

    def list(self, *, include_revoked: bool = True) -> list[Peer]:
        sql = "SELECT * FROM peers" + ("" if include_revoked else " WHERE revoked_at IS NULL") + " ORDER BY paired_at"
        return [self._peer(r) for r in self.conn.execute(sql)]

    def add(self, peer_id: str, *, name: str, role: str, addrs: list[str], granted: Manifest | None,
            received: Manifest | None, now: float | None = None) -> Peer:
        """Store a newly paired peer (re-pairing replaces the old entry and clears both revocations).
        A name another paired peer holds is made unique (`phone-2`), so that every command
        naming a peer means one peer: see `unique_name`."""
        now = time.time() if now is None else now
        with transaction(self.conn):
            name = self.unique_name(name, peer_id)
            self.conn.execute(
                "INSERT INTO peers (peer_id, name, role, addrs, paired_at, revoked_at, granted, received) "
                "VALUES (?, ?, ?, ?, ?, NULL, ?, ?) ON CONFLICT(peer_id) DO UPDATE SET name=excluded.name, "
                "role=excluded.role, addrs=excluded.addrs, paired_at=excluded.paired_at, revoked_at=NULL, "
                "granted=excluded.granted, received=excluded.received, revoked_us_at=NULL, revocation_told_at=NULL, "
                "addrs_seq=NULL",
                (peer_id, name, role, json.dumps(addrs), now, _encode_manifest(granted), _encode_manifest(received)),
            )
        self.version += 1
        peer = self.get(peer_id)
        assert peer is not None
        self._changed()
        return peer

    def unique_name(self, name: str, peer_id: str) -> str:
        """`name`, or `name-2`, `name-3`, ... if another peer not revoked is called that."""
        taken = {r["name"] for r in self.conn.execute(
            "SELECT name FROM peers WHERE peer_id != ? AND revoked_at IS NULL", (peer_id,))}
        if name not in taken:
            return name
        n = 2
        while f"{name}-{n}" in taken:
            n += 1
        return f"{name}-{n}"

    def set_granted(self, peer_id: str, manifest: Manifest) -> None:
        self._update(peer_id, "granted", _encode_manifest(manifest))
        self._changed()  # a narrower grant acts at once on what is open (a worker's RPC stream)

    def set_received(self, peer_id: str, manifest: Manifest) -> None:
        """Keep a manifest a peer issued to us, unless we already hold a newer one (higher serial),
        or it revoked us: then only pairing again gives us a grant (a push that raced the
        revocation must not bring the old access back)."""
        current = self.get(peer_id)
        if current and (current.revoked_us_at is not None or
                        (current.received and current.received.serial >= manifest.serial)):
            return
        self._update(peer_id, "received", _encode_manifest(manifest))

    def set_addrs(self, peer_id: str, addrs: list[str]) -> None:
        self._update(peer_id, "addrs", json.dumps(addrs))

    def set_own_addrs(self, peer_id: str, addrs: list[str], seq: int) -> bool:
        """The addresses a paired peer told us itself (protocol/addresses.py), in place of
        those held, unless we hold some from a newer record of its own already (larger
        `seq`). True if stored."""
        with transaction(self.conn):
            cur = self.conn.execute("UPDATE peers SET addrs = ?, addrs_seq = ? WHERE peer_id = ? AND "
                                    "(addrs_seq IS NULL OR addrs_seq < ?)", (json.dumps(addrs), seq, peer_id, seq))
        self.version += 1
        return cur.rowcount == 1

    def revoke(self, peer_id: str, now: float | None = None) -> None:
        self._update(peer_id, "revoked_at", time.time() if now is None else now)
        self._changed()

    def revocation_told(self, peer_id: str, now: float | None = None) -> None:
        """The revoked peer acknowledged our signed notice."""
        self._update(peer_id, "revocation_told_at", time.time() if now is None else now)

    def revoked_us(self, peer_id: str, now: float | None = None) -> bool:
        """`peer_id` revoked our pairing: drop the grant it gave us (it is void) and remember when.
        True the first time; False if we knew already or it is not a peer of ours."""
        with transaction(self.conn):
            cur = self.conn.execute("UPDATE peers SET received = NULL, revoked_us_at = ? "
                                    "WHERE peer_id = ? AND revoked_us_at IS NULL",
                                    (time.time() if now is None else now, peer_id))
        self.version += 1
        if cur.rowcount == 1:
            self._changed()
        return cur.rowcount == 1

    def _update(self, peer_id: str, column: str, value: object) -> None:
        assert column in {"granted", "received", "addrs", "revoked_at", "revocation_told_at"}
        cur = self.conn.execute(f"UPDATE peers SET {column} = ? WHERE peer_id = ?", (value, peer_id))
        self.version += 1
        if cur.rowcount == 0:
            raise PsymeshError(f"{peer_id} is not a paired peer; see: {self.commands('peers')}", code=ErrorCode.UNKNOWN_PEER)
