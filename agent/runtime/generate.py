"""One way to ask the model: chat messages (and tools) in, text deltas and a typed result out.

Infer tasks, agent steps and (next) an OpenAI-compatible endpoint all need the same
four things, and each doing them itself is how they drift apart:

* the prompt, rendered with the GGUF's chat template (or the built-in Qwen3.5 one), and
  refused (``unsupported``) when it offers tools to a model whose template has none;
* the cacheable prefix: the system turn with the tool block, shared by every
  conversation. A qwen35 hybrid model's recurrent state can only be reused at exact
  boundaries where ``agent.runtime.worker`` saved it, so every caller names this one, and
  every caller gets the saving. The rest of a conversation is reused when its history
  is rendered as the model wrote it: :attr:`Generation.raw` is the assistant turn to
  keep (``ParsedReply.to_message(raw=...)``);
* the reply's shape: a thinking budget (:attr:`GenerationParams.max_think_tokens`:
  the worker closes a thought that runs over) and, with tools, the end of the reply
  right after its last allowed tool call (:attr:`GenerationParams.call_limit`), so a
  caller acts on a call as soon as it is written;
* parameters, as one typed :class:`GenerationParams`. Untrusted ones (a peer's infer
  task) come in through :meth:`GenerationParams.from_untrusted`, which takes only the
  keys a peer may set and names every bad value in a BAD_REQUEST;
* with tools, the reply parsed (by the model's tool family: ``agent.formats.families``), its calls part of the
  result; :class:`ToolGrammar` constrains decoding so that they always parse.

llama_cpp is never imported here: the model runs behind a `TextModel` (a runner process,
node/models/runner.py, or the engine inside one), so the agent loop and scripted models
stay cheap to import.
"""
from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..formats.chatformat import (
    THINK_CLOSE,
    ChatMessage,
    ParsedReply,
    ToolCall,
    ToolSpec,
    render_prefix,
    render_prompt,
    split_generation_prompt,
)
from ...protocol.errors import ErrorCode, PsymeshError
from ..formats.families import FAMILIES, FamilyFormat, ToolFamily, require_tools

if TYPE_CHECKING:
    from ..formats.grammar import ThinkMode
    from .api import Completion, TextModel

__all__ = [
    "FinishReason",
    "Generation",
    "GenerationError",
    "GenerationParams",
    "Piece",
    "TextDelta",
    "ToolGrammar",
    "Usage",
    "complete",
    "generate",
]

# "tool_calls": the model stopped after asking for tools (only with tools, as in OpenAI's API).
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]

# Token ids 128-255 are stray UTF-8 bytes in the byte-level test vocabulary: a random-weight
# model that samples them writes invalid UTF-8. -100 is "never" for any real logit.
_BAN_BYTES = {t: -100.0 for t in range(128, 256)}

# What a peer may set in an infer task's params. Not logit_bias: its token ids index
# straight into llama.cpp's candidate array, and which ids mean what is ours to know.
_PEER_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "grammar", "tool_grammar", "stop", "thinking",
              "max_think_tokens", "ban_bytes")


class GenerationError(PsymeshError):
    """A generation request that cannot run as asked (bad parameters, a grammar without tools)."""

    default_code = ErrorCode.BAD_REQUEST


