"""Delegated tasks survive SIGKILL of either node (real daemon processes on loopback).

The promise under test: once `delegate()` returns, the task runs to one outcome and
its submitter ends up with every event exactly once, whichever node dies meanwhile
and however often. Work interrupted by a crash runs again (the log says so with a
`requeued` event): execution is at-least-once, *completion* is exactly once.
Also: a phone killed while a submit is in flight, and a cancel issued while it is.

The home runs a plugin tool (installed the way pip would: a dist-info with an entry
point, found through PYTHONPATH) that logs each start and finish, so the tests can
count executions across processes.
"""
from __future__ import annotations

import random
import signal
import socket
from collections import Counter
from pathlib import Path

import anyio
import pytest
from waiting import wait_until
from worktool import TOOL_NAME, tool_log, tool_runs, unfinished_runs  # noqa: F401  (tool_log: a fixture)

from psymesh.node.control.client import Client
from psymesh.node.core.db import open_db
from psymesh.node.models import ModelRegistry
from psymesh.node.control.process import DaemonProcess, pair_homes
from psymesh.node.tasks.store import ExecutorStore, Outbox, TaskNotFound
from psymesh.protocol.errors import ErrorCode, RemoteError
from psymesh.protocol.limits import Limits
from psymesh.protocol.tasks import EventKind, TaskEvent, TaskState

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CAPS = ["task.infer", "tool:system.info", "tool:testwork.*"]
ROOMY = Limits(requests_per_minute=100_000, concurrent_tasks=64, max_runtime_s=600, max_payload_bytes=1 << 20)
ROUNDS = 3

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _start_pair(tmp_path: Path, tiny_model: Path) -> tuple[DaemonProcess, DaemonProcess]:
    # A fixed port, so the address the phone stored at pairing stays valid across restarts.
    home = DaemonProcess(tmp_path / "home", name="home", listen=[f"/ip4/127.0.0.1/tcp/{_free_port()}"])
    phone = DaemonProcess(tmp_path / "phone", profile="phone", name="phone")
    async with anyio.create_task_group() as tg:
        tg.start_soon(home.start)
        tg.start_soon(phone.start)
    await pair_homes(home.home, phone.home, grant="phone")
    async with home.client() as h:
        await h.grant("phone", CAPS, limits=ROOMY)
    conn = open_db(home.home / "node.db")  # the running daemon sees it at the next request
    ModelRegistry(conn).add("tiny", tiny_model, n_ctx=4096, n_threads=1)
    conn.close()
    return home, phone


async def _delegate_mix(c: Client, n_work: int, n_infer: int, n_info: int) -> dict[str, str]:
    """Task id -> what it is: slow tool calls, token-streaming inferences, instant ones."""
    kinds: dict[str, str] = {}
    for i in range(max(n_work, n_infer, n_info)):
        if i < n_work:
            kinds[(await c.delegate("home", tool=TOOL_NAME, args={"tag": f"w{i}", "ms": 600})).id] = f"w{i}"
        if i < n_infer:
            t = await c.delegate("home", infer=f"Count to {i}.", model="tiny", max_tokens=2500,
                                 params={"ban_bytes": True, "seed": i, "temperature": 0})
            kinds[t.id] = "infer"
        if i < n_info:
            kinds[(await c.delegate("home", tool="system.info")).id] = "info"
    return kinds


