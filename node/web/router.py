"""The asking side of private web queries: where this node's web queries go, and how.

    hops = 1   the query goes to the exit on our session with it, over Noise. The exit
               learns who asked and what; nobody else learns either.
    hops = 2   the query is sealed to the exit's HPKE key (protocol/oblivious.py) and handed
               to a relay peer, which passes it on. The relay learns who asked, not what;
               the exit learns what, not who. Neither alone links the two (RFC 9458's model:
               it holds unless relay and exit collude).

The exit is `--via` (or `[web] via`), else the one paired peer whose grant to us covers the
query. The relay is `--relay` (or `[web] relay`), else the one paired peer other than the
exit whose grant to us has `web.relay`. Choosing is explicit when more than one fits: a
query is not sent somewhere the owner did not expect.

Exit keys come to us with the exit's grants (`web.key`); we keep the newest in date per exit,
to know which peers are exits. With two hops we seal only to the relay's view of the exit's key
(`web.key_of`), the one it shows every asker; an exit that handed us another key under the same
`key_id` is trying to tell its askers apart, and we refuse to seal to it at all.
"""
from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pydantic import BaseModel, ConfigDict, model_validator

from ..core.db import ensure_schema, transaction
from ..net.session import Call, SessionPool
from ..door.trust import Peer, TrustStore
from ..core.websettings import WebSettings
from ...protocol.common import Error
from ...protocol.errors import ErrorCode, PsymeshError, RemoteError
from ...protocol.manifest import Manifest, Operation, check
from ...protocol.messages import Message, pack, unpack
from ...protocol.oblivious import ExitKey, consistent_key, seal_request, verify_exit_key
from ...protocol.web import (
    WebAnswer,
    WebFetch,
    WebKeyOf,
    WebKeyOk,
    WebKeyPush,
    WebKeyView,
    WebPage,
    WebRelay,
    WebRequest,
    WebResults,
    WebSealedReply,
    WebSearch,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS web_keys (
    exit  TEXT PRIMARY KEY,
    key   BLOB NOT NULL               -- the web.key message that brought it, msgpack
);
"""


class Route(BaseModel):
    """Where a query goes. With two hops it carries the exit key checked (the exit's own,
    signed, in date) when the route was chosen, so the query seals to exactly that key
    instead of loading and verifying it a second time (an Ed25519 verification each)."""

    model_config = ConfigDict(frozen=True)

    exit: str
    relay: str | None = None
    key: ExitKey | None = None

    @model_validator(mode="after")
    def _key_with_relay(self) -> "Route":
        if (self.relay is None) != (self.key is None):
            raise ValueError("a route through a relay carries the exit's key, and only such a route does")
        return self

    @property
    def hops(self) -> int:
        return 1 if self.relay is None else 2


class WebKeys:
    """Exit keys handed to us by their exits, kept across restarts. `receive` is the table's
    only writer, so each exit's key is read from it once and kept (every two-hop query
    looks its exit's key up)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        ensure_schema(conn, SCHEMA)
        self._known: dict[str, ExitKey | None] = {}  # one entry per exit asked about: paired peers

    async def receive(self, call: Call) -> Message:
        """An exit hands us its key (the door checked it is the sender's own, signed)."""
        assert isinstance(call.request, WebKeyPush)
        with transaction(self.conn):
            self.conn.execute("INSERT INTO web_keys (exit, key) VALUES (?, ?) ON CONFLICT(exit) DO UPDATE"
                              " SET key = excluded.key", (call.peer_id, pack(call.request)))
        self._known[call.peer_id] = call.request.key
        return WebKeyOk()

    def get(self, exit_peer: str) -> ExitKey | None:
        if exit_peer in self._known:
            return self._known[exit_peer]
        row = self.conn.execute("SELECT key FROM web_keys WHERE exit = ?", (exit_peer,)).fetchone()
        push = None if row is None else unpack(row[0])
        key = push.key if isinstance(push, WebKeyPush) else None
        self._known[exit_peer] = key
        return key


class WebRouter:
    """Sends this node's web queries to an exit, directly or through a relay."""

    def __init__(self, settings: WebSettings, local_peer_id: str, trust: TrustStore, sessions: SessionPool,
                 keys: WebKeys, *, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.local_peer_id = local_peer_id
        self.trust = trust
        self.sessions = sessions
        self.keys = keys
        self.clock = clock
        # peer id -> the received grant whose signature we verified: the trust store hands back
        # the same frozen Manifest while the row's blob is unchanged, as the door relies on
        self._verified: dict[str, Manifest] = {}
        # exit peer id -> the exit key whose signature we verified last (ours, or the relay's
        # view of it, which is equal unless the exit moved to a new key): equal keys have equal
        # signing bytes and signature, so an Ed25519 verification each is once per key, not
        # twice per two-hop query; who it names, its suite and its expiry are checked every time
        self._verified_keys: dict[str, ExitKey] = {}

    def route(self, request: WebRequest, *, via: str | None = None, relay: str | None = None,
              hops: int | None = None) -> Route:
        """Which exit (and relay) `request` would go through; NOT_FOUND/FORBIDDEN/CONFLICT saying why not.

        One hop: the exit's grant to us must cover the query. Two hops: the exit admits the
        query by the relay's grant (it cannot know ours), so what we need from the exit is its
        key, and from the relay its `web.relay`."""
        hops = hops or (2 if (relay or self.settings.relay) else self.settings.hops)
        now = self.clock()
        if hops == 1:
            op = request.operation()
            exit_peer = self._pick(via or self.settings.via, "exit", lambda p: self._grants(p, op, now),
                                   f"has not granted this node {op.required()}")
            return Route(exit=exit_peer.peer_id)
        keys: dict[str, ExitKey] = {}

        def has_key(peer: Peer) -> bool:
            key = self._key_of(peer.peer_id, now)
            if key is not None:
                keys[peer.peer_id] = key
            return key is not None

        exit_peer = self._pick(via or self.settings.via, "exit", has_key,
                               "has handed this node no exit key in date (it is not a web exit, or has not"
                               " told us yet)")
        relay_op = Operation(name="web.relay")
        relay_peer = self._pick(relay or self.settings.relay, "relay", lambda p: self._grants(p, relay_op, now),
                                "has not granted this node web.relay", exclude=exit_peer.peer_id)
        return Route(exit=exit_peer.peer_id, relay=relay_peer.peer_id, key=keys[exit_peer.peer_id])

    def _grants(self, peer: Peer, op: Operation, now: float) -> bool:
        """Whether `peer`'s grant to us covers `op`, signed and in date; its signature checked
        once per stored grant (an Ed25519 verification each query before), the rest every time."""
        grant = peer.received
        if grant is None:
            return False
        known = self._verified.get(peer.peer_id) is grant
        allowed = check(grant, op, local_peer_id=peer.peer_id, remote_peer_id=self.local_peer_id, now=now,
                        signature_verified=known).allowed
        if allowed and not known:
            self._verified[peer.peer_id] = grant  # one entry per paired peer: replaced, never grows past them
        return allowed

    def _key_of(self, exit_peer: str, now: float) -> ExitKey | None:
        key = self.keys.get(exit_peer)
        if key is None:
            return None
        try:
            verify_exit_key(key, exit=exit_peer, now=now, signature_verified=self._key_verified(exit_peer, key))
        except PsymeshError:
            return None
        self._verified_keys[exit_peer] = key
        return key

    def _key_verified(self, exit_peer: str, key: ExitKey) -> bool:
        """Whether `key` equals the key of `exit_peer` whose signature was verified last."""
        return self._verified_keys.get(exit_peer) == key

    def _pick(self, named: str | None, role: str, fits: Callable[[Peer], bool], lacks: str, *,
              exclude: str | None = None) -> Peer:
        option = "--via" if role == "exit" else "--relay"
        if named is not None:
            peer = self.trust.resolve(named)
            if peer.revoked:
                raise PsymeshError(f"{peer.name} was revoked; pick another {role}", code=ErrorCode.UNKNOWN_PEER)
            if peer.peer_id == exclude:
                raise PsymeshError(f"the relay and the exit must be two different peers ({peer.name} is both)",
                                   code=ErrorCode.BAD_REQUEST)
            if not fits(peer):
                raise PsymeshError(f"{peer.name} {lacks}", code=ErrorCode.FORBIDDEN)
            return peer
        fitting = [p for p in self.trust.list(include_revoked=False) if p.peer_id != exclude and fits(p)]
        if not fitting:
            raise PsymeshError(f"no paired peer can be the {role} of this query (each {lacks}); pair with one,"
                               f" or name one with {option}", code=ErrorCode.NOT_FOUND)
        if len(fitting) > 1:
            names = ", ".join(sorted(p.name for p in fitting))
            raise PsymeshError(f"{len(fitting)} peers could be the {role} ({names}); name one with {option}"
                               f" or in [web] {option[2:]}", code=ErrorCode.CONFLICT)
        return fitting[0]

    async def query(self, request: WebRequest, route: Route) -> WebAnswer:
        """Run `request` through `route`; the exit's answer, or its refusal as RemoteError."""
        timeout = self.settings.timeout_s
        if route.relay is None:
            reply = WebResults if isinstance(request, WebSearch) else WebPage
            return await self.sessions.request(route.exit, request, reply, timeout=timeout)
        assert route.key is not None  # a route through a relay carries the key (Route's validator)
        view = await self.sessions.request(route.relay, WebKeyOf(exit=route.exit), WebKeyView, timeout=timeout)
        key = consistent_key(route.key, view.key, exit=route.exit, now=self.clock(),
                             signature_verified=self._key_verified(route.exit, view.key))
        self._verified_keys[route.exit] = key
        # whole seconds: the exit needs the time only to within its window, and the milliseconds
        # of a phone's clock offset would tell its requests apart
        sealed, pending = seal_request(key, pack(request), now=float(int(self.clock())))
        relayed = await self.sessions.request(route.relay, WebRelay(exit=route.exit, sealed=sealed), WebSealedReply,
                                              timeout=timeout)
        answer = unpack(pending.open(relayed.sealed))
        if isinstance(answer, Error):
            raise RemoteError(answer.message, code=answer.code, retry_after=answer.retry_after,
                              details=answer.details)
        expected = WebResults if isinstance(request, WebSearch) else WebPage
        if not isinstance(answer, expected):
            raise PsymeshError(f"the exit answered {answer.type!r} to {request.type!r}", code=ErrorCode.BAD_FRAME)
        return answer


__all__ = ["Route", "WebFetch", "WebKeys", "WebRouter", "WebSearch", "WebSettings"]
