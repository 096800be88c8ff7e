"""The submitter: delegates tasks from this node and keeps their results, across restarts.

    submit(spec) ─> outbox (SQLite) ─> driver task ── task.submit{follow} ──> executor
                                          │ <── task.accepted  (submit() returns here)
                                          │ <── task.event* ... the final event
                                          │ ── task.ack ──>  (the executor may forget it)
                                          └ session lost / busy: wait, then attach after
                                            the last stored event (or resubmit)

One driver per unfinished task runs `protocol.taskflow.SubmitterTask` over the session
to the task's executor (`node/net/session.py`): the machine says what to send and what each
answer means; the driver stores events (exactly once, by sequence number), waits when
told to, and redials through the session pool. After a restart every unfinished task in
the outbox gets its driver back.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, NamedTuple

import anyio
import anyio.abc

from ..core.commands import Commands
from ..core.db import WalSync
from ..core.notify import Notifier
from ..net.session import SessionPool
from .homes import HomeChooser, Offers
from .store import Outbox, OutboxTask
from ..door.trust import TrustStore
from ..core.wakelock import WakeLock
from ...protocol.admission import task_operation
from ...protocol.common import Error
from ...protocol.errors import ConnectionLost, ErrorCode, NetworkError, ProtocolError, PsymeshError, RemoteError
from ...protocol.messages import Message
from ...protocol.manifest import check
from ...protocol.taskflow import Accepted, Action, Done, Phase, Record, RetryAt, SubmitterTask
from ...protocol.tasks import (
    TaskAck,
    TaskAcked,
    TaskAcks,
    TaskCancel,
    TaskCapsReply,
    TaskEvent,
    TaskInput,
    TaskKind,
    TaskSpec,
    TaskStatus,
)

log = logging.getLogger("psymesh.tasks")


class Submitted(NamedTuple):
    """What `TaskSubmitter.submit` returns: where the task went, whether it was accepted, and its
    final event if that came with the acceptance (a short task: stored already, as every event)."""

    target: str
    accepted: bool
    final: TaskEvent | None = None


class _FirstAnswer:
    """How the executor first answered a submit: accepted, or why not (and the final event,
    if it came in the same read as the acceptance)."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.accepted = False
        self.error: PsymeshError | None = None
        self.final: TaskEvent | None = None

    def settle(self, accepted: bool, error: PsymeshError | None = None) -> None:
        if not self.done.is_set():
            self.accepted, self.error = accepted, error
            self.done.set()


class _AckBatch:
    """Acks for one executor, sent together once the batch is ACK_DELAY_S old."""

    def __init__(self) -> None:
        self.acks: list[TaskAck] = []
        self.done = anyio.Event()
        self.reply: Message | None = None          # task.acked, or the executor's error
        self.failure: NetworkError | ProtocolError | None = None
        self.stored = False                        # every ack's acked_seq is in the outbox already


def _machine(task: OutboxTask) -> SubmitterTask:
    """The conversation of `task` as its outbox row left it (after a restart, too)."""
    return SubmitterTask(task.spec, accepted=task.accepted, last_seq=task.last_seq,
                         last_state=task.state if task.last_seq else None,
                         acked=task.terminal and task.acked_seq >= task.last_seq)


