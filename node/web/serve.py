"""The serving side of private web queries: this node as an *exit* and as a *relay*.

    web.search / web.fetch   a paired peer's own query (one hop): the door admitted it by the
                             peer's grant; the exit runs it (node/web/exit.py) and answers
    web.sealed               a query sealed to our exit key, forwarded by a relay: the door
                             admitted the envelope (the relay holds a grant of ours); we open
                             it, admit what is inside by the *relay's* grant through the same
                             door (as `msg.send_many` admits each letter), run it, and seal the
                             answer (or the refusal) so only the asker can read it
    web.relay                a paired peer hands us a sealed query for an exit we are paired
                             with: we pass it on and pass the sealed answer back, blind; only
                             a query sealed under the `key_id` of our view of the exit's key
    web.key_of               a paired peer asks our view of an exit's key: the one we fetched
                             from the exit ourselves (`web.key_get`, refreshed every
                             VIEW_REFRESH_S) and show to every asker alike
    web.key_get              (as an exit) our current key, to a relay

A peer's tool task or agent run on the exit (the `web.search` / `web.fetch` tools) is held to the
same grant: its search passes the door (`answer_for`), its fetch the peer's domains on every hop.

Every query an exit runs is one more row in its audit log (`web.exit`: what was asked, for
whom, the outcome), beside the door's admission row. A relayed query's row names the relay:
the exit never learns who asked.

Once the exit opened a sealed query, every refusal (expired, replayed, busy, the relay's grant)
goes back sealed to the asker, like an answer: the relay learns neither which nor the phone's
clock. The replay guard's memory (each opened request's `enc`, for its window) is kept in the
node's database, written before the query runs, so a restart inside the window does not let a
relay replay a request.

The exit's HPKE key (protocol/oblivious.py) is a ring (protocol/keyring.py) in the home, 0600:
a new key every `[web.exit] key_rotate_s`, the old one in date `key_overlap_s` longer and its
secret deleted a replay window after that (one timer, at the next deadline); its public half, signed
by our identity key, goes to every paired peer on every connection and whenever it changes
(node/reach/resync.py), so a phone holds it before it needs it (fetching it at query time
would tell the exit when the phone is about to ask).
"""
from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from ..door.audit import AuditLog
from ..core.db import ensure_schema
from ..door.gate import Gate
from ..core.home import NodeHome
from ..core.keyrings import load_ring, save_ring
from ..net.session import Call, SessionPool
from ..door.trust import TrustStore
from ..core.websettings import ExitSettings
from ...protocol.common import Error
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.manifest import Operation, check
from ...protocol.keyring import KeyRing, RingKey
from ...protocol.messages import Message, pack, unpack
from ...protocol.oblivious import ExitKey, ExitSecret, Gateway, Remembered, verify_exit_key
from ...protocol.web import (
    WebAnswer,
    WebFetch,
    WebKeyGet,
    WebKeyOf,
    WebKeyView,
    WebRelay,
    WebRequest,
    WebSealed,
    WebSealedReply,
    WebSearch,
)

if TYPE_CHECKING:
    from .exit import WebExit

log = logging.getLogger("psymesh.web")

EXIT_KEY_FILE = "web-exit.key"
OUTCOME = "web.exit"          # the audit service of an exit's outcome rows
SEALED = "web.sealed"         # the audit service of a sealed query's inner admission
AGENT = "web.agent"           # the audit service of a search a tool task or an agent makes here for a peer
KEY_PUSH_TIMEOUT_S = 10.0
WINDOW_S = 60.0               # the replay window: a sealed query's sent_at within this of our clock
MAX_TIMER_S = 86_400.0
VIEW_REFRESH_S = 300.0        # a relay fetches an exit's key again after this (or once it expired)
REPLAY_SCHEMA = """
CREATE TABLE IF NOT EXISTS web_replay (
    enc        BLOB PRIMARY KEY,        -- a sealed request's ephemeral key, opened here ...
    forget_at  REAL NOT NULL            -- ... remembered until its sent_at + the window
);
CREATE INDEX IF NOT EXISTS web_replay_forget ON web_replay(forget_at);
"""


