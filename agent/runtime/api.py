"""What a caller of a model sees, whichever process the model runs in.

The settings a model is loaded with, the facts it reports once loaded, the shape of one
request's outcome (:class:`Completion`), the rules that end or steer a generation
(:class:`StopAfter`, :class:`ThinkBudget`), the counters it keeps, the errors it raises,
and :class:`TextModel`: the async surface that both the in-process engine
(``agent.runtime.worker.ModelWorker``, which only a model runner process uses) and the daemon's
handle on a runner process (``node.models.runner.ModelRunner``) offer. Nothing here
imports llama_cpp, so the daemon can name all of it without loading the native library.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from ...protocol.errors import ErrorCode, PsymeshError
from ..formats.families import ToolFamily, detect_family

__all__ = [
    "Completion",
    "FinishReason",
    "GrammarError",
    "ModelCrashed",
    "ModelError",
    "ModelInfo",
    "ModelLoadError",
    "ModelSettings",
    "PromptTooLong",
    "StopAfter",
    "StreamingModel",
    "TextModel",
    "ThinkBudget",
    "WorkerBusy",
    "WorkerClosed",
    "WorkerStats",
    "default_threads",
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


class ModelCrashed(ModelError):
    """The model's runner process died while it ran this request (llama.cpp aborted, a
    segfault, the OOM killer, a kill): this request failed, the node did not.
    `details` carries `signal` (e.g. "SIGABRT") or `exit_code`, and the last line the
    runner wrote to its log (`log`)."""

    default_code = ErrorCode.MODEL_CRASHED


def default_threads() -> int:
    """All cores but one. llama.cpp's threads spin while they wait for each other; with
    as many threads as cores, any other busy process (here: the node's own event loop,
    a second model) stalls every token. Measured on a busy 2-core machine: 2 threads
    ran the tiny test model at ~0.4 s a token, 1 thread at under 1 ms."""
    return max(1, (os.cpu_count() or 2) - 1)


class ModelSettings(BaseModel):
    """How to load one model. `chat_template` overrides the GGUF's embedded template.

    `state_cache_bytes` / `state_cache_entries` bound the saved model states (see the
    module docstring). A BotPsy-0.8B state is ~20 MB of recurrent state plus ~12 KB per
    token (measured: 42 MB at 1.8k tokens, saved in ~20 ms, restored in ~3 ms), so the
    default budget holds the system turn and five or so conversations. `reuse=False`
    evaluates every prompt from scratch: the baseline that measurements and
    determinism checks compare against.
    """

    model_config = ConfigDict(frozen=True)

    path: Path
    n_ctx: int = Field(4096, ge=64)
    n_threads: int | None = Field(None, ge=1)  # None: all cores but one (see default_threads)
    n_batch: int = Field(512, ge=1)
    chat_template: str | None = None
    state_cache_bytes: int = Field(256 * 2**20, ge=0)  # memory for saved states; 0 keeps none
    state_cache_entries: int = Field(16, ge=0)  # saved states kept at most; 0 keeps none
    reuse: bool = True
    max_pending: int = Field(32, ge=1)  # queued requests beyond which submit raises WorkerBusy
    # The runner process (node/models/runner.py): how long it stays loaded with nothing to do
    # (None: until the node stops), and the most address space it may map (None: no cap), past
    # which llama.cpp's allocation fails and the runner dies as a clean ModelCrashed.
    keep_alive_s: float | None = Field(300.0, ge=0)
    memory_limit_mb: int | None = Field(None, ge=64)
    # A model split across other processes (agent/runtime/rpc.py): llama.cpp RPC servers
    # ("host:port", in order), how many of its last layers go to them (the output layer counts as
    # one) and how they share them; rpc.split_layers computes the last two from the layer count.
    rpc_servers: tuple[str, ...] = ()
    n_gpu_layers: int = Field(0, ge=0)
    tensor_split: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that callers need for rendering and budgeting."""

    path: Path
    n_ctx: int
    n_vocab: int
    chat_template: str | None
    eog_token_ids: tuple[int, ...]
    family_tokens: tuple[str, ...] = ()  # which of agent.formats.families.FAMILY_TOKENS the vocabulary has

    @property
    def tool_family(self) -> ToolFamily:
        """How this model calls tools (agent.formats.families), from its template and vocabulary."""
        return detect_family(self.chat_template, self.family_tokens)


