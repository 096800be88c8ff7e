"""The task conversation machines (protocol/taskflow.py), driven by hand: what the
submitter sends next after each frame, and how the executor's feed ends an answer."""
from __future__ import annotations

import pytest

from psymesh.protocol.common import Error
from psymesh.protocol.errors import ErrorCode, ProtocolError
from psymesh.protocol.session import SessionEnd
from psymesh.protocol.taskflow import Accepted, Done, EventFeed, Phase, Record, RetryAt, SubmitterTask
from psymesh.protocol.tasks import (
    EventKind,
    Outcome,
    TaskAccepted,
    TaskAck,
    TaskAttach,
    TaskCancel,
    TaskEvent,
    TaskKind,
    TaskSpec,
    TaskState,
    TaskStatus,
    TaskSubmit,
)

SPEC = TaskSpec(id="t1", kind=TaskKind.TOOL, tool="files.read", args={"path": "a"})


def status(state: TaskState = TaskState.SUBMITTED, last: int = 1) -> TaskStatus:
    return TaskStatus(task_id="t1", kind=TaskKind.TOOL, state=state, last_seq=last, acked_seq=0, created_at=1.0,
                      updated_at=1.0)


def ev(seq: int, kind: EventKind, state: TaskState, **data: object) -> TaskEvent:
    return TaskEvent(task_id="t1", seq=seq, kind=kind, state=state, at=1.0, data=data)


ACCEPTED = ev(1, EventKind.ACCEPTED, TaskState.SUBMITTED)
WORKING = ev(2, EventKind.STATE, TaskState.WORKING)
RESULT = ev(3, EventKind.RESULT, TaskState.COMPLETED, result={"ok": 1})


def test_a_task_is_submitted_followed_and_acked_in_one_conversation() -> None:
    task = SubmitterTask(SPEC)
    assert task.next_request() == TaskSubmit(spec=SPEC, follow=True)
    assert task.receive(TaskAccepted(status=status(), created=True), 0) == [Accepted(status())]
    assert [task.receive(e, 0) for e in (ACCEPTED, WORKING, RESULT)] == [[Record(ACCEPTED)], [Record(WORKING)],
                                                                       [Record(RESULT)]]
    assert task.phase is Phase.ACKING
    assert task.next_request() == TaskAck(task_id="t1", upto_seq=3)
    assert task.receive(status(TaskState.COMPLETED, 3), 0) == [Done()]
    assert task.next_request() is None


def test_a_lost_session_resumes_after_the_last_stored_event_and_drops_repeats() -> None:
    task = SubmitterTask(SPEC)
    task.receive(TaskAccepted(status=status(), created=True), 0)
    task.receive(ACCEPTED, 0)
    [retry] = task.connection_lost(10.0)
    assert isinstance(retry, RetryAt) and retry.when > 10.0
    assert task.next_request() == TaskAttach(task_id="t1", after_seq=1)
    assert task.receive(ACCEPTED, 11) == []  # the executor resent it: stored once only
    assert task.receive(WORKING, 11) == [Record(WORKING)]


def test_a_gap_in_the_events_is_a_protocol_error() -> None:
    task = SubmitterTask(SPEC, accepted=True)
    with pytest.raises(ProtocolError, match="skipped"):
        task.receive(WORKING, 0)


def test_busy_backs_off_as_told_and_then_exponentially() -> None:
    task = SubmitterTask(SPEC)
    assert task.receive(Error.of(ErrorCode.BUSY, "full", retry_after=2.5), 100.0) == [RetryAt(102.5)]
    waits = [task.connection_lost(0.0)[0].when for _ in range(8)]
    assert waits == sorted(waits) and waits[-1] == 5.0
    assert task.phase is Phase.UNSENT


