"""ModelWorker: one llama.cpp model behind an async API, on one dedicated thread.

The engine of a model runner process (node/models/child.py): the daemon never loads
llama.cpp itself, because a C++ exception or a fault in it ends the whole process.
The types a caller sees (settings, completions, errors) live in agent/runtime/api.py.

Why a thread of its own: a ``llama_cpp.Llama`` is not thread-safe, and decoding
blocks for seconds. Every call on the model (load, tokenize, evaluate, sample,
close) therefore happens on one worker thread that takes jobs from a FIFO queue,
one at a time. Callers on any anyio backend (trio or asyncio) submit a job and
receive its text pieces through a thread-safe queue; a consumer that goes away
(cancelled, or stops iterating) sets the job's cancel flag, which the worker
checks between tokens and between prompt batches.

State reuse. Step k+1 of an agent run is step k's prompt, the reply the model just
wrote, a tool result and a little template glue; re-evaluating all of it (~2.5k
tokens by step 5, with a ~1.5k-token system turn) would cost the phone seconds per
step. BotPsy is a Qwen3.5 *hybrid* model: its gated-delta-net layers keep a
recurrent state that cannot be truncated, so llama.cpp refuses to cut the context
back to a shared prefix (``seq_rm`` in the middle fails) and llama-cpp-python's own
prefix matching falls back to evaluating the whole prompt. What does work (verified:
logits bit-identical to a fresh evaluation) is to snapshot the sequence state at an
exact token boundary with ``llama_state_seq_get_data`` and restore it with
``llama_state_seq_set_data`` before evaluating only what follows. (The per-sequence
state API, not ``Llama.save_state``, which also copies a ``n_batch x n_vocab`` float32
score buffer: 0.5 GB for a 248k vocabulary.) So the worker keeps:

* the *live* context: whatever the model evaluated last, prompt and reply. A prompt
  that extends it (the next step of the same conversation) just continues;
* *snapshots*, each the state after a known token sequence: the cacheable head a
  caller names (`prefix`: the system turn with the tool block, shared by every
  conversation), a conversation's `checkpoint` (its history, before the generation
  prompt: what a retried step, or a reply that cannot be continued, falls back to),
  and the end of a conversation, taken when another request is about to replace it
  in the live context. They are kept in a byte budget and a count
  (``ModelSettings.state_cache_bytes`` / ``_entries``) and dropped least recently
  used first; a conversation's newer state supersedes its older ones, so several
  conversations take turns without pushing each other out.

A prompt is always evaluated as its fresh tokenisation, and the base it continues
from is the longest state whose tokens are a *proper prefix* of those tokens: a warm
run evaluates exactly the tokens a cold run does, whatever happens to be saved. (Not
always to the last bit: a cold run evaluates in one batch the reply tokens a warm run
evaluated one at a time as it wrote them, and llama.cpp rounds a one-row product
differently from a many-row one. Measured on the logits: 3e-4 on the F16 test model,
up to 0.3 on the random-weight Q4_K_M bench model, whose near-ties then sample
differently. Where a prompt is cut into batches changes nothing.) It works across
steps because the history
renders each reply byte for byte as the model wrote it (``chatformat``'s raw turns)
and a ChatML turn starts with a special token, which no BPE merge crosses. A model
can sample a non-canonical tokenisation of its own text (a trained model seldom
does; a random-weight test model writing ``<tool_call>`` byte by byte always does);
then the end of that reply is not a prefix of the next prompt's tokens, is not kept,
and the next step continues from the checkpoint before the reply instead. That
insurance costs each step one more small batch (the generation prompt, evaluated
after the checkpoint) and a state copy: ~60 ms on the bench model, against ~0.8 s for
a step's new tokens.

A model whose context *can* be cut back (attention layers only: Llama, Qwen3, SmolLM2; not a
recurrent or hybrid one) takes none of that machinery: a prompt continues the live context
from the longest common prefix of their tokens, the rest cut off (``seq_rm``), and is evaluated
in one go. Snapshots there would only cost: evaluating a prompt in three pieces (the prefix,
the history, the generation prompt) reads every weight three times, and each piece's state is
copied; on SmolLM2-135M that was most of the first token's overhead over bare llama.cpp. What it
gives up is a conversation coming back after another replaced it: it re-evaluates past their
shared head (the system turn), where a hybrid model would restore its saved end.

The sampler chain is agent/runtime/sampling.py's and reading the streamed text (stop strings, the
ThinkBudget, StopAfter, UTF-8 validity) agent/runtime/decoding.py's; what stays here is one job over one
llama context: the thread and its queue, and the snapshot bookkeeping that decides what that
context must evaluate next (the two share the live context's state, so they are kept together).
"""
from __future__ import annotations

