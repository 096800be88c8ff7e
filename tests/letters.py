"""What the messaging tests share: reading a node's inbox as its app would, and the order rule."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

from conftest import pair, run_nodes
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.protocol.limits import Limits
from psymesh.protocol.messaging import Letter


@contextlib.asynccontextmanager
async def letter_mesh(tmp_path: Path, home: str, *senders: str, limits: Limits,
                      configs: dict[str, dict] | None = None) -> AsyncIterator[dict[str, Node]]:
    """Daemons `home` and `senders`, each sender paired with home and granted `msg.send` there."""
    async with run_nodes(tmp_path, home, *senders, configs=configs) as nodes:
        async with Client(nodes[home].home.path) as h:
            for sender in senders:
                await pair(nodes[home].home.path, nodes[sender].home.path)
                await h.grant(sender, ["msg.send"], limits=limits)
        yield nodes


async def inbox(node: Node, count: int, timeout: float = 20) -> list[Letter]:
    """The first `count` letters the app sees, in release order."""
    got: list[Letter] = []
    with anyio.fail_after(timeout):
        async for received in node.messaging.follow():
            got.append(received.letter)
            if len(got) == count:
                return got
    return got


def threads_in_order(letters: list[Letter]) -> bool:
    """Each (sender, thread) runs 1, 2, 3 ... with no gap and no repeat."""
    seen: dict[tuple[str, str], int] = {}
    for letter in letters:
        key = (letter.sender, letter.thread)
        if letter.tseq != seen.get(key, 0) + 1:
            return False
        seen[key] = letter.tseq
    return True
