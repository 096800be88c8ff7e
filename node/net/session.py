"""Sessions on the node: the IO shell around `protocol.session`, both ends.

    SessionPool            one outbound session per peer, opened on first use and kept
                           (while relayed, only until a direct connection opens);
      .request(peer, msg)  one request, its one reply
      .stream(peer, msg)   one request, the frames that answer it, until `end`
    serve_session(...)     one inbound session: every request passes `door(call)`,
                           each answered in its own task (or, for the `prompt` kinds
                           that answer at once, in the read loop), frames written one
                           at a time

A session that dies (connection reset, the peer restarted, a liveness ping that got
no answer) fails every request open on it with a `NetworkError`; the next request to
that peer opens a new one, so callers that must not lose work (the task submitter)
retry, and exactly-once stays the job of the task protocol (ids, numbered events).

A session opened while the peer was reachable only through a relay gives way once a
direct connection is open: the next request opens a new session (the p2p host opens
new streams on the direct connection), and the old one is closed as soon as the
requests still on it have ended (node/reach/relaying.py closes the relayed connection then, or
after `overlap_s` at the latest).

What every request does (a deadline, the event its reply sets, the time a read came) is
trio's own, not anyio's wrapper of it: the daemon runs on trio (libp2p is trio-native), and
the wrappers cost ~4% of the phone's instructions a one-hop web query (bench/web_profile.py).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import anyio
import anyio.abc
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .framed import READ_CHUNK, ByteStream
from ...protocol.common import Error, expect
from ...protocol.control import PeerAway
from ...protocol.errors import (
    ConnectionLost,
    ErrorCode,
    NetworkError,
    NetworkTimeout,
    ProtocolError,
    PsymeshError,
    RemoteError,
    cause_of,
)
from ...protocol.messages import Message
from ...protocol.session import Cancel, Refused, Reply, Request, SessionClient, SessionServer

log = logging.getLogger("psymesh.session")

M = TypeVar("M", bound=Message)
# Replies a stream may hold before its reader must catch up (then the session waits for it).
STREAM_BUFFER = 256
FAREWELL_S = 1.0  # how long a broken session's error frame may take to leave before the stream closes


# ============================================================== server side


@dataclass
class Call:
    """One inbound request, as the door and the services see it."""

    peer_id: str
    rid: int
    request: Message
    _send: Callable[[int, tuple[Message, ...]], Awaitable[None]] = field(repr=False)
    ahead: list[Message] = field(default_factory=list, repr=False)  # see `send_with_answer`

    async def send(self, *messages: Message) -> None:
        """Frames that answer the request without ending it (e.g. task events), in one write."""
        await self._send(self.rid, messages)

    def send_with_answer(self, *messages: Message) -> None:
        """Frames that answer the request without ending it, held to go out just before its
        final answer, in the same write (a task's last events before its final one: one write
        and one read instead of two). The door answers for them as for the final answer."""
        self.ahead.extend(messages)


class Door(Protocol):
    async def __call__(self, call: Call) -> Message:
        """Admit `call.request` and answer it: the return value is the final frame."""


async def serve_session(stream: ByteStream, peer_id: str, door: Door, *, max_frame_size: int,
                        max_open: int, prompt: Collection[type[Message]] = ()) -> None:
    """Serve one inbound session until the client closes it (or breaks it). A request of a
    `prompt` type (one the door answers without waiting on anything but the reply's write,
    e.g. `ping`) is answered in the read loop itself, not in a task of its own: the next
    request is read once it is answered. Every other request gets its own task, so a long
    one never holds up the stream."""
    server = SessionServer(max_frame_size, max_open)
    write_lock = anyio.Lock(fast_acquire=True)
    scopes: dict[int, anyio.CancelScope] = {}

    async def write(data: bytes) -> None:
        async with write_lock:
            await stream.send_all(data)

    async def send_more(rid: int, messages: tuple[Message, ...]) -> None:
        await write(b"".join(server.reply(rid, m, end=False) for m in messages))

    async def final_answer(call: Call) -> Message:
        """The door's answer to `call`; a failure is said as an `error` frame (alone)."""
        try:
            return await door(call)
        except PsymeshError as exc:
            call.ahead.clear()
            return Error.from_exception(exc)
        except Exception:
            call.ahead.clear()
            log.exception("%s from %s failed", call.request.type, peer_id)
            return Error.of(ErrorCode.INTERNAL, f"{call.request.type} failed on this node; see its log")

    async def end(rid: int, final: Message, ahead: list[Message]) -> None:
        """The final answer, after the frames held for it (`Call.send_with_answer`), in one write."""
        with contextlib.suppress(PsymeshError):
            try:
                data = b"".join([*(server.reply(rid, m, end=False) for m in ahead), server.reply(rid, final)])
            except ProtocolError as exc:  # e.g. a reply over the frame limit: say so instead
                data = server.reply(rid, Error.from_exception(exc))
            await write(data)

    async def answer(request: Request) -> None:
        """In a task of its own: the client may cancel it meanwhile."""
        final: Message
        call = Call(peer_id, request.rid, request.message, send_more)
        with anyio.CancelScope() as scope:
            scopes[request.rid] = scope
            final = await final_answer(call)
        scopes.pop(request.rid, None)
        if scope.cancelled_caught:
            call.ahead.clear()
            final = Error.of(ErrorCode.CANCELED, "canceled by the requester")
        with anyio.CancelScope(shield=True):
            await end(request.rid, final, call.ahead)

    async def answer_now(request: Request) -> None:
        """A prompt request, in the read loop: no cancel of it can be read before it ends."""
        call = Call(peer_id, request.rid, request.message, send_more)
        await end(request.rid, await final_answer(call), call.ahead)

    async with anyio.create_task_group() as tg:
        try:
            while True:
                data = await stream.receive_some(READ_CHUNK)
                server.receive_data(data)
                while (event := server.next_event()) is not None:
                    if isinstance(event, Request):
                        if type(event.message) in prompt:
                            await answer_now(event)
                        else:
                            tg.start_soon(answer, event)
                    elif isinstance(event, Cancel):
                        if (scope := scopes.get(event.rid)) is not None:
                            scope.cancel()
                    elif isinstance(event, Refused):
                        await write(server.reply(event.rid, Error.from_exception(event.error)))
                if not data:
                    break
        except (ProtocolError, ConnectionLost) as exc:  # broken or gone: closed; the client opens a new one
            log.info("session from %s broken: %s", peer_id, exc.message)
            if farewell := server.farewell():  # say why first (§2), then the stream is closed
                with anyio.move_on_after(FAREWELL_S, shield=True), contextlib.suppress(PsymeshError):
                    await write(farewell)
        finally:
            tg.cancel_scope.cancel()  # the client is gone: nobody will read the answers


