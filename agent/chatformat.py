"""Chat format of Qwen3.5-family models (BotPsy-0.8B): prompt rendering and reply parsing.

Prompts are ChatML. Tools are announced in the system turn as a ``<tools>`` block of
JSON function schemas followed by the XML calling instructions, exactly as the
Qwen3.5 chat template does; tool results go back as a *user* turn made of
``<tool_response>`` blocks. When the GGUF carries its own Jinja chat template we
render with it (sandboxed, the way Hugging Face's ``apply_chat_template`` does), so a
fine-tune with a tweaked template is honoured; otherwise :func:`render_prompt` uses a
built-in renderer that produces the same bytes as the Qwen3.5 template.

Replies are parsed by :func:`parse_reply`, which never raises: whatever the model
wrote, the agent loop gets a :class:`ParsedReply` whose ``errors`` it can hand back
to the model as observations. llama-cpp-python parses neither the Qwen3.5 XML form
nor the Hermes JSON form of tool calls, hence this module.

An assistant turn can also carry its ``raw`` text: the turn exactly as the model
produced it (the generation prompt's opening, then every generated character).
Where the template shows the turn whole (Qwen3.5: every turn after the last user
query, i.e. each step of an agent run) the renderer writes it verbatim instead of
re-rendering the parsed calls, so the next prompt starts with the previous prompt
plus the reply, byte for byte, and the runtime can continue from the model state it
already has instead of evaluating the conversation again.
"""
from __future__ import annotations

import ast
import functools
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..protocol.errors import ErrorCode, PsymeshError

__all__ = [
    "ChatFormatError",
    "ChatMessage",
    "ParsedReply",
    "Role",
    "ToolCall",
    "ToolSpec",
    "parse_reply",
    "render_prefix",
    "render_prompt",
    "split_generation_prompt",
]

