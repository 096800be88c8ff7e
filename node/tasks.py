"""Delegated tasks on the node: `/psymesh/task/1.0.0`, both ends.

    phone (submitter)                                   home PC (executor)
    TaskSubmitter                                        TaskExecutor
      outbox (SQLite) ── task.submit ──────────────────>  gate -> ExecutorStore (SQLite)
      resend loop       <── task.accepted | busy(retry_after)        │ queue -> workers
      follower   ── task.attach(after_seq) ────────────>  event log ─┘ (tool, infer, agent)
                 <── task.event* ... final event
                 ── task.ack(upto_seq) ─────────────────>  finished task may be purged

Durability: the submitter writes a task to its outbox before sending it and resends
it until the executor says `task.accepted` (submitting twice is harmless: the
submitter picks the id). The executor writes the task before answering, numbers
every event, and after a restart requeues what was unfinished. The submitter mirrors
events into its outbox with INSERT-or-ignore on (task, seq), so after either side
restarts it re-attaches after its last stored event and sees each event exactly once.

Backpressure: a full queue (global or per peer) answers `busy` with `retry_after`;
an accepted task is never dropped. The submitter then waits before resending to
that peer.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from psymesh.agent.tools import ToolContext, ToolRegistry, invoke
from psymesh.node.framed import FramedStream, request_once
from psymesh.node.gate import Gate
from psymesh.node.logs import fields
from psymesh.node.models import ModelPool
from psymesh.node.p2p import P2PStream
from psymesh.node.taskstore import ExecutorStore, Outbox, OutboxTask, TaskNotFound, TaskRecord
from psymesh.node.trust import TrustStore
from psymesh.protocol import ids
from psymesh.protocol.errors import ErrorCode, ProtocolError, PsymeshError, RemoteError
from psymesh.protocol.common import Ping, Pong
from psymesh.protocol.manifest import Operation, check
from psymesh.protocol.messages import M, Message, expect
from psymesh.protocol.tasks import (
    EventKind,
    TaskAccepted,
    TaskAck,
    TaskAttach,
    TaskCancel,
    TaskCaps,
    TaskCapsReply,
    TaskEvent,
    TaskInput,
    TaskKind,
    TaskList,
    TaskListReply,
    TaskSpec,
    TaskState,
    TaskStatus,
    TaskSubmit,
)

log = logging.getLogger("psymesh.tasks")

OpenStream = Callable[[str, str], Awaitable[P2PStream]]
# Runs an `agent` task: (record, emit(kind, data, new_state), ask(question, data) -> answer) -> result.
# `ask` moves the task to input-required until the submitter answers (task.input).
AgentRunner = Callable[[TaskRecord, Callable[..., Awaitable[None]], Callable[..., Awaitable[dict]]], Awaitable[Any]]


@dataclass(frozen=True)
class ExecutorLimits:
    workers: int = 4                 # tasks run at once on this node (a model still runs one at a time)
    max_queue: int = 256             # unfinished tasks held for all peers
    max_queue_per_peer: int = 64     # ... and for one peer (its manifest may say less)
    retention_s: float = 7 * 86400   # finished tasks kept for a submitter that has not fetched them
    busy_retry_after: float = 0.5
    token_flush_s: float = 0.05      # token deltas are batched into one event per interval


def operation_for(spec: TaskSpec) -> Operation:
    """What the gate must judge for this task."""
    payload = len(spec.model_dump_json())
    if spec.kind is TaskKind.TOOL:
        assert spec.tool is not None
        return Operation.tool_call(spec.tool, payload_bytes=payload)
    if spec.kind is TaskKind.INFER:
        return Operation.infer(spec.model, spec.max_tokens, payload_bytes=payload)
    return Operation(name="task.agent", payload_bytes=payload)


class _Waiters:
    __slots__ = ("event", "count")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.count = 0


class _Probe:
    """A liveness ping in flight; tasks following the same peer wait for its outcome."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.ok = True  # unless the ping fails (a probe cancelled midway says nothing)


