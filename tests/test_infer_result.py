"""An infer task's result is a typed model (protocol.tasks.InferResult) whose wire map is
the one the executor built as a plain dict before: the bytes a peer receives are unchanged."""
from __future__ import annotations

import msgpack
import pytest
from psymesh.protocol.tasks import InferCall, InferResult, InferUsage

PLAIN = {"text": "hello", "finish_reason": "length", "usage": {"prompt_tokens": 12, "completion_tokens": 3}}
WITH_TOOLS = {"text": '<tool_call>{"name": "lamp", "arguments": {"on": true}}</tool_call>',
              "finish_reason": "tool_calls", "usage": {"prompt_tokens": 40, "completion_tokens": 9},
              "content": "", "tool_calls": [{"id": "call_1", "name": "lamp", "arguments": {"on": True}}]}


def test_the_result_map_is_unchanged() -> None:
    plain = InferResult(text="hello", finish_reason="length",
                        usage=InferUsage(prompt_tokens=12, completion_tokens=3))
    tools = InferResult(text=WITH_TOOLS["text"], finish_reason="tool_calls",
                        usage=InferUsage(prompt_tokens=40, completion_tokens=9), content="",
                        tool_calls=[InferCall(id="call_1", name="lamp", arguments={"on": True})])
    assert plain.wire() == PLAIN and tools.wire() == WITH_TOOLS
    assert msgpack.packb({"result": plain.wire()}) == msgpack.packb({"result": PLAIN})
    assert msgpack.packb({"result": tools.wire()}) == msgpack.packb({"result": WITH_TOOLS})


def test_a_reader_round_trips_the_map_and_fills_what_an_older_node_left_out() -> None:
    for value in (PLAIN, WITH_TOOLS):
        assert InferResult.model_validate(value).wire() == value
    bare = InferResult.model_validate({"text": "hi"})
    assert bare.finish_reason == "stop" and bare.usage.completion_tokens == 0
    assert bare.content is None and bare.tool_calls is None


def test_the_cli_reads_an_infer_outcome_through_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    from psymesh.node.cli.task import _print_outcome
    from psymesh.node.cli.output import Output
    from psymesh.protocol.tasks import Outcome, TaskState

    _print_outcome(Output(), Outcome(TaskState.COMPLETED, value=PLAIN))
    assert "(3 tokens, length)" in capsys.readouterr().err
