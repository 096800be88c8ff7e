"""Test helpers for real libp2p nodes on loopback: run a few P2PNodes, count trio tasks."""
from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import trio

from psymesh.node.net.framed import FramedStream
from psymesh.node.net.p2p import P2PNode, P2PStream
from psymesh.protocol.common import Ping, Pong
from psymesh.protocol.common import expect
from psymesh.protocol.framing import FrameDecoder
from psymesh.protocol.messages import decode_map

PING = "/psymesh/test-ping/1.0.0"


def new_node(seed: bytes | None = None, **kwargs: Any) -> P2PNode:
    """A node (fresh identity unless `seed`; 127.0.0.1, random port) that answers pings on PING."""
    node = P2PNode(seed or os.urandom(32), **kwargs)
    node.set_handler(PING, ping_handler)
    return node


async def ping_handler(stream: P2PStream) -> None:
    """Answer every Ping on the stream until the peer closes it."""
    framed = FramedStream(stream)
    while (message := await framed.receive()) is not None:
        ping = expect(message, Ping)
        await framed.send(Pong(seq=ping.seq, payload=ping.payload))


@asynccontextmanager
async def running(*nodes: P2PNode) -> AsyncIterator[None]:
    """Run `nodes` (each listening before the body starts); stop them all when the body ends."""
    async with anyio.create_task_group() as tg:
        for node in nodes:
            await tg.start(node.run)
        yield
        tg.cancel_scope.cancel()


def all_trio_tasks() -> set[trio.lowlevel.Task]:
    """Every task alive in this trio run, system tasks included."""
    tasks: set[trio.lowlevel.Task] = set()
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        if task is not None:
            tasks.add(task)
            stack.extend(t for nursery in task.child_nurseries for t in nursery.child_tasks)
    return tasks


def unused_port() -> int:
    """A loopback TCP port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def raw_answers(stream: P2PStream, count: int, timeout: float = 20) -> dict[int, dict]:
    """The final frames answering `count` requests written raw on a session stream, as
    decoded maps by `rid` (a test that writes bytes of its own reads the bytes back)."""
    answers: dict[int, dict] = {}
    decoder = FrameDecoder()
    with anyio.fail_after(timeout):
        while len(answers) < count:
            data = await stream.receive_some(65536)
            assert data, f"the stream closed after {answers}"
            decoder.feed(data)
            while (body := decoder.next_frame()) is not None:
                obj = decode_map(body)
                answers[obj["rid"]] = obj
    return answers