class _Answer:
    """A task waiting in input-required for its submitter's answer."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.data: dict[str, Any] = {}


class _Notifier:
    """Wake whoever waits on a task id (attached streams, local watchers).

    Call `wait(key)` right after reading the state you wait on, with no await in
    between: the node runs one trio task at a time, so no change can slip in and
    no wake-up is lost. An entry exists only while someone waits, so the tasks a
    long-lived node has served leave nothing behind in memory.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, _Waiters] = {}

    async def wait(self, key: str) -> None:
        waiters = self._waiting.get(key)
        if waiters is None:
            waiters = self._waiting[key] = _Waiters()
        waiters.count += 1
        try:
            await waiters.event.wait()
        finally:
            waiters.count -= 1
            if not waiters.count and self._waiting.get(key) is waiters:
                del self._waiting[key]

    def notify(self, key: str) -> None:
        waiters = self._waiting.pop(key, None)
        if waiters is not None:
            waiters.event.set()

    def __len__(self) -> int:
        return len(self._waiting)


# ====================================================================== executor


class TaskExecutor:
    """Runs tasks paired peers delegate to this node."""

    def __init__(self, *, local_peer_id: str, store: ExecutorStore, gate: Gate, trust: TrustStore,
                 tools: ToolRegistry, models: ModelPool, profile: str, share_dir: str | None,
                 limits: ExecutorLimits | None = None, agent_runner: AgentRunner | None = None) -> None:
        self.local_peer_id = local_peer_id
        self.store = store
        self.gate = gate
        self.trust = trust
        self.tools = tools
        self.models = models
        self.profile = profile
        self.share_dir = share_dir
        self.limits = limits or ExecutorLimits()
        self.agent_runner = agent_runner
        self._inputs: dict[str, _Answer] = {}
        self._changed = _Notifier()
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
        """Fail queued tasks whose deadline passed (every second); forget old finished ones (every minute)."""
        last_purge = 0.0
        while True:
            await anyio.sleep(1.0)
            for rec in self.store.expire(time.time()):
                self._changed.notify(rec.id)
            if time.monotonic() - last_purge >= 60:
                self.store.purge(time.time(), self.limits.retention_s)
                last_purge = time.monotonic()

    # -- the wire ----------------------------------------------------------------------
    async def serve(self, framed: FramedStream, peer_id: str) -> None:
        """One request per stream (see protocol/tasks.py)."""
        request = await framed.receive_required()
        if isinstance(request, TaskSubmit):
            await framed.send(await self._submit(request.spec, peer_id))
        elif isinstance(request, TaskAttach):
            await self._attach(framed, peer_id, request)
        elif isinstance(request, TaskCancel):
            await framed.send(self._cancel(request.task_id, peer_id, request.reason))
        elif isinstance(request, TaskAck):
            self.gate.authorize(peer_id, ids.TASK, None, label="task.ack")
            await framed.send(self.store.mark_fetched(request.task_id, request.upto_seq, peer_id).status())
        elif isinstance(request, TaskList):
            self.gate.authorize(peer_id, ids.TASK, None, label="task.list")
            recs = self.store.list(submitter=peer_id, states=request.states, limit=request.limit)
            await framed.send(TaskListReply(tasks=[r.status() for r in recs]))
        elif isinstance(request, TaskCaps):
            self.gate.authorize(peer_id, ids.TASK, None, label="task.caps")
            await framed.send(self.caps())
        elif isinstance(request, TaskInput):
            self.gate.authorize(peer_id, ids.TASK, None, label="task.input")
            await framed.send(self._answer(request.task_id, peer_id, dict(request.data)))
        else:
            raise ProtocolError(f"{request.type!r} is not a task request", code=ErrorCode.BAD_REQUEST)

    def caps(self) -> TaskCapsReply:
        return TaskCapsReply(tools=self.tools.names(profile=self.profile), models=self.models.registry.names(),
                             queue_depth=self.store.queue_depth())

    async def _submit(self, spec: TaskSpec, peer_id: str) -> TaskAccepted:
        try:  # a resubmit of a task we hold is answered without charging the peer again
            existing = self.store.get(spec.id, submitter=peer_id)
        except TaskNotFound:
            existing = None
        if existing is not None:
            record, created = self.store.submit(spec, peer_id)
            return TaskAccepted(status=record.status(), created=created)
        decision = self.gate.authorize(peer_id, ids.TASK, operation_for(spec))
        peer = self.trust.get(peer_id)
        manifest_cap = peer.granted.limits.concurrent_tasks if peer and peer.granted else None
        per_peer = min(self.limits.max_queue_per_peer, manifest_cap or self.limits.max_queue_per_peer)
        if self.store.active_for(peer_id) >= per_peer:
            raise PsymeshError(f"you have {per_peer} unfinished task(s) here, the most allowed; retry later",
                               code=ErrorCode.BUSY, retry_after=self.limits.busy_retry_after)
        if self.store.queue_depth() >= self.limits.max_queue:
            raise PsymeshError("this node's task queue is full; retry later", code=ErrorCode.BUSY,
                               retry_after=self.limits.busy_retry_after * 2)
        del decision
        record, created = self.store.submit(spec, peer_id)
        if created:
            log.info("accepted %s task %s from %s", spec.kind.value, spec.id, peer_id, extra=fields(task=spec.id))
            self._send.send_nowait(spec.id)
        return TaskAccepted(status=record.status(), created=created)

    async def _attach(self, framed: FramedStream, peer_id: str, request: TaskAttach) -> None:
        self.gate.authorize(peer_id, ids.TASK, None, label="task.attach")
        self.store.get(request.task_id, submitter=peer_id)  # NOT_FOUND for someone else's task
        sent = request.after_seq
        while True:
            events = self.store.events_after(request.task_id, sent)
            for ev in events:
                await framed.send(ev)
                sent = ev.seq
            if events:
                if events[-1].state.terminal:
                    break
                continue  # more may have come while we were sending
            # A submitter that stored the final event but died before acking it
            # re-attaches after that event: nothing will ever follow, take its ack.
            if self.store.get(request.task_id).terminal:
                break
            await self._changed.wait(request.task_id)
        # The client may confirm on the same stream that it stored everything.
        with anyio.move_on_after(10):
            reply = await framed.receive()
            if isinstance(reply, TaskAck):
                await framed.send(self.store.mark_fetched(request.task_id, reply.upto_seq, peer_id).status())

    def _cancel(self, task_id: str, peer_id: str | None, reason: str = "") -> TaskStatus:
        if peer_id is not None:
            self.gate.authorize(peer_id, ids.TASK, None, label="task.cancel")
            self.store.get(task_id, submitter=peer_id)
        record = self.store.cancel(task_id, reason or "canceled by the submitter")
        running = self._running.get(task_id)
        if running is not None:
            running[1].cancel()   # a sync tool sees it at its next check()
            running[0].cancel()
        self._changed.notify(task_id)
        return record.status()

    def cancel_for(self, peer_id: str, reason: str) -> int:
        """Revocation: stop everything a peer has queued or running here."""
        recs = self.store.list(submitter=peer_id, states=[TaskState.SUBMITTED, TaskState.WORKING,
                                                          TaskState.INPUT_REQUIRED])
        for rec in recs:
            self._cancel(rec.id, None, reason)
        return len(recs)

    # -- running tasks ------------------------------------------------------------------
    async def _worker(self) -> None:
        async for task_id in self._receive:
            try:
                await self._execute(task_id)
            except Exception:  # a bug in one task must not stop the worker
                log.exception("task %s crashed its worker", task_id)
                self._fail(task_id, ErrorCode.INTERNAL, "the executor failed; see its log")

    def _emit(self, task_id: str, kind: EventKind, data: dict[str, Any] | None = None,
              new_state: TaskState | None = None) -> bool:
        """Append an event unless the task already ended (e.g. canceled meanwhile)."""
        try:
            self.store.append_event(task_id, kind, data, new_state)
        except ProtocolError:
            return False
        self._changed.notify(task_id)
        return True

    def _fail(self, task_id: str, code: ErrorCode, message: str) -> None:
        self._emit(task_id, EventKind.ERROR, {"code": code.value, "message": message})

    async def _execute(self, task_id: str) -> None:
        rec = self.store.get(task_id)
        if rec.terminal:
            return  # canceled or expired while queued
        now = time.time()
        peer = self.trust.get(rec.submitter)
        grant = peer.granted if peer and not peer.revoked else None
        if grant is None:
            self._emit(task_id, EventKind.STATE, {"code": "unknown_peer", "reason": "the submitter was revoked"},
                       TaskState.REJECTED)
            return
        decision = check(grant, operation_for(rec.spec), local_peer_id=self.local_peer_id,
                         remote_peer_id=rec.submitter, now=now)
        if not decision.allowed:  # the grant changed or expired while the task waited
            self._emit(task_id, EventKind.STATE, {"code": decision.code.value if decision.code else "forbidden",
                                                  "reason": decision.reason}, TaskState.REJECTED)
            return
        deadline = rec.deadline
        if grant.limits.max_runtime_s:
            deadline = min(deadline or math.inf, now + grant.limits.max_runtime_s)
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

        async def emit(kind: EventKind, data: dict[str, Any] | None = None, new_state: TaskState | None = None):
            self._emit(rec.id, kind, data, new_state)

        async def ask(question: str, data: dict[str, Any]) -> dict[str, Any]:
            return await self._ask(rec.id, question, data)

        return await self.agent_runner(rec, emit, ask)

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
        from psymesh.agent.chatformat import ChatMessage, render_prompt

        spec = rec.spec
        assert spec.model is not None
        worker = await self.models.get(spec.model)
        if spec.prompt is not None:
            messages = [ChatMessage.user(spec.prompt)]
        else:
            messages = [ChatMessage(role=m.role, content=m.content, name=m.name) for m in spec.messages or []]
        params = spec.params
        prompt = render_prompt(messages, thinking=bool(params.get("thinking", False)),
                               template=worker.chat_template)
        max_tokens = spec.max_tokens or 256
        if ceiling is not None:
            max_tokens = min(max_tokens, ceiling)
        kwargs: dict[str, Any] = {k: params[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed", "grammar",
                                                         "stop") if k in params}
        if params.get("ban_bytes"):  # random-weight test models: keep output valid UTF-8
            kwargs["logit_bias"] = {i: -100.0 for i in range(128, 256)}
        from psymesh.agent.runtime import Completion

        pending: list[str] = []
        last_flush = time.monotonic()
        completion: Completion | None = None
        stream = worker.stream(prompt, max_tokens=max_tokens, **kwargs)
        try:
            async for piece in stream:
                if isinstance(piece, Completion):
                    completion = piece
                    break
                pending.append(piece)
                if time.monotonic() - last_flush >= self.limits.token_flush_s:
                    self._emit(rec.id, EventKind.TOKEN, {"text": "".join(pending)})
                    pending.clear()
                    last_flush = time.monotonic()
                    # The model may run ahead of us: then this loop never waits for it and,
                    # without a checkpoint, would keep the whole node (streams too) from running.
                    await anyio.lowlevel.checkpoint()
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        if pending:
            self._emit(rec.id, EventKind.TOKEN, {"text": "".join(pending)})
        assert completion is not None
        return {"text": completion.text, "finish_reason": completion.finish_reason,
                "usage": {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.tokens}}


