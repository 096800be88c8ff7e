"""Tool-calling families: which call format a model speaks, told from its GGUF.

A *family* is how a chat template asks a model to call tools, and so how the model
writes a call:

========== ================================================= ==========================================
family     a call, as the model writes it                    models
========== ================================================= ==========================================
qwen35     ``<tool_call>\\n<function=NAME>\\n<parameter=K>``   Qwen3.5 (BotPsy), Qwen3-Coder
           ``\\nV\\n</parameter>\\n</function>\\n</tool_call>``
hermes     ``<tool_call>\\n{"name": N, "arguments": {..}}``     Qwen2.5, Qwen3, Hermes 2 Pro / 3 and their
           ``\\n</tool_call>``                                 fine-tunes
llama3     ``{"name": N, "parameters": {..}}`` (bare JSON,     Llama 3.1 / 3.2 / 3.3
           or after ``<|python_tag|>``)
mistral    ``[TOOL_CALLS] [{"name": N, "arguments": {..}}]``   Mistral 7B Instruct v0.3, Mistral Nemo
none       (the template has no tool section)                SmolLM2 and other chat-only models
========== ================================================= ==========================================

:func:`detect_family` reads the family from the chat template (``tokenizer.chat_template``)
and the vocabulary's special tokens, in the order llama.cpp's ``common/chat.cpp`` tries its
handlers (Qwen3-Coder XML before Hermes, whose marker it shares; then the Llama 3.x ``ipython``
role; then ``[TOOL_CALLS]``). A model without a template is rendered by the built-in Qwen3.5
renderer, which only a vocabulary with the ``<tool_call>`` token was trained on.

Everything that differs by family is one row of :data:`FAMILIES` (a frozen
:class:`FamilyFormat`): the text that ends a turn, where a turn opens (the cacheable prefix
ends there), the control tokens a message must not smuggle in, the marker that ends a call,
how call ids must look, and the family's parser and GBNF grammar. Rendering goes through the
template itself, which knows its family's tool section.
"""
from __future__ import annotations

import hashlib
import string
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

from ...protocol.errors import ErrorCode, PsymeshError
from .chat import IM_END, IM_START, ParsedReply, ToolSpec
from .grammar import tool_call_grammar
from .jsoncalls import hermes_grammar, llama3_grammar, mistral_grammar, parse_llama3, parse_mistral
from .toolparse import parse_plain, parse_reply

__all__ = [
    "CALL_OPENERS",
    "FAMILIES",
    "FAMILY_TOKENS",
    "FamilyFormat",
    "ReplyParser",
    "ToolFamily",
    "ToolsUnsupported",
    "detect_family",
    "require_tools",
]


class ToolFamily(StrEnum):
    QWEN35 = "qwen35"
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    NONE = "none"


class ReplyParser(Protocol):
    """A family's parser: a reply into reasoning, text and calls (never raising)."""

    def __call__(self, text: str, tools: Sequence[ToolSpec] | None = None, *,
                 in_think: bool = False) -> ParsedReply: ...


def _same_id(call_id: str) -> str:
    return call_id


_ALNUM = string.ascii_letters + string.digits


