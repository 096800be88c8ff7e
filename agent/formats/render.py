"""Rendering a conversation into a Qwen3.5 ChatML prompt.

Tools are announced in the system turn as a ``<tools>`` block of JSON function schemas followed by
the XML calling instructions, exactly as the Qwen3.5 chat template does; tool results go back as a
*user* turn made of ``<tool_response>`` blocks. When the GGUF carries its own Jinja chat template we
render with it (sandboxed, the way Hugging Face's ``apply_chat_template`` does), so a fine-tune with
a tweaked template is honoured; otherwise :func:`render_prompt` uses a built-in renderer that
produces the same bytes as the Qwen3.5 template.

Where the template shows an assistant turn whole (Qwen3.5: every turn after the last user query,
i.e. each step of an agent run) the renderer writes its ``raw`` text verbatim instead of
re-rendering the parsed calls, so the next prompt starts with the previous prompt plus the reply,
byte for byte, and the runtime can continue from the model state it already has instead of
evaluating the conversation again.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat import (
    ASSISTANT_HEADER,
    EMPTY_THINK,
    IM_END,
    IM_START,
    TOOLS_HEADER,
    TOOLS_INSTRUCTIONS,
    ChatFormatError,
    ChatMessage,
    ToolSpec,
)
from .families import FAMILIES, FamilyFormat, ToolFamily

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
                  thinking: bool, add_generation_prompt: bool, fmt: FamilyFormat) -> str:
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
                                   add_generation_prompt=add_generation_prompt, fmt=fmt)
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
    head = text.rfind(ASSISTANT_HEADER, 0, at)
    if at < 0 or content < at or head < 0:
        return None
    return text[:head + len(ASSISTANT_HEADER)] + raw + text[content + len(_raw_marker("content", i)):]


def _render_jinja_plain(template: str, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *,
                        thinking: bool, add_generation_prompt: bool, fmt: FamilyFormat) -> str:
    # bos_token is left to the tokenizer (it adds one where the GGUF asks for it).
    try:
        return _compile_template(template).render(
            messages=[_shown(m, fmt).to_template_dict(fmt.call_id) for m in messages],
            tools=[t.to_openai() for t in tools] or None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=thinking,
            bos_token="",
            eos_token=fmt.eos_token,
        )
    except ChatFormatError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        raise ChatFormatError(f"chat template failed: {exc}") from exc


def _shown(message: ChatMessage, fmt: FamilyFormat) -> ChatMessage:
    """`message` as its family's template is shown it: a tool turn that answers no call in
    the family's `loose_result_role`."""
    if message.role == "tool" and message.tool_call_id is None and fmt.loose_result_role != "tool":
        return ChatMessage(role=fmt.loose_result_role, content=message.content)
    return message


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
            out.append(ASSISTANT_HEADER + m.raw + IM_END + "\n")  # the turn as the model wrote it
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
    family: ToolFamily = ToolFamily.QWEN35,
) -> str:
    """Render a conversation to the prompt text the model continues.

    `template` is a Jinja chat template (usually the GGUF's `tokenizer.chat_template`);
    without one the built-in Qwen3.5 renderer is used. `family` is the template's tool-calling
    family (families.py): its end-of-turn text, its control tokens (kept out of message
    text) and how it spells call ids. With `thinking=False` the generation prompt ends with
    an empty think block, as Qwen3 does. An assistant turn with `raw` text is written
    verbatim wherever the template shows the turn whole (with its thinking); elsewhere it is
    rendered from its parse like any other.
    """
    if not messages:
        raise ChatFormatError("no messages to render")
    fmt = FAMILIES[family]
    messages = [_defanged(m, fmt.control_tokens) for m in messages]
    if template:
        return _render_jinja(template, messages, tools, thinking=thinking, add_generation_prompt=add_generation_prompt,
                             fmt=fmt)
    return _render_builtin(messages, tools, thinking=thinking, add_generation_prompt=add_generation_prompt)


# The runtime tokenizes prompts with special tokens parsed (the template's own markers must
# become control tokens), so the same text inside a message would too: a goal or chat message
# from a peer could end its turn and open a system turn of its own. Message text therefore
# gets an invisible word joiner inside each control token, which breaks the token match.
_CONTROL_TOKENS = FAMILIES[ToolFamily.QWEN35].control_tokens
_WORD_JOINER = "\u2060"


def neutralize_control_tokens(text: str, tokens: Sequence[str] = _CONTROL_TOKENS) -> str:
    """`<|im_end|>` in message text -> `<\u2060|im_end|>`: readable, but never a control token.
    `tokens`: the control tokens of the model's family (ChatML's by default)."""
    for token in tokens:
        if token in text:
            text = text.replace(token, token[0] + _WORD_JOINER + token[1:])
    return text


def _defanged(message: ChatMessage, tokens: Sequence[str]) -> ChatMessage:
    content = neutralize_control_tokens(message.content, tokens)
    reasoning = None if message.reasoning is None else neutralize_control_tokens(message.reasoning, tokens)
    raw = None if message.raw is None else neutralize_control_tokens(message.raw, tokens)
    if content == message.content and reasoning == message.reasoning and raw == message.raw:
        return message
    return message.model_copy(update={"content": content, "reasoning": reasoning, "raw": raw})


def split_generation_prompt(prompt: str) -> tuple[str, str]:
    """(history, opening): the prompt is the history, ``<|im_start|>assistant\n``, then
    the opening the generation prompt already wrote of the assistant turn (``<think>\n``,
    or the empty think block). The model continues the opening, so the turn as the
    model saw it (:attr:`ChatMessage.raw`) is the opening plus the generated text; the
    history is where the runtime keeps a checkpoint of the conversation."""
    at = prompt.rfind(ASSISTANT_HEADER)
    if at < 0:
        return prompt, ""
    return prompt[:at], prompt[at + len(ASSISTANT_HEADER):]


_PREFIX_SENTINEL = "\u2063psymesh-prefix-sentinel\u2063"


def render_prefix(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (), *,
                  template: str | None = None, family: ToolFamily = ToolFamily.QWEN35) -> str:
    """The part of every prompt of this conversation that never changes: the system turn
    with the tool block. The runtime caches the model state at this boundary.

    Found by rendering a sentinel user turn and cutting before the turn that holds it
    (its family's `turn_open`), so it works for any template. Returns "" when there is no
    stable prefix.
    """
    head = [m for m in messages[:1] if m.role == "system"]
    probe = render_prompt([*head, ChatMessage.user(_PREFIX_SENTINEL)], tools, thinking=False,
                          add_generation_prompt=False, template=template, family=family)
    at = probe.find(_PREFIX_SENTINEL)
    cut = probe.rfind(FAMILIES[family].turn_open, 0, at) if at >= 0 else -1
    return probe[:cut] if cut > 0 else ""
