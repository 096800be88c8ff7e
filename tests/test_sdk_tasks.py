"""The SDK's task interface is typed both ways (issue 34 item 10): a bad spec is refused by the
SDK itself, naming the argument, before anything is sent; result() gives the protocol's models;
and the spec's time bound is named for what it bounds."""
from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from conftest import pair, run_nodes

from psymesh.node.control.client import Client
from psymesh.protocol.errors import ErrorCode, PsymeshError, RemoteError
from psymesh.protocol.tasks import InferResult, TaskKind

GREEDY = {"ban_bytes": True, "seed": 1, "temperature": 0}


@pytest.mark.anyio
async def test_a_bad_task_is_refused_here_naming_the_argument(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        async with Client(nodes["phone"].home.path) as phone:
            cases = [
                (dict(infer="hi", model="tiny", tools=[{"description": "no name"}]), "tools[0].name: Field required"),
                (dict(infer="hi", model="tiny", tools=[{"name": "get weather"}]), "tools[0].name: String should"),
                (dict(infer=[{"role": "robot", "content": "hi"}], model="tiny"), "infer[0].role: String should"),
                (dict(infer="hi", model="tiny", tool_choice="required"), "tool_choice 'required' needs tools"),
                (dict(tool="system.info", deadline_s=-1), "deadline_s: Input should be greater than 0"),
                (dict(tool="system.info", max_tokens=5), "max_tokens= not taken by a tool task"),
                (dict(goal=""), "an agent task needs a non-empty 'goal'"),
            ]
            for kwargs, says in cases:
                with pytest.raises(PsymeshError) as err:
                    await phone.delegate("home", **kwargs)
                # the SDK's own refusal, not the daemon's quoting pydantic
                assert not isinstance(err.value, RemoteError), (kwargs, err.value)
                assert err.value.code is ErrorCode.BAD_REQUEST
                assert err.value.message.startswith("invalid task: ") and says in err.value.message, err.value.message
                assert "validation error" not in err.value.message and "pydantic" not in err.value.message
            assert (await phone.tasks()).submitted == []  # nothing was stored or sent


@pytest.mark.anyio
async def test_results_are_typed_and_deadline_s_bounds_the_task(tmp_path: Path, tiny_model: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        nodes["home"].models.registry.add("tiny", tiny_model, n_ctx=1024, n_threads=1)
        async with Client(nodes["phone"].home.path) as phone:
            chat = await phone.delegate("home", infer="Say hello.", model="tiny", max_tokens=16, params=GREEDY,
                                        deadline_s=120)
            assert chat.kind is TaskKind.INFER
            with anyio.fail_after(120):
                result = await chat.result()
            assert isinstance(result, InferResult) and result.text
            assert result.finish_reason in ("stop", "length") and 1 <= result.usage.completion_tokens <= 16
            # a handle made later (after a restart, say) reads its result as the same type
            again = await phone.task(chat.id).result()
            assert isinstance(again, InferResult) and again == result
            # a tool task's result is the tool's own output
            info = await (await phone.delegate("home", tool="system.info")).result()
            assert isinstance(info, dict) and info["profile"] == "home"
            # the old name still works, and says what it became
            with pytest.warns(DeprecationWarning, match="deadline_s"):
                old = await phone.delegate("home", tool="system.info", timeout=30)
            assert (await old.result())["profile"] == "home"
            with pytest.raises(PsymeshError, match="not both"):
                await phone.delegate("home", tool="system.info", timeout=30, deadline_s=30)


def test_the_agent_result_of_section_5_4_reads_as_an_agent_task_result() -> None:
    """docs/protocol.md's worked agent result, byte for byte, is what the executor writes and the SDK reads."""
    import msgpack
    from test_protocol_spec import block_after, spec_bytes

    from psymesh.protocol.tasks import AgentTaskResult, AgentToolCall

    data = msgpack.unpackb(spec_bytes(block_after("Worked example: an agent task's `result` event data")))
    written = AgentTaskResult(answer="ok", stopped="final", steps=1,
                              tool_calls=[AgentToolCall(name="system.info", arguments={}, status="ok")])
    assert data == {"result": written.model_dump(mode="json")}
    assert msgpack.packb(data) == spec_bytes(block_after("Worked example: an agent task's `result` event data"))
    assert AgentTaskResult.model_validate(data["result"]) == written
    assert AgentTaskResult.model_validate({"answer": "hi", "extra": 1}) == AgentTaskResult(answer="hi")  # older/newer nodes