# ============================================================== client side


class OutboundSession:
    """Our end of one session to `peer_id`, read by its own task in the pool."""

    def __init__(self, peer_id: str, stream: ByteStream, max_frame_size: int) -> None:
        self.peer_id = peer_id
        self._stream = stream
        self._client = SessionClient(max_frame_size)
        self._inboxes: dict[int, _Inbox] = {}
        self._write_lock = anyio.Lock(fast_acquire=True)
        self._dead: PsymeshError | None = None  # a NetworkError, or the server's refusal
        self.closed = anyio.Event()
        self._opened: anyio.Event | None = None  # set (and dropped) as the next request is sent
        self.last_heard = anyio.current_time()
        self.relayed = False   # opened while the peer was reachable through a relay only
        self._retired = False  # replaced by a session on a direct connection: closes when idle

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def open_requests(self) -> int:
        return len(self._client.open_requests)

    def next_request(self) -> anyio.Event:
        """An event set when the next request is sent on this session (made when first asked
        for: the liveness watcher waits on it once a quiet period, not once a request)."""
        if self._opened is None:
            self._opened = anyio.Event()
        return self._opened

    async def run(self) -> None:
        """Read replies and hand each to its request, until the stream ends."""
        try:
            while True:
                data = await self._stream.receive_some(READ_CHUNK)
                self.last_heard = trio.current_time()
                self._client.receive_data(data)
                while (reply := self._client.next_reply()) is not None:
                    inbox = self._inboxes.get(reply.rid)
                    if inbox is not None:
                        with contextlib.suppress(anyio.BrokenResourceError):
                            await inbox.send(reply)
                    if reply.end:
                        self._inboxes.pop(reply.rid, None)
                if not data:
                    self._die(ConnectionLost(f"the session to {self.peer_id} was closed"))
                    return
        except ProtocolError as exc:
            self._die(ConnectionLost(f"the session to {self.peer_id} broke: {exc.message}"))
        except RemoteError as exc:  # it refused the whole session: every request gets the reason
            self._die(exc)
        finally:
            self._die(ConnectionLost(f"the session to {self.peer_id} ended"))
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()

    def _die(self, exc: PsymeshError) -> None:
        if self._dead is None:
            self._dead = exc
            for inbox in self._inboxes.values():
                inbox.close()
            self._inboxes.clear()
            self.closed.set()

    def kill(self, why: str) -> None:
        """Take the session for dead now (a liveness ping got no answer)."""
        self._die(ConnectionLost(f"the session to {self.peer_id} died: {why}"))

    async def retire(self) -> None:
        """Take no new requests; close our end once the open ones have ended (now, if none)."""
        self._retired = True
        await self._close_if_idle()

    async def _close_if_idle(self) -> None:
        if self._retired and not self._client.open_requests:
            self._die(ConnectionLost(f"the session to {self.peer_id} was replaced by a direct one"))
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()

    def _start(self, message: Message, inbox: _Inbox) -> tuple[int, bytes]:
        """A new request's id and bytes, its replies to go to `inbox`."""
        if self._dead is not None:
            raise self._dead
        if self._retired:
            raise ConnectionLost(f"the session to {self.peer_id} was replaced by a direct one")
        rid, data = self._client.request(message)
        self._inboxes[rid] = inbox
        if self._opened is not None:
            self._opened.set()
            self._opened = None
        return rid, data

    async def _finish(self, rid: int) -> None:
        """The request is left: cancel it on the server if it is still open there."""
        self._inboxes.pop(rid, None)
        if self._dead is None and rid in self._client.open_requests:
            with anyio.CancelScope(shield=True), contextlib.suppress(PsymeshError):
                await self._write(self._client.cancel(rid))
        await self._close_if_idle()

    @contextlib.asynccontextmanager
    async def open(self, message: Message) -> AsyncIterator[_Replies]:
        """Send `message`; yield its replies. Leaving early cancels the request on the server."""
        send, receive = anyio.create_memory_object_stream[Reply](STREAM_BUFFER)
        rid, data = self._start(message, _StreamInbox(send))
        try:
            await self._write(data)
            yield _Replies(receive, self)
        finally:
            receive.close()
            await self._finish(rid)

    async def request(self, message: Message, reply_type: type[M]) -> M:
        """One request on this session and its one reply (an `error` reply raises RemoteError).
        Its first reply is the answer (a stream of them is cancelled after it, as when
        leaving `open` early): one slot, no stream of replies."""
        inbox = _OneReply()
        rid, data = self._start(message, inbox)
        try:
            await self._write(data)
            reply = await inbox.wait()
        finally:
            await self._finish(rid)
        if reply is None:
            raise self._dead or ConnectionLost("the session ended")
        return expect(reply.message, reply_type)

    async def _write(self, data: bytes) -> None:
        if not data:
            return
        async with self._write_lock:
            try:
                await self._stream.send_all(data)
            except PsymeshError as exc:
                self._die(ConnectionLost(f"the session to {self.peer_id} is gone: {exc.message}"))
                raise self._dead from None  # type: ignore[misc]