import codecs
import ctypes
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import anyio
import llama_cpp
from llama_cpp import Llama, LlamaGrammar
from .api import (
    Completion,
    FinishReason,
    GrammarError,
    ModelError,
    ModelInfo,
    ModelLoadError,
    ModelSettings,
    PromptTooLong,
    StopAfter,
    StreamingModel,
    ThinkBudget,
    WorkerBusy,
    WorkerClosed,
    WorkerStats,
    default_threads,
)
from ...protocol.errors import PsymeshError
from .decoding import StopScanner, Watch, is_utf8
from .rpc import add_servers, output_on_cpu
from ..formats.families import FAMILY_TOKENS
from .sampling import grammar_allows, make_sampler

__all__ = [
    "Completion",
    "GrammarError",
    "ModelError",
    "ModelInfo",
    "ModelLoadError",
    "ModelSettings",
    "ModelWorker",
    "PromptTooLong",
    "StopAfter",
    "ThinkBudget",
    "WorkerBusy",
    "WorkerClosed",
    "WorkerStats",
]


@dataclass(eq=False)
class _Job:
    prompt: str
    prefix: str | None
    max_tokens: int
    grammar: str | None
    stop: tuple[str, ...]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logit_bias: tuple[tuple[int, float], ...]
    checkpoint: str | None = None
    think_budget: ThinkBudget | None = None
    stop_after: StopAfter | None = None
    out: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Call:
    """Run a function with the Llama on the worker thread (tokenize and the like)."""

    fn: Callable[[Llama], Any]
    out: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    cancel: threading.Event = field(default_factory=threading.Event)


SnapshotKind = Literal["prefix", "conversation"]  # a head shared by conversations, or where one stood


@dataclass(eq=False)
class _Snapshot:
    """The model state after `tokens`."""

    tokens: tuple[int, ...]
    buf: Any  # ctypes uint8 array owned by us
    nbytes: int
    kind: SnapshotKind

    def starts(self, tokens: Sequence[int]) -> bool:
        """Is this state's token sequence a proper prefix of `tokens`?"""
        n = len(self.tokens)
        return n < len(tokens) and tuple(tokens[:n]) == self.tokens


@dataclass(frozen=True)
class _Plan:
    """How to bring the context to the end of a prompt's `tokens`: continue the live
    context (`base` None, `reused` > 0), restore `base`, or start from scratch."""

    tokens: list[int]
    reused: int
    base: _Snapshot | None = None


class _Cancelled(Exception):
    pass


_STOP = object()


