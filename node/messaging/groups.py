"""Groups: a named list of paired peers, kept by the node that made it, and a message to
all of them at once.

A group is the sender's own address list, not a membership protocol: members are not
told they were added, hold no copy of the list, and cannot send "to the group" unless
they make one themselves. A message to a group is one letter per member, through
`Messaging.send` (one courier per member, each on its direct session), in the thread
`group:<name>`, each carrying the group's name. So what the letters guarantee holds for
each member: stored durably before the receipt, exactly once, in order within the
thread. (Fan-out over direct sessions rather than libp2p gossipsub, which drops
bursts: a member gets every letter or the sender's outbox says which are pending.)
"""
from __future__ import annotations

import sqlite3
import time

from ..core.commands import Commands
from ..core.db import ensure_schema, transaction
from .service import Messaging
from ..door.trust import Peer, TrustStore
from ...protocol.control import GroupMember, GroupView
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.messaging import Letter
from ...protocol.tasks import JsonMap

SCHEMA = """
CREATE TABLE IF NOT EXISTS msg_group (
    name        TEXT PRIMARY KEY,
    created_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS msg_group_member (
    group_name  TEXT NOT NULL REFERENCES msg_group(name) ON DELETE CASCADE,
    peer_id     TEXT NOT NULL,
    added_at    REAL NOT NULL,
    PRIMARY KEY (group_name, peer_id)
);
"""


def group_thread(name: str) -> str:
    """The thread a group's letters go in (one per group, so their order is the group's)."""
    return f"group:{name}"


class Groups:
    def __init__(self, conn: sqlite3.Connection, trust: TrustStore, messaging: Messaging, *,
                 commands: Commands | None = None) -> None:
        self.conn = conn
        self.commands = commands or Commands()  # how its refusals spell the command to run next
        self.trust = trust
        self.messaging = messaging
        ensure_schema(conn, SCHEMA)


    def _no_group(self, name: str) -> PsymeshError:
        return PsymeshError(f"no group named {name!r}; see: {self.commands('group list')}", code=ErrorCode.NOT_FOUND)

    def _exists(self, name: str) -> bool:
        return self.conn.execute("SELECT 1 FROM msg_group WHERE name = ?", (name,)).fetchone() is not None

    def _peers(self, members: list[str]) -> list[Peer]:
        """Each of `members` (names or ids) as a paired peer: UNKNOWN_PEER names the first that is not."""
        peers = [self.trust.resolve(m) for m in members]
        for peer in peers:
            if peer.revoked:
                raise PsymeshError(f"{peer.name} was revoked; pair again first", code=ErrorCode.UNKNOWN_PEER)
        return peers

    def create(self, name: str, members: list[str], now: float | None = None) -> GroupView:
        now = time.time() if now is None else now
        peers = self._peers(members)
        with transaction(self.conn):
            if self._exists(name):
                raise PsymeshError(f"a group named {name!r} exists already; add members with: "
                                   f"{self.commands('group add', f'{name} PEER')}",
                                   code=ErrorCode.CONFLICT)
            self.conn.execute("INSERT INTO msg_group (name, created_at) VALUES (?, ?)", (name, now))
            self._insert(name, peers, now)
        return self.get(name)

    def add(self, name: str, members: list[str], now: float | None = None) -> GroupView:
        peers = self._peers(members)
        with transaction(self.conn):
            self._require(name)
            self._insert(name, peers, time.time() if now is None else now)
        return self.get(name)

    def remove(self, name: str, members: list[str]) -> GroupView:
        self._require(name)
        view = self.get(name)
        ids = set()
        for member in members:  # a member may have been unpaired since: match the list too
            found = [m.peer_id for m in view.members if member in (m.peer_id, m.name)]
            if not found:
                raise PsymeshError(f"{member!r} is not in group {name!r}", code=ErrorCode.NOT_FOUND)
            ids.update(found)
        self.conn.executemany("DELETE FROM msg_group_member WHERE group_name = ? AND peer_id = ?",
                              [(name, peer_id) for peer_id in ids])
        return self.get(name)

    def _insert(self, name: str, peers: list[Peer], now: float) -> None:
        self.conn.executemany("INSERT OR IGNORE INTO msg_group_member (group_name, peer_id, added_at)"
                              " VALUES (?, ?, ?)", [(name, p.peer_id, now) for p in peers])

    def _require(self, name: str) -> None:
        if not self._exists(name):
            raise self._no_group(name)

    def get(self, name: str) -> GroupView:
        row = self.conn.execute("SELECT created_at FROM msg_group WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise self._no_group(name)
        members = []
        for (peer_id,) in self.conn.execute("SELECT peer_id FROM msg_group_member WHERE group_name = ?"
                                            " ORDER BY added_at, rowid", (name,)):
            peer = self.trust.get(peer_id)
            members.append(GroupMember(peer_id=peer_id, name=peer.name if peer else peer_id))
        return GroupView(name=name, members=members, created_at=row[0])

    def list(self) -> list[GroupView]:
        names = [r[0] for r in self.conn.execute("SELECT name FROM msg_group ORDER BY name")]
        return [self.get(n) for n in names]

    def send(self, name: str, text: str = "", *, body: JsonMap | None = None) -> list[Letter]:
        """One letter per member (durable here when this returns; the couriers deliver).
        Every member is checked first, so a member that cannot be written to (unpaired,
        or it revoked us) stops the whole send before any letter is written."""
        view = self.get(name)
        if not view.members:
            raise PsymeshError(f"group {name!r} has no members; add some with: {self.commands('group add', f'{name} PEER')}",
                               code=ErrorCode.BAD_REQUEST)
        for member in view.members:
            peer = self.trust.get(member.peer_id)
            if peer is None or peer.revoked:
                raise PsymeshError(f"{member.name} is no longer paired; remove it: "
                                   f"{self.commands('group remove', f'{name} {member.peer_id}')}",
                                   code=ErrorCode.UNKNOWN_PEER)
            peer.refuse_if_revoked_us()
        return [self.messaging.send(m.peer_id, text, body=body, thread=group_thread(name), group=name)
                for m in view.members]
