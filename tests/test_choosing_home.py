"""delegate(to=None) picks a home: every candidate asked at once, the first that fits taken,
a peer that did not answer remembered (issue 34 item 11)."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import pytest
from conftest import run_nodes

from psymesh.node.control.client import Client
from psymesh.node.control.process import DaemonProcess, pair_homes
from psymesh.node.tasks.homes import HomeChooser
from psymesh.protocol.errors import ConnectError, ErrorCode, RemoteError
from psymesh.protocol.tasks import TaskCapsReply

PROBE_BOUND_S = 5.0  # a probe's bound: a choice that waited for the frozen home took at least this


@pytest.mark.anyio
async def test_a_frozen_home_does_not_slow_the_choice(tmp_path: Path) -> None:
    """Two real home daemons, one frozen with SIGSTOP: each delegate(to=None) goes to the other
    without waiting out the frozen one's probe, and the second asks the frozen one nothing new."""
    homes = [DaemonProcess(tmp_path / name, name=name) for name in ("home-a", "home-b")]
    async with anyio.create_task_group() as tg:
        for home in homes:
            tg.start_soon(home.start)
    try:
        async with run_nodes(tmp_path, "phone", profiles={"phone": "phone"}) as nodes:
            for home in homes:
                await pair_homes(home.home, tmp_path / "phone", grant="phone")
            chooser = nodes["phone"].submitter.homes
            async with Client(tmp_path / "phone") as phone:
                warm = await phone.delegate(tool="system.info")  # both answer: sessions open, nobody quiet
                assert (await warm.result())["profile"] == "home"
                frozen, live = homes
                assert frozen.proc is not None
                frozen.proc.send_signal(signal.SIGSTOP)
                try:
                    took = []
                    for _ in range(2):
                        start = time.monotonic()
                        task = await phone.delegate(tool="system.info")
                        took.append(time.monotonic() - start)
                        assert task.target_name == live.name and task.accepted
                        assert (await task.result())["profile"] == "home"
                    probes = chooser.probes
                    # before: 5.02 s and 5.01 s (each probe waited out in turn). Margin for a loaded machine.
                    assert max(took) < PROBE_BOUND_S - 1.0, took
                    # the first choice's probe of the frozen home was still out: the second waited on
                    # nothing from it and asked it nothing new (one probe of the live home each time)
                    assert probes == 2 + 2 + 1, probes
                finally:
                    frozen.proc.send_signal(signal.SIGCONT)
    finally:
        for home in homes:
            assert await home.stop() == 0


def _caps(depth: int = 0, tools: tuple[str, ...] = ("system.info",)) -> TaskCapsReply:
    return TaskCapsReply(tools=list(tools), models=[], queue_depth=depth)


class _Peers:
    """task.caps answers on demand: each peer answers when the test lets it (or never)."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.answers: dict[str, TaskCapsReply | Exception] = {}
        self.go: dict[str, anyio.Event] = {}

    async def offers(self, peer: str) -> TaskCapsReply:
        self.asked.append(peer)
        await self.go.setdefault(peer, anyio.Event()).wait()
        answer = self.answers[peer]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def answer(self, peer: str, answer: TaskCapsReply | Exception) -> None:
        self.answers[peer] = answer
        self.go.setdefault(peer, anyio.Event()).set()


@pytest.mark.anyio
async def test_the_chooser_remembers_a_quiet_peer_and_asks_it_last() -> None:
    now = [0.0]
    refused: list[str] = []
    chooser = HomeChooser(on_refused=lambda peer, exc: refused.append(peer), timeout_s=0.5, quiet_s=30.0,
                          clock=lambda: now[0])
    peers = _Peers()
    fits = lambda caps: "system.info" in caps.tools  # noqa: E731
    async with anyio.create_task_group() as tg:
        peers.answer("b", _caps(depth=2))
        assert await chooser.choose(tg, ["a", "b"], fits, peers.offers) == ["b"]  # b fits: a not awaited
        assert sorted(peers.asked) == ["a", "b"] and chooser.probes == 2
        # a's probe is still out: a second choice starts no other one to it
        assert await chooser.choose(tg, ["a", "b"], fits, peers.offers) == ["b"]
        assert sorted(peers.asked) == ["a", "b", "b"]
    # (leaving the group waited a's probe out: anyio's fail_after ran on the real clock.) a is quiet now
    assert chooser.quiet("a")
    async with anyio.create_task_group() as tg:
        # quiet peers are asked only when nobody else fits
        peers.answer("b", _caps(tools=()))
        peers.answer("a", _caps(depth=0))
        assert await chooser.choose(tg, ["a", "b"], fits, peers.offers) == ["a"]
        assert peers.asked[-2:] == ["b", "a"]
        # a refusal (it revoked us) is reported, a peer that is down is skipped, neither is quiet
        peers.answer("c", RemoteError("unknown peer", code=ErrorCode.UNKNOWN_PEER))
        peers.answer("d", ConnectError("refused"))
        assert await chooser.choose(tg, ["c", "d", "b"], fits, peers.offers) == []
        assert refused == ["c"] and not chooser.quiet("c") and not chooser.quiet("d")
    now[0] = 31.0  # quiet_s later: a is asked with the others again
    assert not chooser.quiet("a")
