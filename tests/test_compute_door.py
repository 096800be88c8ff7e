"""Lending compute through the door (issue 35, items 2 and 4): who may reach a worker, with what
budget, and what ends a stream. Real daemons on loopback, real libp2p streams; the worker's
child is a stand-in that echoes (tests/rpc_echo_child.py), so these check psymesh's half:
the llama.cpp half is tests/test_split_engine.py, both together tests/test_split.py."""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.node.control.client import Client
from psymesh.node.net.framed import FramedStream
from psymesh.protocol import ids
from psymesh.protocol.compute import RPC_MAX_FRAME, RpcAccept, RpcGate, RpcOffer
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.limits import Limits

pytestmark = pytest.mark.anyio
ECHO = [sys.executable, str(Path(__file__).with_name("rpc_echo_child.py"))]
V = (7, 0, 0)
HELLO = struct.pack("<BQ", 14, 0)


def alloc(mb: int) -> bytes:
    """llama.cpp's ALLOC_BUFFER command asking `mb` MB (ggml-rpc.cpp: cmd, size, {device, pad, size})."""
    return struct.pack("<BQ", 0, 16) + struct.pack("<I4xQ", 0, mb * 2**20)


async def echoed(stream, data: bytes) -> bytes:
    await stream.send_all(data)
    got = b""
    with anyio.fail_after(15):
        while len(got) < len(data):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            got += chunk
    return got


async def ended(stream) -> bool:
    with anyio.fail_after(15):
        while await stream.receive_some(65536):
            pass
    return True


def rpc_rows(node, peer_id: str) -> list[tuple[str, bool, str | None]]:
    return [(r["operation"], r["allowed"], r["code"]) for r in node.audit.query(peer_id=peer_id, limit=100)
            if r["protocol"] == ids.RPC]


async def lend(nodes, caps: list[str], limits: Limits | None = None):
    """laptop lends its compute (the stand-in child), paired with home, granting it `caps`."""
    home, laptop = nodes["home"], nodes["laptop"]
    laptop.worker.command = ECHO
    await laptop.worker.start()
    home.rpc_links.engine = lambda: (V, "test build")
    await pair(laptop.home.path, home.home.path, grant="messaging", grant_back=None)
    async with Client(laptop.home.path) as c:
        await c.grant("home", caps, limits=limits or Limits())
    return home, laptop, laptop.identity.peer_id


async def test_only_a_peer_granted_compute_rpc_reaches_the_worker(tmp_path):
    async with run_nodes(tmp_path, "home", "laptop", "stranger") as nodes:
        home, laptop, lid = await lend(nodes, ["msg.send"])
        with pytest.raises(PsymeshError) as refused:
            await home.rpc_links.probe(lid)
        assert refused.value.code is ErrorCode.FORBIDDEN and "compute.rpc" in refused.value.message

        stream = await nodes["stranger"].open_peer_stream(laptop.p2p.addrs()[0], ids.RPC)
        with pytest.raises(PsymeshError) as stranger:
            await FramedStream(stream, RPC_MAX_FRAME).request(RpcOffer(rpc=V, build="x"), RpcAccept)
        assert stranger.value.code is ErrorCode.UNKNOWN_PEER and "pair" in stranger.value.message

        async with Client(laptop.home.path) as c:
            await c.grant("home", ["msg.send", "compute.rpc"], limits=Limits(rpc_memory_mb=64))
        accept = await home.rpc_links.probe(lid)
        assert accept.memory_mb == 64 and tuple(accept.rpc) == V and accept.build == "echo"
        framed, _ = await home.rpc_links.offer(lid, probe=False)
        assert await echoed(framed.stream, HELLO) == HELLO  # llama.cpp's bytes cross, both ways
        await framed.aclose()
        assert rpc_rows(laptop, home.identity.peer_id) == [("compute.rpc (probe)", False, "forbidden"),
                                         ("compute.rpc (probe)", True, None), ("compute.rpc", True, None)]
        assert rpc_rows(laptop, nodes["stranger"].identity.peer_id) == [(ids.RPC, False, "unknown_peer")]


async def test_a_version_mismatch_and_a_second_owner_are_refused_saying_why(tmp_path):
    async with run_nodes(tmp_path, "home", "laptop", "tablet") as nodes:
        home, laptop, lid = await lend(nodes, ["compute.rpc"])
        home.rpc_links.engine = lambda: ((7, 1, 0), "newer build")
        with pytest.raises(PsymeshError) as old:
            await home.rpc_links.probe(lid)
        assert old.value.code is ErrorCode.UNSUPPORTED_VERSION
        assert "7.0.0" in old.value.message and "7.1.0" in old.value.message and "newer build" in old.value.message

        tablet = nodes["tablet"]  # a second owner, granted too
        tablet.rpc_links.engine = lambda: (V, "test build")
        await pair(laptop.home.path, tablet.home.path, grant="messaging", grant_back=None)
        async with Client(laptop.home.path) as c:
            await c.grant("tablet", add=["compute.rpc"])
        home.rpc_links.engine = lambda: (V, "test build")
        first, _ = await home.rpc_links.offer(lid, probe=False)
        for probe in (True, False):  # its probe too: the second owner's split leaves this worker out
            with pytest.raises(PsymeshError) as busy:
                await tablet.rpc_links.offer(lid, probe=probe)
            assert busy.value.code is ErrorCode.BUSY and "one split model at a time" in busy.value.message
        assert await echoed(first.stream, HELLO) == HELLO  # the first owner's stream is untouched
        assert (await home.rpc_links.probe(lid)).memory_mb is None  # the owner served may still ask

        # llama.cpp opens its connections one after another: the same owner's next stream waits
        # for the one before to end, instead of being refused busy
        rows = len(rpc_rows(laptop, home.identity.peer_id))
        async with anyio.create_task_group() as tg:
            nexts = []

            async def next_stream() -> None:
                nexts.append((await home.rpc_links.offer(lid, probe=False))[0])
            tg.start_soon(next_stream)
            await wait_until(lambda: len(rpc_rows(laptop, home.identity.peer_id)) > rows, "the next offer at the door")
            assert not nexts
            await first.aclose()
        [second] = nexts
        assert await echoed(second.stream, HELLO) == HELLO
        await second.aclose()
        assert laptop.worker.view().running  # the node and its worker serve on


