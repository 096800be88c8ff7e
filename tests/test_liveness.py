"""A home PC that goes silent (power cut: the TCP connection stays half-open and nothing
closes it for many minutes) must not stall the phone: the phone pings a quiet executor,
drops the dead connection, redials, and still gets the task's result."""
from __future__ import annotations

from pathlib import Path

import anyio
import anyio.abc
import pytest

from conftest import run_nodes
from psymesh.agent.acting.tools import tool_from_function
from psymesh.node.control.client import Client
from psymesh.node.core.home import NodeHome

pytestmark = pytest.mark.anyio


class FreezingProxy:
    """A TCP relay on 127.0.0.1 that can freeze its connections without closing them,
    which is what a peer that lost power looks like from the other end."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = anyio.Event()
        self.port = 0

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_status.started()
        await listener.serve(self._relay)

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        upstream = await anyio.connect_tcp("127.0.0.1", self.target_port)
        async with client, upstream, anyio.create_task_group() as tg:
            tg.start_soon(self._pump, client, upstream)
            tg.start_soon(self._pump, upstream, client)

    async def _pump(self, src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream) -> None:
        try:
            while not self.frozen.is_set():
                data = await src.receive(65536)
                if self.frozen.is_set():
                    break
                await dst.send(data)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return
        await anyio.sleep_forever()  # frozen: hold the sockets open, pass nothing


async def test_phone_recovers_from_a_silently_dead_connection(tmp_path: Path) -> None:
    phone_home = NodeHome(tmp_path / "phone")
    phone_home.init(profile="phone", name="phone")
    phone_home.save_config(phone_home.load_config().model_copy(update={"liveness_probe_s": 1.0}))

    async def slow() -> dict:
        await anyio.sleep(3)  # a task that takes time: the connection dies while it runs
        return {"done": True}

    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes, \
            anyio.create_task_group() as tg:
        home = nodes["home"]
        home.tools.register(tool_from_function(slow, "test.slow"))
        home_port = int(home.p2p.addrs()[0].split("/tcp/")[1].split("/")[0])
        proxy = FreezingProxy(home_port)
        await tg.start(proxy.serve)

        async with Client(home.home.path) as h, Client(phone_home.path) as p:
            invite = await h.pair_invite()
            # Join through the relay: the phone's one connection to home runs over it.
            await p.pair_join(invite.code, address=f"/ip4/127.0.0.1/tcp/{proxy.port}/p2p/{home.identity.peer_id}")
            await h.grant("phone", ["tool:test.slow"])
            task = await p.delegate("home", tool="test.slow")
            assert task.accepted
            proxy.frozen.set()  # power cut: the connection neither works nor closes
            with anyio.fail_after(45):  # without the liveness ping this waits for TCP (~15 min)
                assert await task.result() == {"done": True}
        tg.cancel_scope.cancel()


async def test_many_quiet_tasks_share_one_liveness_ping(tmp_path: Path) -> None:
    """Tasks waiting on the same home must not each spend the phone's request rate on pings."""
    from conftest import pair

    phone_home = NodeHome(tmp_path / "phone")
    phone_home.init(profile="phone", name="phone")
    phone_home.save_config(phone_home.load_config().model_copy(update={"liveness_probe_s": 1.0}))

    async def quiet() -> dict:
        await anyio.sleep(3.5)  # the quiet time is the behaviour under test: pings are counted over it
        return {"done": True}

    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home = nodes["home"]
        home.tools.register(tool_from_function(quiet, "test.quiet"))
        await pair(home.home.path, phone_home.path)
        async with Client(home.home.path) as h, Client(phone_home.path) as p:
            await h.grant("phone", ["tool:test.quiet"])
            started = anyio.current_time()
            tasks = [await p.delegate("home", tool="test.quiet") for _ in range(6)]
            with anyio.fail_after(60):
                for t in tasks:
                    assert await t.result() == {"done": True}
            quiet_s = anyio.current_time() - started  # the grant runs 2 at a time: ~3 rounds of 3.5 s
            pings = [r for r in await h.audit(limit=1000) if r.operation == "ping"]
        # One probe a quiet second for the home, shared by all six followers (each on its own
        # would make it about six times as many).
        assert 1 <= len(pings) <= quiet_s + 3, (len(pings), quiet_s)
