"""Delegated tasks: the `/psymesh/task/1.0.0` messages and the task lifecycle (sans-IO).

A phone hands a home PC a task (run one tool, a chat completion, or a goal for its
agent loop). The lifecycle follows A2A's::

    submitted ──> working ──> completed | failed | canceled | rejected
        │          │  ^
        │          v  │
        │     input-required
        └──────────────────> failed | canceled | rejected

plus one recovery edge: after an executor restart, unfinished work goes back to
`submitted` (a `requeued` event) and runs again from the start.

The *submitter* picks the task id (a ULID or uuid4 string), so resending a submit
after a lost reply is harmless: the same id with the same spec is the same task;
the same id with another spec is a CONFLICT. The executor numbers every task's
events 1..N; a client attaches with the last number it holds and gets the rest,
and acknowledges (`task.ack`) what it has durably stored, which lets the executor
forget finished tasks.

Stream flow on `/psymesh/task/1.0.0` (one request per stream):

    task.submit  -> task.accepted | error(BUSY, retry_after | CONFLICT | FORBIDDEN ...)
    task.attach  -> task.event* until the task is terminal (client may send task.ack
                    on the same stream) | error(NOT_FOUND)
    task.cancel  -> task.status | error(NOT_FOUND)
    task.ack     -> task.status | error(NOT_FOUND)
    task.list    -> task.list_reply

Event kinds and their `data` (extra keys are allowed and kept):

    accepted     {}                                  -> submitted (always seq 1)
    state        {"reason"?: str, "code"?: str}      -> working | input-required |
                                                        canceled | rejected
    progress     {"message"?: str, "fraction"?: float}   (state unchanged)
    token        {"text": str}                       infer/agent output delta (working)
    tool_call    {"name": str, "id"?: str, "arguments"?: {...}}        (working)
    tool_result  {"name"?: str, "id"?: str, "ok"?: bool, "result"?: ...} (working)
    result       {"result": <json>, "usage"?: {...}} -> completed
    error        {"code": str, "message": str}       -> failed (TIMEOUT past deadline)
    requeued     {"reason": str}                     -> submitted (executor restarted;
                                                        output so far is void)

Every event carries the task state *after* it, so a client never has to replay
the log to know where a task stands.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import AfterValidator, Field, JsonValue, model_validator

from .errors import ErrorCode, ProtocolError, RemoteError
from .messages import Message

# -- limits ------------------------------------------------------------------------------
MAX_TASK_ID = 64
MAX_NAME = 128               # tool and model names
MAX_TEXT = 256 * 1024        # one prompt, goal, chat message or reason (characters)
MAX_MESSAGES = 512           # chat messages in one infer task
MAX_JSON_BYTES = 1024 * 1024 # JSON-encoded size of args, params, event data
MAX_JSON_DEPTH = 32
MAX_MAX_TOKENS = 1 << 20
MAX_TIMEOUT_S = 30 * 24 * 3600.0
MAX_LIST = 1000
_INT64 = (-(1 << 63), (1 << 64) - 1)  # what msgpack can carry


class IllegalTransition(ProtocolError):
    """An event that the task lifecycle does not allow from the task's current state."""

    default_code = ErrorCode.BAD_REQUEST


# -- lifecycle ---------------------------------------------------------------------------
class TaskState(StrEnum):
    SUBMITTED = "submitted"
    WORKING = "working"
    INPUT_REQUIRED = "input-required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELED, TaskState.REJECTED})
ACTIVE_STATES = frozenset(TaskState) - TERMINAL_STATES

_S = TaskState
#: Every state change the lifecycle allows (self-loops are not changes and are not listed).
TRANSITIONS: Mapping[TaskState, frozenset[TaskState]] = {
    _S.SUBMITTED: frozenset({_S.WORKING, _S.FAILED, _S.CANCELED, _S.REJECTED}),
    _S.WORKING: frozenset({_S.INPUT_REQUIRED, _S.COMPLETED, _S.FAILED, _S.CANCELED, _S.REJECTED, _S.SUBMITTED}),
    _S.INPUT_REQUIRED: frozenset({_S.WORKING, _S.FAILED, _S.CANCELED, _S.SUBMITTED}),
    _S.COMPLETED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELED: frozenset(),
    _S.REJECTED: frozenset(),
}