class _Inbox(Protocol):
    """Where the session's reader puts the frames answering one request."""

    async def send(self, reply: Reply) -> None: ...

    def close(self) -> None:
        """The session died: no more frames will come."""


class _StreamInbox:
    """The inbox of a request with a stream of replies: frames that came in one read are
    queued without a turn of the scheduler each (a memory stream's `send` takes one), so
    the request's reader finds them together (`_Replies.ready`); it waits only when full."""

    __slots__ = ("_send",)

    def __init__(self, send: MemoryObjectSendStream[Reply]) -> None:
        self._send = send

    async def send(self, reply: Reply) -> None:
        try:
            self._send.send_nowait(reply)
        except anyio.WouldBlock:
            await self._send.send(reply)

    def close(self) -> None:
        self._send.close()


class _OneReply:
    """The inbox of a request that takes one reply: its first frame (any later ones dropped)."""

    __slots__ = ("_ready", "reply")

    def __init__(self) -> None:
        self._ready = trio.Event()
        self.reply: Reply | None = None

    async def send(self, reply: Reply) -> None:
        if self.reply is None:
            self.reply = reply
            self._ready.set()

    def close(self) -> None:
        self._ready.set()

    async def wait(self) -> Reply | None:
        """The first reply, or None if the session died before it came."""
        await self._ready.wait()
        return self.reply


