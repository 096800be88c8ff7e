"""ModelWorker: one llama.cpp model behind an async API, on one dedicated thread.

Why a thread of its own: a ``llama_cpp.Llama`` is not thread-safe, and decoding
blocks for seconds. Every call on the model (load, tokenize, evaluate, sample,
close) therefore happens on one worker thread that takes jobs from a FIFO queue,
one at a time. Callers on any anyio backend (trio or asyncio) submit a job and
receive its text pieces through a thread-safe queue; a consumer that goes away
(cancelled, or stops iterating) sets the job's cancel flag, which the worker
checks between tokens and between prompt batches.

Prefix cache. Every turn of an agent conversation starts with the same system
turn (persona + tool schemas, ~1.5k tokens). BotPsy is a Qwen3.5 *hybrid* model:
gated-delta-net layers keep a recurrent state that cannot be truncated, so
llama.cpp refuses to cut the context back to a shared prefix (``seq_rm`` in the
middle fails) and llama-cpp-python's own prefix matching falls back to evaluating
the whole prompt. What does work (verified: logits bit-identical to a fresh
evaluation) is to evaluate the prefix on its own, snapshot the sequence state at
exactly that boundary with ``llama_state_seq_get_data``, and restore it with
``llama_state_seq_set_data`` before evaluating only the new suffix. We use the
per-sequence state API rather than ``Llama.save_state``, which also copies a
``n_batch x n_vocab`` float32 score buffer (0.5 GB for a 248k vocabulary).
Also, when a prompt extends *everything* already in the context (a multi-step
tool turn appends to the previous prompt and reply), the worker just continues:
removing nothing past the end is allowed even for recurrent state.
"""
from __future__ import annotations

import codecs
import ctypes
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import anyio
import llama_cpp
from llama_cpp import Llama, LlamaGrammar
from pydantic import BaseModel, ConfigDict, Field

from psymesh.protocol.errors import ErrorCode, PsymeshError

__all__ = [
    "Completion",
    "GrammarError",
    "ModelError",
    "ModelInfo",
    "ModelLoadError",
    "ModelSettings",
    "ModelWorker",
    "PromptTooLong",
    "WorkerBusy",
    "WorkerClosed",
    "WorkerStats",
]

FinishReason = Literal["stop", "length", "cancelled"]


class ModelError(PsymeshError):
    """Inference failed."""

    default_code = ErrorCode.INTERNAL


class ModelLoadError(ModelError):
    """The model file is missing or llama.cpp cannot load it."""

    default_code = ErrorCode.UNAVAILABLE


class WorkerBusy(ModelError):
    """Too many requests are already queued for this model."""

    default_code = ErrorCode.BUSY


class WorkerClosed(ModelError):
    """The worker was closed (or never started)."""

    default_code = ErrorCode.UNAVAILABLE


class PromptTooLong(ModelError):
    """The prompt does not fit in the context window."""

    default_code = ErrorCode.TOO_LARGE


class GrammarError(ModelError):
    """llama.cpp rejected a GBNF grammar."""

    default_code = ErrorCode.BAD_REQUEST


def default_threads() -> int:
    """All cores but one. llama.cpp's threads spin while they wait for each other; with
    as many threads as cores, any other busy process (here: the node's own event loop,
    a second model) stalls every token. Measured on a busy 2-core machine: 2 threads
    ran the tiny test model at ~0.4 s a token, 1 thread at under 1 ms."""
    return max(1, (os.cpu_count() or 2) - 1)