class EventKind(StrEnum):
    ACCEPTED = "accepted"
    STATE = "state"
    PROGRESS = "progress"
    TOKEN = "token"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    RESULT = "result"
    ERROR = "error"
    REQUEUED = "requeued"


#: Kinds that move the task to a fixed state.
IMPLIED_STATE: Mapping[EventKind, TaskState] = {
    EventKind.ACCEPTED: _S.SUBMITTED,
    EventKind.RESULT: _S.COMPLETED,
    EventKind.ERROR: _S.FAILED,
    EventKind.REQUEUED: _S.SUBMITTED,
}
#: States a `state` event may name; the others have their own kinds (which carry data).
STATE_EVENT_TARGETS = frozenset({_S.WORKING, _S.INPUT_REQUIRED, _S.CANCELED, _S.REJECTED})
#: Kinds that report on running work and need the task to be working.
WORKING_ONLY = frozenset({EventKind.TOKEN, EventKind.TOOL_CALL, EventKind.TOOL_RESULT})


def next_state(current: TaskState | None, kind: EventKind, state: TaskState | None = None) -> TaskState:
    """The task state after an event of `kind` claiming `state`, or IllegalTransition.

    `current` is None for a task with no events yet: only `accepted` may start a log.
    `state` is the state the event carries; it may be omitted for kinds that imply it
    (or that leave the state alone), but must agree when given.
    """
    if current is None:
        if kind is not EventKind.ACCEPTED:
            raise IllegalTransition(f"a task's first event must be 'accepted', not {kind.value!r}")
    elif kind is EventKind.ACCEPTED:
        raise IllegalTransition("'accepted' may only be a task's first event")
    elif current.terminal:
        raise IllegalTransition(f"task is {current.value}; no {kind.value!r} event may follow")

    if kind in IMPLIED_STATE:
        target = IMPLIED_STATE[kind]
    elif kind is EventKind.STATE:
        if state is None:
            raise IllegalTransition("a 'state' event must name the new state")
        if state not in STATE_EVENT_TARGETS:
            raise IllegalTransition(f"use a {_kind_for(state)!r} event to reach {state.value!r}")
        target = state
    else:  # progress and working-only reports leave the state alone
        assert current is not None
        if kind in WORKING_ONLY and current is not _S.WORKING:
            raise IllegalTransition(f"{kind.value!r} events need a working task; it is {current.value}")
        target = current
    if state is not None and state is not target:
        raise IllegalTransition(f"a {kind.value!r} event leaves the task {target.value}, not {state.value}")

    if current is None or target is current:
        if kind is EventKind.STATE:
            raise IllegalTransition(f"task is already {current.value}")  # type: ignore[union-attr]
        return target
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(f"task cannot go from {current.value} to {target.value}")
    return target


def _kind_for(state: TaskState) -> str:
    return {_S.COMPLETED: "result", _S.FAILED: "error", _S.SUBMITTED: "requeued"}.get(state, "state")


# -- bounded JSON ------------------------------------------------------------------------
def check_json(value: Any, what: str = "value", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Refuse JSON that is too deep, too big, or holds integers msgpack cannot carry."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            if isinstance(item, int) and not isinstance(item, bool) and not _INT64[0] <= item <= _INT64[1]:
                raise ValueError(f"{what}: integer out of the 64-bit range")
            continue
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"{what}: nested deeper than {MAX_JSON_DEPTH}")
        stack.extend((child, depth + 1) for child in children)
    size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
    if size > max_bytes:
        raise ValueError(f"{what}: {size} bytes of JSON exceeds the {max_bytes}-byte limit")
    return value


JsonMap = Annotated[dict[str, JsonValue], AfterValidator(check_json)]
TaskId = Annotated[str, Field(min_length=1, max_length=MAX_TASK_ID, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=r"^[\w.:/@+-]+$")]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Timestamp = Annotated[float, Field(ge=0, allow_inf_nan=False)]


# -- the task spec -----------------------------------------------------------------------
class TaskKind(StrEnum):
    TOOL = "tool"     # run one named tool with JSON arguments
    INFER = "infer"   # a chat completion with a named model, tokens streamed
    AGENT = "agent"   # a goal for the executor's agent loop