class ReplayMemory:
    """The exit's replay guard on disk: what the Gateway remembers, kept across restarts."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        ensure_schema(conn, REPLAY_SCHEMA)

    def load(self, now: float) -> list[Remembered]:
        self.conn.execute("DELETE FROM web_replay WHERE forget_at < ?", (now,))
        return [Remembered(r[0], r[1]) for r in self.conn.execute("SELECT enc, forget_at FROM web_replay")]

    def remember(self, item: Remembered, now: float) -> None:
        """Kept (committed) on return; what the timestamp alone now refuses is dropped."""
        self.conn.execute("DELETE FROM web_replay WHERE forget_at < ?", (now,))
        self.conn.execute("INSERT OR IGNORE INTO web_replay (enc, forget_at) VALUES (?, ?)",
                          (item.enc, item.forget_at))


class WebServer:
    """This node's exit (when `[web.exit] enabled = true`) and relay (always: the door decides)."""

    def __init__(self, settings: ExitSettings, home: NodeHome, identity_key: object, peer_id: str, *,
                 gate: Gate, audit: AuditLog, trust: TrustStore, sessions: SessionPool, db: sqlite3.Connection,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.peer_id = peer_id
        self.gate = gate
        self.audit = audit
        self.trust = trust
        self.sessions = sessions
        self.clock = clock
        self._exit: WebExit | None = None
        self._home = home
        self._identity_key = identity_key
        self._ring: KeyRing | None = None
        self._key: ExitKey | None = None
        self._gateway: Gateway | None = None
        self._replay = ReplayMemory(db)
        self._views: dict[str, tuple[ExitKey, float]] = {}   # exit -> (its key, as we fetched it; when)
        self.on_key: Callable[[], None] = lambda: None        # called when our exit key changed
        if settings.enabled:
            now = clock()
            self._ring = load_ring(home, EXIT_KEY_FILE, rotate_s=settings.key_rotate_s,
                                   keep_s=settings.key_overlap_s + WINDOW_S, now=now, legacy=_legacy_secret)
            self._gateway = Gateway(self._secrets(), window_s=WINDOW_S, remembered=self._replay.load(now))
            self._key = self._public()

    @property
    def key(self) -> ExitKey | None:
        """Our signed exit key, if we are an exit."""
        return self._key

    def _secrets(self) -> dict[int, ExitSecret]:
        assert self._ring is not None
        return {k.key_id: ExitSecret(k.key_id, k.secret) for k in self._ring.keys}

    def _public(self) -> ExitKey:
        """The current key, signed, in date from its making until it has been replaced for
        `key_overlap_s` (the same bytes whenever it is made: Ed25519 signs deterministically)."""
        assert self._ring is not None
        current = self._ring.current
        return ExitSecret(current.key_id, current.secret).public(
            self._identity_key, self.peer_id, now=current.created_at,  # type: ignore[arg-type]
            ttl_s=self.settings.key_rotate_s + self.settings.key_overlap_s)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the exit's HTTP client open for the node's life; rotate our key on schedule
        (node/reach/resync.py hands it to every paired peer, and again on every connection)."""
        async with AsyncExitStack() as stack:
            if self.settings.enabled:
                from .exit import WebExit  # httpx, the extractors: only on a node that is an exit

                self._exit = await stack.enter_async_context(WebExit(self.settings))
            task_status.started()
            if self._key is None:
                await anyio.sleep_forever()
            await self._rotate_forever()

    async def _rotate_forever(self) -> None:
        """One timer, at the ring's next deadline (a rotation, or a retired secret to delete),
        on the injected clock; an idle exit sleeps until then (at most a day at a time, so a
        clock that jumped is caught up with)."""
        assert self._ring is not None and self._gateway is not None
        while True:
            await anyio.sleep(min(max(0.0, self._ring.next_deadline() - self.clock()), MAX_TIMER_S))
            if not self._ring.step(self.clock()):
                continue
            save_ring(self._home, EXIT_KEY_FILE, self._ring)
            self._gateway.set_secrets(self._secrets())
            key = self._public()
            if key != self._key:
                self._key = key
                log.info("exit key %d made; %d key(s) held", key.key_id, len(self._ring.keys))
                self.on_key()  # node/reach/resync.py tells every paired peer, now or when it is back

    # -- one hop ----------------------------------------------------------------------
    async def serve(self, call: Call) -> Message:
        """A paired peer's own web.search / web.fetch (admitted by its grant at the door)."""
        request = call.request
        assert isinstance(request, (WebSearch, WebFetch))
        return await self.answer(request, call.peer_id)

    async def answer_for(self, request: WebRequest, peer_id: str | None) -> WebAnswer:
        """A web request a tool task or an agent run here makes for `peer_id` (None: this node's
        owner): held to the peer's grant as if it had sent it on a session. A search passes the
        door (the `web.search` capability, charged to the peer's rate, one audit row under
        AGENT); a fetch is held to the peer's `web.fetch` domains on every hop (`_hosts_for`)."""
        if peer_id is not None and isinstance(request, WebSearch):
            self.gate.admit(peer_id, AGENT, request)
        return await self.answer(request, peer_id)

    async def answer(self, request: WebRequest, peer_id: str | None) -> WebAnswer:
        """Run `request` for `peer_id` (None: this node's owner, held to nothing but the exit's
        own policy); one outcome row in the audit log."""
        exit_ = self._exit
        what = f"search {request.query!r}" if isinstance(request, WebSearch) else f"fetch {request.url}"
        now = self.clock()
        if exit_ is None:  # admitted by the grant, refused here: the audit says so after its `allowed`
            error = self._not_an_exit(peer_id)
            self.audit.record(peer_id or self.peer_id, OUTCOME, what[:300], False, error.code.value, error.message,
                              now=now)
            raise error
        try:
            if isinstance(request, WebSearch):
                answer: WebAnswer = await exit_.search(request)
            else:
                answer = await exit_.fetch(request, host_allowed=self._hosts_for(peer_id))
        except PsymeshError as exc:
            self.audit.record(peer_id or self.peer_id, OUTCOME, what[:300], False, exc.code.value, exc.message,
                              now=now)
            raise
        self.audit.record(peer_id or self.peer_id, OUTCOME, what[:300], True, now=now)
        return answer

    def _hosts_for(self, peer_id: str | None) -> Callable[[str], bool]:
        """Every hop of a fetch (redirects too) is held to the peer's `web.fetch` domains."""
        if peer_id is None:
            return lambda host: True

        def allowed(host: str) -> bool:
            peer = self.trust.get(peer_id)
            if peer is None or peer.granted is None:
                return False
            try:
                op = Operation(name="web.fetch", domain=host)
            except ValueError:
                return False
            return check(peer.granted, op, local_peer_id=self.peer_id, remote_peer_id=peer_id,
                         now=self.clock()).allowed
        return allowed

    def _not_an_exit(self, peer_id: str | None) -> PsymeshError:
        """Said to `peer_id` (None: our owner), who must read whose exit is off."""
        who = "this node" if peer_id is None else self.gate.name
        return PsymeshError(f"{who} is not a web exit ([web.exit] enabled = true in its config.toml turns it on)",
                            code=ErrorCode.UNAVAILABLE)

    # -- two hops: the exit's part ----------------------------------------------------------
    async def serve_sealed(self, call: Call) -> Message:
        """A query sealed to our key, brought by a relay (`call.peer_id`)."""
        assert isinstance(call.request, WebSealed)
        if self._gateway is None:
            raise self._not_an_exit(call.peer_id)
        opened = self._gateway.decrypt(call.request.sealed)  # refusals before this: nobody to seal to
        try:
            now = self.clock()
            self._replay.remember(self._gateway.admit(opened, now=now), now)  # on disk before it runs
            inner = unpack(opened.body)
            if not isinstance(inner, (WebSearch, WebFetch)):
                raise PsymeshError(f"{inner.type!r} cannot be sent sealed", code=ErrorCode.BAD_REQUEST)
            self.gate.admit(call.peer_id, SEALED, inner)
            answer: Message = await self.answer(inner, call.peer_id)
        except PsymeshError as exc:
            answer = Error.from_exception(exc)
        return WebSealedReply(sealed=opened.sealer.seal(pack(answer)))

    async def key_get(self, call: Call) -> Message:
        """A relay asks our current exit key (the same for every asker)."""
        assert isinstance(call.request, WebKeyGet)
        if self._key is None:
            raise self._not_an_exit(call.peer_id)
        return WebKeyView(key=self._key)

    # -- two hops: the relay's part ----------------------------------------------------------
    async def key_of(self, call: Call) -> Message:
        """Our view of an exit's key, for a phone to seal to (and to check its own against)."""
        request = call.request
        assert isinstance(request, WebKeyOf)
        self._relayable(request.exit, call.peer_id)
        return WebKeyView(key=await self.view_of(request.exit))

    async def view_of(self, exit_peer: str) -> ExitKey:
        """The exit's key as we fetched it ourselves: the one key every asker of ours seals to."""
        now = self.clock()
        held = self._views.get(exit_peer)
        if held is not None and now < held[1] + VIEW_REFRESH_S and now <= held[0].not_after:
            return held[0]
        view = await self.sessions.request(exit_peer, WebKeyGet(), WebKeyView, timeout=KEY_PUSH_TIMEOUT_S)
        verify_exit_key(view.key, exit=exit_peer, now=self.clock())
        self._views[exit_peer] = (view.key, now)
        return view.key

    def _relayable(self, exit_peer: str, asker: str) -> None:
        peer = self.trust.get(exit_peer)
        if peer is None or peer.revoked:
            raise PsymeshError(f"this relay is not paired with exit {exit_peer}", code=ErrorCode.NOT_FOUND)
        if exit_peer == asker:
            raise PsymeshError("a relayed query must go to another peer than the asker", code=ErrorCode.BAD_REQUEST)

    async def relay(self, call: Call) -> Message:
        """Pass a sealed query to the exit it names (one we are paired with) and its answer back,
        if it is sealed under our view of the exit's key."""
        request = call.request
        assert isinstance(request, WebRelay)
        self._relayable(request.exit, call.peer_id)
        view = await self.view_of(request.exit)
        if request.sealed[0] != view.key_id:
            raise PsymeshError(f"sealed under exit key {request.sealed[0]}, not {view.key_id}, the key this relay"
                               " shows every asker (web.key_of)", code=ErrorCode.CONFLICT)
        return await self.sessions.request(request.exit, WebSealed(sealed=request.sealed), WebSealedReply,
                                           timeout=self.settings.timeout_s * (self.settings.max_redirects + 1) + 5)


def _legacy_secret(data: bytes, now: float) -> RingKey | None:
    """An exit key file from before rings (one ExitSecret): that key, counted as made now."""
    try:
        secret = ExitSecret.from_bytes(data)
    except PsymeshError:
        return None
    return RingKey(secret.key_id, secret.private_key, now)

