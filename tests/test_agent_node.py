"""The agent on the mesh: a phone delegates a goal and a home PC runs the agent loop.

Real components throughout: in-process nodes (and daemon processes) talking libp2p on
127.0.0.1, SQLite stores, and llama-cpp-python decoding the generated tiny qwen35 GGUF
under the tool-call grammar. What a user relies on: a delegated goal comes back as an
answer with the steps and tool calls that led to it; an irreversible call waits for the
phone's yes (and a no really means the tool never ran); the phone can see which home
PCs would take an agent task; and `psymesh agent run` / `psymesh eval` behave as their
help says, including a clear error instead of a traceback.

The tiny model has one token per character, so prompts with a tool block need a large
context (n_ctx=16384). It runs on one thread: llama.cpp's spinning thread barrier makes
two threads on a busy 2-core machine hundreds of times slower.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import home_and_phone_daemons, pair, register_model, run_nodes
from psymesh.agent.acting.loop import ScriptedModel, tool_call_text
from psymesh.agent.acting.tools import tool_from_function
from psymesh.node.models import agents
from psymesh.node.control.client import Client, TaskHandle
from psymesh.node.daemon import Node
from psymesh.protocol.errors import ErrorCode, RemoteError
from psymesh.protocol.tasks import AgentTaskResult, EventKind, TaskEvent, TaskState

REPO = Path(__file__).resolve().parent.parent
MODEL = {"n_ctx": 16384, "n_threads": 1}
# Random weights: with this goal and seed the grammar-constrained model calls system.info.
GOAL, CALLING_SEED = "Show system info.", 26


async def _events(handle: TaskHandle) -> list[TaskEvent]:
    with anyio.fail_after(60):
        return [ev async for ev in handle.events()]


def _numbered(events: list[TaskEvent], final: TaskState) -> None:
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].kind is EventKind.ACCEPTED and events[-1].state is final


async def _cli(home: Path, *args: str) -> tuple[int, str, str]:
    done = await anyio.run_process([sys.executable, "-m", "psymesh", *args, "--home", str(home)], check=False,
                                   cwd=REPO)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def _register_model(home: Path, path: Path, profile: str = "phone") -> None:
    register_model(home, path, name="tiny", profile=profile, **MODEL)


# --------------------------------------------------------------------------- delegated agent tasks


@pytest.mark.anyio
async def test_delegated_goal_runs_the_real_model_on_home(tmp_path: Path, tiny_model: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        nodes["home"].models.registry.add("tiny", tiny_model, **MODEL)
        async with Client(nodes["phone"].home.path) as phone:
            handle = await phone.delegate("home", goal=GOAL,
                                          params={"ban_bytes": True, "seed": CALLING_SEED, "max_steps": 2})
            assert handle.accepted and handle.target_name == "home"
            events = await _events(handle)
            result = await handle.result()

    _numbered(events, TaskState.COMPLETED)
    assert isinstance(result, AgentTaskResult)  # typed, as delegate(goal=) says
    assert result.stopped in ("final", "max_steps") and 1 <= result.steps <= 2  # the peer's limit held
    assert isinstance(result.answer, str) and result.answer
    steps = [e for e in events if e.kind is EventKind.PROGRESS and e.data["agent"] == "step"]
    assert [e.data["step"] for e in steps] == list(range(1, result.steps + 1))
    assert all(e.data["max_steps"] == 2 for e in steps)

    calls = [e.data for e in events if e.kind is EventKind.TOOL_CALL]
    results = [e.data for e in events if e.kind is EventKind.TOOL_RESULT]
    assert result.tool_calls, "the tiny model no longer calls a tool with this seed: pick another"
    assert [c["name"] for c in calls] == [c.name for c in result.tool_calls] == \
        ["system.info"] * len(result.tool_calls)
    assert [r["status"] for r in results] == [c.status for c in result.tool_calls]
    ran = [r for r in results if r["ok"]]
    assert ran and all(r["result"]["profile"] == "home" for r in ran)  # it ran on home, with home's tools


class _Notes:
    """An irreversible tool on home that remembers what it really did."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, text: str) -> dict:
        """Send a note to the family (cannot be undone)."""
        self.sent.append(text)
        return {"sent": text}


async def _grant_notes(home: Node) -> None:
    """The phone preset plus home's notes tool (an agent task is offered only granted tools)."""
    async with Client(home.home.path) as h:
        await h.grant("phone", ["task.agent", "tool:system.info", "tool:notes.*"])


def _scripted_home(node: Node, monkeypatch: pytest.MonkeyPatch, tiny_model: Path, replies: list[str]) -> _Notes:
    """Home's real AgentTaskRunner, with the model's replies fixed and an irreversible tool."""
    notes = _Notes()
    node.tools.register(tool_from_function(notes.send, "notes.send", irreversible=True))
    node.models.registry.add("tiny", tiny_model, **MODEL)
    model = ScriptedModel(replies)
    monkeypatch.setattr(agents, "llama_model", lambda worker, params: model)
    return notes