class _Replies:
    """The replies to one request; iteration ends after the final frame. A session that
    dies before it raises its NetworkError."""

    def __init__(self, receive: MemoryObjectReceiveStream[Reply], session: OutboundSession) -> None:
        self._receive = receive
        self._session = session
        self._done = False

    def __aiter__(self) -> "_Replies":
        return self

    async def __anext__(self) -> Message:
        if self._done:
            raise StopAsyncIteration
        try:
            reply = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise self._session._dead or ConnectionLost("the session ended") from None
        self._done = reply.end
        return reply.message

    def ready(self) -> list[Message]:
        """The frames already here, without waiting (up to the final one): what a reader
        may handle together, e.g. store in one transaction."""
        frames: list[Message] = []
        while not self._done:
            try:
                reply = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break  # (the next __anext__ says why it ended)
            self._done = reply.end
            frames.append(reply.message)
        return frames


class OpenStream(Protocol):
    async def __call__(self, peer_id: str, protocol: str) -> ByteStream: ...


class SessionWatcher(Protocol):
    async def watch(self, session: OutboundSession) -> None:
        """Run beside `session` until it ends (e.g. liveness pings)."""


class PathOf(Protocol):
    def __call__(self, peer_id: str) -> str | None:
        """How we are connected to `peer_id`: "direct", "relayed" or None (node/net/host.py P2PNode.path)."""


class Links(Protocol):
    """A node's connections as its services watch them (node/net/host.py P2PNode)."""

    def changes(self) -> anyio.Event:
        """Set at the next change of connections or addresses (read, take this, wait, read again)."""

    def path(self, peer_id: str) -> str | None:
        """How we are connected to `peer_id`: "direct", "relayed" or None."""


