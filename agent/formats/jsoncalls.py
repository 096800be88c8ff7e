"""Tool calls written as JSON: the Hermes, Llama 3.x and Mistral families' parsers and grammars.

* Hermes (Qwen2.5, Qwen3, Hermes 2 Pro / 3): ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``,
  one block per call. :func:`psymesh.agent.toolparse.parse_reply` already reads it (it reads the
  Qwen3.5 XML form too), so only the grammar is here.
* Llama 3.x: the reply *is* the call, ``{"name": N, "parameters": {...}}``, after
  ``<|python_tag|>`` or bare (what Llama 3.1's and 3.2's templates ask for); several are
  separated by ``;``.
* Mistral: ``[TOOL_CALLS]`` and a JSON list of ``{"name": N, "arguments": {...}}`` (v0.3, Nemo),
  or ``[TOOL_CALLS]NAME[ARGS]{...}`` (the newer form).

Parsers never raise (as :func:`~psymesh.agent.toolparse.parse_reply`): whatever the model wrote
comes back as text, calls and errors. Grammars describe exactly what the parsers read, with
llama-cpp-python's JSON-schema converter building each tool's ``{"name", arguments}`` object
from its schema (strings and arrays bounded, so a babbling model still ends).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .chat import ParsedReply, ToolCall, ToolSpec
from .grammar import ThinkMode, bounded_schema, gbnf_literal, json_rules, reply_rules, schema_converter
from .toolparse import admit_call, call_from_json, short, split_reply

__all__ = ["hermes_grammar", "llama3_grammar", "mistral_grammar", "parse_llama3", "parse_mistral"]

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
_LLAMA3_END = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
_MISTRAL_END = ("</s>",)
_DECODER = json.JSONDecoder(strict=False)  # raw newlines in strings: a common small-model slip
_ARGS_FORM = re.compile(r"\s*([^\W\d][\w.\-]{0,63})\s*\[ARGS\]\s*")


def _decode(text: str, at: int) -> tuple[Any, int, str | None]:
    """The JSON value at `text[at:]`: (value, end, None) or (None, at, error)."""
    try:
        value, end = _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError) as exc:
        return None, at, f"tool call is not valid JSON ({exc.__class__.__name__}): {short(text[at:])}"
    return value, end, None


def _skip(text: str, at: int, separators: str) -> int:
    while at < len(text) and (text[at].isspace() or text[at] in separators):
        at += 1
    return at


def parse_llama3(text: str, tools: Sequence[ToolSpec] | None = None, *, in_think: bool = False) -> ParsedReply:
    """A Llama 3.x reply: a call (or calls, ``;``-separated) when it starts with
    ``<|python_tag|>`` or with a JSON object that has a "name"; otherwise the answer."""
    thinking, rest, errors = split_reply(text, _LLAMA3_END, in_think)
    body = rest.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG):].strip()
    if not tagged and not body.startswith("{"):
        return ParsedReply(thinking=thinking, content=body, errors=errors)
    first, _, err = _decode(body, 0)
    if not tagged and err is None and not (isinstance(first, dict) and "name" in first):
        return ParsedReply(thinking=thinking, content=body, errors=errors)  # JSON, but an answer
    if tagged and not body.startswith("{"):  # a built-in tool call (brave_search.call(...)): not ours
        errors.append(f"tool call 1: unrecognised tool call after {PYTHON_TAG}: {short(body)}")
        return ParsedReply(thinking=thinking, errors=errors)
    by_name = {t.name: t for t in tools} if tools is not None else None
    calls: list[ToolCall] = []
    at = n = 0
    while at < len(body):
        n += 1
        value, end, err = _decode(body, at)
        if err is None and not isinstance(value, dict):
            err = f"tool call is not a JSON object: {short(body[at:end])}"
        call, err = (None, err) if err is not None else call_from_json(value)
        admit_call(n, call, err, by_name, calls, errors)
        if end == at:  # undecodable: the rest is lost with it
            break
        at = _skip(body, end, ";")
    return ParsedReply(thinking=thinking, tool_calls=calls, errors=errors)


def parse_mistral(text: str, tools: Sequence[ToolSpec] | None = None, *, in_think: bool = False) -> ParsedReply:
    """A Mistral reply: text, then after ``[TOOL_CALLS]`` a JSON list of calls (or one call
    object, or ``NAME[ARGS]{...}``)."""
    thinking, rest, errors = split_reply(text, _MISTRAL_END, in_think)
    head, *segments = rest.split(TOOL_CALLS)
    by_name = {t.name: t for t in tools} if tools is not None else None
    calls: list[ToolCall] = []
    n = 0
    for segment in segments:
        at = _skip(segment, 0, "")
        named = _ARGS_FORM.match(segment, at)
        if named is not None:
            n += 1
            value, _, err = _decode(segment, named.end())
            if err is None and not isinstance(value, dict):
                err = f"arguments of {named.group(1)} are not a JSON object"
            call = ToolCall(name=named.group(1), arguments=value) if err is None else None
            admit_call(n, call, err, by_name, calls, errors)
            continue
        value, _, err = _decode(segment, at)
        if err is not None:
            n += 1
            admit_call(n, None, err if segment.strip() else f"nothing after {TOOL_CALLS}", by_name, calls, errors)
            continue
        for item in value if isinstance(value, list) else [value]:
            n += 1
            if isinstance(item, dict):
                call, err = call_from_json(item)
            else:
                call, err = None, f"tool call is not a JSON object: {short(json.dumps(item))}"
            admit_call(n, call, err, by_name, calls, errors)
    return ParsedReply(thinking=thinking, content=head.strip(), tool_calls=calls, errors=errors)


# --------------------------------------------------------------------------- grammars


def _call_objects(tools: Sequence[ToolSpec], arguments_key: str, max_string_chars: int) -> tuple[str, list[str]]:
    """GBNF rules for one call object of any of `tools` ({"name": <const>, `arguments_key`:
    <the tool's schema>}), by llama-cpp-python's JSON-schema converter: (rule name, rule lines)."""
    converter = schema_converter()(prop_order={"name": 0, arguments_key: 1}, allow_fetch=False, dotall=False,
                                   raw_pattern=False)
    names = []
    for i, tool in enumerate(tools):
        schema = {"type": "object", "properties": {"name": {"const": tool.name},
                                                   arguments_key: bounded_schema(tool.parameters, max_string_chars)},
                  "required": ["name", arguments_key], "additionalProperties": False}
        names.append(converter.visit(converter.resolve_refs(schema, ""), f"tc-obj-{i}"))
    lines = [line for line in json_rules(converter) if line and not line.startswith("root ::=")]
    lines.append(f"tc-obj ::= {' | '.join(names)}")
    return "tc-obj", lines


def _grammar(tools: Sequence[ToolSpec], calls_rule: str, arguments_key: str, *, require_call: bool, max_calls: int,
             think: ThinkMode, max_think_chars: int, max_string_chars: int, extra: dict[str, str]) -> str:
    if not tools:
        if require_call:
            raise ValueError("require_call needs at least one tool")
        return "\n".join(f"{k} ::= {v}" for k, v in reply_rules(think, max_think_chars, None, False).items()) + "\n"
    if max_calls < 1:
        raise ValueError("max_calls must be >= 1")
    _, lines = _call_objects(tools, arguments_key, max_string_chars)
    rules = {**extra, **reply_rules(think, max_think_chars, calls_rule, require_call)}
    return "\n".join([*(f"{k} ::= {v}" for k, v in rules.items()), *lines]) + "\n"


def _repeat(rule: str, separator: str, max_calls: int) -> str:
    return rule + (f" ({gbnf_literal(separator)} {rule}){{0,{max_calls - 1}}}" if max_calls > 1 else "")


def hermes_grammar(tools: Sequence[ToolSpec], *, require_call: bool = False, max_calls: int = 1,
                   think: ThinkMode = "none", max_think_chars: int = 512, max_string_chars: int = 256) -> str:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, or an answer."""
    call = f'{gbnf_literal("<tool_call>" + chr(10))} tc-obj {gbnf_literal(chr(10) + "</tool_call>")}'
    return _grammar(tools, "tc-calls", "arguments", require_call=require_call, max_calls=max_calls, think=think,
                    max_think_chars=max_think_chars, max_string_chars=max_string_chars,
                    extra={"tc-call": call, "tc-calls": _repeat("tc-call", "\n", max_calls)})


def llama3_grammar(tools: Sequence[ToolSpec], *, require_call: bool = False, max_calls: int = 1,
                   think: ThinkMode = "none", max_think_chars: int = 512, max_string_chars: int = 256) -> str:
    """A bare ``{"name": ..., "parameters": {...}}`` (``; ``-separated when several), or an answer."""
    return _grammar(tools, "tc-calls", "parameters", require_call=require_call, max_calls=max_calls, think=think,
                    max_think_chars=max_think_chars, max_string_chars=max_string_chars,
                    extra={"tc-calls": _repeat("tc-obj", "; ", max_calls)})


def mistral_grammar(tools: Sequence[ToolSpec], *, require_call: bool = False, max_calls: int = 1,
                    think: ThinkMode = "none", max_think_chars: int = 512, max_string_chars: int = 256) -> str:
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, or an answer."""
    calls = f'{gbnf_literal(TOOL_CALLS + " [")} {_repeat("tc-obj", ", ", max_calls)} {gbnf_literal("]")}'
    return _grammar(tools, "tc-calls", "arguments", require_call=require_call, max_calls=max_calls, think=think,
                    max_think_chars=max_think_chars, max_string_chars=max_string_chars,
                    extra={"tc-calls": calls})