async def test_allocations_past_the_grants_budget_cut_the_stream_before_the_server_sees_them(tmp_path):
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop, lid = await lend(nodes, ["compute.rpc"], Limits(rpc_memory_mb=8))
        framed, accept = await home.rpc_links.offer(lid, probe=False)
        assert accept.memory_mb == 8
        assert await echoed(framed.stream, alloc(6)) == alloc(6)  # 6 of 8 MB: served
        await framed.stream.send_all(alloc(3))                     # 9 of 8 MB: cut
        assert await ended(framed.stream)
        await wait_until(lambda: ("compute.rpc", False, "too_large") in rpc_rows(laptop, home.identity.peer_id), "the cut, audited")
        assert "memory budget of 8 MB" in laptop.worker.view().last_end


async def test_revoking_compute_rpc_closes_the_stream_at_once(tmp_path):
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop, lid = await lend(nodes, ["compute.rpc", "msg.send"])
        framed, _ = await home.rpc_links.offer(lid, probe=False)
        assert await echoed(framed.stream, HELLO) == HELLO
        async with Client(laptop.home.path) as c:
            await c.grant("home", remove=["compute.rpc"])
        assert await ended(framed.stream)
        await wait_until(lambda: ("compute.rpc", False, "forbidden") in rpc_rows(laptop, home.identity.peer_id), "the close, audited")

        async with Client(laptop.home.path) as c:  # granted again, then the pairing revoked: closed too
            await c.grant("home", add=["compute.rpc"])
        framed, _ = await home.rpc_links.offer(lid, probe=False)
        async with Client(laptop.home.path) as c:
            await c.revoke("home")
        assert await ended(framed.stream)
        await wait_until(lambda: ("compute.rpc", False, "unknown_peer") in rpc_rows(laptop, home.identity.peer_id), "the revocation")


async def test_a_worker_that_is_not_lending_says_how_to_start_it(tmp_path):
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop, lid = await lend(nodes, ["compute.rpc"])
        async with Client(laptop.home.path) as c:
            stopped = await c.worker("stop")
            assert not stopped.running and stopped.granted == ["home"]
        with pytest.raises(PsymeshError) as off:
            await home.rpc_links.probe(lid)
        assert off.value.code is ErrorCode.UNAVAILABLE and "psymesh worker start" in off.value.message
        async with Client(laptop.home.path) as c:
            started = await c.worker("start")
        assert started.running and started.isolation == "netns" and started.rpc == "7.0.0"
        assert (await home.rpc_links.probe(lid)).build == "echo"


def test_the_budget_gate_reads_llama_cpp_frames_across_any_chunking():
    stream = HELLO + alloc(3) + struct.pack("<BQ", 6, 5) + b"12345" + alloc(4)
    for cut in range(1, len(stream)):
        gate = RpcGate(8 * 2**20)
        gate.feed(stream[:cut])
        gate.feed(stream[cut:])
        assert gate.allocated == 7 * 2**20 and gate.commands == 4
    with pytest.raises(PsymeshError) as big:
        RpcGate(2**20).feed(struct.pack("<BQ", 6, 2**40))  # a payload larger than the budget: refused at its header
    assert big.value.code is ErrorCode.TOO_LARGE
    with pytest.raises(PsymeshError) as junk:
        RpcGate(None).feed(b"\xff" + bytes(8))
    assert junk.value.code is ErrorCode.BAD_FRAME


async def test_a_stream_ends_when_the_grant_that_admitted_it_expires(tmp_path):
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop, lid = await lend(nodes, ["compute.rpc"])
        async with Client(laptop.home.path) as c:
            await c.grant("home", add=["compute.rpc"], expires_s=3)
        framed, _ = await home.rpc_links.offer(lid, probe=False)
        assert await echoed(framed.stream, HELLO) == HELLO
        assert await ended(framed.stream)  # nothing else changed: the grant's date ended it
        await wait_until(lambda: ("compute.rpc", False, "expired") in rpc_rows(laptop, home.identity.peer_id),
                         "the close, audited")
        assert "expired" in laptop.worker.view().last_end
        with pytest.raises(PsymeshError) as late:
            await home.rpc_links.probe(lid)
        assert late.value.code is ErrorCode.EXPIRED


async def test_the_streams_of_one_load_are_one_request_of_the_grants_rate(tmp_path):
    """llama.cpp opens several connections one after another to load one model: the streams that
    follow the owner's previous one at once are audited each but charged as one request."""
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop, lid = await lend(nodes, ["compute.rpc"], Limits(requests_per_minute=2))
        await home.rpc_links.probe(lid)                  # one unit
        for _ in range(6):                               # one unit, the first; the rest go on with it
            framed, _ = await home.rpc_links.offer(lid, probe=False)
            assert await echoed(framed.stream, HELLO) == HELLO
            await framed.aclose()
        with pytest.raises(PsymeshError) as spent:
            await home.rpc_links.probe(lid)              # a third unit: over the grant's rate
        assert spent.value.code is ErrorCode.RATE_LIMITED
        assert rpc_rows(laptop, home.identity.peer_id)[:7] == [("compute.rpc (probe)", True, None)] + [
            ("compute.rpc", True, None)] * 6