CallId = Annotated[str, Field(min_length=1, max_length=MAX_TASK_ID, pattern=r"^[\w.:-]+$")]
MAX_TOOLS = 128              # tools offered in one infer task
MAX_CALLS = 64               # tool calls in one assistant turn
#: `tool_choice` words; any other value names one of the task's tools.
TOOL_CHOICES = frozenset({"auto", "none", "required"})


class ChatToolCall(Message):
    """A tool call an assistant turn made (OpenAI's `tool_calls` item, arguments parsed)."""

    id: CallId
    name: Name
    arguments: JsonMap = Field(default_factory=dict)


class ChatMessage(Message):
    """One chat turn of an infer task (OpenAI-style roles). An assistant turn may carry
    the `tool_calls` it made; a tool turn names the call it answers in `tool_call_id`."""

    role: Annotated[str, Field(pattern=r"^(system|user|assistant|tool)$")]
    content: Text
    name: Name | None = None
    tool_calls: Annotated[list[ChatToolCall], Field(max_length=MAX_CALLS)] | None = None
    tool_call_id: CallId | None = None

    @model_validator(mode="after")
    def _calls_fit_role(self) -> Self:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant turn carries tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool turn carries tool_call_id")
        return self


class ToolDef(Message):
    """A function the model of an infer task may call: a name, what it does, and a JSON
    schema (type object) of its arguments, as in OpenAI's `tools`."""

    name: Name
    description: Text = ""
    parameters: JsonMap = Field(default_factory=lambda: {"type": "object", "properties": {}})


_KIND_FIELDS: Mapping[TaskKind, frozenset[str]] = {
    TaskKind.TOOL: frozenset({"tool", "args"}),
    TaskKind.INFER: frozenset({"model", "messages", "prompt", "max_tokens", "params", "tools", "tool_choice"}),
    TaskKind.AGENT: frozenset({"goal", "params"}),
}
_ALL_KIND_FIELDS = frozenset().union(*_KIND_FIELDS.values())


class TaskSpec(Message):
    """What to do, as the submitter wrote it. Equal specs mean the same task.

    The submitting peer is not part of the spec: the executor takes it from the
    authenticated connection. Give at most one of `deadline` (absolute unix time)
    and `timeout` (seconds, counted from when the executor first accepts the task,
    so it survives clock skew and resends alike).
    """

    id: TaskId
    kind: TaskKind
    # tool
    tool: Name | None = None
    args: JsonMap = Field(default_factory=dict)
    # infer
    model: Name | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    prompt: Text | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_MAX_TOKENS)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Name | None = None   # auto (default with tools) | none | required | a tool's name
    # agent
    goal: Text | None = None
    # infer and agent: sampling / loop parameters (temperature, max_steps, ...)
    params: JsonMap = Field(default_factory=dict)
    deadline: Timestamp | None = None
    timeout: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _fits_kind(self) -> Self:
        stray = sorted(f for f in _ALL_KIND_FIELDS - _KIND_FIELDS[self.kind] if _is_set(getattr(self, f)))
        if stray:
            raise ValueError(f"{', '.join(stray)} not allowed in {self.kind.value} tasks")
        if self.kind is TaskKind.TOOL and self.tool is None:
            raise ValueError("a tool task needs 'tool'")
        if self.kind is TaskKind.INFER:
            if self.model is None:
                raise ValueError("an infer task needs 'model'")
            if (self.messages is None) == (self.prompt is None):
                raise ValueError("an infer task needs exactly one of 'messages' and 'prompt'")
            if self.tool_choice == "required" and not self.tools:
                raise ValueError("tool_choice 'required' needs tools")
            if self.tool_choice is not None and self.tool_choice not in TOOL_CHOICES:
                if not any(t.name == self.tool_choice for t in self.tools or ()):
                    raise ValueError(f"tool_choice {self.tool_choice!r} is none of {sorted(TOOL_CHOICES)} "
                                     "and no tool of the task")
        if self.kind is TaskKind.AGENT and not self.goal:
            raise ValueError("an agent task needs a non-empty 'goal'")
        if self.deadline is not None and self.timeout is not None:
            raise ValueError("give 'deadline' or 'timeout', not both")
        return self

    def resolve_deadline(self, accepted_at: float) -> float | None:
        """The absolute deadline, fixed when the executor first accepts the task."""
        if self.timeout is not None:
            return accepted_at + self.timeout
        return self.deadline


def _is_set(value: Any) -> bool:
    return value is not None and value != {}


