"""A model runner process: `python -m psymesh.node.models.child`, started by the node.

It holds one loaded model (agent/runtime/worker.py's `ModelWorker`, with its saved states and
exact-prefix continuation) and answers the node over stdin/stdout in the frames of
protocol/runner.py. Nothing here is trusted by the node beyond that conversation: if
llama.cpp throws a C++ exception (std::terminate, SIGABRT), faults, or the kernel kills
this process, the node fails the one request that was running and starts a new runner.

The runner exits on its own when its stdin closes (the node stopped or died: no orphan
keeps a model in memory) and after `keep_alive_s` with no request (its memory goes back
to the system). With `memory_limit_mb` it caps its own address space (RLIMIT_AS) before
loading, so a runaway allocation ends in a clean crash of this process alone.

Only the standard library, trio, pydantic, msgpack and our engine are imported: no
libp2p, no daemon modules.
"""
from __future__ import annotations

import os
import sys
import threading
from contextlib import aclosing
from dataclasses import asdict
from typing import TYPE_CHECKING

import trio

from ...agent.runtime.api import Completion, ModelSettings, StopAfter, ThinkBudget
from ...protocol.channel import Channel
from ...protocol.errors import PsymeshError
from ...protocol.messages import Message
from ...protocol.runner import (
    MAX_RUNNER_FRAME,
    Cancel,
    Done,
    Failed,
    Generate,
    Load,
    LoadFailed,
    Piece,
    Ready,
    RunnerBye,
    RunnerStats,
    Started,
    Tokenize,
    Tokens,
)

FIRST_REQUEST_GRACE_S = 5.0  # a runner just loaded waits at least this for the request it was loaded for

if TYPE_CHECKING:
    from ...agent.runtime.worker import ModelWorker


def _limit_memory(limit_mb: int | None) -> None:
    if limit_mb is None:
        return
    import resource

    cap = limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


class _Runner:
    def __init__(self, out: trio.lowlevel.FdStream, inp: trio.lowlevel.FdStream) -> None:
        self.out = out
        self.inp = inp
        self.channel = Channel(max_frame_size=MAX_RUNNER_FRAME)
        self.write_lock = trio.Lock()
        self.jobs: dict[int, threading.Event] = {}  # cancel flags of the requests running
        self.idle = trio.Event()   # set while no request runs
        self.idle.set()
        self.woken = trio.Event()  # set when a request arrives

    async def send(self, msg: Message) -> None:
        async with self.write_lock:
            await self.out.send_all(self.channel.send(msg))

    async def receive(self) -> Message | None:
        """The next message from the node; None when its side closed."""
        while True:
            msg = self.channel.next_message()
            if msg is not None:
                return msg
            if self.channel.eof:
                return None
            self.channel.receive_data(await self.inp.receive_some(65536))


def _stats(worker: ModelWorker) -> RunnerStats:
    return RunnerStats(**asdict(worker.stats))


async def _generate(r: _Runner, worker: ModelWorker, job: Generate, cancel: threading.Event) -> None:
    stream = worker.stream(
        job.prompt, prefix=job.prefix, checkpoint=job.checkpoint, max_tokens=job.max_tokens, grammar=job.grammar,
        stop=job.stop, temperature=job.temperature, top_k=job.top_k, top_p=job.top_p, min_p=job.min_p,
        seed=job.seed, logit_bias=dict(job.logit_bias),
        think_budget=ThinkBudget(job.think_budget.tokens, job.think_budget.close) if job.think_budget else None,
        stop_after=StopAfter(job.stop_after.marker, job.stop_after.count, job.stop_after.after)
        if job.stop_after else None, cancel=cancel)
    async with aclosing(stream) as events:
        async for event in events:
            if isinstance(event, Completion):
                await r.send(Done(id=job.id, text=event.text, tokens=event.tokens, prompt_tokens=event.prompt_tokens,
                                  finish_reason=event.finish_reason, prompt_tokens_reused=event.prompt_tokens_reused,
                                  prompt_seconds=event.prompt_seconds, generation_seconds=event.generation_seconds,
                                  think_closed=event.think_closed, stats=_stats(worker)))
                return
            await r.send(Piece(id=job.id, text=event))