class SessionPool:
    """One outbound session per peer, opened when first needed and reused until it dies, or
    (`path` given) until a direct connection replaces the relayed one it runs on. Runs its
    sessions' reader tasks (and a watcher beside each) in its own task group (start it with
    `tg.start`). It also remembers which peers it could not reach, since when and why
    (`away`), until a session to them opens again: what the CLI tells a user who is
    waiting for a task or a letter (issue 22 item 1)."""

    def __init__(self, open_stream: OpenStream, protocol: str, max_frame_size: int,
                 watcher: SessionWatcher | None = None, path: PathOf | None = None) -> None:
        self._open_stream = open_stream
        self._watcher = watcher
        self._path = path
        self._protocol = protocol
        self._max_frame_size = max_frame_size
        self._sessions: dict[str, OutboundSession] = {}
        self._opening: dict[str, anyio.Lock] = {}
        self._away: dict[str, PeerAway] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await anyio.sleep_forever()

    def sessions(self) -> list[OutboundSession]:
        return [s for s in self._sessions.values() if s.alive]

    async def session(self, peer_id: str) -> OutboundSession:
        """The live session to `peer_id`, opening one (dialing if needed) when there is none."""
        current = self._sessions.get(peer_id)
        if current is not None and current.alive and not self._direct_now(current):
            return current
        lock = self._opening.setdefault(peer_id, anyio.Lock())
        async with lock:  # one dial at a time per peer: concurrent callers share it
            current = self._sessions.get(peer_id)
            if current is not None and current.alive:
                if not self._direct_now(current):
                    return current
                del self._sessions[peer_id]
                await current.retire()
            if self._tg is None:
                raise PsymeshError("the session pool is not running", code=ErrorCode.UNAVAILABLE)
            try:
                stream = await self._open_stream(peer_id, self._protocol)
            except NetworkError as exc:
                since = self._away[peer_id].since if peer_id in self._away else time.time()
                self._away[peer_id] = PeerAway(since=since, reason=cause_of(exc))  # the line names the peer
                raise
            self._away.pop(peer_id, None)
            session = OutboundSession(peer_id, stream, self._max_frame_size)
            session.relayed = self._path is not None and self._path(peer_id) == "relayed"
            self._sessions[peer_id] = session
            self._tg.start_soon(self._reader, session)
            if self._watcher is not None:
                self._tg.start_soon(self._watcher.watch, session)
            return session

    def live(self, peer_id: str) -> OutboundSession | None:
        """The live session to `peer_id`, if one is open (none is opened)."""
        session = self._sessions.get(peer_id)
        return session if session is not None and session.alive else None

    def last_heard(self, peer_id: str) -> float | None:
        """When (anyio's clock) the live session to `peer_id` last heard from it; None: no session."""
        session = self._sessions.get(peer_id)
        return session.last_heard if session is not None and session.alive else None

    def away(self, peer_id: str) -> PeerAway | None:
        """Since when (and why) `peer_id` could not be reached, if the last try failed."""
        return self._away.get(peer_id)

    def _direct_now(self, session: OutboundSession) -> bool:
        """Opened over a relay, and a direct connection to its peer is open now."""
        return session.relayed and self._path is not None and self._path(session.peer_id) == "direct"

    async def _reader(self, session: OutboundSession) -> None:
        try:
            await session.run()
        finally:
            if self._sessions.get(session.peer_id) is session:
                del self._sessions[session.peer_id]
                self._opening.pop(session.peer_id, None)

    def drop(self, peer_id: str, why: str) -> None:
        """Forget the session to `peer_id` (its requests fail with ConnectionLost)."""
        session = self._sessions.pop(peer_id, None)
        if session is not None:
            session.kill(why)

    @contextlib.asynccontextmanager
    async def stream(self, peer_id: str, message: Message) -> AsyncIterator[_Replies]:
        """Send `message` to `peer_id`; iterate the frames that answer it."""
        session = await self.session(peer_id)
        async with session.open(message) as replies:
            yield replies

    async def request(self, peer_id: str, message: Message, reply_type: type[M], *,
                      timeout: float = 30.0) -> M:
        """One request, one reply of `reply_type` (an `error` reply raises RemoteError).
        Bounded by a cancel scope of its own rather than `fail_after` (two generator context
        managers around the same scope, on every request), which only this scope's deadline
        can cancel: caught cancelled means timed out."""
        try:
            with trio.CancelScope(deadline=trio.current_time() + timeout) as bounded:
                session = await self.session(peer_id)
                return await session.request(message, reply_type)
            assert bounded.cancelled_caught  # the block returns or raises otherwise
        except TimeoutError:  # a timeout inside (as under fail_after, which caught these too)
            pass
        raise NetworkTimeout(f"{peer_id} did not answer {message.type} within {timeout:g} s")


__all__ = ["Call", "Door", "OutboundSession", "SessionPool", "serve_session"]
