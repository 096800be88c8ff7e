"""ModelRunner: one model as the node sees it, loaded in a runner process of its own.

llama.cpp runs C++ that can throw through ctypes (std::terminate: SIGABRT), fault, or
be killed for its memory; in the daemon's process any of that would end every session,
letter and task of the node. So a model is loaded in a child process
(node/models/child.py) and driven over its stdin/stdout with the frames of
protocol/runner.py. A runner handle offers the same async surface as the in-process
engine (``agent.runtime.api.TextModel``: `stream`, `complete`, `generate`, `tokenize`,
`info`), and is stable across the processes behind it:

* the process starts on the first request (or `start()`), and exits by itself after
  `keep_alive_s` idle; the next request loads the model again (the info is kept);
* requests queue here, one at a time in FIFO order (a model is single-threaded anyway),
  at most `max_pending` of them (then WorkerBusy);
* when the process dies, the request it was running fails with
  :class:`~psymesh.agent.runtime.api.ModelCrashed` (the signal, and the last line of the
  runner's log), and only that one: a request that had been sent but not started goes to
  a fresh process, and the queued ones run there. Starts after a crash back off
  (0.5 s, doubling, at most 30 s) until a request succeeds again.

State reuse (saved states, exact-prefix continuation) lives in the runner process with
the engine, so a conversation's next step evaluates only its new tokens, as before.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Protocol

import anyio
from anyio.abc import Process

from ...agent.runtime.api import (
    Completion,
    ModelCrashed,
    ModelError,
    ModelInfo,
    ModelLoadError,
    ModelSettings,
    StopAfter,
    StreamingModel,
    ThinkBudget,
    WorkerBusy,
    WorkerClosed,
    WorkerStats,
)
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.messages import Message
from ...protocol.runner import (
    Done,
    Failed,
    Generate,
    LoadFailed,
    Piece,
    Ready,
    RunnerBye,
    RunnerLink,
    RunnerState,
    Started,
    StopAfterRule,
    ThinkBudgetRule,
    Tokenize,
    Tokens,
)

__all__ = ["ModelRunner", "RunnerStatus", "runner_command"]

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
CANCEL_GRACE_S = 5.0    # a cancelled request's end must come back within this, or the runner is killed
STOP_GRACE_S = 5.0      # a runner told to stop (stdin closed) gets this long before SIGKILL
LOG_KEEP_BYTES = 1 << 20


def runner_command() -> list[str]:
    """How a runner process is started: this Python, our child module."""
    return [sys.executable, "-m", "psymesh.node.models.child"]


@dataclass(frozen=True)
class RunnerStatus:
    """One model as `psymesh model ps` shows it."""

    name: str
    path: str
    loaded: bool
    pid: int | None
    rss_bytes: int | None
    n_ctx: int
    state_cache_bytes: int
    idle_s: float | None        # since its last request ended (None: never used)
    jobs_served: int
    crashes: int                # in a row, since the last request that succeeded
    keep_alive_s: float | None
    pending: int                # requests queued or running
    running: bool = False       # the runner has started a request (it is decoding one now)
    tool_family: str | None = None  # how the loaded model calls tools (agent/formats/families.py); None: not loaded
    shares: tuple[Share, ...] = ()  # a split model's parts: this node's and each worker's (node/compute/)


@dataclass(frozen=True)
class Share:
    """One part of a split model as `model ps` shows it (node/compute/split.py decides them)."""

    where: str             # "this node", or the worker's name
    peer_id: str | None    # None: this node
    layers: int
    memory_mb: int | None  # its budget (the worker's `rpc.accept`); None: no cap
    link: str              # "local", "direct", "relayed", or why it was left out ("left out: ...")
    weights_mb: int = 0    # about how much of the model's file it holds (its layers' part)


class Placement(Protocol):
    """Where a model's layers go, decided before each load: a split model's workers
    (node/compute/split.py). Without one a model loads whole in its runner."""

    async def settings(self, base: ModelSettings) -> ModelSettings:
        """`base` with the workers that answered (rpc_servers, n_gpu_layers, tensor_split); raises
        `unavailable` naming a worker when the model must wait for it."""

    def blame(self) -> str | None:
        """The worker whose link failed since the last load, in words (a crash's likely cause)."""

    def shares(self) -> tuple[Share, ...]:
        """The parts of the model as last loaded."""


@dataclass
class _Incarnation:
    proc: Process
    link: RunnerLink


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _how_it_ended(returncode: int | None) -> tuple[str, dict[str, object]]:
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return name, {"signal": name}
    return f"exit status {returncode}", {"exit_code": returncode}


class ModelRunner(StreamingModel):
    """One model behind a runner process (see the module docstring)."""

    def __init__(self, settings: ModelSettings, *, name: str | None = None, log_path: Path | None = None,
                 command: Sequence[str] | None = None, clock: Callable[[], float] = time.monotonic,
                 placement: Placement | None = None) -> None:
        self.settings = settings
        self.placement = placement
        self.name = name or settings.path.stem
        self._log_path = log_path
        self._command = list(command or runner_command())
        self._clock = clock
        self._turn = anyio.Semaphore(1)  # not a Lock: a stream may be opened in one task and closed in another
        self._queued = 0
        self._now: _Incarnation | None = None
        self._log: IO[bytes] | None = None
        self._info: ModelInfo | None = None
        self._stats = WorkerStats()
        self._closed = False
        self.jobs_served = 0
        self.crashes = 0
        self._last_crash = -math.inf
        self._last_used: float | None = None

    # ------------------------------------------------------------------ surface

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise WorkerClosed(f"model {self.name} was never loaded")
        return self._info

    @property
    def chat_template(self) -> str | None:
        return self.info.chat_template

    @property
    def stats(self) -> WorkerStats:
        """The engine's counters as of the runner's last answer (its state-cache memory included)."""
        return replace(self._stats)

    @property
    def pending(self) -> int:
        return self._queued

    @property
    def loaded(self) -> bool:
        now = self._now
        return now is not None and now.proc.returncode is None and now.link.state is not RunnerState.GONE

    @property
    def running(self) -> bool:
        """The runner has started a request: a crash now fails it (before that it would be
        resent to a fresh runner)."""
        now = self._now
        return self.loaded and now is not None and now.link.state is RunnerState.RUNNING

    @property
    def pid(self) -> int | None:
        return self._now.proc.pid if self.loaded and self._now is not None else None

    def status(self) -> RunnerStatus:
        pid = self.pid
        return RunnerStatus(
            name=self.name, path=str(self.settings.path), loaded=pid is not None, pid=pid,
            rss_bytes=_rss_bytes(pid) if pid is not None else None,
            n_ctx=self._info.n_ctx if self._info else self.settings.n_ctx,
            state_cache_bytes=self._stats.state_cache_bytes if pid is not None else 0,
            idle_s=None if self._last_used is None or self._queued else max(0.0, self._clock() - self._last_used),
            jobs_served=self.jobs_served, crashes=self.crashes, keep_alive_s=self.settings.keep_alive_s,
            pending=self._queued, running=self.running,
            tool_family=self._info.tool_family.value if self._info is not None else None,
            shares=self.placement.shares() if self.placement is not None else ())

    async def start(self) -> ModelInfo:
        """The model's info, loading it first if it never was (ModelLoadError / ModelCrashed if
        it cannot be). A model loaded once does not wait here for the request running on it:
        its next request starts a runner again if it left."""
        if self._info is not None and not self._closed:
            return self._info
        self._enter_queue()
        try:
            async with self._turn:
                await self._ensure()
        finally:
            self._queued -= 1
        return self.info

    async def aclose(self) -> None:
        """Stop the runner (its stdin closes, then SIGKILL after a grace period)."""
        self._closed = True
        now, self._now = self._now, None
        if now is not None:
            with anyio.CancelScope(shield=True):
                await self._reap(now)
        if self._log is not None:
            self._log.close()
            self._log = None

    async def __aenter__(self) -> ModelRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def stream(
        self,
        prompt: str,
        *,
        max_tokens: int = 512,
        prefix: str | None = None,
        grammar: str | None = None,
        stop: Sequence[str] | None = None,
        temperature: float = 0.7,
        top_k: int = 20,
        top_p: float = 0.8,
        min_p: float = 0.0,
        seed: int | None = None,
        logit_bias: Mapping[int, float] | None = None,
        checkpoint: str | None = None,
        think_budget: ThinkBudget | None = None,
        stop_after: StopAfter | None = None,
    ) -> AsyncIterator[str | Completion]:
        """Text pieces as the runner decodes them, then one final Completion (arguments as
        ``ModelWorker.stream``)."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        fields = dict(
            prompt=prompt, prefix=prefix or None, checkpoint=checkpoint or None, max_tokens=max_tokens,
            grammar=grammar, stop=tuple(stop or ()), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seed=seed, logit_bias=tuple((int(t), float(b)) for t, b in (logit_bias or {}).items()),
            think_budget=ThinkBudgetRule(tokens=think_budget.tokens, close=think_budget.close) if think_budget else None,
            stop_after=StopAfterRule(marker=stop_after.marker, count=stop_after.count, after=stop_after.after)
            if stop_after else None)
        return self._request(Generate, fields)

    async def tokenize(self, text: str) -> list[int]:
        async with aclosing(self._request(Tokenize, {"text": text})) as events:
            async for event in events:
                if isinstance(event, list):
                    return event
        raise ModelError("the model runner ended a request without a result")

    # ------------------------------------------------------------------ requests

    def _enter_queue(self) -> None:
        if self._closed:
            raise WorkerClosed(f"model {self.name} is closed")
        if self._queued >= self.settings.max_pending:
            raise WorkerBusy(f"{self._queued} requests already queued for model {self.name}", retry_after=1.0)
        self._queued += 1

    async def _request(self, kind: type[Generate] | type[Tokenize],
                       fields: dict[str, object]) -> AsyncIterator[str | Completion | list[int]]:
        self._enter_queue()
        try:
            async with self._turn:
                for attempt in range(2):
                    now = await self._ensure()
                    _, frame = now.link.request(kind, **fields)
                    finished = ended = False
                    try:
                        await self._write(now, frame)
                        while True:
                            msg = await self._read(now)
                            if msg is None:
                                ended = True
                                break
                            if isinstance(msg, Piece):
                                yield msg.text
                                continue
                            if isinstance(msg, Started):
                                continue
                            finished = True
                            self._succeeded()
                            if isinstance(msg, Failed):
                                raise _engine_error(msg)
                            if isinstance(msg, Tokens):
                                yield list(msg.tokens)
                            elif isinstance(msg, Done):
                                yield Completion(text=msg.text, tokens=msg.tokens, prompt_tokens=msg.prompt_tokens,
                                                 finish_reason=msg.finish_reason,
                                                 prompt_tokens_reused=msg.prompt_tokens_reused,
                                                 prompt_seconds=msg.prompt_seconds,
                                                 generation_seconds=msg.generation_seconds,
                                                 think_closed=msg.think_closed)
                            return
                    finally:
                        if not (finished or ended) and now is self._now:
                            with anyio.CancelScope(shield=True):
                                await self._abandon(now)
                    outcome = now.link.ended()
                    await self._drop(now)
                    if self._closed:
                        raise WorkerClosed(f"model {self.name} was closed while running a request")
                    if outcome.resend and attempt == 0:
                        continue  # it died before our request started: a fresh runner takes it
                    raise self._crashed(now)
        finally:
            self._queued -= 1

    def _succeeded(self) -> None:
        self.crashes = 0
        self.jobs_served += 1
        self._last_used = self._clock()

    async def _abandon(self, now: _Incarnation) -> None:
        """The caller went away mid-request: ask the runner to stop it and wait for its end,
        so the next request finds the runner ready; kill it if the end does not come."""
        with anyio.move_on_after(CANCEL_GRACE_S):
            try:
                await self._write(now, now.link.cancel())
                while now.link.in_flight is not None:
                    if await self._read(now) is None:
                        break
            except PsymeshError:
                pass
            else:
                if now.link.in_flight is None:
                    self._last_used = self._clock()
                    return
        await self._drop(now)

    # ------------------------------------------------------------------ processes

    async def _ensure(self) -> _Incarnation:
        """A ready runner process (the caller holds the turn)."""
        now = self._now
        if now is not None and now.proc.returncode is None and now.link.state is RunnerState.READY:
            return now
        if now is not None:
            await self._drop(now)
        if self._closed:
            raise WorkerClosed(f"model {self.name} is closed")
        if self.crashes:
            wait = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (self.crashes - 1)) - (self._clock() - self._last_crash)
            if wait > 0:
                await anyio.sleep(wait)
        return await self._spawn()

    def _open_log(self) -> IO[bytes]:
        if self._log is None:
            if self._log_path is None:  # an unnamed file, opened for appending like a named one
                fd, name = tempfile.mkstemp(prefix=f"psymesh-runner-{self.name}-")
                try:
                    self._log = os.fdopen(os.open(name, os.O_RDWR | os.O_APPEND), "a+b")
                finally:
                    os.close(fd)
                    os.unlink(name)
            else:
                self._log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(self._log_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
                self._log = os.fdopen(fd, "a+b")
        if self._log.seek(0, os.SEEK_END) > LOG_KEEP_BYTES:
            self._log.truncate(0)
        return self._log

    async def _spawn(self) -> _Incarnation:
        settings = self.settings if self.placement is None else await self.placement.settings(self.settings)
        log = self._open_log()
        proc = await anyio.open_process(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                        start_new_session=True)  # the terminal's Ctrl-C is the node's to handle
        link = RunnerLink()
        pending = _Incarnation(proc, link)
        try:
            await self._write(pending, link.load(settings.model_dump_json()))
            msg = await self._read(pending)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._reap(pending)
            raise
        if isinstance(msg, Ready):
            self._now = pending
            self._info = ModelInfo(path=self.settings.path, n_ctx=msg.n_ctx, n_vocab=msg.n_vocab,
                                   chat_template=msg.chat_template, eog_token_ids=tuple(msg.eog_token_ids),
                                   family_tokens=tuple(msg.family_tokens))
            return self._now
        await self._reap(pending)
        if isinstance(msg, LoadFailed):
            blame = self.placement.blame() if self.placement is not None else None
            raise ModelLoadError(msg.message + (f" ({blame})" if blame else ""))
        link.ended()
        raise self._crashed(pending, while_="loading it")

    async def _write(self, now: _Incarnation, frame: bytes) -> None:
        assert now.proc.stdin is not None
        try:
            await now.proc.stdin.send(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # it is gone: the read that follows sees the end

    async def _read(self, now: _Incarnation) -> Message | None:
        """The runner's next message; None when its output ended (or broke the protocol)."""
        assert now.proc.stdout is not None
        try:
            while (msg := now.link.next_message()) is None:
                try:
                    data = await now.proc.stdout.receive(65536)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    data = b""
                now.link.receive_data(data)
                if not data:
                    return now.link.next_message()
        except PsymeshError:  # a runner that breaks the protocol is not trusted further
            with anyio.CancelScope(shield=True):
                await self._reap(now)
            return None
        if isinstance(msg, RunnerBye):
            return await self._read(now)  # it goes idle: its end follows
        if isinstance(msg, (Done, Tokens)):
            self._stats = WorkerStats(**msg.stats.model_dump())
        return msg

    async def _drop(self, now: _Incarnation) -> None:
        with anyio.CancelScope(shield=True):
            await self._reap(now)
        if self._now is now:
            self._now = None

    async def _reap(self, now: _Incarnation) -> None:
        """End the process: close its stdin (it exits), SIGKILL it if it does not."""
        proc = now.proc
        if proc.stdin is not None:
            with contextlib.suppress(Exception):
                await proc.stdin.aclose()
        if proc.returncode is None:
            with anyio.move_on_after(STOP_GRACE_S):
                await proc.wait()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        for stream in (proc.stdout,):
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.aclose()

    def _crashed(self, now: _Incarnation, *, while_: str = "running this request") -> ModelCrashed:
        self.crashes += 1
        self._last_crash = self._clock()
        how, details = _how_it_ended(now.proc.returncode)
        line = self._log_tail()
        details["log"] = line
        blame = self.placement.blame() if self.placement is not None else None
        if blame:  # a split model's worker went away: that, not llama.cpp's last words, is the news
            details["worker"] = blame
            return ModelCrashed(f"the runner of model {self.name} died ({how}) while {while_}: {blame}",
                                details=details)
        return ModelCrashed(f"the runner of model {self.name} died ({how}) while {while_}"
                            + (f": {line}" if line else ""), details=details)

    def _log_tail(self) -> str:
        """The last line the runner wrote (llama.cpp's abort message, for one)."""
        log = self._log
        if log is None:
            return ""
        with contextlib.suppress(OSError):
            end = log.seek(0, os.SEEK_END)
            log.seek(max(0, end - 4096))
            lines = [ln.strip() for ln in log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
            log.seek(0, os.SEEK_END)
            return lines[-1][:300] if lines else ""
        return ""


def _engine_error(msg: Failed) -> PsymeshError:
    """A refusal from the engine, as the same error class the in-process engine raises."""
    from ...agent.runtime import api as inference

    by_code = {ErrorCode.TOO_LARGE: inference.PromptTooLong, ErrorCode.BAD_REQUEST: inference.GrammarError,
               ErrorCode.BUSY: inference.WorkerBusy, ErrorCode.UNAVAILABLE: inference.WorkerClosed}
    try:
        code = ErrorCode(msg.code)
    except ValueError:
        code = ErrorCode.INTERNAL
    return by_code.get(code, ModelError)(msg.message, code=code, details=dict(msg.details))