# -- events and outcomes -----------------------------------------------------------------
def _require_str(data: Mapping[str, Any], key: str, kind: EventKind) -> None:
    if not isinstance(data.get(key), str):
        raise ValueError(f"a {kind.value!r} event needs a string {key!r} in its data")


class TaskEvent(Message):
    """One numbered entry of a task's event log, as stored and as sent to attached clients."""

    type = "task.event"
    task_id: TaskId
    seq: int = Field(ge=1, le=_INT64[1])
    kind: EventKind
    state: TaskState       # the task's state after this event
    at: Timestamp          # executor clock
    data: JsonMap = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        implied = IMPLIED_STATE.get(self.kind)
        if implied is not None and self.state is not implied:
            raise ValueError(f"a {self.kind.value!r} event leaves the task {implied.value}")
        if self.kind is EventKind.STATE and self.state not in STATE_EVENT_TARGETS:
            raise ValueError(f"a 'state' event cannot announce {self.state.value!r}")
        if self.kind in WORKING_ONLY and self.state is not _S.WORKING:
            raise ValueError(f"a {self.kind.value!r} event belongs to a working task")
        if self.kind is EventKind.PROGRESS and self.state.terminal:
            raise ValueError("a 'progress' event belongs to an unfinished task")
        if self.kind is EventKind.ACCEPTED and self.seq != 1:
            raise ValueError("'accepted' is always event 1")
        if self.kind is EventKind.ERROR:
            _require_str(self.data, "code", self.kind)
            _require_str(self.data, "message", self.kind)
        elif self.kind is EventKind.TOKEN:
            _require_str(self.data, "text", self.kind)
        elif self.kind is EventKind.TOOL_CALL:
            _require_str(self.data, "name", self.kind)
        elif self.kind is EventKind.RESULT and "result" not in self.data:
            raise ValueError("a 'result' event needs a 'result' key in its data")
        return self

    @property
    def outcome(self) -> "Outcome | None":
        """How the task ended, if this is its final event."""
        return Outcome.from_event(self) if self.state.terminal else None


@dataclass(frozen=True)
class Outcome:
    """How a task ended: its value if completed, else a stable error code and message."""

    state: TaskState
    value: Any = None
    code: ErrorCode | str | None = None   # a str only for codes newer than this node
    message: str = ""

    @classmethod
    def from_event(cls, event: TaskEvent) -> "Outcome":
        data, state = event.data, event.state
        if state is _S.COMPLETED:
            return cls(state, value=data.get("result"))
        default = {_S.CANCELED: ErrorCode.CANCELED, _S.REJECTED: ErrorCode.FORBIDDEN}.get(state, ErrorCode.INTERNAL)
        code: ErrorCode | str = data["code"] if isinstance(data.get("code"), str) else default
        if code in ErrorCode._value2member_map_:
            code = ErrorCode(code)
        message = data.get("message", data.get("reason", ""))
        return cls(state, code=code, message=message if isinstance(message, str) else "")

    @property
    def ok(self) -> bool:
        return self.state is _S.COMPLETED

    def unwrap(self) -> Any:
        """The result value, or the failure as a RemoteError (branch on `.code`)."""
        if self.ok:
            return self.value
        raise RemoteError(self.message or f"task {self.state.value}", code=self.code)


# -- an infer task's result ---------------------------------------------------------------
class InferCall(Message):
    """A tool call the model made, as an infer result names it (arguments parsed)."""

    id: str
    name: str
    arguments: JsonMap = Field(default_factory=dict)


class InferUsage(Message):
    """Tokens an infer task counted: the rendered prompt's and the completion's."""

    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)


class InferResult(Message):
    """The `result` of a completed infer task (the data of its `result` event, and the
    Outcome's value). `content` and `tool_calls` are present only when tools were offered:
    then the reply is the model's parse of `text`. A reader fills what an older node left
    out with the defaults below; `wire()` gives the map as it goes on the wire."""

    text: str = ""
    finish_reason: str = "stop"   # "stop", "length", "tool_calls" or "cancelled"
    usage: InferUsage = Field(default_factory=InferUsage)
    content: str | None = None
    tool_calls: Annotated[list[InferCall], Field(max_length=MAX_CALLS)] | None = None
    tool_family: str | None = None  # how the model writes calls (qwen35, hermes, llama3, mistral), with tools

    def wire(self) -> dict[str, Any]:
        """The result map: the fields set, none of them nil."""
        return self.model_dump(mode="json", exclude_none=True)


