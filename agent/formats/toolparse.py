"""Parsing a model's reply: its reasoning, its visible text and the tool calls written in it.

:func:`parse_reply` never raises: whatever the model wrote, the agent loop gets a
:class:`~psymesh.agent.formats.chat.ParsedReply` whose ``errors`` it can hand back to the model as
observations. llama-cpp-python parses neither the Qwen3.5 XML form nor the Hermes JSON form of tool
calls, hence this module.
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .chat import END_MARKERS, ParsedReply, ToolCall, ToolSpec

_FUNCTION_OPEN = re.compile(r"<function=([^>\n]*)>")
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]*)>")
_JSON_START = re.compile(r"^(?:[\[{\"]|-?\d|true\b|false\b|null\b)")
_LITERAL_EVAL_LIMIT = 10_000


def short(text: str, limit: int = 60) -> str:
    """A reply's text quoted for an error message, cut to `limit` characters."""
    text = text.replace("\n", "\\n")
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _loads(text: str) -> tuple[bool, Any]:
    try:  # strict=False: raw newlines/tabs inside JSON strings are a common small-model slip
        return True, json.loads(text, strict=False)
    except (ValueError, RecursionError):
        return False, None


def _loads_container(text: str) -> tuple[bool, Any]:
    """JSON, then Python literal syntax (small models often write {'a': 1})."""
    ok, value = _loads(text)
    if ok or len(text) > _LITERAL_EVAL_LIMIT:
        return ok, value
    try:
        return True, ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None


