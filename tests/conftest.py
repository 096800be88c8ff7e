"""Shared test fixtures. Async tests run on trio through anyio's pytest plugin
(libp2p is trio-native); SDK tests that must prove asyncio support use pytest-asyncio."""
from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio


@contextlib.asynccontextmanager
async def run_nodes(tmp_path: Path, *names: str, profiles: dict[str, str] | None = None) -> AsyncIterator[dict]:
    """Run in-process daemons (one per name) under one task group; cancel them all on exit."""
    from psymesh.node.daemon import Node
    from psymesh.node.home import NodeHome

    profiles = profiles or {}
    nodes = {}
    async with anyio.create_task_group() as tg:
        for name in names:
            home = NodeHome(tmp_path / name)
            home.init(profile=profiles.get(name, "home"), name=name)  # type: ignore[arg-type]
            config = home.load_config().model_copy(update={"listen": ["/ip4/127.0.0.1/tcp/0"]})
            node = Node(home, config)
            await tg.start(node.run)
            nodes[name] = node
        try:
            yield nodes
        finally:
            tg.cancel_scope.cancel()


async def pair(inviter_home: Path, joiner_home: Path, *, grant: str = "phone", grant_back: str | None = "messaging"):
    """Pair two running daemons through their control sockets, as `psymesh pair` does."""
    from psymesh.node.client import Client

    async with Client(inviter_home) as inviter, Client(joiner_home) as joiner:
        invite = await inviter.pair_invite(grant=grant)
        return await joiner.pair_join(invite.invite, grant=grant_back)