class ModelWorker(StreamingModel):
    """One model, one thread, many async callers.

    >>> async with ModelWorker(ModelSettings(path=p)) as worker:
    ...     async for piece in worker.generate(prompt, max_tokens=64):
    ...         print(piece, end="")
    """

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"psymesh-model-{settings.path.name}", daemon=True)
        self._lock = threading.Lock()
        self._pending = 0
        self._current: _Job | _Call | None = None
        self._closed = False
        self._info: ModelInfo | None = None
        self._stats = WorkerStats()
        self._snapshots: list[_Snapshot] = []  # least recently used first
        self._live_saved = True      # the live context is a snapshot already (or empty)
        self._live_canonical = True  # its tokens are the fresh tokenisation of their text
        self._cuttable = False       # the context can be cut back to any prefix (no recurrent layers)
        self._pieces: dict[int, bytes] = {}
        self._spelled: frozenset[int] = frozenset()  # control tokens written into the text (see _piece)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> ModelInfo:
        """Load the model on the worker thread; raises ModelLoadError if it cannot."""
        if self._closed:
            raise WorkerClosed("model worker is closed")
        if self._info is not None:
            return self._info
        self._thread.start()
        result = await anyio.to_thread.run_sync(self._ready.get)
        if isinstance(result, BaseException):
            self._closed = True
            raise result
        self._info = result
        return result

    async def aclose(self) -> None:
        """Fail queued requests, stop the running one, free the model."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job.out.put(WorkerClosed("model worker closed"))
        current = self._current
        if current is not None:
            current.cancel.set()
        self._jobs.put(_STOP)
        if self._thread.is_alive():
            await anyio.to_thread.run_sync(self._thread.join)

    async def __aenter__(self) -> ModelWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise WorkerClosed("model worker not started")
        return self._info

    @property
    def chat_template(self) -> str | None:
        return self.info.chat_template

    @property
    def stats(self) -> WorkerStats:
        return replace(self._stats)

    @property
    def pending(self) -> int:
        """Requests queued behind the one running (for backpressure and status)."""
        return self._pending

    # ------------------------------------------------------------------ requests

    def stream(
        self,
        prompt: str,
        *,
        max_tokens: int = 512,
        prefix: str | None = None,
        grammar: str | LlamaGrammar | None = None,
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
        cancel: threading.Event | None = None,
    ) -> AsyncIterator[str | Completion]:
        """Text pieces as they are decoded, then one final :class:`Completion`.

        `prefix` is the stable head of `prompt` shared with other conversations (see
        ``chatformat.render_prefix``) and `checkpoint` the part of `prompt` before its
        generation prompt: the states there are saved on the way (see the module
        docstring). `grammar` is GBNF text (or a LlamaGrammar). `seed=None` draws a
        fresh seed. `stop` strings end the text before them; `stop_after` ends it after
        a marker; `think_budget` caps a thought the prompt opened. Setting `cancel` stops the
        generation between tokens and still ends the stream with its Completion
        (`finish_reason` "cancelled"), as a runner process needs to report it.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        gbnf = grammar._grammar if isinstance(grammar, LlamaGrammar) else grammar  # its only representation
        job = _Job(
            prompt=prompt, prefix=prefix or None, max_tokens=max_tokens, grammar=gbnf, stop=tuple(stop or ()),
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seed=llama_cpp.LLAMA_DEFAULT_SEED if seed is None else seed & 0xFFFFFFFF,
            logit_bias=tuple((int(t), float(b)) for t, b in (logit_bias or {}).items()),
            checkpoint=checkpoint or None, think_budget=think_budget, stop_after=stop_after,
            cancel=cancel or threading.Event(),
        )
        return self._events(job)

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` (special tokens parsed), for context budgeting."""
        call = _Call(lambda llm: llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))
        async with aclosing(self._events(call)) as events:
            async for event in events:
                return event  # type: ignore[no-any-return]
        raise ModelError("model worker ended a request without a result")

    def _submit(self, job: _Job | _Call) -> None:
        if self._closed or self._info is None:
            raise WorkerClosed("model worker is not running")
        with self._lock:
            if self._pending >= self.settings.max_pending:
                raise WorkerBusy(f"{self._pending} requests already queued for this model", retry_after=1.0)
            self._pending += 1
        self._jobs.put(job)

    async def _events(self, job: _Job | _Call) -> AsyncIterator[Any]:
        self._submit(job)
        try:
            while True:
                # Block in a helper thread; if we are cancelled it is abandoned and
                # released by the job's final item, which the worker always sends.
                items = [await anyio.to_thread.run_sync(job.out.get, abandon_on_cancel=True)]
                while True:
                    try:
                        items.append(job.out.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if isinstance(item, Completion) or isinstance(job, _Call):
                        return
        finally:
            job.cancel.set()

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        try:
            llm = self._load()
            info = self._info_of(llm)
        except Exception as exc:  # start() waits on _ready: it must always get an answer
            self._ready.put(exc if isinstance(exc, ModelLoadError) else ModelLoadError(f"cannot load model: {exc}"))
            return
        self._ready.put(info)
        try:
            while True:
                job = self._jobs.get()
                if job is _STOP:
                    return
                with self._lock:
                    self._pending -= 1
                self._current = job
                try:
                    if self._closed:
                        job.out.put(WorkerClosed("model worker closed"))
                    elif isinstance(job, _Call):
                        job.out.put(job.fn(llm))
                    elif job.cancel.is_set():
                        self._stats.cancelled += 1
                        job.out.put(Completion("", 0, 0, "cancelled"))
                    else:
                        self._execute(llm, job)
                except PsymeshError as exc:
                    job.out.put(exc)
                except Exception as exc:  # never let one request kill the model thread
                    self._forget_context(llm)
                    job.out.put(ModelError(f"inference failed: {exc}"))
                finally:
                    self._current = None
        finally:
            self._snapshots.clear()
            llm.close()

    def _load(self) -> Llama:
        s = self.settings
        if not s.path.is_file():
            raise ModelLoadError(f"model file not found: {s.path}")
        threads = s.n_threads or default_threads()
        if s.rpc_servers:  # the split model's other parts: registered first, or Llama would not see them
            add_servers(s.rpc_servers)
        try:
            with output_on_cpu() if s.rpc_servers else nullcontext():  # the logits stay here (see rpc.py)
                llm = Llama(model_path=str(s.path), n_ctx=s.n_ctx, n_batch=s.n_batch, n_threads=threads,
                            n_threads_batch=threads, n_gpu_layers=s.n_gpu_layers,
                            tensor_split=list(s.tensor_split) or None, verbose=False)
        except Exception as exc:  # llama-cpp-python raises bare ValueError/RuntimeError
            # A split model whose RPC server refused an allocation (its memory cap) fails here too,
            # with llama.cpp's generic message: say where else to look.
            hint = f" (or an RPC server of {', '.join(s.rpc_servers)} could not hold its part)" if s.rpc_servers else ""
            raise ModelLoadError(f"cannot load {s.path.name}: {exc}{hint}") from exc
        model = llm.model
        self._cuttable = not (llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))
        return llm

    def _info_of(self, llm: Llama) -> ModelInfo:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        eog = tuple(t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))
        template = self.settings.chat_template or llm.metadata.get("tokenizer.chat_template") or None
        family_tokens = {}
        for text in FAMILY_TOKENS:  # the vocabulary has it when it is one token
            ids = llm.tokenize(text.encode(), add_bos=False, special=True)
            if len(ids) == 1:
                family_tokens[text] = ids[0]
        self._spelled = frozenset(family_tokens.values())
        return ModelInfo(path=self.settings.path, n_ctx=llm.n_ctx(), n_vocab=llm.n_vocab(),
                         chat_template=template, eog_token_ids=eog, family_tokens=tuple(family_tokens))

    def _execute(self, llm: Llama, job: _Job) -> None:
        started = time.perf_counter()
        stats = self._stats
        stats.requests += 1
        plan = self._plan(llm, job.prompt.encode("utf-8"))
        tokens = plan.tokens
        room = llm.n_ctx() - len(tokens)
        if room < 1:
            raise PromptTooLong(f"prompt is {len(tokens)} tokens; the context holds {llm.n_ctx()}",
                                details={"prompt_tokens": len(tokens), "n_ctx": llm.n_ctx()})
        sampler, grammar = make_sampler(llm, grammar_text=job.grammar, temperature=job.temperature, top_k=job.top_k,
                                       top_p=job.top_p, min_p=job.min_p, seed=job.seed,
                                       logit_bias=job.logit_bias)  # before touching the context: a bad grammar fails cleanly
        try:
            try:
                self._prepare(llm, job, plan)
            except _Cancelled:
                stats.cancelled += 1
                job.out.put(Completion("", 0, len(tokens), "cancelled"))
                return
            stats.prompt_tokens_reused += plan.reused
            stats.prompt_tokens_evaluated += len(tokens) - plan.reused
            prompt_done = time.perf_counter()
            text, n_gen, reason, closed = self._decode(llm, job, sampler, grammar, min(job.max_tokens, room))
        finally:
            llama_cpp.llama_sampler_free(sampler)
        stats.generated_tokens += n_gen
        stats.think_closes += closed
        if reason == "cancelled":
            stats.cancelled += 1
        job.out.put(Completion(text=text, tokens=n_gen, prompt_tokens=len(tokens), finish_reason=reason,
                               prompt_tokens_reused=plan.reused, prompt_seconds=prompt_done - started,
                               generation_seconds=time.perf_counter() - prompt_done, think_closed=closed))

    # ------------------------------------------------------------------ state reuse

    @property
    def _keeps_snapshots(self) -> bool:
        s = self.settings
        return s.reuse and not self._cuttable and s.state_cache_entries > 0 and s.state_cache_bytes > 0

    @staticmethod
    def _tokenize(llm: Llama, text: bytes, *, first: bool) -> list[int]:
        """The one way to llama.cpp's tokenizer, which takes valid UTF-8 only (see
        :meth:`_canonical`): anything else is a ModelError here, not an abort there."""
        if not is_utf8(text):
            raise ModelError("cannot tokenize text that is not valid UTF-8")
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        add_bos = first and bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        return llm.tokenize(text, add_bos=add_bos, special=True)

    def _plan(self, llm: Llama, prompt: bytes) -> _Plan:
        """The prompt's fresh tokens, and the longest state they extend."""
        tokens = self._tokenize(llm, prompt, first=True)
        if not tokens:
            raise ModelError("empty prompt")
        if not self.settings.reuse:
            return _Plan(tokens, 0)
        n = llm.n_tokens
        if self._cuttable:  # the longest common prefix, short of the whole prompt (its last token's logits are new)
            have = llm.input_ids[:min(n, len(tokens) - 1)].tolist()
            same = next((i for i, (a, b) in enumerate(zip(have, tokens)) if a != b), len(have))
            return _Plan(tokens, same)
        live = n if self._live_canonical and 0 < n < len(tokens) and llm.input_ids[:n].tolist() == tokens[:n] else 0
        best = max((s for s in self._snapshots if s.starts(tokens)), key=lambda s: len(s.tokens), default=None)
        if best is not None and len(best.tokens) > live:
            return _Plan(tokens, len(best.tokens), best)
        return _Plan(tokens, live)

    def _prepare(self, llm: Llama, job: _Job, plan: _Plan) -> None:
        """Bring the context to the end of the prompt, evaluating only what `plan` does
        not reuse, and saving the states at the job's marks on the way."""
        stats = self._stats
        start = plan.reused
        if start and plan.base is None and self._cut(llm, start):
            stats.continuation_hits += 1
        else:
            self._save_live(llm, "conversation")  # another conversation may come back to it
            if start and plan.base is not None and self._restore(llm, plan.base):
                stats.snapshot_hits += 1
            else:
                stats.misses += 1
                self._forget_context(llm)
                start = 0
        try:
            for mark, kind in self._marks(llm, job, plan.tokens, start):
                self._eval(llm, plan.tokens[start:mark], job)
                self._save_live(llm, kind)
                start = mark
            self._eval(llm, plan.tokens[start:], job)
        except _Cancelled:
            self._forget_context(llm)  # stopped between batches, at no boundary worth keeping
            raise

    def _cut(self, llm: Llama, n: int) -> bool:
        """Keep the live context's first `n` tokens (the rest is cut off); False if it cannot be."""
        if n == llm.n_tokens:
            return True
        if not self._cuttable or not llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), 0, n, -1):
            return False
        llm.n_tokens = n
        return True

    def _marks(self, llm: Llama, job: _Job, tokens: list[int], start: int) -> list[tuple[int, SnapshotKind]]:
        """Token positions past `start` where the job's prefix and checkpoint end, if they
        are boundaries of the prompt's tokens and not saved yet."""
        if not self._keeps_snapshots:
            return []
        prompt = job.prompt.encode("utf-8")
        marks: list[tuple[int, SnapshotKind]] = []
        for text, kind in ((job.prefix, "prefix"), (job.checkpoint, "conversation")):
            head = (text or "").encode("utf-8")
            if not head or len(head) >= len(prompt) or not prompt.startswith(head):
                continue
            tail = self._tokenize(llm, prompt[len(head):], first=False)
            at = len(tokens) - len(tail)
            if start < at < len(tokens) and tokens[at:] == tail and \
                    not any(s.tokens == tuple(tokens[:at]) for s in self._snapshots):
                marks.append((at, kind))
        return sorted(marks)

    def _save_live(self, llm: Llama, kind: SnapshotKind) -> None:
        """Save the live context's state (at a mark, or before it is replaced), unless it
        is saved already or could never be continued (a non-canonical reply)."""
        if self._live_saved or not llm.n_tokens or not self._live_canonical or not self._keeps_snapshots:
            return
        self._live_saved = True
        size = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
        if size > self.settings.state_cache_bytes:
            return
        tokens = tuple(llm.input_ids[:llm.n_tokens].tolist())
        keep = []
        for s in self._snapshots:  # a conversation's newer state supersedes its older ones
            if s.tokens == tokens or (kind == s.kind == "conversation" and len(s.tokens) < len(tokens)
                                      and tokens[:len(s.tokens)] == s.tokens):
                self._stats.snapshots_dropped += 1
            else:
                keep.append(s)
        self._snapshots = keep
        self._evict(room_for=size)  # first, so the budget holds even while copying
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(llm.ctx, buf, size, 0)
        self._snapshots.append(_Snapshot(tokens, buf, int(n), kind))
        self._stats.snapshots_saved += 1
        self._count_snapshots()

    def _evict(self, room_for: int) -> None:
        """Drop the least recently used states until one of `room_for` bytes fits."""
        s = self.settings
        while self._snapshots and (len(self._snapshots) + 1 > s.state_cache_entries or
                                   sum(x.nbytes for x in self._snapshots) + room_for > s.state_cache_bytes):
            self._snapshots.pop(0)
            self._stats.snapshots_dropped += 1

    def _count_snapshots(self) -> None:
        self._stats.state_cache_bytes = sum(s.nbytes for s in self._snapshots)
        self._stats.state_cache_entries = len(self._snapshots)

    def _restore(self, llm: Llama, snap: _Snapshot) -> bool:
        """Make `snap` the live context and the most recently used state. It may have been
        dropped a moment ago by saving the live context; it is in use, so it comes back."""
        if snap in self._snapshots:
            self._snapshots.remove(snap)
        else:
            self._evict(room_for=snap.nbytes)
        self._forget_context(llm)
        if llama_cpp.llama_state_seq_set_data(llm.ctx, snap.buf, snap.nbytes, 0) != snap.nbytes:
            self._forget_context(llm)
            self._stats.snapshots_dropped += 1
            self._count_snapshots()
            return False
        self._snapshots.append(snap)
        self._count_snapshots()
        llm.input_ids[: len(snap.tokens)] = snap.tokens
        llm.n_tokens = len(snap.tokens)
        self._live_saved = True
        return True

    def _eval(self, llm: Llama, tokens: Sequence[int], job: _Job) -> None:
        step = self.settings.n_batch
        for i in range(0, len(tokens), step):
            if job.cancel.is_set():
                raise _Cancelled
            llm.eval(tokens[i:i + step])
            self._live_saved = False

    def _forget_context(self, llm: Llama) -> None:
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
        self._live_saved = self._live_canonical = True

    def _piece(self, llm: Llama, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            # A family's call marker is a control token in some vocabularies (Mistral's
            # [TOOL_CALLS]): spelled out, or the parser would never see the call.
            piece = self._pieces[token] = llm.detokenize([token], special=token in self._spelled)
        return piece

    def _canonical(self, llm: Llama, tokens: list[int]) -> bool:
        """Are generated `tokens` what tokenising their text gives? Only then can a later
        prompt's tokens extend them (control tokens are spelled out, as in a prompt).

        Bytes that are not valid UTF-8 never are: the reply's text (and so the next
        prompt, rendered from it) is their decoding with U+FFFD for what is invalid, and
        they are never handed to the tokenizer. That was issue 18's "invalid codepoint"
        abort (SIGABRT, exit 134): a byte-level vocabulary lets a model write any bytes,
        one token each (the random-weight test model often does; a real one can), and
        llama.cpp's BPE tokenizer reads a lead byte F5-F7, or F4 followed by 90-BF, with
        three continuation bytes as a code point above U+10FFFF (its UTF-8 decoder checks
        the bytes' shape, not the range), then throws std::invalid_argument from
        unicode_cpt_to_utf8 in its pre-tokenizer, through the C API: std::terminate.
        Valid UTF-8 decodes to code points <= U+10FFFF only, and nothing else reaches the
        tokenizer now: prompts, prefixes and the ThinkBudget's close are Python strings
        encoded as UTF-8 (valid by construction), the model's own bytes reach it only
        here, checked, and :meth:`_tokenize` refuses invalid UTF-8 from any caller. So no
        byte sequence a model writes can reach that throw. The grammar stage is not involved: it decodes
        pieces with its own lenient decoder that never throws (invalid sequences are
        rejected or, above U+10FFFF and surrogates, read as code points, which Python
        then decodes to U+FFFD), so no mask is needed there.
        """
        if not tokens:
            return True
        text = llm.detokenize(tokens, special=True)
        return is_utf8(text) and self._tokenize(llm, text, first=False) == tokens

    def _decode(self, llm: Llama, job: _Job, sampler: Any, grammar: Any,
                limit: int) -> tuple[str, int, FinishReason, bool]:
        """Sample up to `limit` tokens: (text, tokens, finish reason, thought closed by the budget).

        Every token but a final one is evaluated (the state then stands for the prompt
        and the reply); a final token is too when it completes the StopAfter marker, so
        that the state ends where the text does.
        """
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        scanner = StopScanner(job.stop)
        watch = Watch(job.think_budget, job.stop_after)
        forced: list[int] = []
        evaluated: list[int] = []
        closed = False
        parts: list[str] = []
        n_gen = 0
        reason: FinishReason = "length"
        stopped = False
        while n_gen < limit:
            if job.cancel.is_set():
                reason = "cancelled"
                break
            sampled = not (forced and grammar_allows(grammar, forced[0]))
            if sampled:
                forced.clear()
                token = llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1)
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    reason = "stop"
                    break
            else:
                token = forced.pop(0)
                llama_cpp.llama_sampler_accept(sampler, token)
                closed = True
            n_gen += 1
            text = utf8.decode(self._piece(llm, token))
            ended = watch.add(text, sampled=sampled)
            out, stopped = scanner.feed(text)
            if out:
                parts.append(out)
                job.out.put(out)
            if stopped:
                reason = "stop"
                break
            if n_gen < limit or ended:  # a final token is evaluated only to keep the state at a marker
                llm.eval([token])
                evaluated.append(token)
            if ended:
                reason = "stop"
                break
            if not forced and watch.over_budget():
                forced = self._tokenize(llm, watch.closing_text().encode("utf-8"), first=False)
        self._live_saved = self._live_saved and not evaluated
        self._live_canonical = self._cuttable or self._canonical(llm, evaluated)  # a cut needs no canonical reply
        if not stopped and reason != "cancelled":  # a stop string drops what is held back
            tail, _ = scanner.feed(utf8.decode(b"", final=True))
            tail += scanner.flush()
            if tail:
                parts.append(tail)
                job.out.put(tail)
        return "".join(parts), n_gen, reason, closed
