"""The chat of Qwen3.5-family models (BotPsy-0.8B) as data: messages, tool calls, tool specs, a
parsed reply, and the ChatML markers and tool-calling instructions the template writes.

Rendering a conversation into a prompt is render.py's job and parsing a reply is toolparse.py's;
both build on these models. An assistant turn can carry its ``raw`` text: the turn exactly as the
model produced it, which the renderer writes back verbatim (see render.py).
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ...protocol.errors import ErrorCode, PsymeshError


Role = Literal["system", "user", "assistant", "tool"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
END_MARKERS = (IM_END, "<|endoftext|>")
# Tool and parameter names: a letter or "_", then letters, digits, "_", "." or "-", in any script
# (real schemas name parameters "año_vehiculo" or "件数"); never "<", ">", "=", quotes, spaces or
# newlines, so a name cannot break out of a `<function=NAME>` / `<parameter=NAME>` tag, and a GBNF
# literal carries it as UTF-8 (agent/formats/grammar.py escapes only quotes, backslashes and controls).
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
ASSISTANT_HEADER = IM_START + "assistant\n"


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

    def to_template_dict(self, call_id: Callable[[str], str] = str) -> dict[str, Any]:
        """The Hugging Face message shape chat templates are written against; `call_id`
        spells a call id as the template wants it (Mistral's: 9 letters or digits)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            d["reasoning_content"] = self.reasoning
        if self.tool_calls:
            d["tool_calls"] = [{"id": call_id(c.id), "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = call_id(self.tool_call_id)
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
