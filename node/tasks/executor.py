"""The executor: runs the tasks paired peers delegate to this node.

    session door (admitted) ──> TaskExecutor.handle(call)
        task.submit{follow}  store durably, queue, answer `task.accepted`, then stream
                             the task's events on the same request until the final one
        task.attach          stream events above `after_seq` until the final one
        task.ack / cancel / input / list / caps        one reply each
    workers (N)  ──> gate.recheck ──> tool | infer | agent ──> event log ──> followers

Durability: a task is written, and synced, before `task.accepted` leaves (a worker may start
it during that sync); every event is numbered and stored before it is sent; after a restart
unfinished work is requeued. Who sends what next on a follow request is
`protocol.taskflow.EventFeed`; admission (capability, rate, queue limits) happened at the door
before `handle` runs.
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from ...agent.acting.tools import ToolContext, ToolRegistry, invoke
from ..models.agents import granted_tools
from ..door.gate import Gate
from ..core.db import WalSync
from ..core.logs import fields
from ..models import ModelPool
from ..core.notify import Notifier
from ..core.wakelock import WakeLock
from ..core.redact import Redactor
from ..net.session import Call
from .store import ExecutorStore, TaskRecord
from ..door.trust import TrustStore
from ...protocol.errors import ErrorCode, ProtocolError, PsymeshError
from ...protocol.messages import Message
from ...protocol.taskflow import EventFeed
from ...protocol.tasks import (
    EventKind,
    InferCall,
    InferResult,
    InferUsage,
    TaskAccepted,
    TaskAck,
    TaskAcked,
    TaskAcks,
    TaskAttach,
    TaskCancel,
    TaskCaps,
    TaskCapsReply,
    TaskInput,
    TaskKind,
    TaskList,
    TaskListReply,
    TaskState,
    TaskStatus,
    TaskSubmit,
)

log = logging.getLogger("psymesh.tasks")
PURGE_EVERY_S = 3600.0  # finished tasks (fetched, or past retention) are forgotten this often


class Emit(Protocol):
    async def __call__(self, kind: EventKind, data: dict[str, Any] | None = None,
                       new_state: TaskState | None = None) -> None: ...


class Ask(Protocol):
    async def __call__(self, question: str, data: dict[str, Any]) -> dict[str, Any]: ...


class AgentRunner(Protocol):
    """Runs an `agent` task: `emit` appends events, `ask` moves the task to input-required
    until the submitter answers (task.input); `tools` are those the submitter's grant covers.
    Returns the task's result."""

    async def __call__(self, rec: TaskRecord, emit: Emit, ask: Ask, tools: ToolRegistry) -> Any: ...


@dataclass(frozen=True)
class ExecutorLimits:
    workers: int = 4                 # tasks run at once on this node (a model still runs one at a time)
    retention_s: float = 7 * 86400   # finished tasks kept for a submitter that has not fetched them
    token_flush_s: float = 0.05      # after the first, token deltas are batched into one event per interval


