"""The local control API server: the daemon's Unix socket, one task per client connection.

Requests are dispatched by message class to handlers registered by the daemon
(node/control/owner.py). A handler returns one reply, or sends several itself (streaming) and
returns None. A handler's PsymeshError becomes an `error` reply (one that is the
network failing says so: protocol/control/common.py `error_reply`), and so does a failing
database (mapped by node/core/db.py to what happened and what to do); any other exception
is logged and becomes `internal` — the connection and the daemon live on.

Who may connect is decided by where the socket lives: a directory only the owner
may enter (the home, or a per-user runtime dir; see NodeHome.socket_path), created
or checked here before binding. A directory someone else made first is refused,
never used, so no other local user can sit between the owner's CLI and daemon.

And the daemon asks each connection who is on the other end (`socket_peer`: SO_PEERCRED
on Linux, LOCAL_PEERCRED on BSD/macOS) before it reads a byte: a process of another uid
(root included: psymesh never serves one user's home to another) is refused, its
connection closed unanswered and one audit row written (`control` / `connect`, the peer
named `uid:N`). So a socket whose mode someone loosened still answers only its owner.
"""
from __future__ import annotations

import logging
import os
import socket
import sqlite3
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.abc

from ..core.commands import Commands
from ..core.db import storage_error
from ..net.framed import AnyioByteStream, FramedStream
from ..core.paths import SOCKET_DIR_ADVICE, ensure_private_dir, socket_peer
from ...protocol import control as c
from ...protocol.common import Error
from ...protocol.errors import ConnectionLost, ErrorCode, ProtocolError, PsymeshError
from ...protocol.messages import Message

log = logging.getLogger("psymesh.control")

Handler = Callable[[Any, FramedStream], Awaitable[Message | None]]
PeerOf = Callable[[socket.socket], tuple[int, int | None] | None]
"""(uid, pid) of a connected client, or None where the OS cannot tell (the seam tests use)."""


class Refused(Protocol):
    def __call__(self, uid: int, pid: int | None) -> None:
        """A client of another uid was turned away (the daemon writes its audit row)."""


def _socket_in_use(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


class _LocalReplies:
    """What a handler sends on, for a request answered in this process (`ControlServer.call`)."""

    def __init__(self, send: Callable[[Message], Awaitable[None]]) -> None:
        self.send = send


class ControlServer:
    def __init__(self, socket_path: Path, max_frame_size: int, *, refused: Refused | None = None,
                 peer_of: PeerOf = socket_peer, uid: int | None = None, commands: Commands | None = None) -> None:
        self.commands = commands or Commands()  # how its refusals spell the command to run next
        self.socket_path = socket_path
        self.max_frame_size = max_frame_size
        self.refused = refused
        self.peer_of = peer_of
        self.uid = os.geteuid() if uid is None else uid  # who may talk to this daemon: its owner
        self._handlers: dict[type[Message], Handler] = {}

    def route(self, request_type: type[Message], handler: Handler) -> None:
        self._handlers[request_type] = handler

    async def call(self, request: Message, on_send: Callable[[Message], Awaitable[None]] | None = None) -> Message:
        """Answer `request` in this process, by the same handler and with the same error
        replies a socket client gets (the dashboard, node/control/dashboard.py, is such a client):
        a streaming handler's messages go to `on_send`; returns the last reply."""
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)
            if on_send is not None:
                await on_send(message)

        reply = await self._dispatch(request, _LocalReplies(send))  # type: ignore[arg-type]
        if reply is None:
            if not sent:
                return Error.of(ErrorCode.INTERNAL, f"{request.type} sent no reply")
            reply = sent[-1]
        return reply

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        path = self.socket_path
        ensure_private_dir(path.parent, "the control socket's directory", SOCKET_DIR_ADVICE)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise PsymeshError(f"{path} exists and is not a socket, so the control socket cannot go there; "
                                   f"move it away: mv {path} {path}.old", code=ErrorCode.CONFLICT)
            if _socket_in_use(path):
                raise PsymeshError(
                    f"another daemon is already serving {path}; stop it first ({self.commands('status')} shows it)",
                    code=ErrorCode.CONFLICT,
                )
            path.unlink()  # left behind by a daemon that was killed
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            listener = await anyio.create_unix_listener(path)
        except OSError as exc:
            raise PsymeshError(f"cannot listen on {path}: {exc.strerror or exc}", code=ErrorCode.UNAVAILABLE) from None
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        try:
            async with listener:
                task_status.started()
                await listener.serve(self._handle_connection)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass

    async def _handle_connection(self, raw: anyio.abc.SocketStream) -> None:
        try:
            if not self._owner(raw):
                await raw.aclose()
                return
            await self._converse(raw)
        except Exception:  # one bad client must never take the listener (and the daemon) down
            log.exception("control connection failed")

    def _owner(self, raw: anyio.abc.SocketStream) -> bool:
        """Whether the process at the other end runs as this daemon's uid; a refusal is logged
        and audited. Where the OS cannot tell, the socket's mode and directory stand alone."""
        peer = self.peer_of(raw.extra(anyio.abc.SocketAttribute.raw_socket))
        if peer is None or peer[0] == self.uid:
            return True
        uid, pid = peer
        log.warning("refused a control connection from uid %d (pid %s): this daemon answers only uid %d",
                    uid, pid if pid is not None else "?", self.uid)
        if self.refused is not None:
            try:
                self.refused(uid, pid)
            except Exception:  # an audit that fails must not open the door
                log.exception("could not audit a refused control connection")
        return False

    async def _converse(self, raw: anyio.abc.SocketStream) -> None:
        framed = FramedStream(AnyioByteStream(raw), self.max_frame_size)
        async with raw:
            while True:
                try:
                    request = await framed.receive()
                except ProtocolError as exc:
                    await framed.send_error(exc)  # the channel is broken: say why, then hang up
                    return
                if request is None:
                    return
                reply = await self._dispatch(request, framed)
                if reply is not None:
                    try:
                        await framed.send(reply)
                    except (ProtocolError, ConnectionLost):  # too large to send, or the client left
                        return

    async def _dispatch(self, request: Message, framed: FramedStream) -> Message | None:
        handler = self._handlers.get(type(request))
        if handler is None:
            return Error.of(ErrorCode.BAD_REQUEST, f"the control API has no request {request.type!r}")
        try:
            return await handler(request, framed)
        except PsymeshError as exc:
            return c.error_reply(exc)
        except sqlite3.Error as exc:
            log.error("control request %s: %s", request.type, exc)
            return c.error_reply(storage_error(exc, None))
        except Exception:
            log.exception("control request %s failed", request.type)
            return Error.of(ErrorCode.INTERNAL, f"{request.type} failed inside the daemon; see its log")