def _check_history(events: list[TaskEvent], what: str, runs: Counter[str]) -> None:
    """One task's history as the app saw it: each event once, in order, one final event
    (a result); an interrupted run is voided by `requeued` and the last run stands."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), what
    assert [e.state.terminal for e in events].count(True) == 1, what
    final = events[-1]
    assert final.kind is EventKind.RESULT and final.state is TaskState.COMPLETED, (what, final)
    requeues = [i for i, e in enumerate(events) if e.kind is EventKind.REQUEUED]
    last_run = events[(requeues[-1] + 1) if requeues else 0:]
    assert [e.state for e in last_run].count(TaskState.WORKING) >= 1
    starts = sum(1 for e in events if e.kind is EventKind.STATE and e.state is TaskState.WORKING)
    value = final.data["result"]
    if what == "infer":
        tokens = "".join(e.data["text"] for e in last_run if e.kind is EventKind.TOKEN)
        assert tokens == value["text"] and value["usage"]["completion_tokens"] == 2500
    elif what.startswith("w"):
        assert value["tag"] == what
        # Every run the tool made is one the log announced; none ran after completion.
        assert 1 <= runs[f"done {what}"] <= runs[f"start {what}"] <= starts, (what, runs, starts)


async def _all_acknowledged(home: DaemonProcess, ids: set[str]) -> None:
    """Wait until the executor knows the phone holds every event (then it may forget the tasks)."""

    async def acknowledged() -> bool:
        async with home.client() as h:
            held = [t for t in (await h.tasks(limit=1000)).executing if t.task_id in ids]
        return all(t.acked_seq == t.last_seq for t in held)

    await wait_until(acknowledged, "the home to know the phone holds every event", timeout=20)


def _logs_match(home: Path, phone: Path, seen: dict[str, list[TaskEvent]]) -> None:
    """The phone's mirror holds exactly what the app saw, and exactly the executor's log."""
    hconn, pconn = open_db(home / "node.db"), open_db(phone / "node.db")
    try:
        store, outbox = ExecutorStore(hconn), Outbox(pconn)
        for task_id, events in seen.items():
            ours = outbox.events_after(task_id, 0, limit=100_000)
            assert ours == events, task_id
            try:
                theirs = store.events_after(task_id, 0, limit=100_000)
            except TaskNotFound:  # fully acknowledged: the executor may have forgotten it
                continue
            assert ours == theirs, task_id
    finally:
        hconn.close()
        pconn.close()


async def test_home_killed_mid_tasks_every_task_completes_once(tmp_path: Path, tool_log: Path,
                                                                tiny_model: Path) -> None:
    home, phone = await _start_pair(tmp_path, tiny_model)
    rng = random.Random(7)
    seen: dict[str, list[TaskEvent]] = {}
    try:
        async with phone.client() as c:
            kinds = await _delegate_mix(c, n_work=8, n_infer=3, n_info=4)

            async def watch(task_id: str) -> None:  # the app keeps watching through the crashes
                seen[task_id] = [ev async for ev in c.task(task_id).events()]

            with anyio.fail_after(75):
                async with anyio.create_task_group() as tg:
                    for task_id in kinds:
                        tg.start_soon(watch, task_id)
                    for _ in range(ROUNDS):  # the behaviour under test: kills at random moments
                        await anyio.sleep(rng.uniform(0.3, 0.8))  # while tasks run
                        home.kill()
                        await anyio.sleep(rng.uniform(0.0, 0.3))  # and a random time down
                        await home.start()
        assert set(seen) == set(kinds)
        runs = tool_runs(tool_log)
        for task_id, what in kinds.items():
            _check_history(seen[task_id], what, runs)
        requeued = sum(1 for evs in seen.values() for e in evs if e.kind is EventKind.REQUEUED)
        assert requeued >= 1, "no crash hit a running task: the test proved nothing"
        # And no task runs again later: the home holds every one as finished (a finished task
        # is never run again), and no run its live process started is still going (runs in
        # killed processes cannot come back).
        async with home.client() as h:
            held = {t.task_id: t.state for t in (await h.tasks(limit=1000)).executing if t.task_id in kinds}
        assert all(state.terminal for state in held.values()), held
        assert home.proc is not None and not unfinished_runs(tool_log, home.proc.pid)
        assert tool_runs(tool_log) == runs
        await _all_acknowledged(home, set(kinds))
    finally:
        await phone.stop()
        await home.stop()
    _logs_match(home.home, phone.home, seen)


async def test_phone_killed_mid_tasks_gets_every_event_once(tmp_path: Path, tool_log: Path,
                                                            tiny_model: Path) -> None:
    home, phone = await _start_pair(tmp_path, tiny_model)
    rng = random.Random(11)
    seen: dict[str, list[TaskEvent]] = {}
    try:
        async with phone.client() as c:
            kinds = await _delegate_mix(c, n_work=8, n_infer=3, n_info=4)
        for task_id in kinds:
            seen[task_id] = []

        async def follow(task_id: str) -> None:
            """Like an app: watch from the last event it holds; the daemon may vanish under it."""
            after = seen[task_id][-1].seq if seen[task_id] else 0
            try:
                async with phone.client() as c:
                    async for ev in c.task(task_id).events(after):
                        seen[task_id].append(ev)
            except Exception:  # the phone died: resume after the restart
                pass

        with anyio.fail_after(75):
            for _ in range(ROUNDS):
                async with anyio.create_task_group() as tg:
                    for task_id in kinds:
                        tg.start_soon(follow, task_id)
                    await anyio.sleep(rng.uniform(0.3, 0.8))  # the behaviour under test: a kill at a random moment
                    phone.kill()
                await phone.start()
            async with anyio.create_task_group() as tg:  # after the last restart: to the end
                for task_id in kinds:
                    tg.start_soon(follow, task_id)
        runs = tool_runs(tool_log)
        for task_id, what in kinds.items():
            _check_history(seen[task_id], what, runs)
        assert all(runs[f"start w{i}"] == 1 for i in range(8))  # the home never restarted
        await _all_acknowledged(home, set(kinds))
    finally:
        await phone.stop()
        await home.stop()
    _logs_match(home.home, phone.home, seen)


async def test_phone_killed_while_handing_a_task_over_still_delivers_it(tmp_path: Path, tool_log: Path,
                                                                       tiny_model: Path) -> None:
    """The outbox holds a task before it goes out: a phone killed mid-submit (here: the home
    is frozen, so the submit hangs) delivers it after its restart, and the app finds it by id."""
    home, phone = await _start_pair(tmp_path, tiny_model)
    try:
        assert home.proc is not None
        home.proc.send_signal(signal.SIGSTOP)
        try:
            returned: list[bool] = []
            async with phone.client() as c, phone.client() as c2, anyio.create_task_group() as tg:
                async def submit() -> None:
                    await c.delegate("home", tool=TOOL_NAME, args={"tag": "w0", "ms": 50}, task_id="t-handover")
                    returned.append(True)

                async def in_the_outbox() -> bool:
                    return any(t.task_id == "t-handover" for t in (await c2.tasks()).submitted)

                tg.start_soon(submit)
                await wait_until(in_the_outbox, "the phone to hold t-handover in its outbox", timeout=10)
                assert not returned, "the submit should hang while the home is frozen"
                tg.cancel_scope.cancel()
            phone.kill()
        finally:
            home.proc.send_signal(signal.SIGCONT)
        await phone.start()
        async with phone.client() as c:
            with anyio.fail_after(30):
                events = [ev async for ev in c.task("t-handover").events()]
        _check_history(events, "w0", tool_runs(tool_log))
        assert tool_runs(tool_log)["start w0"] == 1
    finally:
        await phone.stop()
        await home.stop()


async def test_cancel_while_the_task_is_on_its_way_reaches_the_home(tmp_path: Path, tool_log: Path,
                                                                     tiny_model: Path) -> None:
    """The app cancels a task whose submit is still in flight (the home is frozen): once the
    home wakes and accepts it, the phone passes the cancel on instead of mirroring it."""
    home, phone = await _start_pair(tmp_path, tiny_model)
    try:
        assert home.proc is not None
        async with phone.client() as c, anyio.create_task_group() as tg:
            home.proc.send_signal(signal.SIGSTOP)
            try:
                tg.start_soon(lambda: c.delegate("home", tool=TOOL_NAME, args={"tag": "w0", "ms": 5000},
                                                 task_id="t-late"))
                async with phone.client() as c2:
                    async def in_the_outbox() -> bool:
                        return any(t.task_id == "t-late" for t in (await c2.tasks()).submitted)

                    await wait_until(in_the_outbox, "the phone to hold t-late in its outbox", timeout=10)
                    await c2.task("t-late").cancel()
                    with pytest.raises(RemoteError) as err:
                        await c2.task("t-late").result()
                    assert err.value.code is ErrorCode.CANCELED
            finally:
                home.proc.send_signal(signal.SIGCONT)
        async with home.client() as h:
            async def canceled_at_home() -> bool:
                return [t.state for t in (await h.tasks()).executing if t.task_id == "t-late"] == ["canceled"]

            await wait_until(canceled_at_home, "home to hold t-late, canceled", timeout=20)
        assert tool_runs(tool_log)["done w0"] == 0
    finally:
        await phone.stop()
        await home.stop()


async def test_clean_stop_mid_task_requeues_without_counting_a_crash(tmp_path: Path, tool_log: Path,
                                                                     tiny_model: Path) -> None:
    """SIGTERM while a task runs: the home requeues it itself (so crash-loop protection does
    not count it), runs it again after the restart, and the phone gets the result."""
    home, phone = await _start_pair(tmp_path, tiny_model)
    try:
        async with phone.client() as c:
            task = await c.delegate("home", tool=TOOL_NAME, args={"tag": "w0", "ms": 3000})
            await wait_until(lambda: "start w0" in tool_log.read_text(), "the tool to start on the home", timeout=30)
            assert await home.stop() == 0
            await home.start()
            with anyio.fail_after(60):
                assert (await task.result())["tag"] == "w0"
            events = [ev async for ev in task.events()]
        requeues = [e.data for e in events if e.kind is EventKind.REQUEUED]
        assert requeues and requeues[0]["reason"] == "executor shut down"
        assert not any(r.get("interrupted_run") for r in requeues)
    finally:
        await phone.stop()
        await home.stop()
