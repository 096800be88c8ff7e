"""`splice`: two byte streams joined, both ways, until one of them ends.

The carrier of a split model's llama.cpp RPC bytes (node/compute/): the owner's runner's TCP
connection to a libp2p stream, and that stream to the worker's RPC server. One conversation:
when either side ends, both are closed (llama.cpp's RPC has no half-close). `watch`, if
given, sees the bytes from `a` before they go to `b` and may refuse them by raising a
PsymeshError, which ends the splice with that error, the refused bytes unsent.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from .framed import ByteStream
from ...protocol.errors import PsymeshError

CHUNK = 256 * 1024


@dataclass
class Traffic:
    """What one splice carried, for `model ps` and `worker status`."""

    a_to_b: int = 0
    b_to_a: int = 0
    ended: str = ""          # why it ended, in a few words ("" while it runs)
    refused: PsymeshError | None = field(default=None, repr=False)


async def splice(a: ByteStream, b: ByteStream, *, first: bytes = b"",
                 watch: Callable[[bytes], None] | None = None, traffic: Traffic | None = None) -> Traffic:
    """Join `a` and `b` (`first`: bytes already read from `a`) until either ends; both are then
    closed. Returns what passed and why it stopped; cancelling the caller's scope cuts it."""
    seen = traffic or Traffic()

    async def pump(src: ByteStream, dst: ByteStream, forward: bool, scope: anyio.CancelScope) -> None:
        pending = first if forward else b""
        try:
            while True:
                data = pending or await src.receive_some(CHUNK)
                pending = b""
                if not data:
                    seen.ended = seen.ended or ("the owner closed it" if forward else "the worker closed it")
                    return
                if forward and watch is not None:
                    try:
                        watch(data)
                    except PsymeshError as exc:  # refused: these bytes go no further
                        seen.refused, seen.ended = exc, exc.message
                        return
                await dst.send_all(data)
                if forward:
                    seen.a_to_b += len(data)
                else:
                    seen.b_to_a += len(data)
        except PsymeshError as exc:  # ConnectionLost from a libp2p stream
            seen.ended = seen.ended or exc.message
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            seen.ended = seen.ended or f"a side went away ({exc.__class__.__name__})"
        finally:
            scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump, a, b, True, tg.cancel_scope)
            tg.start_soon(pump, b, a, False, tg.cancel_scope)
    finally:
        with anyio.CancelScope(shield=True):
            for end in (a, b):
                try:
                    await end.aclose()
                except Exception:
                    pass
    return seen
