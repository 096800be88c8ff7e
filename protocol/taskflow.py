"""The delegated-task conversation, both ends, as state machines (sans-IO).

The messages are in `protocol/tasks.py`; this module decides who sends what next.
The node drives each machine over a session (`protocol/session.py`): it sends what
the machine asks for, feeds it every frame that comes back and carries out the
actions it returns, like `node/door/pairing.py` drives the pairing machines.

Submitter (one `SubmitterTask` per delegated task), phases:

    unsent ──task.submit{follow}──> following ──final event──> acking ──task.status──> done
       │  <── busy/rate_limited: retry at        │ <── events (stored, exactly once by seq)
       │  <── forbidden, unknown_peer, ...       │ session lost: task.attach{after_seq} again
       └──────────── refused: finish here ───────┴── not_found / forbidden ...: finish here
       │
       └─ canceled by the app while a submit may be on its way: recalling
            task.submit (harmless if it arrived) ─> task.accepted ─> task.cancel ─> done

Executor (one `EventFeed` per follow request): sends the task's stored events above
the client's `after_seq`, in order, and ends the answer with the final one.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from .common import Error
from .errors import ErrorCode, ProtocolError
from .messages import Message
from .session import SessionEnd
from .tasks import (
    EventKind,
    TaskAccepted,
    TaskAck,
    TaskAcked,
    TaskAttach,
    TaskCancel,
    TaskEvent,
    TaskSpec,
    TaskState,
    TaskStatus,
    TaskSubmit,
)

RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0
#: Refusals that no resend can change: the task ends on the submitter's side.
FINAL_REFUSALS = frozenset({ErrorCode.UNKNOWN_PEER, ErrorCode.FORBIDDEN, ErrorCode.EXPIRED, ErrorCode.BAD_REQUEST,
                            ErrorCode.CONFLICT, ErrorCode.TOO_LARGE, ErrorCode.BAD_FRAME,
                            ErrorCode.UNSUPPORTED_VERSION})


class Phase(StrEnum):
    UNSENT = "unsent"          # in the outbox; no executor has said it holds it
    FOLLOWING = "following"    # accepted; its events are mirrored until the final one
    ACKING = "acking"          # the final event is stored here; the executor may forget it once told
    RECALLING = "recalling"    # canceled here before acceptance: make sure the executor cancels it too
    DONE = "done"


# -- actions the driver carries out, in order -------------------------------------------
@dataclass(frozen=True)
class Accepted:
    """The executor holds the task durably (the outbox row becomes `accepted`)."""

    status: TaskStatus


@dataclass(frozen=True)
class Record:
    """Store this event durably (INSERT-or-ignore on task and seq), then tell watchers.
    `local`: written here (the task ended on this side), not received from the executor."""

    event: TaskEvent
    local: bool = False


@dataclass(frozen=True)
class RetryAt:
    """Nothing more to do before `when` (the submitter's clock); then ask `next_request()`."""

    when: float


@dataclass(frozen=True)
class Done:
    """Nothing remains to fetch or acknowledge: never resume this task."""


Action = Accepted | Record | RetryAt | Done


class SubmitterTask:
    """The submitter's side of one task; rebuilt from the outbox after a restart."""

    def __init__(self, spec: TaskSpec, *, accepted: bool = False, last_seq: int = 0, last_state: TaskState | None = None,
                 acked: bool = False) -> None:
        self.spec = spec
        self.last_seq = last_seq
        self.last_state = last_state
        self._backoff = 0.0
        self._recall_accepted = False
        if acked:
            self.phase = Phase.DONE
        elif last_state is TaskState.CANCELED and not accepted:
            self.phase = Phase.RECALLING
        elif last_state is not None and last_state.terminal:
            self.phase = Phase.ACKING
        else:
            self.phase = Phase.FOLLOWING if accepted else Phase.UNSENT

    @property
    def task_id(self) -> str:
        return self.spec.id

    def next_request(self) -> Message | None:
        """What to send the executor now (each on a new session request), or None when done."""
        if self.phase is Phase.UNSENT:
            return TaskSubmit(spec=self.spec, follow=True)
        if self.phase is Phase.FOLLOWING:
            return TaskAttach(task_id=self.task_id, after_seq=self.last_seq)
        if self.phase is Phase.ACKING:
            return TaskAck(task_id=self.task_id, upto_seq=self.last_seq)
        if self.phase is Phase.RECALLING:
            if self._recall_accepted:
                return TaskCancel(task_id=self.task_id, reason="canceled before delivery")
            return TaskSubmit(spec=self.spec)
        return None

    def receive(self, message: Message, now: float) -> list[Action]:
        """A frame answering our latest request. ProtocolError if the executor broke the rules."""
        if isinstance(message, TaskAccepted):
            if message.status.task_id != self.task_id:
                raise ProtocolError("the executor accepted another task")
            self._backoff = 0.0
            if self.phase is Phase.RECALLING:
                self._recall_accepted = True  # it holds the task: now cancel it there
                return []
            if self.phase is Phase.UNSENT:
                self.phase = Phase.FOLLOWING
            return [Accepted(message.status)]
        if isinstance(message, TaskEvent):
            return self._on_event(message)
        if isinstance(message, TaskAcked) and self.phase is Phase.ACKING:
            self.phase = Phase.DONE  # (one of a batch of acks)
            return [Done()]
        if isinstance(message, TaskStatus):
            if self.phase in (Phase.ACKING, Phase.RECALLING):
                self.phase = Phase.DONE
                return [Done()]
            return []
        if isinstance(message, SessionEnd):
            return []  # the answer ended early (executor shutting down): ask again
        if isinstance(message, Error):
            return self._on_error(message, now)
        raise ProtocolError(f"unexpected {message.type!r} in a task conversation")

    def _on_event(self, event: TaskEvent) -> list[Action]:
        if event.task_id != self.task_id:
            raise ProtocolError("the executor sent another task's event")
        if self.phase is not Phase.FOLLOWING or event.seq <= self.last_seq:
            return []  # already stored (a resend after a lost session)
        if event.seq != self.last_seq + 1:
            raise ProtocolError(f"event {event.seq} arrived after {self.last_seq}: events were skipped")
        self.last_seq, self.last_state = event.seq, event.state
        self._backoff = 0.0
        if event.state.terminal:
            self.phase = Phase.ACKING
        return [Record(event)]

    def _on_error(self, error: Error, now: float) -> list[Action]:
        code = error.code
        if code in (ErrorCode.BUSY, ErrorCode.RATE_LIMITED, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT,
                    ErrorCode.CANCELED, ErrorCode.INTERNAL):
            return [self._retry(now, error.retry_after)]
        if self.phase in (Phase.ACKING, Phase.RECALLING):
            self.phase = Phase.DONE  # e.g. not_found or refused: the executor holds nothing to cancel or ack
            return [Done()]
        if code == ErrorCode.NOT_FOUND:
            return self._finish(now, ErrorCode.NOT_FOUND, "the executor no longer holds this task")
        if code in FINAL_REFUSALS or code not in ErrorCode._value2member_map_:
            return self._finish(now, code, error.message or code)
        return [self._retry(now, error.retry_after)]

    def connection_lost(self, now: float) -> list[Action]:
        """The session under our request died: try again after a backoff."""
        return [self._retry(now, None)]

    def cancel_unsent(self, now: float, *, maybe_sent: bool) -> list[Action]:
        """The app canceled a task no executor has accepted: it ends here, canceled. If a submit
        may be on its way (`maybe_sent`), the machine then recalls it: resubmits (harmless if it
        arrived) and cancels it on the executor, so it does not run there unseen."""
        if self.phase is not Phase.UNSENT:
            raise ProtocolError("only a task no executor holds can be canceled locally")
        actions = self._finish(now, ErrorCode.CANCELED, "canceled before delivery", state=TaskState.CANCELED)
        if maybe_sent:
            self.phase = Phase.RECALLING
            return [a for a in actions if not isinstance(a, Done)]
        return actions

    def _retry(self, now: float, retry_after: float | None) -> RetryAt:
        self._backoff = min(RETRY_MAX_S, max(RETRY_MIN_S, self._backoff * 2))
        return RetryAt(now + (retry_after if retry_after is not None else self._backoff))

    def _finish(self, now: float, code: str, message: str, state: TaskState | None = None) -> list[Action]:
        """End the task here with this outcome, numbered after what we hold, as the executor would."""
        events: list[TaskEvent] = []
        if self.last_seq == 0:
            events.append(TaskEvent(task_id=self.task_id, seq=1, kind=EventKind.ACCEPTED, state=TaskState.SUBMITTED,
                                    at=now))
        seq = len(events) + self.last_seq + 1
        data = {"code": str(code), "message": message, "reason": message}
        if state is TaskState.CANCELED or (self.last_seq == 0 and state is None):
            target = state or TaskState.REJECTED
            events.append(TaskEvent(task_id=self.task_id, seq=seq, kind=EventKind.STATE, state=target, at=now,
                                    data=data))
        else:
            events.append(TaskEvent(task_id=self.task_id, seq=seq, kind=EventKind.ERROR, state=TaskState.FAILED,
                                    at=now, data=data))
        self.last_seq, self.last_state = events[-1].seq, events[-1].state
        self.phase = Phase.DONE
        return [*(Record(e, local=True) for e in events), Done()]


class EventFeed:
    """The executor's side of one follow request (`task.submit{follow}` or `task.attach`)."""

    def __init__(self, task_id: str, after_seq: int) -> None:
        self.task_id = task_id
        self.sent = after_seq
        self.done = False

    def receive(self, events: Sequence[TaskEvent], *, task_ended: bool) -> tuple[list[TaskEvent], Message | None]:
        """Given the stored events above what was sent (and whether the task is over), the
        frames to send now, and the final frame if the answer ends here."""
        if self.done:
            return [], None
        fresh = [e for e in events if e.seq > self.sent]
        for expected, event in enumerate(fresh, start=self.sent + 1):
            if event.seq != expected or event.task_id != self.task_id:
                raise ProtocolError("the event log has a gap", code=ErrorCode.INTERNAL)
        if fresh:
            self.sent = fresh[-1].seq
            if fresh[-1].state.terminal:
                self.done = True
                return fresh[:-1], fresh[-1]
            return fresh, None
        if task_ended:  # the client already holds the final event (it died before acking)
            self.done = True
            return [], SessionEnd(reason="the task is over and you hold all its events")
        return [], None
