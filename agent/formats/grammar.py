"""GBNF grammars that make a model's next turn a well-formed Qwen3.5 tool call.

A 0.8B model gets the tool-call syntax right most of the time; "most" is not good
enough for an agent that acts on it. Constrained decoding removes the failure
mode: tool names can only be the offered tools, each tool's parameters and their
order come from its JSON schema, and simple values are constrained (enums,
booleans, integers, numbers, short strings without '<'). Structured object/array
values go through llama-cpp-python's own JSON-schema converter; free-form ones
("type": "object" without properties) are limited to flat JSON.

Everything is bounded (string lengths, item counts, reasoning length), so even a
model that babbles reaches the end of the grammar, and the grammar describes only
what the model writes after the generation prompt: the output always parses with
:func:`psymesh.agent.formats.chatformat.parse_reply`.
"""
from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from .chat import ToolSpec

__all__ = ["ThinkMode", "bounded_schema", "gbnf_literal", "json_rules", "reply_rules", "schema_converter",
           "tool_call_grammar"]

ThinkMode = Literal["none", "empty", "bounded"]


@functools.cache
def schema_converter() -> Any:
    """llama-cpp-python's JSON-schema -> GBNF converter, without the native library.

    `llama_cpp/llama_grammar.py` is pure Python (it imports only the standard library),
    but importing it as `llama_cpp.llama_grammar` first runs `llama_cpp/__init__`, which
    loads libllama (~37 MB of the daemon's memory, for good) into the node's process,
    where no model runs any more (node/models/runner.py). So the file is loaded alone."""
    package = importlib.util.find_spec("llama_cpp")  # finds the package without running it
    if package is None or not package.submodule_search_locations:
        raise ImportError("llama-cpp-python is not installed")
    path = Path(next(iter(package.submodule_search_locations))) / "llama_grammar.py"
    spec = importlib.util.spec_from_file_location("psymesh.agent._llama_grammar", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SchemaConverter

# Characters allowed in free text: anything but '<' (no tag can start) and the
# C0 controls other than tab and newline.
_TEXT_CHAR = r"[^<\x00-\x08\x0B-\x1F]"
_MAX_ITEMS = 16  # items in arrays / entries in free-form objects


def gbnf_literal(text: str) -> str:
    """A GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _render_enum_value(value: Any) -> str:
    # How the parser reads values back: strings raw, everything else as JSON.
    return value if isinstance(value, str) else json.dumps(value)


def bounded_schema(schema: Any, max_string_chars: int) -> Any:
    """A copy of `schema` whose strings and arrays have upper bounds and whose objects
    admit only their declared properties, so a babbling model still terminates."""
    if isinstance(schema, list):
        return [bounded_schema(s, max_string_chars) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_schema(v, max_string_chars) if k in ("items", "anyOf", "oneOf", "allOf") else v
           for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: bounded_schema(v, max_string_chars) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "string" in types and "enum" not in schema and "const" not in schema:
        out["maxLength"] = min(int(schema.get("maxLength", max_string_chars)), max_string_chars)
    if "array" in types:
        out["maxItems"] = min(int(schema.get("maxItems", _MAX_ITEMS)), _MAX_ITEMS)
    return out


def _free_json_rules(max_string_chars: int) -> dict[str, str]:
    """Free-form objects/arrays: flat, bounded, JSON. Enough for "options"-style arguments."""
    return {
        "tc-free-object": f'"{{" (tc-free-kv (", " tc-free-kv){{0,{_MAX_ITEMS - 1}}})? "}}"',
        "tc-free-kv": 'tc-free-key ": " tc-free-scalar',
        "tc-free-key": '"\\"" [a-zA-Z0-9_]{1,32} "\\""',
        "tc-free-array": f'"[" (tc-free-scalar (", " tc-free-scalar){{0,{_MAX_ITEMS - 1}}})? "]"',
        "tc-free-scalar": 'tc-free-string | tc-free-number | "true" | "false" | "null"',
        "tc-free-string": f'"\\"" ([^"\\\\\\x00-\\x1F<]){{0,{max_string_chars}}} "\\""',
        "tc-free-number": '"-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,15})?',
    }


class _Builder:
    def __init__(self, max_string_chars: int) -> None:
        self.rules: dict[str, str] = {}
        self.max_string_chars = max_string_chars
        self._json = schema_converter()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self._json_used = False

    def add(self, name: str, body: str) -> str:
        self.rules[name] = body
        return name

    def string_rule(self, schema: dict[str, Any]) -> str:
        lo = max(0, int(schema.get("minLength", 0)))
        hi = min(int(schema.get("maxLength", self.max_string_chars)), self.max_string_chars)
        hi = max(hi, lo)
        return self.add(f"tc-str-{lo}-{hi}", f"{_TEXT_CHAR}{{{lo},{hi}}}")

    def value_rule(self, name: str, schema: dict[str, Any] | None) -> str:
        """A rule for one parameter value, written the way parse_reply reads it back."""
        schema = schema or {}
        if "const" in schema:
            return self.add(name, gbnf_literal(_render_enum_value(schema["const"])))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.add(name, " | ".join(gbnf_literal(_render_enum_value(v)) for v in schema["enum"]))
        alternatives = [s for s in (schema.get("anyOf") or schema.get("oneOf") or []) if isinstance(s, dict)]
        if alternatives:
            subs = [self.value_rule(f"{name}-{k}", s) for k, s in enumerate(alternatives)]
            return self.add(name, " | ".join(subs))
        types = schema.get("type")
        if isinstance(types, list):
            subs = [self.value_rule(f"{name}-{k}", {**schema, "type": t}) for k, t in enumerate(types)]
            return self.add(name, " | ".join(subs))
        if types == "boolean":
            return self.add(name, '"true" | "false"')
        if types == "null":
            return self.add(name, '"null"')
        if types in ("integer", "number"):
            sign = "" if isinstance(schema.get("minimum"), (int, float)) and schema["minimum"] >= 0 else '"-"? '
            body = f'{sign}("0" | [1-9] [0-9]{{0,15}})'
            if types == "number":
                body += ' ("." [0-9]{1,15})?'
            return self.add(name, body)
        if types == "object" and not isinstance(schema.get("properties"), dict):
            return self.add(name, "tc-free-object")  # free-form: bounded generic shape
        if types == "array" and not isinstance(schema.get("items"), dict):
            return self.add(name, "tc-free-array")
        if types in ("object", "array"):
            self._json_used = True
            return self._json.visit(self._json.resolve_refs(bounded_schema(schema, self.max_string_chars), ""), name)
        return self.add(name, self.string_rule(schema))

    def grammar(self) -> str:
        if any(body in ("tc-free-object", "tc-free-array") for body in self.rules.values()):
            self.rules.update(_free_json_rules(self.max_string_chars))
        lines = [f"{name} ::= {body}" for name, body in self.rules.items()]
        if self._json_used:
            lines.extend(json_rules(self._json))
        return "\n".join(lines) + "\n"


def json_rules(converter: Any) -> list[str]:
    """The rules a JSON-schema converter built, its string characters narrowed: valid JSON
    has no raw controls, and a '<' could end the call early (``</parameter>``, ``</tool_call>``,
    where the runtime stops after the last call)."""
    lines = []
    for line in converter.format_grammar().splitlines():
        if line.startswith("char ::= "):
            line = line.replace(r'[^"\\', r'[^"\\<\x00-\x1F', 1)
        lines.append(line)
    return lines


def tool_call_grammar(
    tools: Sequence[ToolSpec],
    *,
    require_call: bool = False,
    max_calls: int = 1,
    think: ThinkMode = "none",
    max_think_chars: int = 512,
    max_string_chars: int = 256,
) -> str:
    """GBNF for the model's reply: tool call(s) for `tools`, or (unless `require_call`)
    a plain final answer that contains no tags.

    `think` describes what comes first: "none" when the prompt already holds the
    empty think block (``render_prompt(thinking=False)``); "empty" to have the model
    close a just-opened ``<think>`` at once; "bounded" for at most `max_think_chars`
    of reasoning before ``</think>``. String values are capped at `max_string_chars`
    even where the schema allows more: the cap is what guarantees termination.
    """
    if not tools and require_call:
        raise ValueError("require_call needs at least one tool")
    if max_calls < 1:
        raise ValueError("max_calls must be >= 1")
    b = _Builder(max_string_chars)
    functions = []
    for i, tool in enumerate(tools):
        params = tool.parameters.get("properties", {})
        required = set(tool.parameters.get("required", []))
        parts = [gbnf_literal(f"<function={tool.name}>\n")]
        for j, (pname, pschema) in enumerate(params.items()):
            value = b.value_rule(f"tc-v-{i}-{j}", pschema if isinstance(pschema, dict) else None)
            open_tag, close_tag = gbnf_literal(f"<parameter={pname}>\n"), gbnf_literal("\n</parameter>\n")
            param = b.add(f"tc-p-{i}-{j}", f"{open_tag} {value} {close_tag}")
            parts.append(param if pname in required else f"{param}?")
        parts.append(gbnf_literal("</function>\n"))
        functions.append(b.add(f"tc-fn-{i}", " ".join(parts)))

    calls = None
    if functions:
        call_open, call_close, newline = gbnf_literal("<tool_call>\n"), gbnf_literal("</tool_call>"), gbnf_literal("\n")
        b.add("tc-call", f"{call_open} ({' | '.join(functions)}) {call_close}")
        more = f" ({newline} tc-call){{0,{max_calls - 1}}}" if max_calls > 1 else ""
        calls = b.add("tc-calls", "tc-call" + more)
    b.rules.update(reply_rules(think, max_think_chars, calls, require_call))
    return b.grammar()


def reply_rules(think: ThinkMode, max_think_chars: int, calls: str | None, require_call: bool) -> dict[str, str]:
    """The rules around the calls, the same for every family: what comes first (`think`,
    as :func:`tool_call_grammar` says), then the rule `calls` or (unless `require_call`)
    a plain answer. `root` is the reply."""
    rules = {"root": "tc-think tc-reply" if think != "none" else "tc-reply"}
    if think == "empty":
        rules["tc-think"] = gbnf_literal("\n</think>\n\n")
    elif think == "bounded":
        rules["tc-think"] = f"{_TEXT_CHAR}{{0,{max_think_chars}}} " + gbnf_literal("</think>\n\n")
    # Answer: non-empty, starts with a visible character, never opens a tag ("a < b" is fine).
    rules["tc-answer"] = r'[^<\x00-\x20] tc-answer-char*'
    rules["tc-answer-char"] = f'{_TEXT_CHAR} | "<" [ =0-9]'
    rules["tc-reply"] = calls if calls is not None and require_call else \
        f"{calls} | tc-answer" if calls is not None else "tc-answer"
    return rules