def _nine_alnum(call_id: str) -> str:
    """Mistral's templates refuse any call id but 9 letters or digits; ours are longer, so each
    is mapped to 9 (stable: a call and its result map alike)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


def _answer_only(tools: Sequence[ToolSpec], **rules: Any) -> str:
    """A model that cannot call tools: without tools, the plain-answer grammar every family has."""
    if tools:
        raise ValueError("this model's chat template has no tool calls to constrain")
    return tool_call_grammar((), **rules)


@dataclass(frozen=True)
class FamilyFormat:
    """How one family renders, ends, parses and constrains a tool call.

    `tools`: can the model call tools at all. `eos_token`: what the template's ``eos_token``
    stands for (the end of an assistant turn). `turn_open`: the text that opens every turn
    (the prefix shared by a conversation's prompts ends before the first user turn's).
    `control_tokens`: special tokens a message's text may not carry (they are broken with a
    word joiner). `call_open`: the text a call starts with, where the family has one (a Llama
    3.x call may also be bare JSON). `call_close`: the text a call ends with, where the runtime can stop after
    the last allowed call (None: the call ends the turn, at the model's end-of-turn token).
    `call_id`: the id a template is shown for a call (and its result). `loose_result_role`: the
    role a tool turn that answers no call (the agent loop's word on a malformed reply) is shown
    with: "user" where the template wants every result tied to a call (Mistral's raises on a
    result without a call id, and on two assistant turns in a row around one).
    """

    family: ToolFamily
    description: str
    tools: bool
    eos_token: str
    turn_open: str
    control_tokens: tuple[str, ...]
    call_open: str | None
    call_close: str | None
    call_id: Callable[[str], str]
    loose_result_role: Literal["tool", "user"]
    parse: ReplyParser
    grammar: Callable[..., str]  # as agent.grammar.tool_call_grammar: (tools, *, require_call, max_calls, think, ...)


_CHATML = (IM_START, IM_END, "<|endoftext|>")
_LLAMA3 = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
           "<|python_tag|>", "<|end_of_text|>")
_MISTRAL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "<s>", "</s>")

FAMILIES: dict[ToolFamily, FamilyFormat] = {f.family: f for f in (
    FamilyFormat(ToolFamily.QWEN35, "Qwen3.5 XML: <tool_call><function=NAME><parameter=KEY>", True, IM_END,
                 IM_START, _CHATML, "<tool_call>", "</tool_call>", _same_id, "tool", parse_reply,
                 tool_call_grammar),
    FamilyFormat(ToolFamily.HERMES, "Hermes / Qwen2.5 / Qwen3 JSON in <tool_call>", True, IM_END, IM_START, _CHATML,
                 "<tool_call>", "</tool_call>", _same_id, "tool", parse_reply, hermes_grammar),
    FamilyFormat(ToolFamily.LLAMA3, "Llama 3.x JSON {\"name\", \"parameters\"}", True, "<|eot_id|>",
                 "<|start_header_id|>", _LLAMA3, "<|python_tag|>", None, _same_id, "tool", parse_llama3,
                 llama3_grammar),
    FamilyFormat(ToolFamily.MISTRAL, "Mistral [TOOL_CALLS] [{\"name\", \"arguments\"}]", True, "</s>", "[INST]",
                 _MISTRAL, "[TOOL_CALLS]", None, _nine_alnum, "user", parse_mistral, mistral_grammar),
    FamilyFormat(ToolFamily.NONE, "no tool calling (the chat template has no tool section)", False, IM_END,
                 IM_START, _CHATML, None, None, _same_id, "tool", parse_plain, _answer_only),
)}

# What any family's call starts with (a reply streamed to a client is held back from there on).
CALL_OPENERS: tuple[str, ...] = tuple(dict.fromkeys(f.call_open for f in FAMILIES.values() if f.call_open))

# Template markers, in llama.cpp's order (common/chat.cpp, common_chat_templates_apply_jinja):
# every marker of a row must be in the template.
_DETECTION: tuple[tuple[ToolFamily, tuple[str, ...]], ...] = (
    (ToolFamily.QWEN35, ("<tool_call>", "<function=", "<parameter=")),
    (ToolFamily.HERMES, ("<tool_call>",)),
    (ToolFamily.LLAMA3, ("<|start_header_id|>ipython<|end_header_id|>",)),
    (ToolFamily.MISTRAL, ("[TOOL_CALLS]",)),
)

# The special tokens detection asks the vocabulary about (the runtime and `model add` look
# each up as one token).
FAMILY_TOKENS: tuple[str, ...] = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]")


def detect_family(template: str | None, tokens: Collection[str]) -> ToolFamily:
    """The family of a model whose chat template is `template` (None: it has none) and whose
    vocabulary has the special tokens `tokens` (any of :data:`FAMILY_TOKENS`).

    Without a template the built-in Qwen3.5 renderer speaks for the model, which is right
    only for a vocabulary that has ``<tool_call>``; any other such model is chat-only."""
    if not template:
        return ToolFamily.QWEN35 if "<tool_call>" in tokens else ToolFamily.NONE
    for family, markers in _DETECTION:
        if all(m in template for m in markers):
            return family
    return ToolFamily.NONE


class ToolsUnsupported(PsymeshError):
    """Tools offered to a model whose chat template cannot call them."""

    default_code = ErrorCode.UNSUPPORTED


def require_tools(family: ToolFamily, model: str) -> None:
    """The one check that a request with tools can go to `model` (named for the message):
    a model of the family "none" would read a prompt without them and answer as if it had
    looked, so the request fails instead, saying what to do."""
    if not FAMILIES[family].tools:
        raise ToolsUnsupported(
            f"model {model} cannot call tools: its chat template has no tool section (tool family 'none'). "
            "Use a tool-capable model (psymesh model ps shows each model's tool family: qwen35, hermes, llama3 "
            "or mistral), or ask without tools (agent run --no-tools).", details={"model": model, "family": family.value})
