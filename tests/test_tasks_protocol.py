"""The delegated-task protocol: lifecycle table, specs, events, and hostile decoding."""
from __future__ import annotations

import itertools
import uuid

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psymesh.protocol.errors import ErrorCode, ProtocolError, RemoteError
from psymesh.protocol.messages import Message, pack, unpack
from psymesh.protocol.tasks import (
    MAX_JSON_DEPTH,
    ChatMessage,
    EventKind,
    IllegalTransition,
    Outcome,
    TaskAccepted,
    TaskAck,
    TaskAttach,
    TaskCancel,
    TaskEvent,
    TaskKind,
    TaskList,
    TaskListReply,
    TaskSpec,
    TaskState,
    TaskStatus,
    TaskSubmit,
    next_state,
)

S, K = TaskState, EventKind

# The lifecycle, written out by hand: (state before, event kind) -> state after.
# Anything not listed here must be refused.
LEGAL: dict[tuple[TaskState | None, EventKind, TaskState | None], TaskState] = {}


def legal(before: TaskState | None, kind: EventKind, after: TaskState, named: bool = False) -> None:
    """Register a legal event; `named` kinds must name their target, others may omit it."""
    LEGAL[(before, kind, after)] = after
    if not named:
        LEGAL[(before, kind, None)] = after


legal(None, K.ACCEPTED, S.SUBMITTED)
for target in (S.WORKING, S.CANCELED, S.REJECTED):
    legal(S.SUBMITTED, K.STATE, target, named=True)
legal(S.SUBMITTED, K.ERROR, S.FAILED)
legal(S.SUBMITTED, K.REQUEUED, S.SUBMITTED)
legal(S.SUBMITTED, K.PROGRESS, S.SUBMITTED)
for target in (S.INPUT_REQUIRED, S.CANCELED, S.REJECTED):
    legal(S.WORKING, K.STATE, target, named=True)
legal(S.WORKING, K.RESULT, S.COMPLETED)
legal(S.WORKING, K.ERROR, S.FAILED)
legal(S.WORKING, K.REQUEUED, S.SUBMITTED)
for kind in (K.PROGRESS, K.TOKEN, K.TOOL_CALL, K.TOOL_RESULT):
    legal(S.WORKING, kind, S.WORKING)
for target in (S.WORKING, S.CANCELED):
    legal(S.INPUT_REQUIRED, K.STATE, target, named=True)
legal(S.INPUT_REQUIRED, K.ERROR, S.FAILED)
legal(S.INPUT_REQUIRED, K.REQUEUED, S.SUBMITTED)
legal(S.INPUT_REQUIRED, K.PROGRESS, S.INPUT_REQUIRED)

ALL_CASES = list(itertools.product([None, *TaskState], EventKind, [None, *TaskState]))


@pytest.mark.parametrize("before,kind,claimed", ALL_CASES)
def test_lifecycle_table(before: TaskState | None, kind: EventKind, claimed: TaskState | None) -> None:
    expected = LEGAL.get((before, kind, claimed))
    if expected is None:
        with pytest.raises(IllegalTransition) as info:
            next_state(before, kind, claimed)
        assert info.value.code is ErrorCode.BAD_REQUEST
    else:
        assert next_state(before, kind, claimed) is expected


def test_terminal_states_are_final_and_input_required_resumes() -> None:
    assert {s for s in TaskState if s.terminal} == {S.COMPLETED, S.FAILED, S.CANCELED, S.REJECTED}
    state = next_state(None, K.ACCEPTED)
    for kind, target in [(K.STATE, S.WORKING), (K.STATE, S.INPUT_REQUIRED), (K.STATE, S.WORKING), (K.RESULT, None)]:
        state = next_state(state, kind, target)
    assert state is S.COMPLETED


# -- specs -------------------------------------------------------------------------------
def tool_spec(**kw: object) -> TaskSpec:
    return TaskSpec(**{"id": str(uuid.uuid4()), "kind": "tool", "tool": "fs.read", "args": {"path": "/a"}, **kw})