# -- an agent task's result ---------------------------------------------------------------
class AgentToolCall(Message):
    """A tool call an agent run made, as its result lists it: what it asked and how it went
    (`ok`, `error`, `declined`, `unconfirmed` or `blocked`)."""

    name: str
    arguments: JsonMap = Field(default_factory=dict)
    status: str = "ok"


class AgentTaskResult(Message):
    """The `result` of a completed agent task: its final answer, why the loop stopped (`final`,
    `max_steps`, `deadline` or `guard`), its steps and the tool calls it made. A reader fills
    what an older node left out with the defaults below and ignores keys it does not know."""

    answer: str = ""
    stopped: str = "final"
    steps: int = Field(default=0, ge=0)
    tool_calls: list[AgentToolCall] = Field(default_factory=list)


# -- wire messages -----------------------------------------------------------------------
class TaskStatus(Message):
    """Where a task stands, without its log. Reply to cancel and ack; an item of list."""

    type = "task.status"
    task_id: TaskId
    kind: TaskKind
    state: TaskState
    last_seq: int = Field(ge=0)      # number of events in the log
    acked_seq: int = Field(ge=0)     # events the submitter confirmed it stored
    created_at: Timestamp
    updated_at: Timestamp
    deadline: Timestamp | None = None


class TaskSubmit(Message):
    """Submit (or harmlessly resubmit) a task. Reply: `task.accepted` or an `error`.
    With `follow` (on a session), `task.accepted` does not end the answer: the task's
    events follow on the same request, as for `task.attach` with `after_seq` 0."""

    type = "task.submit"
    spec: TaskSpec
    follow: bool = False


class TaskAccepted(Message):
    """The executor holds the task durably. `created` is False for a resubmit."""

    type = "task.accepted"
    durable = True  # the task is on disk before this is sent
    status: TaskStatus
    created: bool


class TaskAttach(Message):
    """Stream the task's events numbered above `after_seq`, live until it ends."""

    type = "task.attach"
    task_id: TaskId
    after_seq: int = Field(default=0, ge=0, le=_INT64[1])


class TaskCancel(Message):
    """Stop the task. Canceling a finished task is not an error; the reply shows its state."""

    type = "task.cancel"
    task_id: TaskId
    reason: Annotated[str, Field(max_length=1024)] = ""


class TaskAck(Message):
    """The client has durably stored events 1..upto_seq; a finished, fully acked task may be forgotten."""

    type = "task.ack"
    task_id: TaskId
    upto_seq: int = Field(ge=0, le=_INT64[1])


class TaskAcks(Message):
    """Several acks in one request (a submitter batches them off its hot path). Tasks the
    executor no longer holds are skipped. Reply: `task.acked` with how many it took."""

    type = "task.acks"
    acks: Annotated[list[TaskAck], Field(min_length=1, max_length=MAX_LIST)]


class TaskAcked(Message):
    type = "task.acked"
    acked: int = Field(ge=0)


class TaskList(Message):
    """The submitter's own tasks, oldest first, optionally only in `states`."""

    type = "task.list"
    states: Annotated[list[TaskState], Field(max_length=len(TaskState))] | None = None
    limit: int = Field(default=100, ge=1, le=MAX_LIST)


class TaskListReply(Message):
    type = "task.list_reply"
    tasks: Annotated[list[TaskStatus], Field(max_length=MAX_LIST)]


class TaskCaps(Message):
    """What this executor offers (tools and models), so a submitter can pick a target.
    Reply: `task.caps_reply`. Needs a valid grant, no particular capability."""

    type = "task.caps"


class TaskCapsReply(Message):
    type = "task.caps_reply"
    tools: Annotated[list[Name], Field(max_length=1024)] = Field(default_factory=list)
    models: Annotated[list[Name], Field(max_length=256)] = Field(default_factory=list)
    queue_depth: int = Field(default=0, ge=0)


class TaskInput(Message):
    """The submitter's answer to an `input-required` event (an agent asking to run an
    irreversible tool sends `{"question", "tool_call"}`; answer `{"approve": bool}`).
    Reply: `task.status`."""

    type = "task.input"
    task_id: TaskId
    data: JsonMap = Field(default_factory=dict)
