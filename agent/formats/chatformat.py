"""Chat format of Qwen3.5-family models (BotPsy-0.8B): an index of its three modules.

* chat.py: the data (messages, tool calls, tool specs, a parsed reply, the ChatML markers and the
  tool-calling instructions the model was trained on);
* render.py: a conversation into a prompt, with the GGUF's own Jinja template (sandboxed) or a
  built-in renderer that writes the same bytes, raw assistant turns verbatim;
* toolparse.py: a reply into reasoning, text and tool calls, never raising.

Many callers import these names from here, so this module keeps them.
"""
from __future__ import annotations

from .chat import (
    EMPTY_THINK,
    IM_END,
    IM_START,
    THINK_CLOSE,
    TOOL_CALL_CLOSE,
    ChatFormatError,
    ChatMessage,
    ParsedReply,
    Role,
    ToolCall,
    ToolSpec,
)
from .render import neutralize_control_tokens, render_prefix, render_prompt, split_generation_prompt
from .toolparse import parse_reply

__all__ = [
    "EMPTY_THINK",
    "IM_END",
    "IM_START",
    "THINK_CLOSE",
    "TOOL_CALL_CLOSE",
    "ChatFormatError",
    "ChatMessage",
    "ParsedReply",
    "Role",
    "ToolCall",
    "ToolSpec",
    "neutralize_control_tokens",
    "parse_reply",
    "render_prefix",
    "render_prompt",
    "split_generation_prompt",
]
