"""Control messages of delegated tasks: submit, watch, cancel, list, answer an input request,
and the offers of paired peers (who would run a task of a kind)."""
import json

from pydantic import Field

from ..messages import Message
from ..tasks import TaskEvent, TaskKind, TaskSpec, TaskState
from .common import PeerAway, View

SUMMARY_CHARS = 120


def task_summary(spec: TaskSpec) -> str:
    """What a task asks, on one line of at most SUMMARY_CHARS: `system.info {}`, `on botpsy:
    what is ...`, `goal: turn on wifi` (a task list's row says it, not only its kind)."""
    if spec.tool is not None:
        text = f"{spec.tool} {json.dumps(spec.args, ensure_ascii=False, default=str)}"
    elif spec.goal is not None:
        text = f"goal: {spec.goal}"
    else:
        asked = spec.prompt if spec.prompt is not None else (spec.messages[-1].content if spec.messages else "")
        text = f"on {spec.model or 'its model'}: {asked}"
    text = " ".join(str(text).split())
    return text if len(text) <= SUMMARY_CHARS else text[:SUMMARY_CHARS - 1] + "…"


class TaskSubmitRequest(Message):
    """Delegate `spec` to `to` (a paired peer's name or id), or to the best paired peer
    offering it when `to` is None. The task is durable once this returns."""

    type = "control.task_submit"
    to: str | None = None
    spec: dict  # a protocol.tasks.TaskSpec (validated by the daemon)


class TaskSubmitted(Message):
    type = "control.task_submitted"
    durable = True  # the outbox row is synced to disk before this is sent
    task_id: str
    target: str
    target_name: str
    accepted: bool  # False: stored and queued for delivery (the target was unreachable or busy)
    away: PeerAway | None = None  # not accepted because the target is unreachable: since when, why
    final: TaskEvent | None = None  # the task ended before this answer: its final event (no wait needed)


class TaskWatchRequest(Message):
    """Stream this node's mirror of a delegated task's events after `after_seq`
    (`task.event` messages), then `control.ok` once the task has ended."""

    type = "control.task_watch"
    task_id: str
    after_seq: int = Field(default=0, ge=0)


class TaskWaitRequest(Message):
    """Wait until a delegated task has ended; the reply is its final `task.event` (the one
    whose state is terminal: its result or why it failed), from this node's mirror."""

    type = "control.task_wait"
    task_id: str


class TaskCancelRequest(Message):
    type = "control.task_cancel"
    task_id: str


class TaskListRequest(Message):
    type = "control.task_list"
    limit: int = Field(default=100, ge=1, le=1000)


class SubmittedTaskView(View):
    """A task this node delegated, from its durable mirror."""

    task_id: str
    kind: TaskKind
    target: str          # the executing peer's name (its id if it is no longer paired)
    state: TaskState
    accepted: bool       # the target holds it (False: still queued here for delivery)
    events: int          # events mirrored so far
    created_at: float
    updated_at: float
    away: PeerAway | None = None  # unfinished, and the target could not be reached when last tried
    what: str = ""       # what it asks, one line (task_summary)
    error: str | None = None  # ended without completing: why (the final event's message)


class ExecutingTaskView(View):
    """A task this node runs for a peer."""

    task_id: str
    kind: TaskKind
    submitter: str       # the submitting peer's name (its id if it is no longer paired)
    state: TaskState
    last_seq: int        # events in the task's log
    acked_seq: int       # events the submitter confirmed it stored
    created_at: float
    updated_at: float
    deadline: float | None = None
    what: str = ""       # what it asks, one line (task_summary)


class TaskListReply(Message):
    type = "control.task_list_reply"
    submitted: list[SubmittedTaskView] = Field(default_factory=list)  # tasks this node delegated
    executing: list[ExecutingTaskView] = Field(default_factory=list)  # tasks this node runs for others


class TaskInputRequest(Message):
    """Answer a delegated task that is `input-required` (forwarded to the executing node)."""

    type = "control.task_input"
    task_id: str
    data: dict = Field(default_factory=dict)


class OffersRequest(Message):
    """Which paired peers would take a task of `operation` (e.g. task.agent), with what they offer."""

    type = "control.offers"
    operation: str = "task.agent"


class Offer(View):
    """A paired peer that would take the operation now, and what it has for it."""

    peer_id: str
    name: str
    models: list[str] = Field(default_factory=list)
    tools: list[str] = Field(default_factory=list)
    queue_depth: int = 0  # tasks waiting there


class OffersReply(Message):
    type = "control.offers_reply"
    offers: list[Offer] = Field(default_factory=list)