SEND = tool_call_text("notes.send", {"text": "home by 6"})


@pytest.mark.anyio
async def test_irreversible_call_waits_for_the_phone_and_runs_once_approved(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        notes = _scripted_home(nodes["home"], monkeypatch, tiny_model, [SEND, "Sent."])
        await _grant_notes(nodes["home"])
        async with Client(nodes["phone"].home.path) as phone:
            handle = await phone.delegate("home", goal="Tell the family I am home by 6.")
            events: list[TaskEvent] = []
            with anyio.fail_after(30):
                async for ev in handle.events():
                    events.append(ev)
                    if ev.state is TaskState.INPUT_REQUIRED:
                        assert notes.sent == []  # nothing happens before the yes
                        await handle.respond({"approve": True})
            result = await handle.result()
            with pytest.raises(RemoteError) as late:  # the question was answered; nothing waits now
                await handle.respond({"approve": True})

    _numbered(events, TaskState.COMPLETED)
    asked = [e for e in events if e.state is TaskState.INPUT_REQUIRED]
    assert len(asked) == 1
    assert asked[0].data["tool_call"] == {"name": "notes.send", "arguments": {"text": "home by 6"}}
    assert "notes.send" in asked[0].data["question"]
    resumed = events[events.index(asked[0]) + 1]
    assert resumed.state is TaskState.WORKING and resumed.data["answer"] == {"approve": True}
    assert notes.sent == ["home by 6"]
    assert result.model_dump() == {"answer": "Sent.", "stopped": "final", "steps": 2,
                                   "tool_calls": [{"name": "notes.send", "arguments": {"text": "home by 6"}, "status": "ok"}]}
    assert [e.data["status"] for e in events if e.kind is EventKind.TOOL_RESULT] == ["ok"]
    assert late.value.code is ErrorCode.CONFLICT and "not waiting for input" in late.value.message


@pytest.mark.anyio
async def test_declined_call_never_runs(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        notes = _scripted_home(nodes["home"], monkeypatch, tiny_model, [SEND, "I did not send it."])
        await _grant_notes(nodes["home"])
        async with Client(nodes["phone"].home.path) as phone:
            handle = await phone.delegate("home", goal="Tell the family I am home by 6.")
            with anyio.fail_after(30):
                async for ev in handle.events():
                    if ev.state is TaskState.INPUT_REQUIRED:
                        await handle.respond({"approve": False})
            result = await handle.result()
            events = await _events(handle)

    assert notes.sent == []
    assert result.answer == "I did not send it." and result.stopped == "final"
    assert [c.model_dump() for c in result.tool_calls] == [{"name": "notes.send", "arguments": {"text": "home by 6"}, "status": "declined"}]
    declined = [e.data for e in events if e.kind is EventKind.TOOL_RESULT]
    assert [(d["ok"], d["status"], d["error"]["code"]) for d in declined] == [(False, "declined", "forbidden")]


@pytest.mark.anyio
async def test_a_delegated_agent_is_offered_only_the_tools_its_submitter_was_granted(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """task.agent without tool:notes.*: the agent on home never sees notes.send, so the
    model's call to it goes nowhere (and the phone is not even asked)."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        notes = _scripted_home(nodes["home"], monkeypatch, tiny_model, [SEND, "Could not."])
        offered: list[list[str]] = []
        real_run = agents.run_agent

        async def spy(goal: str, **kw: Any) -> Any:
            offered.append(kw["tools"].names())
            return await real_run(goal, **kw)

        monkeypatch.setattr(agents, "run_agent", spy)
        async with Client(nodes["phone"].home.path) as phone:
            handle = await phone.delegate("home", goal="Tell the family I am home by 6.")
            with anyio.fail_after(30):
                result = await handle.result()
            events = await _events(handle)
    assert offered and "notes.send" not in offered[0] and "system.info" in offered[0]
    assert notes.sent == [] and not any(e.state is TaskState.INPUT_REQUIRED for e in events)
    assert all(c.status != "ok" for c in result.tool_calls)


@pytest.mark.anyio
async def test_bad_params_from_the_phone_are_its_bad_request(tmp_path: Path, tiny_model: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        nodes["home"].models.registry.add("tiny", tiny_model, **MODEL)
        async with Client(nodes["phone"].home.path) as phone:
            failures = []
            for params in ({"max_steps": "lots"}, {"temperature": "hot", "max_tokens": 0}):
                handle = await phone.delegate("home", goal=GOAL, params=params)
                with pytest.raises(RemoteError) as err:
                    await handle.result()
                failures.append(err.value)

    assert all(f.code is ErrorCode.BAD_REQUEST for f in failures)
    assert "max_steps" in failures[0].message
    assert "temperature" in failures[1].message and "max_tokens" in failures[1].message


@pytest.mark.anyio
async def test_offers_list_the_homes_that_would_run_an_agent(tmp_path: Path, tiny_model: Path) -> None:
    async with run_nodes(tmp_path, "home", "neighbour", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        await pair(nodes["neighbour"].home.path, nodes["phone"].home.path, grant="messaging")  # no task.agent
        nodes["home"].models.registry.add("tiny", tiny_model, **MODEL)
        nodes["neighbour"].models.registry.add("other", tiny_model, **MODEL)
        async with Client(nodes["phone"].home.path) as phone:
            offers = await phone.offers("task.agent")
            with pytest.raises(RemoteError) as bad:
                await phone.offers("task.teleport")

    assert [(o.name, o.peer_id, o.models) for o in offers] == [
        ("home", nodes["home"].identity.peer_id, ["tiny"])]
    assert "system.info" in offers[0].tools and offers[0].queue_depth == 0
    assert bad.value.code is ErrorCode.BAD_REQUEST


# --------------------------------------------------------------------------- the CLI


@pytest.mark.anyio
async def test_agent_run_here(tmp_path: Path, tiny_model: Path) -> None:
    phone = tmp_path / "phone"
    _register_model(phone, tiny_model)
    rc, out, err = await _cli(phone, "agent", "run", "Turn wifi on", "--delegate", "never", "--ban-bytes",
                              "--seed", "3", "--max-steps", "2", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["where"] == "local" and result["model"] == "tiny"
    assert result["stopped"] in ("final", "max_steps") and 1 <= result["steps"] <= 2
    assert isinstance(result["answer"], str) and isinstance(result["tool_calls"], list)
    # before the run, the person is told what the phone's tools act on (nothing real is on this PATH)
    assert "device tools: simulated: this node's device.db, not a real phone: calendar.add" in err

    # Forced remote with no daemon (so no paired home PC either): a clear error, not a traceback.
    rc, out, err = await _cli(phone, "agent", "run", "Turn wifi on", "--delegate", "always", "--json")
    assert rc == 1 and "Traceback" not in err
    assert json.loads(out)["error"]["code"] == "unavailable"


@pytest.mark.anyio
async def test_agent_run_delegates_from_a_phone_daemon(tmp_path: Path, tiny_model: Path) -> None:
    # the phone has no model of its own
    async with home_and_phone_daemons(tmp_path, lambda h: _register_model(h, tiny_model, profile="home")) as (home,
                                                                                                        phone):
        goal = ["agent", "run", "Turn wifi on", "--ban-bytes", "--seed", "3", "--max-steps", "2", "--json"]
        rc, out, err = await _cli(phone.home, *goal, "--delegate", "always")
        assert rc == 1 and "Traceback" not in err, err  # a running daemon, but no paired home PC
        error = json.loads(out)["error"]
        assert error["code"] == "unavailable" and "no reachable paired peer" in error["message"]

        await pair(home.home, phone.home, grant="phone")
        rc, out, err = await _cli(phone.home, *goal, "--delegate", "auto")
        assert rc == 0, err
        result = json.loads(out)  # one JSON document, as for a local run
        assert result["where"] == "remote" and result["task_id"]
        assert result["stopped"] in ("final", "max_steps") and 1 <= result["steps"] <= 2
        async with Client(phone.home) as client:
            listed = (await client.tasks()).submitted
        assert [(t.task_id, t.kind, t.target, t.state) for t in listed] == [
            (result["task_id"], "agent", "home", "completed")]


@pytest.mark.anyio
async def test_eval_scores_each_category(tmp_path: Path, tiny_model: Path) -> None:
    home = tmp_path / "evalhome"
    _register_model(home, tiny_model, profile="home")
    rc, out, err = await _cli(home, "eval", "examples/eval_cases.jsonl", "--model", "tiny", "--ban-bytes", "--json")
    assert rc == 0, err
    report: dict[str, Any] = json.loads(out)
    cases = [json.loads(line) for line in (REPO / "examples" / "eval_cases.jsonl").read_text().splitlines()
             if line.strip() and "category" in json.loads(line)]
    expected = {c: sum(1 for x in cases if x["category"] == c) for c in ("single", "multi_turn", "no_tool")}
    assert report["model"] == "tiny" and report["cases"] == len(cases)
    assert {c: s["cases"] for c, s in report["categories"].items()} == expected
    for score in report["categories"].values():
        assert 0.0 <= score["accuracy"] <= 1.0 and 0 <= score["passed"] <= score["cases"]
    assert report["passed"] == sum(s["passed"] for s in report["categories"].values())
