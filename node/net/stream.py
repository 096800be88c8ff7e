"""`P2PStream`: one libp2p stream as a `node.net.framed.ByteStream` (bytes in, bytes out, b"" at
the end), and the quiet close/reset every part of the host uses on libp2p's streams and
connections, with `_reason()`, which turns a libp2p exception chain into a sentence for people."""
from __future__ import annotations

import errno

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from libp2p.abc import INetStream

from ...protocol.errors import ConnectionLost

log = logging.getLogger(__name__)

READ_CHUNK = 65536


class P2PStream:
    """One libp2p stream as a `node.framed.ByteStream`: bytes in, bytes out, b"" at the end."""

    def __init__(self, stream: INetStream, protocol: str) -> None:
        self._stream = stream
        self.protocol = protocol
        self.remote_peer_id = str(stream.muxed_conn.peer_id)
        self._closed = False

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        """Up to `max_bytes`; b"" once the peer closed or reset the stream (or the connection died)."""
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        try:
            return await self._stream.read(max_bytes)
        except Exception as exc:  # StreamEOF, StreamReset, StreamError, muxer errors: all mean "no more"
            log.debug("stream %s from %s ended: %r", self.protocol, self.remote_peer_id, exc)
            return b""

    async def send_all(self, data: bytes) -> None:
        if not data:
            return
        if self._closed:
            raise ConnectionLost(f"stream {self.protocol} to {self.remote_peer_id} is closed")
        try:
            await self._stream.write(data)
        except Exception as exc:
            raise ConnectionLost(f"stream {self.protocol} to {self.remote_peer_id} is gone: {_reason(exc)}") from exc

    async def aclose(self) -> None:
        """Half-close gracefully (the peer reads EOF after what we sent). Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stream.close()
        except Exception as exc:
            log.debug("closing stream %s to %s: %r", self.protocol, self.remote_peer_id, exc)

    async def reset(self) -> None:
        """Abort: the peer's reads end at once and unsent data is dropped."""
        self._closed = True
        await _reset_quietly(self._stream)


Handler = Callable[[P2PStream], Awaitable[None]]


async def _close_quietly(resource: Any) -> None:
    try:
        await resource.close()
    except Exception as exc:
        log.debug("closing %r: %r", resource, exc)


async def _reset_quietly(stream: INetStream) -> None:
    try:
        await stream.reset()
    except Exception as exc:
        log.debug("resetting a stream: %r", exc)


def _leaves(exc: BaseException) -> list[BaseException]:
    """Every exception inside `exc`: its chain, libp2p's MultiError `errors` and exception groups."""
    seen: list[BaseException] = []
    stack = [exc]
    while stack and len(seen) < 64:
        e = stack.pop()
        if any(e is s for s in seen):
            continue
        seen.append(e)
        stack.extend(getattr(e, "errors", None) or [])
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        if (nxt := e.__cause__ or e.__context__) is not None:
            stack.append(nxt)
    return seen


_TRIED = re.compile(r"all attempts to connect to (\S+) failed")


def nobody_listens(exc: BaseException) -> bool:
    """Whether libp2p's failed dial was refused by the address itself (nothing listens there)."""
    return any(isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED)
               for e in _leaves(exc))


def dial_failure(exc: BaseException) -> str | None:
    """libp2p's failed dial in a few words: `connection refused at 127.0.0.1:4001`, from the
    socket error deep inside its SwarmDialAllFailedError / MultiError / OSError chain (whose
    own text names the peer id three times). None when no socket error is inside."""
    leaves = _leaves(exc)
    where = next((m.group(1) for e in leaves if (m := _TRIED.search(str(e)))), None)
    errno_error = next((e for e in leaves if isinstance(e, OSError) and e.errno is not None and e.strerror), None)
    if errno_error is None or errno_error.strerror is None:
        return None
    what = errno_error.strerror.rpartition(": ")[2]  # trio: "error connecting to ('IP', PORT): Connection refused"
    return what[:1].lower() + what[1:] + (f" at {where}" if where else "")


def _reason(exc: BaseException) -> str:
    """The first and the innermost message of a libp2p exception chain, for people."""
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(nxt)
    first, root = str(exc) or type(exc).__name__, str(chain[-1]) or type(chain[-1]).__name__
    return first if root == first or len(chain) == 1 else f"{first} ({root})"