class TaskSubmitter:
    #: A finished task's ack waits this long for others to the same executor: off the path of
    #: the next task (it costs the executor a request, a door decision and an audit row).
    ACK_DELAY_S = 0.05

    def __init__(self, *, local_peer_id: str, outbox: Outbox, trust: TrustStore, sessions: SessionPool,
                 wal: WalSync | None = None, wake: WakeLock | None = None, commands: Commands | None = None) -> None:
        """`wal`: puts what is committed on disk (node/core/db.py); `submit()` returns only once
        the task's outbox row is, and a task.ack (which promises the executor that the events it
        covers are) waits for it first. `wake`: held while a task is being driven
        (node/core/wakelock.py)."""
        self.local_peer_id = local_peer_id
        self.wal = wal
        self.outbox = outbox
        self.trust = trust
        self.sessions = sessions
        self.changed = Notifier()       # per task id: a new event was mirrored
        self._drivers: dict[str, anyio.CancelScope] = {}
        self._acks: dict[str, _AckBatch] = {}   # executor -> the batch being filled
        self._tg: anyio.abc.TaskGroup | None = None
        self.wake = wake or WakeLock(None)
        self.commands = commands or Commands()  # how its refusals spell the command to run next
        self.retention_s = 7 * 86400.0   # finished tasks (and their events) are kept this long for the app
        self.purge_every_s = 3600.0
        self._retention_changed = anyio.Event()
        self.homes = HomeChooser(on_refused=lambda peer, exc: self.revoked_by(peer, exc.code, self._refusal(peer, exc)))

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self.resume()
            task_status.started()
            while True:  # or a phone's storage only grows
                self.outbox.purge(time.time(), self.retention_s)
                with anyio.move_on_after(self.purge_every_s):
                    await self._retention_changed.wait()
                    self._retention_changed = anyio.Event()

    def set_retention(self, retention_s: float, purge_every_s: float) -> None:
        """Keep finished tasks `retention_s`, looking every `purge_every_s` (from now on)."""
        self.retention_s, self.purge_every_s = retention_s, purge_every_s
        self._retention_changed.set()

    def resume(self) -> None:
        """Give every unfinished task in the outbox its driver (at start, after a crash)."""
        for task in self.outbox.pending() + self.outbox.resumable():
            self._drive(task)

    @property
    def following(self) -> int:
        """Tasks with a driver at work (for tests and status)."""
        return len(self._drivers)

    # -- submitting -----------------------------------------------------------------------
    async def submit(self, spec: TaskSpec, to: str | None, offers: Offers) -> Submitted:
        """Store the task durably, then hand it over now if an executor takes it. Returns
        (target, accepted, final) once the task's outbox row is on disk (synced while the task is
        on its way, not after); a refusal no resend can change raises RemoteError. Once a WAL
        fsync failed, nothing can be promised: it raises before the task is stored or sent."""
        existing = self.outbox.find(spec.id)
        if existing is not None:  # already known (a resubmit from the script): keep its target
            self.outbox.add(existing.target, spec)
            await self._synced(self._mark())
            return Submitted(existing.target, existing.accepted,
                             self.outbox.final(spec.id) if existing.accepted else None)
        if to:
            peer = self.trust.resolve(to)
            peer.refuse_if_revoked_us()
            candidates = [peer.peer_id]
        else:
            candidates = await self._candidates(spec, offers)
        if self.wal is not None:  # a row it could not promise: the task must not leave (run there, told failed here)
            self.wal.refuse_if_failed()  # (here, after the offers were awaited: a failure meanwhile counts too)
        # Committed before anything leaves this node: if we die while the executor accepts
        # it, the driver delivers it again after the restart (a harmless resubmit). On disk
        # (for a power cut) before this returns: the WAL sync runs beside the hand-over and
        # covers the row, not what the driver writes after it (acceptance rides on event 1;
        # a power cut that loses those only means a harmless resubmit too).
        task = self.outbox.add(candidates[0], spec)
        row_written = self._mark()
        if self.wal is not None:
            self.wal.start(row_written)  # the fsync begins now, on a worker thread, beside the hand-over
        answer = await self._hand_over(spec, task, candidates)  # a refusal waits only for its delete (_forgotten)
        await self._synced(row_written)  # the row is on disk before this returns (or the disk failed)
        return answer

    def _mark(self) -> int:
        return 0 if self.wal is None else self.wal.mark()

    async def _synced(self, mark: int) -> None:
        if self.wal is not None:
            await self.wal.sync(mark)

    async def _forgotten(self) -> None:
        """A refused task's delete is on disk before the refusal is told: else a power cut could
        bring back its row (synced beside the hand-over) and the driver submit it again after the
        restart, a task its caller was told was refused. A disk that fails this sync has failed
        every later durable answer too (WalSync); the refusal is still what the caller hears."""
        try:
            await self._synced(self._mark())
        except PsymeshError as exc:
            log.error("task refused, but its removal may not be on disk: %s", exc)

    async def _hand_over(self, spec: TaskSpec, task: OutboxTask, candidates: list[str]) -> Submitted:
        last: PsymeshError | None = None
        for target in candidates:  # fail over before acceptance; after it, the task stays put
            if target != task.target:
                task = self.outbox.retarget(spec.id, target)
            first = _FirstAnswer()
            self._drive(task, first)
            await first.done.wait()
            if first.accepted:
                return Submitted(target, True, first.final)
            last = first.error
            if isinstance(last, RemoteError) and last.code not in (ErrorCode.BUSY, ErrorCode.RATE_LIMITED,
                                                                   ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT):
                self.outbox.forget(spec.id)  # refused outright: as if never submitted
                await self._forgotten()
                if last.code is ErrorCode.UNKNOWN_PEER:
                    self.revoked_by(target, last.code, self._refusal(target, last))
                raise last
        # Nobody took it now: its driver keeps trying the first choice.
        self.outbox.retarget(spec.id, candidates[0])
        log.info("task %s queued for delivery to %s: %s", spec.id, candidates[0], last)
        self._drive(self.outbox.get(spec.id))
        return Submitted(candidates[0], False)

    async def _candidates(self, spec: TaskSpec, offers: Offers) -> list[str]:
        """Paired peers whose grant covers the task and that offer its tool/model, least busy
        first: all asked at once, the choice made as soon as one fits (node/tasks/homes.py)."""
        op = task_operation(spec)
        now = time.time()
        granted = [peer.peer_id for peer in self.trust.list(include_revoked=False)
                   if peer.received is not None
                   and check(peer.received, op, local_peer_id=peer.peer_id, remote_peer_id=self.local_peer_id,
                             now=now).allowed]

        def fits(caps: TaskCapsReply) -> bool:
            if spec.kind is TaskKind.TOOL:
                return spec.tool in caps.tools
            if spec.kind is TaskKind.INFER:
                return spec.model in caps.models
            return True

        if self._tg is None:
            raise PsymeshError("the submitter is not running", code=ErrorCode.UNAVAILABLE)
        chosen = await self.homes.choose(self._tg, granted, fits, offers)
        if not chosen:
            raise PsymeshError(f"no reachable paired peer offers {op.required()}; see: {self.commands('peers')}",
                               code=ErrorCode.UNAVAILABLE)
        return chosen

    # -- driving one task ---------------------------------------------------------------------
    def _drive(self, task: OutboxTask, first: _FirstAnswer | None = None) -> None:
        """Start the driver for `task` (unless one runs). With `first`, it reports the first
        answer and, unless that is `accepted`, leaves the next move to `submit()`."""
        if self._tg is None:
            raise PsymeshError("the submitter is not running", code=ErrorCode.UNAVAILABLE)
        if task.id in self._drivers:
            if first is not None:
                first.settle(False, PsymeshError("a delivery is already under way", code=ErrorCode.BUSY))
            return
        scope = self._drivers[task.id] = anyio.CancelScope()
        self._tg.start_soon(self._driver, _machine(task), task.target, scope, first)

    async def _driver(self, machine: SubmitterTask, target: str, scope: anyio.CancelScope,
                      first: _FirstAnswer | None) -> None:
        task_id = machine.task_id

        def report(accepted: bool, error: PsymeshError | None = None) -> None:
            if not accepted and self._drivers.get(task_id) is scope:
                del self._drivers[task_id]  # before submit() wakes: it may start the next driver at once
            assert first is not None
            first.settle(accepted, error)

        not_before = -math.inf
        try:
            with scope, self.wake.held():
                while (request := machine.next_request()) is not None:
                    if not_before > time.time():
                        await anyio.sleep(not_before - time.time())
                    actions: list[Action] = []
                    try:
                        if isinstance(request, TaskAck):  # batched with others to the same executor
                            reply, stored = await self._ack(target, request)
                            actions = machine.receive(reply, time.time())
                            self._apply(task_id, [a for a in actions if not (stored and isinstance(a, Done))], target)
                        else:
                            async with self.sessions.stream(target, request) as replies:
                                async for message in replies:
                                    # with the frames that came with it: their events in one transaction
                                    actions = []
                                    try:
                                        for message in (message, *replies.ready()):
                                            if isinstance(message, Error) and (
                                                    first is not None or message.code == ErrorCode.UNKNOWN_PEER):
                                                self._apply(task_id, actions, target)  # what came before it
                                                actions = []
                                                if first is not None:
                                                    return report(False, message.to_exception())  # submit() decides
                                                # not this task alone: every task there, and new ones, for good
                                                exc = message.to_exception()
                                                return self.revoked_by(target, exc.code, self._refusal(target, exc))
                                            actions += machine.receive(message, time.time())
                                    finally:  # what the machine took is stored, even if a later frame broke it
                                        self._apply(task_id, actions, target)
                                    if first is not None and machine.phase is not Phase.UNSENT:
                                        first.final = next((a.event for a in actions if isinstance(a, Record)
                                                            and a.event.state.terminal), None)  # stored above
                                        report(True)
                                        first = None
                    except (NetworkError, ProtocolError) as exc:
                        log.debug("task %s: %s to %s failed: %s", task_id, request.type, target, exc)
                        if first is not None:
                            return report(False, exc)
                        if isinstance(exc, ProtocolError):
                            self.sessions.drop(target, f"it broke the task protocol: {exc.message}")
                        actions = machine.connection_lost(time.time())
                    retry = next((a for a in actions if isinstance(a, RetryAt)), None)
                    not_before = retry.when if retry else -math.inf
        finally:
            if first is not None:
                report(False, PsymeshError("the submitter stopped", code=ErrorCode.UNAVAILABLE))
            if self._drivers.get(task_id) is scope:
                del self._drivers[task_id]

    async def _ack(self, target: str, ack: TaskAck) -> tuple[Message, bool]:
        """Join the batch of acks going to `target`; its answer (task.acked or an error), and
        whether the batch stored the ack (`Outbox.mark_acked_each`)."""
        batch = self._acks.get(target)
        if batch is None:
            batch = self._acks[target] = _AckBatch()
            assert self._tg is not None
            self._tg.start_soon(self._send_acks, target, batch)
        batch.acks.append(ack)
        await batch.done.wait()
        if batch.failure is not None:
            raise batch.failure
        assert batch.reply is not None
        return batch.reply, batch.stored

    async def _send_acks(self, target: str, batch: _AckBatch) -> None:
        try:
            await anyio.sleep(self.ACK_DELAY_S)
            del self._acks[target]  # later acks start the next batch
            if self.wal is not None:
                try:
                    await self.wal.sync()  # the events acknowledged are on disk before the executor may forget them
                except PsymeshError as exc:  # the disk's, or no descriptor left: not sent; each driver retries
                    batch.failure = ConnectionLost(f"the acks wait for this node's disk: {exc.message}")
                    return
            async with self.sessions.stream(target, TaskAcks(acks=batch.acks)) as replies:
                async for message in replies:
                    batch.reply = message
            if isinstance(batch.reply, TaskAcked):  # stored for the whole batch at once, not by each driver
                self.outbox.mark_acked_each((a.task_id, a.upto_seq) for a in batch.acks)
                batch.stored = True
        except (NetworkError, ProtocolError) as exc:
            batch.failure = exc
        finally:
            if batch.reply is None and batch.failure is None:
                batch.failure = ConnectionLost("the acks got no answer")
            if self._acks.get(target) is batch:
                del self._acks[target]
            batch.done.set()

    def _apply(self, task_id: str, actions: list[Action], target: str | None = None) -> None:
        """Carry out the machine's actions; `target` is the executor the frames came from.
        Events in a row are stored in one transaction (Outbox.record_events)."""
        i = 0
        while i < len(actions):
            action = actions[i]
            if isinstance(action, Record):
                run = [action]
                while i + len(run) < len(actions) and isinstance(nxt := actions[i + len(run)], Record) \
                        and nxt.local == action.local:
                    run.append(nxt)
                if self.outbox.record_events(task_id, [r.event for r in run], None if action.local else target):
                    self.changed.notify(task_id)
                i += len(run)
                continue
            if isinstance(action, Done):
                self.outbox.mark_acked(task_id, self.outbox.last_seq(task_id))
            # Accepted: stored with the first event, which follows on the same answer (Outbox.record_events)
            i += 1

    # -- losing access ----------------------------------------------------------------------
    def revoked_by(self, peer_id: str, code: ErrorCode, reason: str) -> None:
        """`peer_id` takes no more requests from us: its signed revocation notice said so, or
        it answered one with `unknown_peer`. Remember it (new submissions to it are refused
        here), and end every task it held or was to hold for us, now, with `code`: following
        them would only add a refusal to its audit log every few seconds, for ever (and once it
        refuses us during the handshake, without even an error to tell us why)."""
        if self.trust.revoked_us(peer_id):
            log.warning("%s revoked this node: %s", self.trust.label(peer_id), reason)
        ended = 0
        for task in self.outbox.pending(peer_id) + self.outbox.resumable(peer_id):
            ended += not task.terminal
            self._end_here(task, code, reason)
        if ended:
            log.info("%d task(s) delegated to %s ended: %s", ended, self.trust.label(peer_id), reason)

    def _end_here(self, task: OutboxTask, code: ErrorCode, reason: str) -> None:
        """End `task` on this side with `code` (unless it ended already) and stop its driver."""
        scope = self._drivers.pop(task.id, None)
        if scope is not None:
            scope.cancel()
        machine = _machine(task)
        if machine.phase in (Phase.UNSENT, Phase.FOLLOWING):
            self._apply(task.id, machine.receive(Error.of(code, reason), time.time()))
        else:
            self._apply(task.id, [Done()])

    def _refusal(self, target: str, exc: PsymeshError) -> str:
        peer = self.trust.get(target)
        return f"{peer.name if peer else target} refused this node: {exc.message}"

    # -- the app's requests about its tasks ---------------------------------------------------
    async def cancel(self, task_id: str) -> TaskStatus | None:
        """Cancel on the executor (or here, if no executor accepted the task yet). An executor
        that no longer serves us ends the task here with its refusal instead (one that revoked
        us has canceled our tasks itself)."""
        task = self.outbox.get(task_id)
        if task.terminal:
            return None
        if not task.accepted:
            scope = self._drivers.pop(task_id, None)  # its submit may be on its way: recall it instead
            if scope is not None:
                scope.cancel()
            self._apply(task_id, SubmitterTask(task.spec).cancel_unsent(time.time(), maybe_sent=scope is not None))
            self.changed.notify(task_id)
            if scope is not None:
                self._drive(self.outbox.get(task_id))
            return None
        try:
            return await self.sessions.request(task.target, TaskCancel(task_id=task_id), TaskStatus)
        except RemoteError as exc:
            if self._access_refused(task, exc):
                return None
            raise

    async def respond(self, task_id: str, data: dict[str, Any]) -> TaskStatus:
        """Answer a task of ours that is input-required (e.g. {"approve": True}). The answer not
        arriving is always an error; if the executor no longer serves us, the task ends too."""
        task = self.outbox.get(task_id)
        peer = self.trust.get(task.target)
        if peer is not None:
            peer.refuse_if_revoked_us()
        try:
            return await self.sessions.request(task.target, TaskInput(task_id=task_id, data=data), TaskStatus)
        except RemoteError as exc:
            self._access_refused(task, exc)
            raise

    def _access_refused(self, task: OutboxTask, exc: RemoteError) -> bool:
        """Does `exc` mean the executor will never serve this task for us again? Then it has
        ended here (and, for `unknown_peer`, every other task that executor held for us)."""
        if exc.code is ErrorCode.UNKNOWN_PEER:
            self.revoked_by(task.target, exc.code, self._refusal(task.target, exc))
            return True
        if exc.code in (ErrorCode.FORBIDDEN, ErrorCode.EXPIRED):  # our grant from it was withdrawn or ran out
            self._end_here(task, exc.code, self._refusal(task.target, exc))
            return True
        return False