@dataclass(frozen=True)
class StopAfter:
    """End the generation right after the `count`-th `marker` in the generated text
    (kept, and evaluated, so the model state matches the text). Occurrences count only
    after `after` once it was written, if given: a reply that starts inside a thought
    ends at its calls, not at a call it muses about."""

    marker: str
    count: int = 1
    after: str | None = None


@dataclass(frozen=True)
class ThinkBudget:
    """The generation starts inside an open thought; after `tokens` generated tokens
    without `close` (its non-blank part: ``</think>``) the worker writes `close` itself
    and lets the model go on to its answer. With a grammar, each forced token is
    first checked against it, and a token the grammar refuses is left to sampling."""

    tokens: int
    close: str


@dataclass(frozen=True)
class Completion:
    """The outcome of one request. Token counts are model tokens."""

    text: str
    tokens: int
    prompt_tokens: int
    finish_reason: FinishReason
    prompt_tokens_reused: int = 0  # not evaluated: continued from the live context or a saved state
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    think_closed: bool = False  # the ThinkBudget ran out and the worker closed the thought

    @property
    def prompt_tokens_evaluated(self) -> int:
        return self.prompt_tokens - self.prompt_tokens_reused


@dataclass
class WorkerStats:
    """Cumulative counters; `prompt_tokens_reused` is what state reuse saved."""

    requests: int = 0
    cancelled: int = 0
    prompt_tokens_evaluated: int = 0
    prompt_tokens_reused: int = 0
    generated_tokens: int = 0
    continuation_hits: int = 0  # prompts that extended the live context
    snapshot_hits: int = 0      # prompts that restored a saved state
    misses: int = 0             # prompts evaluated from their first token
    snapshots_saved: int = 0
    snapshots_dropped: int = 0  # evicted (budget, count) or superseded
    state_cache_bytes: int = 0  # memory held by saved states now
    state_cache_entries: int = 0
    think_closes: int = 0


class StreamingModel:
    """`generate` and `complete`, written once over a model's `stream` (the engine's and a
    runner handle's): text pieces only, or the final Completion only."""

    def stream(self, prompt: str, **kwargs: Any) -> AsyncIterator[str | Completion]:
        raise NotImplementedError

    async def generate(self, prompt: str, **kwargs: Any) -> AsyncIterator[str]:
        """Stream the completion of `prompt` as text pieces (arguments as `stream`)."""
        async with aclosing(self.stream(prompt, **kwargs)) as events:
            async for event in events:
                if isinstance(event, str):
                    yield event

    async def complete(self, prompt: str, **kwargs: Any) -> Completion:
        """The whole completion of `prompt` (arguments as `stream`)."""
        async with aclosing(self.stream(prompt, **kwargs)) as events:
            async for event in events:
                if isinstance(event, Completion):
                    return event
        raise ModelError("the model ended a request without a result")


class TextModel(Protocol):
    """The async surface of a loaded model, in process or behind a runner process.

    `stream` yields text pieces as they are decoded, then one final :class:`Completion`;
    closing it early (``contextlib.aclosing``) cancels the request between tokens."""

    settings: ModelSettings

    @property
    def info(self) -> ModelInfo: ...

    @property
    def chat_template(self) -> str | None: ...

    def stream(self, prompt: str, *, max_tokens: int = 512, prefix: str | None = None, grammar: str | None = None,
               stop: Sequence[str] | None = None, temperature: float = 0.7, top_k: int = 20, top_p: float = 0.8,
               min_p: float = 0.0, seed: int | None = None, logit_bias: Mapping[int, float] | None = None,
               checkpoint: str | None = None, think_budget: ThinkBudget | None = None,
               stop_after: StopAfter | None = None) -> AsyncIterator[str | Completion]: ...

    async def complete(self, prompt: str, **kwargs: Any) -> Completion: ...

    async def tokenize(self, text: str) -> list[int]: ...
