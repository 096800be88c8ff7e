"""What the messaging tests share: reading a node's inbox as its app would, and the order rule."""
from __future__ import annotations

import anyio

from psymesh.node.daemon import Node
from psymesh.protocol.messaging import Letter


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