@pytest.mark.parametrize("code", [ErrorCode.FORBIDDEN, ErrorCode.UNKNOWN_PEER, ErrorCode.EXPIRED])
def test_a_refusal_no_resend_can_change_ends_the_task_here(code: ErrorCode) -> None:
    unsent = SubmitterTask(SPEC)
    actions = unsent.receive(Error.of(code, "no"), 5.0)
    assert actions[-1] == Done() and unsent.next_request() is None
    final = actions[-2].event
    assert Outcome.from_event(final).code is code and final.state is TaskState.REJECTED
    following = SubmitterTask(SPEC, accepted=True, last_seq=2, last_state=TaskState.INPUT_REQUIRED)
    actions = following.receive(Error.of(code, "revoked"), 5.0)
    assert [a.event.seq for a in actions if isinstance(a, Record)] == [3]
    assert Outcome.from_event(actions[0].event).code is code
    assert following.next_request() is None


def test_an_executor_that_lost_the_task_ends_it_as_failed() -> None:
    task = SubmitterTask(SPEC, accepted=True, last_seq=2, last_state=TaskState.WORKING)
    actions = task.receive(Error.of(ErrorCode.NOT_FOUND, "?"), 1.0)
    assert Outcome.from_event(actions[0].event).code is ErrorCode.NOT_FOUND


def test_an_ack_the_executor_no_longer_needs_is_done() -> None:
    task = SubmitterTask(SPEC, accepted=True, last_seq=3, last_state=TaskState.COMPLETED)
    assert task.next_request() == TaskAck(task_id="t1", upto_seq=3)
    assert task.receive(Error.of(ErrorCode.NOT_FOUND, "purged"), 0) == [Done()]


def test_cancel_before_delivery_ends_it_canceled() -> None:
    task = SubmitterTask(SPEC)
    actions = task.cancel_unsent(3.0, maybe_sent=False)
    assert [a.event.state for a in actions if isinstance(a, Record)] == [TaskState.SUBMITTED, TaskState.CANCELED]
    assert actions[-1] == Done() and task.next_request() is None
    with pytest.raises(ProtocolError):
        SubmitterTask(SPEC, accepted=True).cancel_unsent(3.0, maybe_sent=False)


def test_a_submit_that_may_be_on_its_way_is_recalled_from_the_executor() -> None:
    task = SubmitterTask(SPEC)
    actions = task.cancel_unsent(3.0, maybe_sent=True)
    assert Done() not in actions and task.phase is Phase.RECALLING
    assert task.next_request() == TaskSubmit(spec=SPEC)  # harmless if the first one arrived
    assert task.receive(TaskAccepted(status=status(), created=False), 4.0) == []
    assert task.next_request() == TaskCancel(task_id="t1", reason="canceled before delivery")
    assert task.receive(status(TaskState.CANCELED, 2), 4.0) == [Done()]
    # after a restart, the outbox row (canceled here, never accepted) brings the recall back
    again = SubmitterTask(SPEC, last_seq=2, last_state=TaskState.CANCELED)
    assert again.phase is Phase.RECALLING


def test_an_early_end_of_answer_means_ask_again() -> None:
    task = SubmitterTask(SPEC, accepted=True, last_seq=1, last_state=TaskState.SUBMITTED)
    assert task.receive(SessionEnd(reason="shutting down"), 0) == []
    assert task.next_request() == TaskAttach(task_id="t1", after_seq=1)


def test_the_feed_sends_in_order_and_ends_on_the_final_event() -> None:
    feed = EventFeed("t1", after_seq=1)
    assert feed.receive([ACCEPTED, WORKING], task_ended=False) == ([WORKING], None)
    assert feed.receive([RESULT], task_ended=True) == ([], RESULT)
    assert feed.done


def test_the_feed_ends_at_once_for_a_client_holding_everything() -> None:
    feed = EventFeed("t1", after_seq=3)
    frames, final = feed.receive([], task_ended=True)
    assert frames == [] and isinstance(final, SessionEnd)


def test_the_feed_refuses_a_log_with_holes() -> None:
    with pytest.raises(ProtocolError):
        EventFeed("t1", after_seq=0).receive([WORKING], task_ended=False)