def _schema_types(schema: Mapping[str, Any] | None) -> list[str]:
    if not schema:
        return []
    types: list[str] = []
    t = schema.get("type")
    if isinstance(t, str):
        types.append(t)
    elif isinstance(t, list):
        types.extend(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            if isinstance(sub, Mapping):
                types.extend(_schema_types(sub))
    if not types and "enum" in schema and isinstance(schema["enum"], list):
        types.extend(sorted({_json_type(v) for v in schema["enum"]}))
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _as_type(raw: str, kind: str) -> tuple[bool, Any]:
    s = raw.strip()
    if kind == "string":
        return True, raw
    if kind == "boolean":
        low = s.lower()
        return (True, low == "true") if low in ("true", "false") else (False, None)
    if kind == "null":
        return (True, None) if s.lower() in ("null", "none") else (False, None)
    if kind in ("integer", "number"):
        ok, v = _loads(s)
        if not ok or isinstance(v, bool) or not isinstance(v, (int, float)):
            return False, None
        if kind == "integer":
            if isinstance(v, float):
                return (True, int(v)) if v.is_integer() else (False, None)
        return True, v
    if kind in ("object", "array"):
        ok, v = _loads_container(s)
        want = dict if kind == "object" else list
        if ok and isinstance(v, tuple) and kind == "array":
            v = list(v)
        return (True, v) if ok and isinstance(v, want) else (False, None)
    return False, None


def _convert_value(raw: str, schema: Mapping[str, Any] | None) -> tuple[Any, str | None]:
    """Typed value of an XML parameter: by schema when known, else JSON-looking -> JSON."""
    types = _schema_types(schema)
    if not types:
        s = raw.strip()
        if _JSON_START.match(s):
            ok, v = _loads(s)
            if ok:
                return v, None
        return raw, None
    # Try the strict types first; a string type (if allowed) is the fallback.
    for kind in sorted(set(types), key=lambda k: (k == "string", types.index(k))):
        ok, v = _as_type(raw, kind)
        if ok:
            enum = schema.get("enum") if schema else None
            if isinstance(enum, list) and v not in enum:
                return None, f"value {short(raw)} is not one of {enum}"
            return v, None
    return None, f"expected {' or '.join(dict.fromkeys(types))}, got {short(raw)}"


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parse_xml_call(body: str, tools: Mapping[str, ToolSpec] | None) -> tuple[ToolCall | None, str | None, str]:
    """Parse `<function=NAME>...</function>` at the start of `body`.

    Returns (call, error, text after </function>).
    """
    m = _FUNCTION_OPEN.match(body)
    if m is None:
        return None, f"malformed function tag {short(body)}", ""
    name = m.group(1).strip()
    end = body.find("</function>", m.end())
    if end < 0:
        return None, f"unterminated <function={name}>: no </function>", ""
    if not name:
        return None, "function tag without a name", body[end + len("</function>"):]
    inner, rest = body[m.end():end], body[end + len("</function>"):]
    spec = tools.get(name) if tools else None
    args: dict[str, Any] = {}
    pos = 0
    while True:
        while pos < len(inner) and inner[pos].isspace():
            pos += 1
        if pos >= len(inner):
            break
        pm = _PARAMETER_OPEN.match(inner, pos)
        if pm is None:
            return None, f"unexpected text in <function={name}>: {short(inner[pos:])}", rest
        pname = pm.group(1).strip()
        close = inner.find("</parameter>", pm.end())
        if close < 0:
            return None, f"<parameter={pname}> of {name} is not closed with </parameter>", rest
        raw = inner[pm.end():close]
        if "<parameter=" in raw:
            return None, f"<parameter={pname}> of {name} is not closed before the next parameter", rest
        if not pname:
            return None, f"parameter without a name in {name}", rest
        if pname in args:
            return None, f"parameter {pname!r} of {name} given twice", rest
        value, err = _convert_value(_strip_one_newline(raw), spec.property_schema(pname) if spec else None)
        if err is not None:
            return None, f"parameter {pname!r} of {name}: {err}", rest
        args[pname] = value
        pos = close + len("</parameter>")
    return ToolCall(name=name, arguments=args), None, rest


def _parse_json_call(body: str) -> tuple[ToolCall | None, str | None]:
    ok, obj = _loads(body)
    if not ok or not isinstance(obj, dict):
        return None, f"tool call is not a JSON object: {short(body)}"
    return call_from_json(obj)


def call_from_json(obj: Mapping[str, Any]) -> tuple[ToolCall | None, str | None]:
    """A call written as a JSON object: its "name", and its "arguments" (Hermes, Mistral) or
    "parameters" (Llama 3.x), maybe double-encoded as a string. (call, None) or (None, error)."""
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        ok, args = _loads(args)
        args = args if ok else None
    if not isinstance(name, str) or not name.strip():
        return None, "tool call JSON has no \"name\""
    if not isinstance(args, dict):
        return None, f"arguments of {name.strip()} are not a JSON object"
    return ToolCall(name=name.strip(), arguments=args), None


def _split_thinking(text: str, in_think: bool) -> tuple[str, str, list[str]]:
    """(thinking, rest, errors). `in_think`: the prompt already opened `<think>`."""
    close = text.find("</think>")
    open_at = text.find("<think>")
    if open_at >= 0 and (close < 0 or open_at < close):
        before, after = text[:open_at], text[open_at + len("<think>"):]
        close = after.find("</think>")
        if close < 0:
            return after.strip(), before, ["reply ended inside <think> (reasoning was not closed)"]
        return after[:close].strip(), before + after[close + len("</think>"):], []
    if close >= 0:  # the generation prompt opened the block
        return text[:close].strip(), text[close + len("</think>"):], []
    if in_think:
        return text.strip(), "", ["reply ended inside <think> (reasoning was not closed)"]
    return "", text, []


def parse_reply(text: str, tools: Sequence[ToolSpec] | None = None, *, in_think: bool = False) -> ParsedReply:
    """Split a raw completion into reasoning, visible text and tool calls. Never raises.

    Accepts the Qwen3.5 XML form and the Hermes JSON form, several calls per reply,
    and a missing `</tool_call>` when the function block itself is complete (a stop
    string may have eaten it). With `tools`, parameter values are typed by the tool's
    schema and calls to unknown tools are reported instead of returned.
    """
    thinking, rest, errors = split_reply(text, END_MARKERS, in_think)
    by_name = {t.name: t for t in tools} if tools is not None else None

    content: list[str] = []
    calls: list[ToolCall] = []
    pos = n = 0
    while pos < len(rest):
        starts = [i for i in (rest.find("<tool_call>", pos), rest.find("<function=", pos)) if i >= 0]
        if not starts:
            content.append(rest[pos:])
            break
        at = min(starts)
        content.append(rest[pos:at])
        n += 1
        if rest.startswith("<function=", at):  # a call without its <tool_call> wrapper
            call, err, after = _parse_xml_call(rest[at:], by_name)
            pos = len(rest) - len(after)
            stray = re.match(r"\s*</tool_call>", after)  # wrapper half-present
            if stray:
                pos += stray.end()
        else:
            close = rest.find("</tool_call>", at)
            body_end = close if close >= 0 else len(rest)
            body = rest[at + len("<tool_call>"):body_end].strip()
            pos = close + len("</tool_call>") if close >= 0 else len(rest)
            if body.startswith("<function="):
                call, err, after = _parse_xml_call(body, by_name)
                if err is None and after.strip():
                    call, err = None, f"unexpected text after </function>: {short(after.strip())}"
            elif body.startswith("{"):
                call, err = _parse_json_call(body)
            elif not body:
                call, err = None, "empty <tool_call>" if close >= 0 else "unterminated <tool_call>"
            else:
                call, err = None, f"unrecognised tool call {short(body)}"
            if err is not None and close < 0 and body:
                err = f"unterminated <tool_call> ({err})"
        admit_call(n, call, err, by_name, calls, errors)
    return ParsedReply(thinking=thinking, content="".join(content).strip(), tool_calls=calls, errors=errors)


def split_reply(text: str, end_markers: Sequence[str], in_think: bool) -> tuple[str, str, list[str]]:
    """(thinking, the rest, errors) of a reply cut at the first of `end_markers` (the turn's
    end, when a stop string did not already cut it)."""
    for marker in end_markers:
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    return _split_thinking(text, in_think)


def admit_call(n: int, call: ToolCall | None, err: str | None, by_name: Mapping[str, ToolSpec] | None,
               calls: list[ToolCall], errors: list[str]) -> None:
    """File the `n`-th call of a reply: an error, a call to a tool not offered (an error
    naming the offered ones), or a call."""
    if err is not None:
        errors.append(f"tool call {n}: {err}")
    elif call is not None and by_name is not None and call.name not in by_name:
        available = ", ".join(sorted(by_name)) or "none"
        errors.append(f"tool call {n}: unknown tool {call.name!r} (available: {available})")
    elif call is not None:
        calls.append(call)


def parse_plain(text: str, tools: Sequence[ToolSpec] | None = None, *, in_think: bool = False) -> ParsedReply:
    """A reply of a model that cannot call tools: reasoning and text, never a call."""
    thinking, rest, errors = split_reply(text, END_MARKERS, in_think)
    return ParsedReply(thinking=thinking, content=rest.strip(), errors=errors)