class ToolGrammar(BaseModel):
    """Constrain decoding (``agent.formats.grammar``) to well-formed calls of the offered tools,
    or a plain answer unless `require_call`. The bounds are what guarantee a babbling
    model still reaches the end of the grammar."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    require_call: bool = False
    max_calls: int = Field(default=1, ge=1, le=64)              # calls per reply (a result holds at most 64)
    max_think_chars: int = Field(default=512, ge=1, le=8192)    # reasoning, when the prompt opened <think>
    max_string_chars: int = Field(default=256, ge=1, le=4096)   # each string argument


class GenerationParams(BaseModel):
    """How to sample one reply. `temperature=0` is greedy; `seed=None` draws a fresh seed.

    `grammar` is GBNF text for the whole reply; `tool_grammar` builds one from the tools
    instead (give at most one). `thinking` opens a ``<think>`` block in the generation
    prompt; `max_think_tokens` caps it (the thought is then closed the way the template
    closes one, and the model goes on to its answer). With tools, `call_limit` ends the
    reply right after that many complete tool calls (None: the tool grammar's
    `max_calls`, which is all it allows; without a grammar, no limit). `ban_bytes` keeps
    random-weight test models to ASCII; `logit_bias` adds to chosen tokens' logits
    (trusted callers only: see :meth:`from_untrusted`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.7, ge=0, allow_inf_nan=False)
    top_k: int = Field(default=20, ge=0)               # 0: off
    top_p: float = Field(default=0.8, gt=0, le=1)      # 1: off
    min_p: float = Field(default=0.0, ge=0, le=1)      # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    grammar: str | None = None
    tool_grammar: ToolGrammar | None = None
    thinking: bool = False
    max_think_tokens: int | None = Field(default=None, ge=1)
    call_limit: int | None = Field(default=None, ge=1)
    ban_bytes: bool = False
    logit_bias: dict[int, float] = Field(default_factory=dict)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v  # OpenAI allows one string or a list

    @model_validator(mode="after")
    def _one_grammar(self) -> GenerationParams:
        if self.grammar is not None and self.tool_grammar is not None:
            raise ValueError("give grammar or tool_grammar, not both")
        return self

    @classmethod
    def from_untrusted(cls, params: Mapping[str, Any], *, max_tokens: int) -> GenerationParams:
        """A peer's sampling params: only the keys a peer may set (others are ignored, so a
        newer peer's extras do no harm), each type-checked; a bad one is the peer's
        BAD_REQUEST, naming every problem."""
        picked = {k: params[k] for k in _PEER_KEYS if k in params}
        try:
            checked = cls.model_validate({**picked, "max_tokens": max_tokens})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'params'}: {e['msg']}"
                                 for e in exc.errors(include_url=False))
            raise GenerationError(f"bad generation params: {problems}") from None
        if checked.grammar is not None and _names_tokens(checked.grammar):
            raise GenerationError("bad generation params: grammar: token references (<[id]>, <token>) are not "
                                  "allowed in a peer's grammar; write the text instead")
        return checked


@dataclass(frozen=True)
class TextDelta:
    """The next piece of the reply's text, as decoded."""

    text: str


@dataclass(frozen=True)
class Usage:
    """Model tokens. `prompt_tokens_cached` of the prompt were not evaluated again: restored
    from the prefix cache, or kept from the previous request in the context."""

    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_cached: int = 0
    prompt_seconds: float = 0.0      # until the first token could be sampled
    generation_seconds: float = 0.0

    @property
    def prompt_tokens_evaluated(self) -> int:
        return self.prompt_tokens - self.prompt_tokens_cached


@dataclass(frozen=True)
class Generation:
    """The finished reply. `text` is exactly the streamed deltas joined.

    `opened_think`: the generation prompt opened a ``<think>`` block, so `text` starts
    inside it (``"<think>\\n" + text`` parses on its own). `opening` is what the prompt
    wrote of the assistant turn before the model went on, so :attr:`raw` is the turn as
    the model saw it. `reply` is the parsed text when tools were given (None otherwise:
    plain text is not searched for calls). `think_closed`: the thinking budget ran out.
    """

    text: str
    finish_reason: FinishReason
    usage: Usage
    opened_think: bool = False
    reply: ParsedReply | None = None
    opening: str = ""
    think_closed: bool = False

    @property
    def raw(self) -> str:
        """The assistant turn exactly as the model saw and wrote it, for the history."""
        return self.opening + self.text

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(self.reply.tool_calls) if self.reply is not None else ()


Piece = TextDelta | Generation


