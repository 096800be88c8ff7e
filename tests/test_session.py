"""Sessions over real libp2p hosts on loopback: many requests on one negotiated stream,
streamed answers, cancel, a dead peer failing open requests, and a redial."""
from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import anyio
import pytest

from p2p_helpers import new_node, running
from waiting import wait_until
from psymesh.node.net.framed import ByteStream
from psymesh.node.net.liveness import Liveness
from psymesh.node.net.p2p import P2PNode, P2PStream
from psymesh.node.net.session import Call, SessionPool, serve_session
from psymesh.protocol.common import Error, Ping, Pong
from psymesh.protocol.errors import ConnectionLost, ErrorCode, NetworkError, RemoteError
from psymesh.protocol.framing import FrameDecoder, encode_frame
from psymesh.protocol.messages import Message, decode_map, pack
from psymesh.protocol.session import SessionEnd

pytestmark = pytest.mark.anyio
SESSION = "/psymesh/test-session/1.0.0"


class Server:
    """A door that answers ping with pong, streams `seq` pongs for ping(payload=b"stream")
    (the second half held to go out with the final answer for b"held"; held, then refused,
    for b"held-refuse"), and waits for ever on ping(payload=b"hang")."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.canceled = anyio.Event()

    async def __call__(self, call: Call) -> Message:
        self.calls.append(call)
        request = call.request
        assert isinstance(request, Ping)
        if request.payload == b"stream":
            for i in range(request.seq):
                await call.send(Pong(seq=i))
            return SessionEnd(reason="done")
        if request.payload in (b"held", b"held-refuse"):
            half = request.seq // 2
            await call.send(*(Pong(seq=i) for i in range(half)))
            call.send_with_answer(*(Pong(seq=i) for i in range(half, request.seq)))
            if request.payload == b"held-refuse":
                raise RemoteError("no", code=ErrorCode.FORBIDDEN)
            return SessionEnd(reason="done")
        if request.payload == b"hang":
            try:
                await anyio.sleep_forever()
            finally:
                self.canceled.set()
        if request.payload == b"refuse":
            raise RemoteError("no", code=ErrorCode.FORBIDDEN)
        return Pong(seq=request.seq)


def serve(node: P2PNode, door: Server) -> None:
    async def on_stream(stream: P2PStream) -> None:
        await serve_session(stream, stream.remote_peer_id, door, max_frame_size=1 << 20, max_open=64)

    node.set_handler(SESSION, on_stream)


def pool_for(client: P2PNode, watcher: Liveness | None = None) -> SessionPool:
    async def open_stream(peer_id: str, protocol: str) -> ByteStream:
        return await client.open_stream(peer_id, protocol)

    return SessionPool(open_stream, SESSION, 1 << 20, watcher)


@contextlib.asynccontextmanager
async def session_pair(door: Server) -> AsyncIterator[tuple[P2PNode, P2PNode, SessionPool]]:
    """A server answering with `door` and a connected client with a running session pool."""
    server, client = new_node(), new_node()
    serve(server, door)
    pool = pool_for(client)
    async with running(server, client), anyio.create_task_group() as tg:
        await tg.start(pool.run)
        await client.connect(server.addrs()[0])
        yield server, client, pool
        tg.cancel_scope.cancel()


async def test_many_requests_share_one_stream_and_answer_concurrently() -> None:
    door = Server()
    async with session_pair(door) as (server, _, pool):
        results: dict[int, int] = {}

        async def one(i: int) -> None:
            results[i] = (await pool.request(server.peer_id, Ping(seq=i), Pong)).seq

        async with anyio.create_task_group() as burst:
            for i in range(50):
                burst.start_soon(one, i)
        assert results == {i: i for i in range(50)}
        assert len(pool.sessions()) == 1
        assert sorted(c.rid for c in door.calls) == list(range(1, 51))  # one session, 50 request ids


class _Spawned:
    """A trio instrument counting tasks spawned."""

    def __init__(self) -> None:
        self.tasks = 0

    def task_spawned(self, task: object) -> None:
        self.tasks += 1


async def test_prompt_requests_are_answered_without_a_task_each_and_a_long_one_still_blocks_nothing() -> None:
    """A `prompt` kind (the daemon's: ping) is answered in the session's read loop, no task
    spawned for it; any other kind gets its own task, so one that never answers holds up
    neither the pings after it nor the session."""
    import trio

    from psymesh.protocol.tasks import TaskCaps

    release = anyio.Event()
    answered: list[str] = []

    async def door(call: Call) -> Message:
        if isinstance(call.request, TaskCaps):
            await release.wait()
            answered.append("caps")
            return Pong(seq=0)
        assert isinstance(call.request, Ping)
        return Pong(seq=call.request.seq)

    server, client = new_node(), new_node()

    async def on_stream(stream: P2PStream) -> None:
        await serve_session(stream, stream.remote_peer_id, door, max_frame_size=1 << 20, max_open=64,
                            prompt=frozenset({Ping}))

    server.set_handler(SESSION, on_stream)
    pool = pool_for(client)
    async with running(server, client), anyio.create_task_group() as tg:
        await tg.start(pool.run)
        await client.connect(server.addrs()[0])
        assert (await pool.request(server.peer_id, Ping(seq=0), Pong)).seq == 0  # the session is open
        spawned = _Spawned()
        trio.lowlevel.add_instrument(spawned)  # type: ignore[arg-type]
        try:
            for seq in range(1, 51):
                assert (await pool.request(server.peer_id, Ping(seq=seq), Pong)).seq == seq
        finally:
            trio.lowlevel.remove_instrument(spawned)  # type: ignore[arg-type]
        assert spawned.tasks == 0
        tg.start_soon(pool.request, server.peer_id, TaskCaps(), Pong)
        await wait_until(lambda: pool.sessions()[0].open_requests == 1, "the long request to be open")
        for seq in range(51, 61):  # answered while it hangs
            assert (await pool.request(server.peer_id, Ping(seq=seq), Pong)).seq == seq
        assert answered == []
        release.set()
        await wait_until(lambda: answered == ["caps"], "the long request to end")
        tg.cancel_scope.cancel()


async def test_a_streamed_answer_arrives_whole_and_in_order() -> None:
    async with session_pair(Server()) as (server, _, pool):
        async with pool.stream(server.peer_id, Ping(seq=500, payload=b"stream")) as replies:
            got = [m async for m in replies]
        assert [m.seq for m in got[:-1]] == list(range(500)) and isinstance(got[-1], SessionEnd)
        # frames held for the final answer come just before it, in order
        async with pool.stream(server.peer_id, Ping(seq=9, payload=b"held")) as replies:
            got = [m async for m in replies]
        assert [m.seq for m in got[:-1]] == list(range(9)) and isinstance(got[-1], SessionEnd)
        with pytest.raises(RemoteError) as info:
            await pool.request(server.peer_id, Ping(seq=1, payload=b"refuse"), Pong)
        assert info.value.code is ErrorCode.FORBIDDEN
        # a service that fails after holding frames: its error goes alone, the held frames never
        async with pool.stream(server.peer_id, Ping(seq=6, payload=b"held-refuse")) as replies:
            got = [m async for m in replies]
        assert [m.seq for m in got[:-1]] == [0, 1, 2] and isinstance(got[-1], Error)
        assert got[-1].code == ErrorCode.FORBIDDEN


async def test_leaving_a_stream_early_cancels_the_work_on_the_server() -> None:
    door = Server()
    async with session_pair(door) as (server, _, pool):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.request, server.peer_id, Ping(seq=1, payload=b"hang"), Pong)
            await wait_until(lambda: len(door.calls) == 1, "the hanging request to reach the server")
            tg.cancel_scope.cancel()  # the client leaves it
        with anyio.fail_after(5):
            await door.canceled.wait()
        assert (await pool.request(server.peer_id, Ping(seq=7), Pong)).seq == 7  # the session lives on


async def test_a_reused_request_id_gets_the_error_frame_before_the_stream_closes() -> None:
    """docs/protocol.md §2 and §5.1: the server answers the frame that breaks the session with
    one `error` frame without `rid`, then closes (the requests open on it are lost, as when
    a session breaks: the client asks again on a new one)."""
    server, client, door = new_node(), new_node(), Server()
    serve(server, door)
    async with running(server, client):
        await client.connect(server.addrs()[0])
        stream = await client.open_stream(server.peer_id, SESSION)
        ping = encode_frame(pack(Ping(seq=1), {"rid": 1}))
        await stream.send_all(ping + ping)
        decoder, bodies = FrameDecoder(), []
        with anyio.fail_after(10):
            while data := await stream.receive_some(65536):
                decoder.feed(data)
                while (body := decoder.next_frame()) is not None:
                    bodies.append(decode_map(body))
        assert all(b.get("rid") == 1 for b in bodies[:-1])  # at most the first ping's pong before it
        assert bodies[-1]["type"] == "error" and "rid" not in bodies[-1]
        assert bodies[-1]["code"] == "bad_frame" and "does not follow" in bodies[-1]["message"]


async def test_a_peer_that_goes_away_fails_open_requests_and_the_next_request_redials() -> None:
    seed = os.urandom(32)
    server, client, door = new_node(seed), new_node(), Server()
    serve(server, door)
    pool = pool_for(client)
    async with running(client), anyio.create_task_group() as tg:
        await tg.start(pool.run)
        async with anyio.create_task_group() as server_tg:
            await server_tg.start(server.run)
            addr = server.addrs()[0]
            await client.connect(addr)
            assert (await pool.request(server.peer_id, Ping(seq=1), Pong)).seq == 1
            failure: list[BaseException] = []

            async def hang() -> None:
                try:
                    await pool.request(server.peer_id, Ping(seq=2, payload=b"hang"), Pong)
                except NetworkError as exc:
                    failure.append(exc)

            tg.start_soon(hang)
            await wait_until(lambda: len(door.calls) == 2, "the hanging request to reach the server")
            server_tg.cancel_scope.cancel()  # the server stops: its connections close
        await wait_until(lambda: bool(failure), "the open request to fail")
        assert isinstance(failure[0], ConnectionLost)
        again = new_node(seed)  # the same peer back, on a new port
        serve(again, door)
        async with running(again):
            await client.connect(again.addrs()[0])
            assert (await pool.request(again.peer_id, Ping(seq=3), Pong)).seq == 3
        tg.cancel_scope.cancel()


async def test_liveness_drops_a_session_whose_peer_stops_answering() -> None:
    server, client = new_node(), new_node()
    frozen = anyio.Event()

    async def door(call: Call) -> Message:
        if isinstance(call.request, Ping) and call.request.payload == b"wait":
            await anyio.sleep_forever()
        await frozen.wait()  # the liveness ping: a peer that lost power never answers
        return Error.of(ErrorCode.INTERNAL, "unreachable")

    async def on_stream(stream: P2PStream) -> None:
        await serve_session(stream, stream.remote_peer_id, door, max_frame_size=1 << 20, max_open=64)

    server.set_handler(SESSION, on_stream)
    dropped: list[str] = []

    async def drop(peer_id: str) -> None:
        dropped.append(peer_id)
        await client.disconnect(peer_id)

    pool = pool_for(client, Liveness(probe_s=0.3, drop_connection=drop))
    async with running(server, client), anyio.create_task_group() as tg:
        await tg.start(pool.run)
        await client.connect(server.addrs()[0])
        with anyio.fail_after(10), pytest.raises(ConnectionLost):
            await pool.request(server.peer_id, Ping(seq=1, payload=b"wait"), Pong, timeout=60)
        assert dropped == [server.peer_id]
        tg.cancel_scope.cancel()


async def test_a_relayed_session_gives_way_to_a_direct_one_and_closes_once_idle() -> None:
    """Reached through a relay at first; once a direct connection opens, new requests take a
    new session on it, while a request still open on the relayed one finishes there."""
    from psymesh.protocol.relay import RelaySettings

    door, relay, server, client = Server(), new_node(), new_node(), new_node()
    relay.serve_relay(RelaySettings(enabled=True), lambda peer_id, what: None)
    serve(server, door)

    async def open_stream(peer_id: str, protocol: str) -> ByteStream:
        return await client.open_stream(peer_id, protocol)

    pool = SessionPool(open_stream, SESSION, 1 << 20, path=client.path)
    async with running(relay, server, client), anyio.create_task_group() as tg:
        await tg.start(pool.run)
        await server.reserve(relay.peer_id, relay.addrs())
        await client.connect(server.relayed_addrs()[0])
        first = await pool.session(server.peer_id)
        assert first.relayed and await pool.request(server.peer_id, Ping(seq=1), Pong) == Pong(seq=1)

        got: list[Pong] = []

        async def long_request() -> None:  # a stream still open when the path changes
            async with pool.stream(server.peer_id, Ping(seq=3, payload=b"stream")) as replies:
                await wait_until(lambda: client.path(server.peer_id) == "direct", "the direct path")
                got.extend([m async for m in replies if isinstance(m, Pong)])

        tg.start_soon(long_request)
        await wait_until(lambda: len(door.calls) == 2, "the long request to reach the server")
        await client.connect(server.addrs()[0])
        second = await pool.session(server.peer_id)
        assert second is not first and not second.relayed
        assert await pool.request(server.peer_id, Ping(seq=2), Pong) == Pong(seq=2)
        await wait_until(lambda: len(got) == 3, "the relayed session's last request to finish")
        await wait_until(lambda: first.closed.is_set(), "the relayed session to close once idle")
        assert await client.drop_relayed(server.peer_id, idle_only=True)
        tg.cancel_scope.cancel()
