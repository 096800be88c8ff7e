"""An infer task as generate() arguments: the chat, the tools, and how the tool choice
shapes the reply.

A peer's delegated infer task and the owner's OpenAI-compatible endpoint
(node/bridges/openai.py) describe a completion the same way (protocol.tasks.TaskSpec);
this one translation turns it into :func:`psymesh.agent.runtime.generate.generate`'s
arguments, so a request asked of a paired home renders, samples and parses exactly
as it would on this node.

The tool choice, as in OpenAI's API:

* ``auto`` (the default with tools): the tools are announced, the reply is parsed
  for calls, decoding is free (a plain answer may say anything);
* ``none``: the tools are not announced, the reply is plain text;
* ``required``: decoding is constrained (``ToolGrammar``) to one well-formed call
  of an offered tool, so even a small or random-weight model produces a valid one;
* a tool's name: only that tool is announced, and decoding is constrained to a
  call of it.

One call per reply when a call is forced (the grammar's bound, which is also what
guarantees that a babbling model reaches its end).
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from ..formats.chatformat import ChatMessage, ToolCall, ToolSpec
from .generate import GenerationError, GenerationParams, ToolGrammar
from ...protocol.tasks import ChatMessage as WireMessage
from ...protocol.tasks import TaskSpec, ToolDef

__all__ = ["InferInputs", "infer_inputs"]


@dataclass(frozen=True)
class InferInputs:
    """What generate() takes: `tools` None means no tool block and an unparsed reply."""

    messages: list[ChatMessage]
    tools: list[ToolSpec] | None
    params: GenerationParams


def infer_inputs(spec: TaskSpec, max_tokens: int) -> InferInputs:
    """The infer task `spec` (its params untrusted: a peer's, or an HTTP client's) as
    generate() arguments. A conversation or tool that cannot be rendered is a
    GenerationError (BAD_REQUEST) naming what is wrong."""
    params = GenerationParams.from_untrusted(spec.params, max_tokens=max_tokens)
    if spec.prompt is not None:
        messages = [ChatMessage.user(spec.prompt)]
    else:
        messages = _messages(spec.messages or [])
    choice = spec.tool_choice or "auto"
    if not spec.tools or choice == "none":
        return InferInputs(messages, None, params)
    tools = [_tool(t) for t in spec.tools]
    if choice == "auto":
        return InferInputs(messages, tools, params)
    if choice != "required":
        tools = [t for t in tools if t.name == choice]  # the task's validator made sure it is one of them
    if params.grammar is not None:
        raise GenerationError("give a grammar or a tool_choice that forces a call, not both")
    forced = ToolGrammar(require_call=True, max_calls=1)
    return InferInputs(messages, tools, params.model_copy(update={"tool_grammar": forced}))


def _tool(tool: ToolDef) -> ToolSpec:
    try:
        return ToolSpec(name=tool.name, description=tool.description, parameters=dict(tool.parameters))
    except ValidationError as exc:
        problems = "; ".join(e["msg"] for e in exc.errors(include_url=False))
        raise GenerationError(f"tool {tool.name!r} cannot be offered to the model: {problems}") from None


def _messages(turns: list[WireMessage]) -> list[ChatMessage]:
    """The wire's turns as the chat format's; a tool turn gets the name of the call it
    answers (the template shows results by position, but names help the parser)."""
    names: dict[str, str] = {}
    out: list[ChatMessage] = []
    for m in turns:
        calls = tuple(ToolCall(id=c.id, name=c.name, arguments=dict(c.arguments)) for c in m.tool_calls or ())
        names.update((c.id, c.name) for c in calls)
        name = m.name
        if m.role == "tool" and name is None and m.tool_call_id is not None:
            name = names.get(m.tool_call_id)
        out.append(ChatMessage(role=m.role, content=m.content, name=name, tool_calls=calls,  # type: ignore[arg-type]
                               tool_call_id=m.tool_call_id))
    return out