async def generate(
    worker: TextModel,
    messages: Sequence[ChatMessage],
    *,
    tools: Sequence[ToolSpec] | None = None,
    params: GenerationParams = GenerationParams(),
) -> AsyncGenerator[Piece, None]:
    """Stream the model's next assistant turn: :class:`TextDelta` pieces, then one
    :class:`Generation`. Close the generator (``contextlib.aclosing``) to stop early:
    the worker then drops the request between tokens.

    `tools` are announced in the system turn and, when given (even empty), the reply is
    parsed against them. Raises GenerationError / ChatFormatError for a request that
    cannot run, and the worker's ModelError family for one that failed.
    """
    from .api import StopAfter, ThinkBudget

    offered = tuple(tools) if tools is not None else ()
    template = worker.chat_template
    family = worker.info.tool_family
    if offered:
        require_tools(family, worker.info.path.name)
    fmt = FAMILIES[family]
    prompt = render_prompt(messages, offered, thinking=params.thinking, template=template, family=family)
    prefix = render_prefix(messages, offered, template=template, family=family)
    history, opening = split_generation_prompt(prompt)
    opened = prompt.rstrip().endswith("<think>")
    grammar = params.grammar
    if params.tool_grammar is not None:
        if tools is None:
            raise GenerationError("tool_grammar needs tools (an empty list allows only an answer)")
        grammar = _tool_grammar(family, tuple(t.model_dump_json() for t in offered), "bounded" if opened else "none",
                                params.tool_grammar)
    calls = params.call_limit or (params.tool_grammar.max_calls if params.tool_grammar is not None else None)
    budget = params.max_think_tokens if opened else None
    stream = worker.stream(
        prompt, prefix=prefix or None, checkpoint=history, max_tokens=params.max_tokens, grammar=grammar,
        stop=params.stop, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, seed=params.seed, logit_bias=_logit_bias(params, worker.info.n_vocab),
        think_budget=ThinkBudget(budget, THINK_CLOSE) if budget else None,
        stop_after=StopAfter(fmt.call_close, calls, after=THINK_CLOSE.strip() if opened else None)
        if tools and calls and fmt.call_close else None)
    async with aclosing(stream) as events:  # type: ignore[type-var]  # stream() is an async generator
        async for event in events:
            if isinstance(event, str):
                yield TextDelta(event)
            else:
                yield _finished(event, tools, opened, opening, fmt)
                return


async def complete(
    worker: TextModel,
    messages: Sequence[ChatMessage],
    *,
    tools: Sequence[ToolSpec] | None = None,
    params: GenerationParams = GenerationParams(),
) -> Generation:
    """The whole reply at once (arguments as :func:`generate`)."""
    async with aclosing(generate(worker, messages, tools=tools, params=params)) as pieces:
        async for piece in pieces:
            if isinstance(piece, Generation):
                return piece
    raise GenerationError("the model worker ended a request without a result", code=ErrorCode.INTERNAL)


def _finished(done: Completion, tools: Sequence[ToolSpec] | None, opened: bool, opening: str,
              fmt: FamilyFormat) -> Generation:
    reply = fmt.parse(done.text, tools, in_think=opened) if tools is not None else None
    reason: FinishReason = done.finish_reason
    if reason == "stop" and reply is not None and reply.tool_calls:
        reason = "tool_calls"
    return Generation(text=done.text, finish_reason=reason, opened_think=opened, reply=reply, opening=opening,
                      think_closed=done.think_closed,
                      usage=Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.tokens,
                                  prompt_tokens_cached=done.prompt_tokens_reused,
                                  prompt_seconds=done.prompt_seconds, generation_seconds=done.generation_seconds))


def _logit_bias(params: GenerationParams, n_vocab: int) -> dict[int, float]:
    bias = {**_BAN_BYTES, **params.logit_bias} if params.ban_bytes else dict(params.logit_bias)
    bad = sorted(t for t in bias if not 0 <= t < n_vocab)
    if bad:  # llama.cpp would index its candidate array with them unchecked
        raise GenerationError(f"logit_bias token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
    return bias


def _names_tokens(gbnf: str) -> bool:
    """Does this GBNF name tokens (`<[245]>`, `<think>`) outside its strings, character
    classes and comments? A token literal can leave llama.cpp's grammar with no token it
    accepts after a partial UTF-8 sequence, which it answers with an uncaught C++
    exception ("Unexpected empty grammar stack"): the runner dies. A node's own grammars
    never name tokens; a peer's may not."""
    i, n = 0, len(gbnf)
    while i < n:
        ch = gbnf[i]
        if ch in "\"[":
            close = '"' if ch == '"' else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif ch == "#":
            while i < n and gbnf[i] != "\n":
                i += 1
        elif ch == "<":
            return True
        i += 1
    return False


@functools.lru_cache(maxsize=32)
def _tool_grammar(family: ToolFamily, tools_json: tuple[str, ...], think: ThinkMode, rules: ToolGrammar) -> str:
    """GBNF for these tools in `family`'s call format, cached: an agent asks with the same
    tools at every step, and building the grammar (JSON-schema conversion) costs more than
    parsing the key."""
    try:
        return FAMILIES[family].grammar([ToolSpec.model_validate_json(t) for t in tools_json], think=think,
                                        require_call=rules.require_call, max_calls=rules.max_calls,
                                        max_think_chars=rules.max_think_chars,
                                        max_string_chars=rules.max_string_chars)
    except ValueError as exc:  # e.g. require_call without tools
        raise GenerationError(f"cannot build the tool grammar: {exc}") from None