def test_specs_of_each_kind_validate() -> None:
    tool_spec()
    TaskSpec(id="01HZY3K9", kind="infer", model="botpsy-0.8b:q4", prompt="hi", max_tokens=64,
             params={"temperature": 0.2})
    TaskSpec(id="t-2", kind="infer", model="m", messages=[ChatMessage(role="user", content="hi")])
    TaskSpec(id="t-3", kind="agent", goal="tidy my downloads folder", timeout=600)


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"kind": "tool", "tool": None}, "needs 'tool'"),
        ({"kind": "tool", "tool": "x", "goal": "g"}, "goal not allowed"),
        ({"kind": "infer", "model": "m"}, "exactly one of"),
        ({"kind": "infer", "model": "m", "prompt": "p", "messages": []}, "exactly one of"),
        ({"kind": "infer", "prompt": "p"}, "needs 'model'"),
        ({"kind": "agent", "goal": ""}, "non-empty 'goal'"),
        ({"kind": "agent", "goal": "g", "args": {"a": 1}}, "args not allowed in agent tasks"),
        ({"kind": "tool", "tool": "x", "deadline": 5.0, "timeout": 5.0}, "not both"),
        ({"kind": "tool", "tool": "has space"}, "tool"),
        ({"kind": "tool", "tool": "x", "id": "../etc"}, "id"),
        ({"kind": "tool", "tool": "x", "id": "a" * 65}, "id"),
        ({"kind": "tool", "tool": "x", "args": [1, 2]}, "args"),
        ({"kind": "tool", "tool": "x", "args": {"b": b"raw"}}, "args"),
        ({"kind": "infer", "model": "m", "prompt": "p", "max_tokens": 0}, "max_tokens"),
        ({"kind": "tool", "tool": "x", "timeout": -1}, "timeout"),
        ({"kind": "tool", "tool": "x", "deadline": float("inf")}, "deadline"),
    ],
)
def test_bad_specs_are_refused_on_the_wire(fields: dict, needle: str) -> None:
    spec = {"id": "t1", **fields}
    body = msgpack.packb({"v": 1, "type": "task.submit", "spec": spec}, use_bin_type=True)
    with pytest.raises(ProtocolError) as info:
        unpack(body)
    assert needle in str(info.value)


def test_args_nesting_is_bounded() -> None:
    deep: dict = {}
    node = deep
    for _ in range(MAX_JSON_DEPTH + 1):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ValueError, match="nested deeper"):
        tool_spec(args=deep)


def test_args_hold_only_what_msgpack_can_carry() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        tool_spec(args={"n": 1 << 70})


def test_args_size_is_bounded() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        tool_spec(args={"blob": "x" * (1024 * 1024)})


def test_timeout_becomes_a_deadline_when_first_accepted() -> None:
    assert tool_spec(timeout=30).resolve_deadline(1000.0) == 1030.0
    assert tool_spec(deadline=5000.0).resolve_deadline(1000.0) == 5000.0
    assert tool_spec().resolve_deadline(1000.0) is None


def test_equal_specs_compare_equal_regardless_of_key_order() -> None:
    a = tool_spec(id="same", args={"x": 1, "y": [1, {"z": 2}]})
    b = TaskSpec.model_validate_json(a.model_dump_json())
    c = tool_spec(id="same", args={"y": [1, {"z": 2}], "x": 1})
    assert a == b == c
    assert a != tool_spec(id="same", args={"x": 2, "y": [1, {"z": 2}]})


# -- events ------------------------------------------------------------------------------
def event(**kw: object) -> TaskEvent:
    return TaskEvent(**{"task_id": "t1", "seq": 2, "at": 1.0, "data": {}, **kw})


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "result", "state": "working", "data": {"result": 1}},   # result must complete
        {"kind": "result", "state": "completed"},                        # result needs a value
        {"kind": "error", "state": "failed", "data": {"code": "timeout"}},
        {"kind": "token", "state": "working", "data": {"text": 5}},
        {"kind": "token", "state": "submitted", "data": {"text": "a"}},
        {"kind": "tool_call", "state": "working", "data": {}},
        {"kind": "accepted", "state": "submitted", "seq": 3},
        {"kind": "state", "state": "completed"},
        {"kind": "progress", "state": "failed"},
        {"kind": "requeued", "state": "working"},
        {"kind": "state", "state": "working", "seq": 0},
    ],
)
def test_inconsistent_events_are_refused(fields: dict) -> None:
    with pytest.raises(ValueError):
        event(**fields)


