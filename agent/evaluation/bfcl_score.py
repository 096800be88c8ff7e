"""One single-turn reply scored: parsed with ``chatformat.parse_reply`` and judged by the
mirrored checker (:mod:`.bfcl_checker`), or by the irrelevance / relevance rule, into a
:class:`BfclResult` (:func:`score_single_turn`; :func:`.bfcl.score_reply` for any case).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..formats.chatformat import ToolCall, ToolSpec, parse_reply
from ..formats.families import ReplyParser
from .bfcl_categories import PYTHON
from .bfcl_checker import PYTHON_TYPES, check_calls
from .bfcl_data import BfclCase


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class BfclResult:
    id: str
    category: str
    passed: bool
    kind: str            # BFCL's error_type ("" when passed)
    reason: str          # "" when passed
    reply: str           # the raw model output
    calls: list[ToolCall]


def scoring_spec(spec: ToolSpec) -> ToolSpec:
    """`spec` for reading a reply back: a value that does not fit its declared type stays
    the text the model wrote, and enums are not enforced. BFCL decodes a reply without the
    schema and judges types and values in the checker, which then refuses such a value
    (or, for a ground truth that names a variable, accepts it); refusing it in the parse
    would make the checker see no call at all."""
    props = {k: ({key: v for key, v in p.items() if key != "enum"}
                 | ({"type": [p["type"], "string"]} if p.get("type") in PYTHON_TYPES.keys() - {"string"} else {}))
             if isinstance(p, Mapping) else p
             for k, p in spec.parameters.get("properties", {}).items()}
    return spec.model_copy(update={"parameters": {**spec.parameters, "properties": props}})


def _literal_spec(spec: ToolSpec) -> ToolSpec:
    """`spec` for the other reading of a reply: string parameters untyped, so text that
    looks like JSON (true, 2, null) reads as JSON."""
    scoring = scoring_spec(spec)
    props = {k: ({key: v for key, v in p.items() if key != "type"} if isinstance(p, Mapping)
                 and p.get("type") == "string" else p)
             for k, p in scoring.parameters.get("properties", {}).items()}
    return scoring.model_copy(update={"parameters": {**scoring.parameters, "properties": props}})


def _readings(calls: list[ToolCall], literal: list[ToolCall], limit: int = 64) -> Iterable[list[ToolCall]]:
    """Every mix of the two readings, parameter by parameter (at most `limit`)."""
    if len(literal) != len(calls) or any(a.name != b.name for a, b in zip(calls, literal, strict=True)):
        return
    ambiguous = [(i, p) for i, (a, b) in enumerate(zip(calls, literal, strict=True))
                 for p in a.arguments if p in b.arguments and a.arguments[p] != b.arguments[p]]
    for mask in range(1, min(1 << len(ambiguous), limit)):
        mixed = [dict(c.arguments) for c in calls]
        for bit, (i, p) in enumerate(ambiguous):
            if mask >> bit & 1:
                mixed[i][p] = literal[i].arguments[p]
        yield [c.model_copy(update={"arguments": a}) for c, a in zip(calls, mixed, strict=True)]


def score_single_turn(case: BfclCase, text: str, parse: ReplyParser = parse_reply) -> BfclResult:
    """Score one raw reply to a single-turn case (AST, irrelevance, relevance) as BFCL would,
    read by `parse` (the model's tool family's parser)."""
    if case.wants_call is not None:
        reply = parse(text)  # a well-formed call to any function, offered or not, counts
        calls = list(reply.tool_calls)
        if calls and not case.wants_call:
            return BfclResult(case.id, case.category, False, "irrelevance_error:decoder_success",
                              f"expected no tool call, got {', '.join(c.name for c in calls)}", text, calls)
        if not calls and case.wants_call:
            return BfclResult(case.id, case.category, False, "relevance_error:decoder_failed",
                              "expected a tool call, got none", text, calls)
        return BfclResult(case.id, case.category, True, "", "", text, calls)
    assert case.expected is not None
    reply = parse(text, [scoring_spec(t) for t in case.tools])
    calls = list(reply.tool_calls)
    if reply.errors:
        return BfclResult(case.id, case.category, False, "ast_decoder:decoder_failed",
                          "malformed reply: " + "; ".join(reply.errors), text, calls)
    mismatch = check_calls(calls, case.expected, case.check_tools or case.tools, case.language)
    if mismatch is not None and case.language == PYTHON:
        # The XML call form writes `true`, `2` and `null` alike for a string and for a JSON
        # literal; a JSON-writing model is read unambiguously by BFCL. So a reply also
        # passes if it does with its string parameters read as the literals they spell.
        literal = parse(text, [_literal_spec(t) for t in case.tools])
        for reading in _readings(calls, list(literal.tool_calls) if not literal.errors else []):
            if check_calls(reading, case.expected, case.tools) is None:
                return BfclResult(case.id, case.category, True, "", "", text, reading)
    if mismatch is not None:
        return BfclResult(case.id, case.category, False, mismatch.kind, mismatch.message, text, calls)
    return BfclResult(case.id, case.category, True, "", "", text, calls)