class _Answer:
    """A task waiting in input-required for its submitter's answer."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.data: dict[str, Any] = {}


class TaskExecutor:
    """Runs tasks paired peers delegate to this node."""

    def __init__(self, *, store: ExecutorStore, gate: Gate, trust: TrustStore, tools: ToolRegistry,
                 models: ModelPool, profile: str, share_dir: str | None, limits: ExecutorLimits | None = None,
                 agent_runner: AgentRunner | None = None, wake: WakeLock | None = None,
                 wal: WalSync | None = None, redact: Redactor | None = None) -> None:
        """`wal`: puts what is committed on disk (node/core/db.py); a `task.accepted` leaves
        only once the task's row is (the door leaves this answer's promise to us: daemon.py
        SYNCS_ITSELF). `redact`: this machine's paths taken out of every event before it is
        stored, so none reaches the submitter (node/core/redact.py)."""
        self.redact = redact or Redactor()
        self.store = store
        self.gate = gate
        self.trust = trust
        self.tools = tools
        self.models = models
        self.profile = profile
        self.share_dir = share_dir
        self.limits = limits or ExecutorLimits()
        self.agent_runner = agent_runner
        self.wake = wake or WakeLock(None)  # held while a task runs (a phone's CPU stays up for it)
        self.wal = wal
        self._inputs: dict[str, _Answer] = {}
        self.changed = Notifier()  # per task id: an event was written (the daemon adds its activity pulse)
        self._deadlines = anyio.Event()  # set when a task with a deadline is accepted
        self._running: dict[str, tuple[anyio.CancelScope, ToolContext]] = {}
        self._send, self._receive = anyio.create_memory_object_stream[str](math.inf)

    # -- lifecycle -------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        recovered = self.store.recover(time.time())
        for rec in recovered:
            self._send.send_nowait(rec.id)
        if recovered:
            log.info("requeued %d unfinished task(s) after restart", len(recovered))
        async with anyio.create_task_group() as tg:
            for _ in range(self.limits.workers):
                tg.start_soon(self._worker)
            tg.start_soon(self._housekeeping)
            task_status.started()

    async def _housekeeping(self) -> None:
        """Fail unfinished tasks whose deadline passed, at that deadline; forget old finished
        ones every PURGE_EVERY_S. Asleep in between: an idle node has no timer here but the
        purge's (a new task with an earlier deadline wakes it, `_deadlines`)."""
        next_purge = 0.0
        while True:
            now = time.time()
            for rec in self.store.expire(now):
                self.changed.notify(rec.id)
            if now >= next_purge:
                self.store.purge(now, self.limits.retention_s)
                next_purge = now + PURGE_EVERY_S
            deadline = self.store.next_deadline()
            wake_at = next_purge if deadline is None else min(next_purge, deadline)
            with anyio.move_on_after(max(0.0, wake_at - time.time())):
                await self._deadlines.wait()
            self._deadlines = anyio.Event()

    # -- requests (already admitted by the gate) -------------------------------------------
    async def handle(self, call: Call) -> Message:
        request, peer_id = call.request, call.peer_id
        if isinstance(request, TaskSubmit):
            record, created = self.store.submit(request.spec, peer_id)  # durable before the answer
            if created and record.deadline is not None:
                self._deadlines.set()
            accepted = TaskAccepted(status=record.status(), created=created)
            if created:
                log.info("accepted %s task %s from %s", request.spec.kind.value, request.spec.id, self.trust.label(peer_id),
                         extra=fields(task=request.spec.id))
            # Queued before the answer: a worker runs the task while we sync what `task.accepted`
            # promises (the task's row: the writes up to here, not the worker's after them), and
            # the events it wrote by then go out with the answer, in one write; a task that ended
            # meanwhile is answered whole (docs/security.md: why this is safe).
            promised = self._mark()
            if created:
                self._send.send_nowait(record.id)
            if self.wal is not None:
                await self.wal.sync(promised)
            if not request.follow:
                return accepted
            return await self._follow(call, EventFeed(record.id, 0), first=accepted)
        if isinstance(request, TaskAttach):
            self.store.get(request.task_id, submitter=peer_id)  # NOT_FOUND for someone else's task
            return await self._follow(call, EventFeed(request.task_id, request.after_seq))
        if isinstance(request, TaskAck):
            return self.store.mark_fetched(request.task_id, request.upto_seq, peer_id).status()
        if isinstance(request, TaskAcks):  # one transaction for the batch; forgotten or others' tasks are skipped
            return TaskAcked(acked=self.store.mark_fetched_each(((a.task_id, a.upto_seq) for a in request.acks),
                                                               peer_id))
        if isinstance(request, TaskCancel):
            self.store.get(request.task_id, submitter=peer_id)
            return self._cancel(request.task_id, request.reason)
        if isinstance(request, TaskInput):
            return self._answer(request.task_id, peer_id, dict(request.data))
        if isinstance(request, TaskList):
            recs = self.store.list(submitter=peer_id, states=request.states, limit=request.limit)
            return TaskListReply(tasks=[r.status() for r in recs])
        if isinstance(request, TaskCaps):
            return self.caps()
        raise ProtocolError(f"{request.type!r} is not a task request", code=ErrorCode.BAD_REQUEST)

    async def _follow(self, call: Call, feed: EventFeed, first: Message | None = None) -> Message:
        """Send the task's events as they are stored (after `first`, in its write); the final
        one ends the answer."""
        task_id = feed.task_id
        held = [] if first is None else [first]
        while True:
            events, ended = self.store.news(task_id, feed.sent)
            frames, final = feed.receive(events, task_ended=ended)
            frames, held = held + frames, []
            if final is not None:
                call.send_with_answer(*frames)  # in the final answer's write: one write, not two
                return final
            if frames:
                await call.send(*frames)
            if not events:  # nothing new since the reads above (no await between): wait for news
                await self.changed.wait(task_id)

    def _mark(self) -> int:
        return 0 if self.wal is None else self.wal.mark()

    def caps(self) -> TaskCapsReply:
        return TaskCapsReply(tools=self.tools.names(profile=self.profile), models=self.models.registry.names(),
                             queue_depth=self.store.queue_depth())

    def _cancel(self, task_id: str, reason: str = "") -> TaskStatus:
        record = self.store.cancel(task_id, reason or "canceled by the submitter")
        running = self._running.get(task_id)
        if running is not None:
            running[1].cancel()   # a sync tool sees it at its next check()
            running[0].cancel()
        self.changed.notify(task_id)
        return record.status()

    def cancel_for(self, peer_id: str, reason: str) -> int:
        """Revocation: stop everything a peer has queued or running here."""
        recs = self.store.list(submitter=peer_id, states=[TaskState.SUBMITTED, TaskState.WORKING,
                                                          TaskState.INPUT_REQUIRED])
        for rec in recs:
            self._cancel(rec.id, reason)
        return len(recs)

    # -- running tasks ------------------------------------------------------------------
    async def _worker(self) -> None:
        async for task_id in self._receive:
            try:
                with self.wake.held():
                    await self._execute(task_id)
            except Exception:  # a bug in one task must not stop the worker
                log.exception("task %s crashed its worker", task_id)
                self._fail(task_id, ErrorCode.INTERNAL, "the executor failed; see its log")

    def _emit(self, task_id: str, kind: EventKind, data: dict[str, Any] | None = None,
              new_state: TaskState | None = None) -> bool:
        """Append an event unless the task already ended (e.g. canceled meanwhile)."""
        try:
            self.store.append_event(task_id, kind, self.redact.data(data), new_state)
        except ProtocolError:
            return False
        self.changed.notify(task_id)
        return True

    def _fail(self, task_id: str, code: ErrorCode, message: str) -> None:
        self._emit(task_id, EventKind.ERROR, {"code": code.value, "message": message})

    async def _execute(self, task_id: str) -> None:
        rec = self.store.get(task_id)
        if rec.terminal:
            return  # canceled or expired while queued
        decision = self.gate.recheck(rec.submitter, rec.spec)  # the grant may have changed while it waited
        if not decision.allowed:
            code = decision.code.value if decision.code else "forbidden"
            self._emit(task_id, EventKind.STATE, {"code": code, "reason": decision.reason}, TaskState.REJECTED)
            return
        now = time.time()
        peer = self.trust.get(rec.submitter)
        max_runtime = peer.granted.limits.max_runtime_s if peer and peer.granted else None
        deadline = rec.deadline
        if max_runtime:
            deadline = min(deadline or math.inf, now + max_runtime)
        if deadline is not None and deadline <= now:
            self._fail(task_id, ErrorCode.TIMEOUT, "the task's deadline passed before it could start")
            return
        if not self._emit(task_id, EventKind.STATE, {}, TaskState.WORKING):
            return
        ctx = ToolContext(share_dir=None if self.share_dir is None else Path(self.share_dir),
                          profile=self.profile, peer_id=rec.submitter,
                          deadline=None if deadline in (None, math.inf) else deadline)
        with anyio.CancelScope() as scope:
            self._running[task_id] = (scope, ctx)
            try:
                with anyio.move_on_after(math.inf if deadline is None else deadline - time.time()) as timer:
                    result = await self._run_kind(rec, ctx, decision.max_tokens)
                if timer.cancel_called:
                    ctx.cancel()
                    self._fail(task_id, ErrorCode.TIMEOUT, "the task ran past its deadline")
                    return
                self._emit(task_id, EventKind.RESULT, {"result": result})
            except PsymeshError as exc:
                self._fail(task_id, exc.code, exc.message)
            except anyio.get_cancelled_exc_class():
                if not scope.cancel_called:  # the node is shutting down, not a cancel of this task:
                    ctx.cancel()             # requeue it now, so a clean stop is not counted as a crash
                    self._emit(task_id, EventKind.REQUEUED, {"reason": "executor shut down"})
                raise
            finally:
                self._running.pop(task_id, None)
        if scope.cancel_called:
            log.info("task %s canceled while running", task_id)

    async def _run_kind(self, rec: TaskRecord, ctx: ToolContext, max_tokens: int | None) -> Any:
        spec = rec.spec
        if spec.kind is TaskKind.TOOL:
            assert spec.tool is not None
            tool = self.tools.get(spec.tool)
            if not tool.offered_on(self.profile):
                raise PsymeshError(f"tool {spec.tool!r} is not offered on a {self.profile} node",
                                   code=ErrorCode.NOT_FOUND)
            return await invoke(tool, spec.args, ctx)
        if spec.kind is TaskKind.INFER:
            return await self._infer(rec, max_tokens)
        if self.agent_runner is None:
            raise PsymeshError("this node runs no agent loop", code=ErrorCode.NOT_FOUND)

        async def emit(kind: EventKind, data: dict[str, Any] | None = None, new_state: TaskState | None = None) -> None:
            self._emit(rec.id, kind, data, new_state)

        async def ask(question: str, data: dict[str, Any]) -> dict[str, Any]:
            return await self._ask(rec.id, question, data)

        peer = self.trust.get(rec.submitter)  # (re-checked as the task started: the grant covers task.agent)
        tools = granted_tools(self.tools, peer.granted if peer else None, local_peer_id=self.gate.local_peer_id,
                              peer_id=rec.submitter, now=time.time())
        return await self.agent_runner(rec, emit, ask, tools)

    async def _ask(self, task_id: str, question: str, data: dict[str, Any]) -> dict[str, Any]:
        """Move the task to input-required and wait for the submitter's `task.input`.
        The task's deadline (and cancel) still apply while it waits."""
        waiter = _Answer()
        self._inputs[task_id] = waiter
        try:
            self._emit(task_id, EventKind.STATE, {"question": question, **data}, TaskState.INPUT_REQUIRED)
            await waiter.event.wait()
        finally:
            self._inputs.pop(task_id, None)
        self._emit(task_id, EventKind.STATE, {"answer": waiter.data}, TaskState.WORKING)
        return waiter.data

    def _answer(self, task_id: str, peer_id: str, data: dict[str, Any]) -> TaskStatus:
        record = self.store.get(task_id, submitter=peer_id)
        waiter = self._inputs.get(task_id)
        if waiter is None or waiter.event.is_set():
            raise PsymeshError(f"task {task_id} is {record.state.value}, not waiting for input",
                               code=ErrorCode.CONFLICT)
        waiter.data = data
        waiter.event.set()
        return record.status()

    async def _infer(self, rec: TaskRecord, ceiling: int | None) -> dict[str, Any]:
        from ...agent.runtime.generate import Generation, generate
        from ...agent.runtime.infer_task import infer_inputs

        spec = rec.spec
        assert spec.model is not None
        max_tokens = spec.max_tokens or 256
        if ceiling is not None:
            max_tokens = min(max_tokens, ceiling)
        inputs = infer_inputs(spec, max_tokens)  # BAD_REQUEST before loading
        worker = await self.models.get(spec.model)

        pending: list[str] = []
        last_flush = -math.inf  # the first token goes out at once; batching starts after it
        result: Generation | None = None
        async with aclosing(generate(worker, inputs.messages, tools=inputs.tools, params=inputs.params)) as pieces:
            async for piece in pieces:
                if isinstance(piece, Generation):
                    result = piece
                    break
                pending.append(piece.text)
                if time.monotonic() - last_flush >= self.limits.token_flush_s:
                    self._emit(rec.id, EventKind.TOKEN, {"text": "".join(pending)})
                    pending.clear()
                    last_flush = time.monotonic()
                    # The model may run ahead of us: then this loop never waits for it and,
                    # without a checkpoint, would keep the whole node (streams too) from running.
                    await anyio.lowlevel.checkpoint()
        if pending:
            self._emit(rec.id, EventKind.TOKEN, {"text": "".join(pending)})
        assert result is not None
        reply = result.reply  # not None when tools were offered: the reply as the model's parse of it
        return InferResult(
            text=result.text, finish_reason=result.finish_reason,
            usage=InferUsage(prompt_tokens=result.usage.prompt_tokens,
                             completion_tokens=result.usage.completion_tokens),
            content=None if reply is None else reply.content,
            tool_calls=None if reply is None else [InferCall(id=c.id, name=c.name, arguments=c.arguments)
                                                   for c in result.tool_calls],
            tool_family=None if reply is None else worker.info.tool_family.value).wire()