class ModelSettings(BaseModel):
    """How to load one model. `chat_template` overrides the GGUF's embedded template."""

    model_config = ConfigDict(frozen=True)

    path: Path
    n_ctx: int = Field(4096, ge=64)
    n_threads: int | None = Field(None, ge=1)  # None: all cores but one (see default_threads)
    n_batch: int = Field(512, ge=1)
    chat_template: str | None = None
    prefix_cache_size: int = Field(4, ge=0)  # prefix states kept (LRU); 0 disables the cache
    max_pending: int = Field(32, ge=1)  # queued requests beyond which submit raises WorkerBusy


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that callers need for rendering and budgeting."""

    path: Path
    n_ctx: int
    n_vocab: int
    chat_template: str | None
    eog_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Completion:
    """The outcome of one request. Token counts are model tokens."""

    text: str
    tokens: int
    prompt_tokens: int
    finish_reason: FinishReason
    prompt_tokens_reused: int = 0  # restored from the prefix cache or kept from the last turn
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0


@dataclass
class WorkerStats:
    """Cumulative counters; `prompt_tokens_reused` is what the caches saved."""

    requests: int = 0
    cancelled: int = 0
    prompt_tokens_evaluated: int = 0
    prompt_tokens_reused: int = 0
    generated_tokens: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    continuation_hits: int = 0
    prefix_cache_bytes: int = 0  # memory held by cached prefix states


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
    out: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Call:
    """Run a function with the Llama on the worker thread (tokenize and the like)."""

    fn: Callable[[Llama], Any]
    out: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _PrefixState:
    buf: Any  # ctypes uint8 array owned by us
    nbytes: int


class _Cancelled(Exception):
    pass


_STOP = object()


class _StopScanner:
    """Streams text while holding back any tail that could start a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:k]):
                    keep = k
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class ModelWorker:
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
        self._prefix_cache: OrderedDict[tuple[int, ...], _PrefixState] = OrderedDict()
        self._pieces: dict[int, bytes] = {}

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
    ) -> AsyncIterator[str | Completion]:
        """Text pieces as they are decoded, then one final :class:`Completion`.

        `prefix` is the stable head of `prompt` (see ``chatformat.render_prefix``);
        its model state is cached and restored so only the rest is evaluated.
        `grammar` is GBNF text (or a LlamaGrammar). `seed=None` draws a fresh seed.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        gbnf = grammar._grammar if isinstance(grammar, LlamaGrammar) else grammar  # its only representation
        job = _Job(
            prompt=prompt, prefix=prefix or None, max_tokens=max_tokens, grammar=gbnf, stop=tuple(stop or ()),
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seed=llama_cpp.LLAMA_DEFAULT_SEED if seed is None else seed & 0xFFFFFFFF,
            logit_bias=tuple((int(t), float(b)) for t, b in (logit_bias or {}).items()),
        )
        return self._events(job)

    async def generate(self, prompt: str, **kwargs: Any) -> AsyncIterator[str]:
        """Stream the completion of `prompt` as text pieces (arguments as :meth:`stream`)."""
        async with aclosing(self.stream(prompt, **kwargs)) as events:
            async for event in events:
                if isinstance(event, str):
                    yield event

    async def complete(self, prompt: str, **kwargs: Any) -> Completion:
        """The whole completion of `prompt` (arguments as :meth:`stream`)."""
        async with aclosing(self.stream(prompt, **kwargs)) as events:
            async for event in events:
                if isinstance(event, Completion):
                    return event
        raise ModelError("model worker ended a request without a result")

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
            self._prefix_cache.clear()
            llm.close()

    def _load(self) -> Llama:
        s = self.settings
        if not s.path.is_file():
            raise ModelLoadError(f"model file not found: {s.path}")
        threads = s.n_threads or default_threads()
        try:
            return Llama(model_path=str(s.path), n_ctx=s.n_ctx, n_batch=s.n_batch, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        except Exception as exc:  # llama-cpp-python raises bare ValueError/RuntimeError
            raise ModelLoadError(f"cannot load {s.path.name}: {exc}") from exc

    def _info_of(self, llm: Llama) -> ModelInfo:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        eog = tuple(t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))
        template = self.settings.chat_template or llm.metadata.get("tokenizer.chat_template") or None
        return ModelInfo(path=self.settings.path, n_ctx=llm.n_ctx(), n_vocab=llm.n_vocab(),
                         chat_template=template, eog_token_ids=eog)

    def _execute(self, llm: Llama, job: _Job) -> None:
        started = time.perf_counter()
        stats = self._stats
        stats.requests += 1
        prefix_toks: list[int] = []
        if job.prefix and job.prompt.startswith(job.prefix) and len(job.prompt) > len(job.prefix):
            prefix_toks = self._tokenize(llm, job.prefix, first=True)
            tokens = prefix_toks + self._tokenize(llm, job.prompt[len(job.prefix):], first=False)
        else:
            tokens = self._tokenize(llm, job.prompt, first=True)
        if not tokens:
            raise ModelError("empty prompt")
        room = llm.n_ctx() - len(tokens)
        if room < 1:
            raise PromptTooLong(f"prompt is {len(tokens)} tokens; the context holds {llm.n_ctx()}",
                                details={"prompt_tokens": len(tokens), "n_ctx": llm.n_ctx()})
        sampler = self._make_sampler(llm, job)  # before touching the context: a bad grammar fails cleanly
        try:
            try:
                reused = self._prepare(llm, job, prefix_toks, tokens)
            except _Cancelled:
                stats.cancelled += 1
                job.out.put(Completion("", 0, len(tokens), "cancelled"))
                return
            stats.prompt_tokens_reused += reused
            stats.prompt_tokens_evaluated += len(tokens) - reused
            prompt_done = time.perf_counter()
            text, n_gen, reason = self._decode(llm, job, sampler, min(job.max_tokens, room))
        finally:
            llama_cpp.llama_sampler_free(sampler)
        stats.generated_tokens += n_gen
        if reason == "cancelled":
            stats.cancelled += 1
        job.out.put(Completion(text=text, tokens=n_gen, prompt_tokens=len(tokens), finish_reason=reason,
                               prompt_tokens_reused=reused, prompt_seconds=prompt_done - started,
                               generation_seconds=time.perf_counter() - prompt_done))

    @staticmethod
    def _tokenize(llm: Llama, text: str, *, first: bool) -> list[int]:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        add_bos = first and bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def _prepare(self, llm: Llama, job: _Job, prefix: list[int], tokens: list[int]) -> int:
        """Bring the context to the end of `tokens`; return how many were reused."""
        n = llm.n_tokens
        if 0 < n < len(tokens) and llm.input_ids[:n].tolist() == tokens[:n]:
            self._stats.continuation_hits += 1
            self._eval(llm, tokens[n:], job)
            return n
        if prefix and self.settings.prefix_cache_size:
            key = tuple(prefix)
            state = self._prefix_cache.get(key)
            if state is not None and self._restore(llm, state, prefix):
                self._prefix_cache.move_to_end(key)
                self._stats.prefix_hits += 1
                self._eval(llm, tokens[len(prefix):], job)
                return len(prefix)
            self._stats.prefix_misses += 1
            self._forget_context(llm)
            self._eval(llm, prefix, job)
            self._remember(key, self._snapshot(llm))
            self._eval(llm, tokens[len(prefix):], job)
            return 0
        self._forget_context(llm)
        self._eval(llm, tokens, job)
        return 0

    def _eval(self, llm: Llama, tokens: list[int], job: _Job) -> None:
        step = self.settings.n_batch
        for i in range(0, len(tokens), step):
            if job.cancel.is_set():
                raise _Cancelled
            llm.eval(tokens[i:i + step])

    @staticmethod
    def _forget_context(llm: Llama) -> None:
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)

    @staticmethod
    def _snapshot(llm: Llama) -> _PrefixState:
        size = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(llm.ctx, buf, size, 0)
        return _PrefixState(buf, int(n))

    def _restore(self, llm: Llama, state: _PrefixState, prefix: list[int]) -> bool:
        self._forget_context(llm)
        if llama_cpp.llama_state_seq_set_data(llm.ctx, state.buf, state.nbytes, 0) != state.nbytes:
            self._forget_context(llm)
            return False
        llm.input_ids[: len(prefix)] = prefix
        llm.n_tokens = len(prefix)
        return True

    def _remember(self, key: tuple[int, ...], state: _PrefixState) -> None:
        self._prefix_cache[key] = state
        self._prefix_cache.move_to_end(key)
        while len(self._prefix_cache) > self.settings.prefix_cache_size:
            self._prefix_cache.popitem(last=False)
        self._stats.prefix_cache_bytes = sum(s.nbytes for s in self._prefix_cache.values())

    @staticmethod
    def _make_sampler(llm: Llama, job: _Job) -> Any:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = llama_cpp.llama_sampler_chain_add
        try:
            if job.logit_bias:
                biases = (llama_cpp.llama_logit_bias * len(job.logit_bias))(
                    *(llama_cpp.llama_logit_bias(t, b) for t, b in job.logit_bias))
                add(chain, llama_cpp.llama_sampler_init_logit_bias(llm.n_vocab(), len(job.logit_bias), biases))
            if job.grammar:
                g = llama_cpp.llama_sampler_init_grammar(vocab, job.grammar.encode("utf-8"), b"root")
                if not g:
                    raise GrammarError("llama.cpp rejected the GBNF grammar")
                add(chain, g)
            if job.temperature <= 0:
                add(chain, llama_cpp.llama_sampler_init_greedy())
            else:
                if job.top_k > 0:
                    add(chain, llama_cpp.llama_sampler_init_top_k(job.top_k))
                if job.top_p < 1.0:
                    add(chain, llama_cpp.llama_sampler_init_top_p(job.top_p, 1))
                if job.min_p > 0.0:
                    add(chain, llama_cpp.llama_sampler_init_min_p(job.min_p, 1))
                add(chain, llama_cpp.llama_sampler_init_temp(job.temperature))
                add(chain, llama_cpp.llama_sampler_init_dist(job.seed))
        except BaseException:
            llama_cpp.llama_sampler_free(chain)
            raise
        return chain

    def _piece(self, llm: Llama, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = llm.detokenize([token])
        return piece

    def _decode(self, llm: Llama, job: _Job, sampler: Any, limit: int) -> tuple[str, int, FinishReason]:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        scanner = _StopScanner(job.stop)
        parts: list[str] = []
        n_gen = 0
        reason: FinishReason = "length"
        stopped = False
        while n_gen < limit:
            if job.cancel.is_set():
                reason = "cancelled"
                break
            token = llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1)
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                reason = "stop"
                break
            n_gen += 1
            out, stopped = scanner.feed(utf8.decode(self._piece(llm, token)))
            if out:
                parts.append(out)
                job.out.put(out)
            if stopped:
                reason = "stop"
                break
            if n_gen < limit:
                llm.eval([token])  # the last token is never needed: it would only feed a next step
        if not stopped and reason != "cancelled":  # a stop string drops what is held back
            tail, _ = scanner.feed(utf8.decode(b"", final=True))
            tail += scanner.flush()
            if tail:
                parts.append(tail)
                job.out.put(tail)
        return "".join(parts), n_gen, reason