def test_outcomes_carry_value_or_stable_code() -> None:
    done = event(kind="result", state="completed", data={"result": {"answer": 42}, "usage": {"tokens": 3}})
    assert done.outcome is not None and done.outcome.unwrap() == {"answer": 42}
    assert event(kind="token", state="working", data={"text": "x"}).outcome is None

    failed = event(kind="error", state="failed", data={"code": "timeout", "message": "deadline passed"})
    with pytest.raises(RemoteError) as info:
        failed.outcome.unwrap()  # type: ignore[union-attr]
    assert info.value.code is ErrorCode.TIMEOUT and "deadline" in info.value.message

    canceled = Outcome.from_event(event(kind="state", state="canceled", data={"reason": "user"}))
    assert not canceled.ok and canceled.code is ErrorCode.CANCELED and canceled.message == "user"
    rejected = Outcome.from_event(event(kind="state", state="rejected"))
    assert rejected.code is ErrorCode.FORBIDDEN


def valid_messages() -> list[Message]:
    status = TaskStatus(task_id="t1", kind=TaskKind.INFER, state=S.WORKING, last_seq=7, acked_seq=3,
                        created_at=1.0, updated_at=2.0, deadline=60.0)
    messages: list[Message] = [
        TaskSubmit(spec=tool_spec(timeout=5)),
        TaskSubmit(spec=TaskSpec(id="i1", kind="infer", model="m",
                                 messages=[ChatMessage(role="system", content="be brief"),
                                           ChatMessage(role="user", content="hi")])),
        TaskAccepted(status=status, created=True),
        TaskAttach(task_id="t1", after_seq=7),
        event(kind="token", state="working", data={"text": "Hel"}),
        TaskCancel(task_id="t1", reason="changed my mind"),
        TaskAck(task_id="t1", upto_seq=9),
        TaskList(states=[S.WORKING, S.SUBMITTED], limit=10),
        TaskListReply(tasks=[status, status]),
        status,
    ]
    return messages


def test_every_task_message_round_trips() -> None:
    for message in valid_messages():
        assert message.type.startswith("task.")
        assert unpack(pack(message)) == message


# -- hostile input -----------------------------------------------------------------------
TASK_TYPES = ["task.submit", "task.accepted", "task.attach", "task.event", "task.cancel", "task.ack",
              "task.list", "task.list_reply", "task.status"]
FIELD_NAMES = ["spec", "id", "kind", "tool", "args", "model", "messages", "prompt", "max_tokens", "goal",
               "params", "deadline", "timeout", "task_id", "seq", "after_seq", "upto_seq", "state", "at",
               "data", "status", "created", "reason", "states", "limit", "tasks", "role", "content",
               "last_seq", "acked_seq", "created_at", "updated_at", "text", "result", "code"]
VALUES = [*TaskState, *EventKind, *TaskKind, "t1", "fs.read", "user"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(), st.text(max_size=20), st.binary(max_size=20), st.sampled_from(VALUES),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=5), inner, max_size=6),
    ),
    max_leaves=25,
)
envelopes = st.fixed_dictionaries(
    {"v": st.just(1), "type": st.sampled_from(TASK_TYPES)},
    optional={"_": st.none()},
).flatmap(
    lambda env: st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=8).map(lambda body: {**body, **env})
)


def _mutate(body: dict, key: str, value: object, drop: bool) -> dict:
    """Replace (or drop) one field of a valid message, at the top level or inside a nested map."""
    body = dict(body)
    nested = [k for k, v in body.items() if isinstance(v, dict)]
    if nested and key.startswith("_"):
        inner = nested[len(key) % len(nested)]
        body[inner] = _mutate(body[inner], key[1:], value, drop)
        return body
    target = key if key in body or not body else sorted(body)[len(key) % len(body)]
    if drop:
        body.pop(target, None)
    else:
        body[target] = value
    return body


mutated = st.builds(
    _mutate,
    st.sampled_from([msgpack.unpackb(pack(m)) for m in valid_messages()]),
    st.sampled_from(FIELD_NAMES) | st.sampled_from(["_" + f for f in FIELD_NAMES]),
    values,
    st.booleans(),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelopes | mutated)
def test_arbitrary_maps_only_ever_raise_protocol_error(body: dict) -> None:
    """Garbage of the right shape is refused cleanly; whatever is accepted can be sent on again."""
    try:
        message = unpack(msgpack.packb(body, use_bin_type=True))
    except ProtocolError:
        return
    assert message.type in TASK_TYPES
    wire = pack(message)  # compare bytes: NaN is a valid JSON-ish float but never equal to itself
    assert pack(unpack(wire)) == wire


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_ever_raise_protocol_error(body: bytes) -> None:
    try:
        unpack(body)
    except ProtocolError:
        pass