Role = Literal["system", "user", "assistant", "tool"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_END_MARKERS = (IM_END, "<|endoftext|>")
# Tool and parameter names: a letter or "_", then letters, digits, "_", "." or "-", in any script
# (real schemas name parameters "año_vehiculo" or "件数"); never "<", ">", "=", quotes, spaces or
# newlines, so a name cannot break out of a `<function=NAME>` / `<parameter=NAME>` tag, and a GBNF
# literal carries it as UTF-8 (agent/grammar.py escapes only quotes, backslashes and controls).
_NAME_RE = r"^[^\W\d][\w.\-]{0,63}$"

# The calling instructions of the Qwen3.5 / Qwen3-Coder template, verbatim in effect:
# the model was trained on these bytes, so any drift costs accuracy.
TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\n"
    "multiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"
THINK_CLOSE = "\n</think>\n\n"  # how the template closes a thought: what a cut-short one is closed with
TOOL_CALL_CLOSE = "</tool_call>"
_ASSISTANT_HEADER = IM_START + "assistant\n"


class ChatFormatError(PsymeshError):
    """A conversation that cannot be rendered (bad roles, template failure)."""

    default_code = ErrorCode.BAD_REQUEST


def _new_call_id() -> str:
    return f"call_{secrets.token_hex(6)}"


class ToolCall(BaseModel):
    """One call the model asked for. Qwen3.5 has no call ids; ours pair results with calls."""

    model_config = ConfigDict(frozen=True)

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str = Field(default_factory=_new_call_id)


class ToolSpec(BaseModel):
    """A tool as the model sees it: name, description and a JSON schema for arguments.

    `irreversible` never reaches the prompt; the agent loop uses it to ask before acting.
    """

    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=_NAME_RE)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    irreversible: bool = False

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        # Parameter names become `<parameter=NAME>` tags and grammar literals: keep them tame.
        if v.get("type", "object") != "object":
            raise ValueError("tool parameters must be a JSON schema of type 'object'")
        props = v.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError("'properties' must be an object")
        for key in props:
            if not re.match(_NAME_RE, key):
                raise ValueError(f"parameter name {key!r} must match {_NAME_RE}")
        return v

    def property_schema(self, param: str) -> dict[str, Any] | None:
        prop = self.parameters.get("properties", {}).get(param)
        return prop if isinstance(prop, dict) else None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI-style function object chat templates expect (key order matters)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class ChatMessage(BaseModel):
    """One turn. `reasoning` is an assistant's `<think>` text; tool turns carry the result.

    `raw` (assistant turns only) is the turn as the model wrote it, opening included
    (see :func:`split_generation_prompt`); content, reasoning and calls are its parse.
    """

    model_config = ConfigDict(frozen=True)

    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    raw: str | None = None

    @model_validator(mode="after")
    def _raw_is_an_assistant_turn(self) -> ChatMessage:
        if self.raw is not None and self.role != "assistant":
            raise ValueError("only an assistant turn has raw model text")
        return self

    @classmethod
    def system(cls, content: str) -> ChatMessage:
        return cls(role="system", content=content)

    @classmethod
    def user(cls, content: str) -> ChatMessage:
        return cls(role="user", content=content)

    @classmethod
    def assistant(cls, content: str = "", *, reasoning: str | None = None,
                  tool_calls: Sequence[ToolCall] = (), raw: str | None = None) -> ChatMessage:
        return cls(role="assistant", content=content, reasoning=reasoning, tool_calls=tuple(tool_calls), raw=raw)

    @classmethod
    def tool(cls, call: ToolCall, content: str) -> ChatMessage:
        return cls(role="tool", content=content, tool_call_id=call.id, name=call.name)

    def to_template_dict(self) -> dict[str, Any]:
        """The Hugging Face message shape chat templates are written against."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            d["reasoning_content"] = self.reasoning
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


class ParsedReply(BaseModel):
    """What the model said: reasoning, visible text, calls, and everything that went wrong."""

    model_config = ConfigDict(frozen=True)

    thinking: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list)

    def to_message(self, raw: str | None = None) -> ChatMessage:
        """The assistant turn to append to the history; `raw`: the text this reply was
        parsed from, as the model wrote it (:attr:`ChatMessage.raw`)."""
        return ChatMessage.assistant(self.content, reasoning=self.thinking or None, tool_calls=self.tool_calls,
                                     raw=raw)


# --------------------------------------------------------------------------- rendering


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Hugging Face's `tojson`: plain json.dumps, no HTML escaping (unlike Jinja's own)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatFormatError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _render_jinja(template: str, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *,
                  thinking: bool, add_generation_prompt: bool) -> str:
    """Render with the template; assistant turns with `raw` text go in verbatim where the
    template shows them whole.

    A template knows nothing of raw text, so each such turn is first rendered as a pair
    of markers (reasoning and content). Where both come out in order after the turn's
    ``<|im_start|>assistant\n``, the template shows the turn whole and that span is
    replaced by the raw text; where the reasoning marker is missing (the template drops
    the thinking of turns before the last user query), the turn is rendered again from
    its parse, exactly as the template renders any turn.
    """
    verbatim = {i for i, m in enumerate(messages) if m.raw is not None}
    while True:
        probe = [_raw_markers(i) if i in verbatim else m for i, m in enumerate(messages)]
        text = _render_jinja_plain(template, probe, tools, thinking=thinking,
                                   add_generation_prompt=add_generation_prompt)
        spliced: str | None = text
        for i in sorted(verbatim):
            spliced = _splice_raw(spliced, i, messages[i].raw or "")
            if spliced is None:
                verbatim.discard(i)
                break
        if spliced is not None:
            return spliced


def _raw_marker(kind: str, i: int) -> str:
    return f"\u2063psymesh-raw-{kind}-{i}\u2063"


def _raw_markers(i: int) -> ChatMessage:
    return ChatMessage.assistant(_raw_marker("content", i), reasoning=_raw_marker("reasoning", i))


def _splice_raw(text: str, i: int, raw: str) -> str | None:
    """`text` with turn `i`'s marked span replaced by `raw`; None if the template did not
    show that turn whole (its reasoning is missing, or the shape is not a ChatML turn)."""
    at = text.find(_raw_marker("reasoning", i))
    content = text.find(_raw_marker("content", i))
    head = text.rfind(_ASSISTANT_HEADER, 0, at)
    if at < 0 or content < at or head < 0:
        return None
    return text[:head + len(_ASSISTANT_HEADER)] + raw + text[content + len(_raw_marker("content", i)):]


def _render_jinja_plain(template: str, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *,
                        thinking: bool, add_generation_prompt: bool) -> str:
    try:
        return _compile_template(template).render(
            messages=[m.to_template_dict() for m in messages],
            tools=[t.to_openai() for t in tools] or None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=thinking,
            bos_token="",
            eos_token=IM_END,
        )
    except ChatFormatError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        raise ChatFormatError(f"chat template failed: {exc}") from exc


def _is_tool_response_turn(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def _render_argument(value: Any) -> str:
    # The template writes mappings/sequences as JSON and everything else with Jinja's
    # `string` filter, i.e. str(): booleans come out as True/False.
    if isinstance(value, (Mapping, list, tuple)):
        return _tojson(value)
    return str(value)


def _render_builtin(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *,
                    thinking: bool, add_generation_prompt: bool) -> str:
    out: list[str] = []
    first_system = messages[0].content.strip() if messages[0].role == "system" else None
    if tools:
        out.append(IM_START + "system\n" + TOOLS_HEADER)
        out.extend("\n" + _tojson(t.to_openai()) for t in tools)
        out.append(TOOLS_INSTRUCTIONS)
        if first_system:
            out.append("\n\n" + first_system)
        out.append(IM_END + "\n")
    elif first_system is not None:
        out.append(IM_START + "system\n" + first_system + IM_END + "\n")

    last_query = -1
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "user" and not _is_tool_response_turn(m.content.strip()):
            last_query = i
            break
    if last_query < 0:
        raise ChatFormatError("no user query found in messages")

    for i, m in enumerate(messages):
        content = m.content.strip()
        if m.role == "system":
            if i != 0:
                raise ChatFormatError("a system message must come first")
        elif m.role == "user":
            out.append(IM_START + "user\n" + content + IM_END + "\n")
        elif m.role == "assistant" and m.raw is not None and i > last_query:
            out.append(_ASSISTANT_HEADER + m.raw + IM_END + "\n")  # the turn as the model wrote it
        elif m.role == "assistant":
            if m.reasoning is not None:
                reasoning = m.reasoning
            elif "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            else:
                reasoning = ""
            if i > last_query:  # reasoning of the current multi-step turn stays visible
                out.append(IM_START + "assistant\n<think>\n" + reasoning.strip() + "\n</think>\n\n" + content)
            else:
                out.append(IM_START + "assistant\n" + content)
            for k, call in enumerate(m.tool_calls):
                if k == 0:
                    out.append("\n\n<tool_call>\n" if content.strip() else "<tool_call>\n")
                else:
                    out.append("\n<tool_call>\n")
                out.append(f"<function={call.name}>\n")
                for key, value in call.arguments.items():
                    out.append(f"<parameter={key}>\n{_render_argument(value)}\n</parameter>\n")
                out.append("</function>\n</tool_call>")
            out.append(IM_END + "\n")
        else:  # tool results are folded into one user turn of <tool_response> blocks
            if i > 0 and messages[i - 1].role != "tool":
                out.append(IM_START + "user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1].role != "tool":
                out.append(IM_END + "\n")

    if add_generation_prompt:
        out.append(IM_START + "assistant\n" + ("<think>\n" if thinking else EMPTY_THINK))
    return "".join(out)


def render_prompt(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] = (),
    *,
    thinking: bool,
    add_generation_prompt: bool = True,
    template: str | None = None,
) -> str:
    """Render a conversation to the prompt text the model continues.

    `template` is a Jinja chat template (usually the GGUF's `tokenizer.chat_template`);
    without one the built-in Qwen3.5 renderer is used. With `thinking=False` the
    generation prompt ends with an empty think block, as Qwen3 does. An assistant turn
    with `raw` text is written verbatim wherever the template shows the turn whole
    (with its thinking); elsewhere it is rendered from its parse like any other.
    """
    if not messages:
        raise ChatFormatError("no messages to render")
    messages = [_defanged(m) for m in messages]
    if template:
        return _render_jinja(template, messages, tools, thinking=thinking, add_generation_prompt=add_generation_prompt)
    return _render_builtin(messages, tools, thinking=thinking, add_generation_prompt=add_generation_prompt)


# The runtime tokenizes prompts with special tokens parsed (the template's own markers must
# become control tokens), so the same text inside a message would too: a goal or chat message
# from a peer could end its turn and open a system turn of its own. Message text therefore
# gets an invisible word joiner inside each control token, which breaks the token match.
_CONTROL_TOKENS = (IM_START, IM_END, "<|endoftext|>")
_WORD_JOINER = "\u2060"


def neutralize_control_tokens(text: str) -> str:
    """`<|im_end|>` in message text -> `<\u2060|im_end|>`: readable, but never a control token."""
    for token in _CONTROL_TOKENS:
        if token in text:
            text = text.replace(token, token[0] + _WORD_JOINER + token[1:])
    return text


def _defanged(message: ChatMessage) -> ChatMessage:
    content = neutralize_control_tokens(message.content)
    reasoning = None if message.reasoning is None else neutralize_control_tokens(message.reasoning)
    raw = None if message.raw is None else neutralize_control_tokens(message.raw)
    if content == message.content and reasoning == message.reasoning and raw == message.raw:
        return message
    return message.model_copy(update={"content": content, "reasoning": reasoning, "raw": raw})


def split_generation_prompt(prompt: str) -> tuple[str, str]:
    """(history, opening): the prompt is the history, ``<|im_start|>assistant\n``, then
    the opening the generation prompt already wrote of the assistant turn (``<think>\n``,
    or the empty think block). The model continues the opening, so the turn as the
    model saw it (:attr:`ChatMessage.raw`) is the opening plus the generated text; the
    history is where the runtime keeps a checkpoint of the conversation."""
    at = prompt.rfind(_ASSISTANT_HEADER)
    if at < 0:
        return prompt, ""
    return prompt[:at], prompt[at + len(_ASSISTANT_HEADER):]


_PREFIX_SENTINEL = "\u2063psymesh-prefix-sentinel\u2063"


def render_prefix(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (), *,
                  template: str | None = None) -> str:
    """The part of every prompt of this conversation that never changes: the system turn
    with the tool block. The runtime caches the model state at this boundary.

    Found by rendering a sentinel user turn and cutting before its `<|im_start|>`, so it
    works for any ChatML template. Returns "" when there is no stable prefix.
    """
    head = [m for m in messages[:1] if m.role == "system"]
    probe = render_prompt([*head, ChatMessage.user(_PREFIX_SENTINEL)], tools, thinking=False,
                          add_generation_prompt=False, template=template)
    at = probe.find(_PREFIX_SENTINEL)
    cut = probe.rfind(IM_START, 0, at) if at >= 0 else -1
    return probe[:cut] if cut > 0 else ""


# --------------------------------------------------------------------------- parsing

_FUNCTION_OPEN = re.compile(r"<function=([^>\n]*)>")
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]*)>")
_JSON_START = re.compile(r"^(?:[\[{\"]|-?\d|true\b|false\b|null\b)")
_LITERAL_EVAL_LIMIT = 10_000


def _short(text: str, limit: int = 60) -> str:
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
                return None, f"value {_short(raw)} is not one of {enum}"
            return v, None
    return None, f"expected {' or '.join(dict.fromkeys(types))}, got {_short(raw)}"


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
        return None, f"malformed function tag {_short(body)}", ""
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
            return None, f"unexpected text in <function={name}>: {_short(inner[pos:])}", rest
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
        return None, f"tool call is not a JSON object: {_short(body)}"
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
    for marker in _END_MARKERS:
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    thinking, rest, errors = _split_thinking(text, in_think)
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
                    call, err = None, f"unexpected text after </function>: {_short(after.strip())}"
            elif body.startswith("{"):
                call, err = _parse_json_call(body)
            elif not body:
                call, err = None, "empty <tool_call>" if close >= 0 else "unterminated <tool_call>"
            else:
                call, err = None, f"unrecognised tool call {_short(body)}"
            if err is not None and close < 0 and body:
                err = f"unterminated <tool_call> ({err})"
        if err is not None:
            errors.append(f"tool call {n}: {err}")
        elif call is not None and by_name is not None and call.name not in by_name:
            available = ", ".join(sorted(by_name)) or "none"
            errors.append(f"tool call {n}: unknown tool {call.name!r} (available: {available})")
        elif call is not None:
            calls.append(call)
    return ParsedReply(thinking=thinking, content="".join(content).strip(), tool_calls=calls, errors=errors)