async def _serve(r: _Runner, worker: ModelWorker, job: Generate | Tokenize) -> None:
    """One request, answered with exactly one final frame (done, tokens or failed). A
    cancel reaches the engine as its job's flag: it stops between tokens and still says
    how the generation ended, so its counters are right when the node reads them."""
    cancel = r.jobs[job.id]
    try:
        await r.send(Started(id=job.id))
        if isinstance(job, Tokenize):
            tokens = await worker.tokenize(job.text)
            await r.send(Tokens(id=job.id, tokens=tuple(tokens), stats=_stats(worker)))
        else:
            await _generate(r, worker, job, cancel)
    except PsymeshError as exc:
        await r.send(Failed(id=job.id, code=exc.code.value, message=exc.message,
                           details={k: v for k, v in exc.details.items() if isinstance(v, (int, float, str))}))
    finally:
        del r.jobs[job.id]
        if not r.jobs:
            r.idle.set()


async def _leave_when_idle(r: _Runner, keep_alive_s: float, scope: trio.CancelScope) -> None:
    """Say bye and end the runner once no request has run for `keep_alive_s` (one timer,
    armed only while idle). Just loaded, it waits at least FIRST_REQUEST_GRACE_S: the request
    that made the node load it follows our Ready, and `keep_alive_s` 0 ("unload after each
    request") must not end the runner before that request arrives."""
    wait = max(keep_alive_s, FIRST_REQUEST_GRACE_S)
    while True:
        await r.idle.wait()
        r.woken = trio.Event()
        with trio.move_on_after(wait):
            wait = keep_alive_s
            await r.woken.wait()
            continue
        if not r.jobs:
            await r.send(RunnerBye())
            scope.cancel()
            return


async def main() -> None:
    # Our frames go to the node on the original stdout; anything a library prints to fd 1
    # afterwards (llama.cpp, ggml) goes to stderr, the runner's log, instead of into them.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    # When ggml aborts (GGML_ABORT: a split model's RPC server gone, for one) it prints its reason,
    # then by default forks gdb to attach to us: seconds more to die, and gdb's last line in our log
    # where the node looks for the reason (ModelCrashed's `log`). The reason alone, then.
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    r = _Runner(trio.lowlevel.FdStream(out_fd), trio.lowlevel.FdStream(os.dup(0)))
    first = await r.receive()
    if not isinstance(first, Load):
        return
    settings = ModelSettings.model_validate_json(first.settings)
    _limit_memory(settings.memory_limit_mb)
    from ...agent.runtime.worker import ModelWorker  # llama.cpp is loaded here, in this process only

    worker = ModelWorker(settings)
    try:
        info = await worker.start()
    except PsymeshError as exc:
        await r.send(LoadFailed(message=exc.message))
        return
    await r.send(Ready(pid=os.getpid(), n_ctx=info.n_ctx, n_vocab=info.n_vocab, chat_template=info.chat_template,
                       eog_token_ids=info.eog_token_ids, family_tokens=info.family_tokens))
    try:
        async with trio.open_nursery() as nursery:
            if settings.keep_alive_s is not None:
                nursery.start_soon(_leave_when_idle, r, settings.keep_alive_s, nursery.cancel_scope)
            while (msg := await r.receive()) is not None:  # None: the node closed our stdin (stopped or died)
                if isinstance(msg, (Generate, Tokenize)):
                    r.jobs[msg.id] = threading.Event()
                    r.idle = trio.Event()
                    r.woken.set()
                    nursery.start_soon(_serve, r, worker, msg)
                elif isinstance(msg, Cancel) and msg.id in r.jobs:
                    r.jobs[msg.id].set()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await worker.aclose()


# No PR_SET_PDEATHSIG: the kernel sends it when the *thread* that started us exits, and trio
# starts processes from a worker thread that it retires after 10 s idle, so every runner was
# SIGKILLed ~10 s after it started (keep-alive lost, and a generation longer than that failed
# `model_crashed`). Our loop reads stdin all the time, a generation running on the engine's own
# thread, so the node's death (its end of the pipe closing) is seen at once.
if __name__ == "__main__":
    try:
        trio.run(main)
    except KeyboardInterrupt:  # the node handles the terminal's Ctrl-C; we just go
        sys.exit(0)