# ====================================================================== submitter


class TaskSubmitter:
    """Delegates tasks from this node and keeps their results, across restarts on both sides."""

    RETRY_MIN_S = 0.2
    RETRY_MAX_S = 5.0
    RETENTION_S = 7 * 86400.0   # finished tasks (and their events) are kept this long for the app
    PURGE_EVERY_S = 3600.0

    def __init__(self, *, local_peer_id: str, outbox: Outbox, trust: TrustStore, open_stream: OpenStream,
                 max_frame_size: int, liveness_probe_s: float = 20.0,
                 drop_peer: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.local_peer_id = local_peer_id
        # An executor that loses power leaves a half-open TCP connection that nothing
        # closes for many minutes: after this long without an event, ping it, and drop
        # the connection if it does not answer in as long again.
        self.liveness_probe_s = liveness_probe_s
        self.drop_peer = drop_peer
        self._heard: dict[str, float] = {}        # peer -> when anything last arrived from it
        self._probes: dict[str, _Probe] = {}      # peer -> the liveness ping in flight
        self.outbox = outbox
        self.trust = trust
        self.open_stream = open_stream
        self.max_frame_size = max_frame_size
        self.changed = _Notifier()       # per task id: a new event was mirrored
        self._wake = anyio.Event()
        self._not_before: dict[str, float] = {}   # peer -> when to try it again (busy/unreachable)
        self._backoff: dict[str, float] = {}
        self._following: dict[str, anyio.CancelScope] = {}  # task id -> its follower, to stop it at once
        self._submitting: set[str] = set()        # first delivery in progress (not for the resend loop)
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            purged_at = -math.inf
            while True:
                if time.monotonic() - purged_at >= self.PURGE_EVERY_S:  # or a phone's storage only grows
                    purged_at = time.monotonic()
                    self.outbox.purge(time.time(), self.RETENTION_S)
                await self._deliver_pending()
                for task in self.outbox.resumable():
                    self._follow(task.id, task.target)
                self._wake = anyio.Event()
                with anyio.move_on_after(self._next_wake()):
                    await self._wake.wait()

    def _next_wake(self) -> float:
        now = time.monotonic()
        waits = [t - now for t in self._not_before.values() if t > now]
        return max(0.05, min(waits, default=1.0))

    def wake(self) -> None:
        self._wake.set()

    # -- submitting -----------------------------------------------------------------------
    async def submit(self, spec: TaskSpec, to: str | None, offers: Callable[[str], Awaitable[TaskCapsReply]]
                     ) -> tuple[str, bool]:
        """Store the task durably, then try to hand it over now. Returns (target, accepted)."""
        try:  # already known (a resubmit from the script): keep its target
            existing = self.outbox.get(spec.id)
            self.outbox.add(existing.target, spec)
            return existing.target, existing.accepted
        except TaskNotFound:
            pass
        if to:
            peer = self.trust.resolve(to)
            peer.refuse_if_revoked_us()
            candidates = [peer.peer_id]
        else:
            candidates = await self._candidates(spec, offers)
        # Durable before anything leaves this node: if we die while the executor accepts
        # it, the resend loop delivers it again after the restart (a harmless resubmit).
        self.outbox.add(candidates[0], spec)
        self._submitting.add(spec.id)
        last: PsymeshError | None = None
        try:
            for target in candidates:  # fail over before acceptance; after it, the task stays put
                self.outbox.retarget(spec.id, target)
                try:
                    await self._send_submit(target, spec)
                except RemoteError as exc:
                    if exc.code is ErrorCode.BUSY or exc.code is ErrorCode.RATE_LIMITED:
                        last = exc
                        continue
                    self.outbox.forget(spec.id)  # refused outright: as if never submitted
                    if exc.code is ErrorCode.UNKNOWN_PEER:
                        self.revoked_by(target, exc.code, self._refusal(target, exc))
                    raise  # forbidden, conflict, bad request: resending would not help
                except PsymeshError as exc:
                    last = exc
                    continue
                await self._handed_over(spec.id, target)
                return target, True
            # Nobody took it now: keep it for the resend loop, addressed to the first choice.
            self.outbox.retarget(spec.id, candidates[0])
        finally:
            self._submitting.discard(spec.id)
        log.info("task %s queued for delivery to %s: %s", spec.id, candidates[0], last)
        if isinstance(last, RemoteError) and last.retry_after:
            self._not_before[candidates[0]] = time.monotonic() + last.retry_after
        self.wake()
        return candidates[0], False

    async def _candidates(self, spec: TaskSpec, offers: Callable[[str], Awaitable[TaskCapsReply]]) -> list[str]:
        """Paired peers whose grant covers the task and that offer its tool/model, healthiest first."""
        op = operation_for(spec)
        now = time.time()
        scored: list[tuple[int, str]] = []
        for peer in self.trust.list(include_revoked=False):
            grant = peer.received
            if grant is None or not check(grant, op, local_peer_id=peer.peer_id, remote_peer_id=self.local_peer_id,
                                          now=now).allowed:
                continue
            try:
                with anyio.fail_after(5):
                    caps = await offers(peer.peer_id)
            except RemoteError as exc:
                if exc.code is ErrorCode.UNKNOWN_PEER:  # it revoked us: never ask it again
                    self.revoked_by(peer.peer_id, exc.code, self._refusal(peer.peer_id, exc))
                continue
            except (PsymeshError, TimeoutError):
                continue  # down or unhealthy: skip it
            if spec.kind is TaskKind.TOOL and spec.tool not in caps.tools:
                continue
            if spec.kind is TaskKind.INFER and spec.model not in caps.models:
                continue
            scored.append((caps.queue_depth, peer.peer_id))
        if not scored:
            raise PsymeshError(f"no reachable paired peer offers {op.required()}; see: psymesh peers",
                               code=ErrorCode.UNAVAILABLE)
        return [pid for _, pid in sorted(scored)]

    async def _request(self, target: str, message: Message, reply_type: type[M], timeout: float = 30.0) -> M:
        """One request to the executor `target` on a stream of its own."""
        stream = await self.open_stream(target, ids.TASK)
        return await request_once(stream, message, reply_type, max_frame_size=self.max_frame_size, timeout=timeout)

    async def _send_submit(self, target: str, spec: TaskSpec) -> TaskAccepted:
        return await self._request(target, TaskSubmit(spec=spec), TaskAccepted)

    async def _deliver_pending(self) -> None:
        """Resend what no executor has accepted yet: each target in parallel (a home that
        has gone silent must not hold up delivery to the others), in order within one."""
        by_target: dict[str, list[OutboxTask]] = {}
        for task in self.outbox.pending():
            by_target.setdefault(task.target, []).append(task)
        async with anyio.create_task_group() as tg:
            for target, tasks in by_target.items():
                tg.start_soon(self._deliver_to, target, tasks)

    async def _deliver_to(self, target: str, tasks: list[OutboxTask]) -> None:
        for task in tasks:
            if self._not_before.get(target, 0) > time.monotonic():
                return  # busy or unreachable: the loop wakes us when it is worth trying again
            if task.id in self._submitting:
                continue
            try:
                await self._send_submit(target, task.spec)
            except RemoteError as exc:
                if exc.code in (ErrorCode.BUSY, ErrorCode.RATE_LIMITED, ErrorCode.UNAVAILABLE):
                    self._not_before[target] = time.monotonic() + (exc.retry_after or self.RETRY_MIN_S)
                elif exc.code is ErrorCode.UNKNOWN_PEER:  # not this task: all of them, and for good
                    self.revoked_by(target, exc.code, self._refusal(target, exc))
                    return
                else:
                    self._finish_locally(task.id, TaskState.REJECTED, exc.code.value, exc.message)
                continue
            except PsymeshError:
                self._retry_later(target)
                continue
            self._backoff.pop(target, None)
            await self._handed_over(task.id, target)

    async def _handed_over(self, task_id: str, target: str) -> None:
        """The executor holds the task now: mirror its events, unless the app canceled
        it while it was on its way, in which case the executor must cancel it too."""
        if not self.outbox.mark_accepted(task_id).terminal:
            self._follow(task_id, target)
            return
        try:
            await self._request_cancel(target, task_id)
        except (PsymeshError, TimeoutError) as exc:
            log.warning("task %s was canceled while being delivered, and %s could not be told: %s",
                        task_id, target, exc)

    def _retry_later(self, target: str) -> None:
        if self._not_before.get(target, 0) > time.monotonic():
            return  # a retry is already due: the other failures of this round (one per task) are the same one
        delay = min(self.RETRY_MAX_S, self._backoff.get(target, self.RETRY_MIN_S / 2) * 2)
        self._backoff[target] = delay
        self._not_before[target] = time.monotonic() + delay

    def _finish_locally(self, task_id: str, state: TaskState, code: str, message: str) -> None:
        """The executor refused the task outright: record that as the task's own history
        (numbered like the executor would), so watchers and result() see one outcome."""
        at = time.time()
        events = [TaskEvent(task_id=task_id, seq=1, kind=EventKind.ACCEPTED, state=TaskState.SUBMITTED, at=at)]
        events.append(TaskEvent(task_id=task_id, seq=2, kind=EventKind.STATE, state=state, at=at,
                                data={"code": code, "reason": message, "message": message}))
        for ev in events:
            self.outbox.record_event(ev)
        self.outbox.mark_accepted(task_id)
        self._nothing_to_fetch(task_id)
        self.changed.notify(task_id)

    def _nothing_to_fetch(self, task_id: str) -> None:
        """This history is final and no executor holds more of it: do not re-attach for it."""
        self.outbox.mark_acked(task_id, self.outbox.last_seq(task_id))

    # -- following --------------------------------------------------------------------------
    def _follow(self, task_id: str, target: str) -> None:
        if task_id in self._following or self._tg is None:
            return
        scope = self._following[task_id] = anyio.CancelScope()
        self._tg.start_soon(self._follower, task_id, target, scope)

    async def _follower(self, task_id: str, target: str, scope: anyio.CancelScope) -> None:
        try:
            with scope:
                while True:
                    if self._not_before.get(target, 0) > time.monotonic():
                        await anyio.sleep(self._not_before[target] - time.monotonic())
                    try:
                        if await self._attach_once(task_id, target):
                            return
                    except RemoteError as exc:
                        if exc.code is ErrorCode.NOT_FOUND:  # the executor no longer holds it
                            # (if we hold its end, it finished and was acked, and we died before noting the ack)
                            self._end_locally(task_id, ErrorCode.NOT_FOUND, "the executor lost this task")
                            return
                        if self._access_refused(task_id, target, exc):
                            return
                        self._retry_later(target)
                    except (PsymeshError, TimeoutError) as exc:
                        log.debug("task %s: attach to %s failed: %s", task_id, target, exc)
                        self._retry_later(target)
        finally:
            if self._following.get(task_id) is scope:
                del self._following[task_id]

    # -- losing access ----------------------------------------------------------------------
    def revoked_by(self, peer_id: str, code: ErrorCode, reason: str) -> None:
        """`peer_id` takes no more requests from us: its signed revocation notice said so, or
        it answered one with `unknown_peer`. Remember it (new submissions to it are refused
        here), and end every task it held or was to hold for us, now, with `code`: following
        them would only add a refusal to its audit log every few seconds, for ever (and once it
        refuses us during the handshake, without even an error to tell us why)."""
        if self.trust.revoked_us(peer_id):
            log.warning("%s revoked this node: %s", peer_id, reason)
        ended = 0
        for task in self.outbox.pending(peer_id) + self.outbox.resumable(peer_id):
            ended += not task.terminal
            self._end_locally(task.id, code, reason)
        if ended:
            log.info("%d task(s) delegated to %s ended: %s", ended, peer_id, reason)

    def _access_refused(self, task_id: str, target: str, exc: RemoteError) -> bool:
        """Does `exc` mean `target` will never serve this task for us again? Then the task has
        ended here with it (and, for `unknown_peer`, every other task `target` held for us)."""
        if exc.code is ErrorCode.UNKNOWN_PEER:
            self.revoked_by(target, exc.code, self._refusal(target, exc))
            return True
        if exc.code in (ErrorCode.FORBIDDEN, ErrorCode.EXPIRED):  # our grant from it was withdrawn or ran out
            self._end_locally(task_id, exc.code, self._refusal(target, exc))
            return True
        return False

    def _refusal(self, target: str, exc: RemoteError) -> str:
        peer = self.trust.get(target)
        return f"{peer.name if peer else target} refused this node: {exc.message}"

    def _end_locally(self, task_id: str, code: ErrorCode, message: str) -> None:
        """The executor will never tell us more about this task: end it here with `code` (unless
        it has ended already), never re-attach for it, and stop its follower if one runs."""
        task = self.outbox.get(task_id)
        if not task.accepted:
            self._finish_locally(task_id, TaskState.REJECTED, code.value, message)  # it never ran there
        elif not task.terminal:
            self._finish_locally_after(task_id, code, message)
        self._nothing_to_fetch(task_id)
        scope = self._following.get(task_id)
        if scope is not None:
            scope.cancel()

    def _finish_locally_after(self, task_id: str, code: ErrorCode, message: str) -> None:
        """Append a final `error` (-> failed) to what we mirrored. `failed`, not `rejected`: the
        executor accepted the task and may have run it, and the lifecycle allows no other end
        from every unfinished state (input-required cannot become rejected)."""
        task = self.outbox.get(task_id)
        at = time.time()
        if task.last_seq == 0:  # accepted, but not one event mirrored yet: a log starts with `accepted`
            self.outbox.record_event(TaskEvent(task_id=task_id, seq=1, kind=EventKind.ACCEPTED,
                                               state=TaskState.SUBMITTED, at=at))
        ev = TaskEvent(task_id=task_id, seq=max(task.last_seq, 1) + 1, kind=EventKind.ERROR, state=TaskState.FAILED,
                       at=at, data={"code": code.value, "message": message})
        self.outbox.record_event(ev)
        self.changed.notify(task_id)

    async def _attach_once(self, task_id: str, target: str) -> bool:
        """Mirror events until the task ends and is acknowledged (True), or the stream drops."""
        if self.outbox.get(task_id).terminal:
            # We hold the final event, only the ack is missing (the stream or a node died
            # before it): attaching would wait for events that never come. Just ack.
            return await self._ack(task_id, target)
        stream = await self.open_stream(target, ids.TASK)
        framed = FramedStream(stream, self.max_frame_size)
        self._heard[target] = time.monotonic()  # the stream opened: it is alive now
        dead = anyio.Event()
        failure: Exception | None = None  # raised after the task group, so callers see it unwrapped
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_liveness, target, dead, tg.cancel_scope)
                try:
                    await self._mirror(framed, task_id, target)
                except Exception as exc:
                    failure = exc
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        if failure is not None:
            raise failure
        if dead.is_set():
            raise PsymeshError(f"{target} stopped answering; reconnecting", code=ErrorCode.UNAVAILABLE)
        self.outbox.mark_acked(task_id, self.outbox.last_seq(task_id))
        self._backoff.pop(target, None)
        return True

    async def _mirror(self, framed: FramedStream, task_id: str, target: str) -> None:
        await framed.send(TaskAttach(task_id=task_id, after_seq=self.outbox.last_seq(task_id)))
        while True:
            message = await framed.receive()
            self._heard[target] = time.monotonic()
            if message is None:
                raise PsymeshError("the executor closed the stream", code=ErrorCode.UNAVAILABLE)
            event = expect(message, TaskEvent)
            if event.task_id != task_id:
                raise ProtocolError("the executor sent another task's event")
            if self.outbox.record_event(event, target):
                self.changed.notify(task_id)
            if event.state.terminal:
                break
        await framed.send(TaskAck(task_id=task_id, upto_seq=self.outbox.last_seq(task_id)))
        with anyio.fail_after(10):
            expect(await framed.receive_required(), TaskStatus)

    async def _watch_liveness(self, target: str, dead: anyio.Event, attach: anyio.CancelScope) -> None:
        """While `target` is quiet, check that it still answers; if not, end this attach."""
        while True:
            await anyio.sleep(max(0.0, self._heard.get(target, 0.0) + self.liveness_probe_s - time.monotonic()))
            if time.monotonic() - self._heard.get(target, 0.0) < self.liveness_probe_s:
                continue  # something arrived from it meanwhile, on any of its tasks
            if not await self._alive(target):
                dead.set()
                attach.cancel()
                return

    async def _alive(self, target: str) -> bool:
        """One liveness ping per target, shared by every task following it: a phone waiting on
        many quiet tasks (say, all in input-required) must not spend its request rate on pings."""
        probe = self._probes.get(target)
        if probe is not None:
            await probe.done.wait()
            return probe.ok
        probe = self._probes[target] = _Probe()
        try:
            with anyio.fail_after(self.liveness_probe_s):
                stream = await self.open_stream(target, ids.PING)
                await request_once(stream, Ping(seq=0), Pong, max_frame_size=self.max_frame_size)
        except RemoteError:
            pass  # it answered (even a refusal means it is alive)
        except (PsymeshError, TimeoutError):
            probe.ok = False
            log.info("%s did not answer a liveness ping; dropping the connection", target)
            if self.drop_peer is not None:
                with anyio.move_on_after(5, shield=True):
                    await self.drop_peer(target)
        finally:
            del self._probes[target]
            probe.done.set()
        if probe.ok:
            self._heard[target] = time.monotonic()
        return probe.ok

    async def _ack(self, task_id: str, target: str) -> bool:
        """`task.ack` on a stream of its own: the executor may now forget the task."""
        last = self.outbox.last_seq(task_id)
        await self._request(target, TaskAck(task_id=task_id, upto_seq=last), TaskStatus, timeout=10)
        self.outbox.mark_acked(task_id, last)
        self._backoff.pop(target, None)
        return True

    async def cancel(self, task_id: str) -> TaskStatus | None:
        """Cancel on the executor (or locally, if it never accepted the task). An executor that
        no longer serves us ends the task here with its refusal instead (one that revoked us
        has canceled our tasks itself)."""
        task = self.outbox.get(task_id)
        if task.terminal:
            return None
        if not task.accepted:  # (if a delivery is under way, _handed_over passes the cancel on)
            self._finish_locally(task_id, TaskState.CANCELED, ErrorCode.CANCELED.value, "canceled before delivery")
            return None
        try:
            return await self._request_cancel(task.target, task_id)
        except RemoteError as exc:
            if self._access_refused(task_id, task.target, exc):
                return None
            raise

    async def respond(self, task_id: str, data: dict[str, Any]) -> TaskStatus:
        """Answer a task of ours that is input-required (e.g. {"approve": True}). The answer
        not arriving is always an error; if the executor no longer serves us, the task ends too."""
        task = self.outbox.get(task_id)
        peer = self.trust.get(task.target)
        if peer is not None:
            peer.refuse_if_revoked_us()
        try:
            return await self._request(task.target, TaskInput(task_id=task_id, data=data), TaskStatus)
        except RemoteError as exc:
            self._access_refused(task_id, task.target, exc)
            raise

    async def _request_cancel(self, target: str, task_id: str) -> TaskStatus:
        return await self._request(target, TaskCancel(task_id=task_id), TaskStatus)

