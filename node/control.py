"""The local control API server: the daemon's Unix socket, one task per client connection.

Requests are dispatched by message class to handlers registered by the daemon's
services. A handler returns one reply, or sends several itself (streaming) and
returns None. A handler's PsymeshError becomes an `error` reply; any other
exception is logged and becomes `internal` — the connection and the daemon live on.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from psymesh.node.framed import AnyioByteStream, FramedStream
from psymesh.protocol.errors import ErrorCode, ProtocolError, PsymeshError
from psymesh.protocol.messages import Message

log = logging.getLogger("psymesh.control")

Handler = Callable[[Any, FramedStream], Awaitable[Message | None]]


def _socket_in_use(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


class ControlServer:
    def __init__(self, socket_path: Path, max_frame_size: int) -> None:
        self.socket_path = socket_path
        self.max_frame_size = max_frame_size
        self._handlers: dict[type[Message], Handler] = {}

    def route(self, request_type: type[Message], handler: Handler) -> None:
        self._handlers[request_type] = handler

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        path = self.socket_path
        if path.exists():
            if _socket_in_use(path):
                raise PsymeshError(
                    f"another daemon is already serving {path}; stop it first (psymesh status shows it)",
                    code=ErrorCode.CONFLICT,
                )
            path.unlink()  # left behind by a daemon that was killed
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            listener = await anyio.create_unix_listener(path)
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
            await self._converse(raw)
        except Exception:  # one bad client must never take the listener (and the daemon) down
            log.exception("control connection failed")

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
                    except ProtocolError:
                        return

    async def _dispatch(self, request: Message, framed: FramedStream) -> Message | None:
        from psymesh.protocol.common import Error

        handler = self._handlers.get(type(request))
        if handler is None:
            return Error.of(ErrorCode.BAD_REQUEST, f"the control API has no request {request.type!r}")
        try:
            return await handler(request, framed)
        except PsymeshError as exc:
            return Error.from_exception(exc)
        except Exception:
            log.exception("control request %s failed", request.type)
            return Error.of(ErrorCode.INTERNAL, f"{request.type} failed inside the daemon; see its log")
