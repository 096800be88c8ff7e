"""Groups: a message to a named list of peers is one letter per member over direct
sessions, so a burst arrives whole, in order and exactly once at every member (real
in-process daemons on loopback, driven through the SDK as a script would)."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.messaging.store import OutState
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.limits import Limits
from psymesh.protocol.messaging import LetterKind

pytestmark = pytest.mark.anyio
ROOMY = Limits(requests_per_minute=100_000)
BURST = 200


async def _members_of(host: Node, members: list[Node]) -> None:
    """Pair each member with `host`, and let the host send it as much as a burst needs
    (the messaging preset allows 30 letters a minute)."""
    for member in members:
        await pair(member.home.path, host.home.path)
        async with Client(member.home.path) as m:
            await m.grant("host", ["msg.send"], limits=ROOMY)


async def test_a_200_letter_burst_reaches_three_members_whole_in_order_once(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "host", "a", "b", "c") as nodes:
        host, members = nodes["host"], [nodes[n] for n in "abc"]
        await _members_of(host, members)
        async with Client(host.home.path) as h:
            group = await h.group_create("family", ["a", "b"])
            group = await h.group_add("family", ["c", "a"])  # adding a member twice keeps one
            assert [m.name for m in group.members] == ["a", "b", "c"]
            sent = []
            for i in range(BURST):
                sent += await h.group_send("family", f"burst {i}", body={"i": i})
        assert len(sent) == 3 * BURST and len({s.id for s in sent}) == 3 * BURST

        for member in members:
            store = member.messaging.store
            await wait_until(lambda: len(store.released_after(0, limit=10 * BURST)) >= BURST,
                             f"{member.config.name} to hold the whole burst", timeout=60)
        await wait_until(lambda: all(host.messaging.store.sent(s.id).state is OutState.DELIVERED for s in sent),
                         "every receipt back at the host", timeout=30)
        for member in members:
            store = member.messaging.store
            got = [r.letter for r in store.released_after(0, limit=10 * BURST)]
            assert len(got) == BURST and store.held() == 0  # nothing lost, nothing twice, nothing held back
            assert [x.text for x in got] == [f"burst {i}" for i in range(BURST)]
            assert [x.tseq for x in got] == list(range(1, BURST + 1))
            assert {(x.group, x.thread, x.kind, x.sender) for x in got} == \
                {("family", "group:family", LetterKind.SEND, host.identity.peer_id)}
            assert all(x.signature_valid() for x in got)


async def test_group_lists_are_the_senders_own_and_checked(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "host", "a", "b") as nodes:
        host = nodes["host"]
        await _members_of(host, [nodes["a"], nodes["b"]])
        async with Client(host.home.path) as h:
            await h.group_create("empty")
            with pytest.raises(PsymeshError) as info:
                await h.group_send("empty", "anyone?")
            assert info.value.code is ErrorCode.BAD_REQUEST
            with pytest.raises(PsymeshError) as info:
                await h.group_create("empty", ["a"])
            assert info.value.code is ErrorCode.CONFLICT
            with pytest.raises(PsymeshError) as info:
                await h.group_create("ghosts", ["a", "nobody"])
            assert info.value.code is ErrorCode.UNKNOWN_PEER
            with pytest.raises(PsymeshError) as info:
                await h.group_send("no-such-group", "hi")
            assert info.value.code is ErrorCode.NOT_FOUND
            with pytest.raises(PsymeshError) as info:  # checked in the SDK, before anything is sent
                await h.group_create("two words")
            assert info.value.code is ErrorCode.BAD_REQUEST
            assert [g.name for g in await h.groups()] == ["empty"]  # nothing half-made

            await h.group_create("pair", ["a", "b"])
            after = await h.group_remove("pair", ["b"])
            assert [m.name for m in after.members] == ["a"]
            [letter] = await h.group_send("pair", "just a")
            assert letter.recipient_name == "a" and letter.group == "pair" and letter.thread == "group:pair"
        # the members were told nothing: a group is a list on the sender's node
        assert nodes["a"].groups.list() == [] and nodes["b"].groups.list() == []
        await wait_until(lambda: len(nodes["a"].messaging.store.released_after(0)) == 1, "a to get its letter")
        assert nodes["b"].messaging.store.released_after(0) == []
