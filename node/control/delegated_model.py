"""A model on a paired peer, as an :class:`~psymesh.agent.acting.loop.AgentModel`: each reply is
one delegated infer task (``Client.delegate(peer, infer=..., tools=...)``).

`psymesh eval --via PEER` asks the peer's model this way, so a phone can score the model
of its home. The task carries what a local run gives ``agent.runtime.generate``: the chat (calls
and tool results included), the tools, and the sampling params a peer may set; a tool
grammar travels as its rules (``tool_grammar``), and the peer builds the GBNF for its
model's tool-calling family (agent/formats/families.py) as ``generate`` builds it here, so the
peer decodes under the same constraint and a greedy run gives the same replies, and
scores, as a local one (its result says the family: :meth:`PeerFamily.parse` reads
replies with that family's parser).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...agent.formats.chatformat import ChatMessage, ParsedReply, ToolSpec
from ...agent.formats.families import FAMILIES, ToolFamily
from ...agent.runtime.generate import GenerationParams
from .client import Client

__all__ = ["DelegatedModel", "PeerFamily"]


def _wire_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


@dataclass
class PeerFamily:
    """A peer model's tool family, as its results with tools say (a node from before families
    says none: then Qwen3.5's, which reads the Hermes form too); the DelegatedModels asking
    one model share it, and an eval reads their replies with :meth:`parse`."""

    family: ToolFamily = ToolFamily.QWEN35

    def parse(self, text: str, tools: Sequence[ToolSpec] | None = None, *, in_think: bool = False) -> ParsedReply:
        return FAMILIES[self.family].parse(text, tools, in_think=in_think)


@dataclass
class DelegatedModel:
    """Replies from `model` on the paired node `peer` (name or peer id), asked through
    `client` (this node's control socket). `params` as for a local LlamaAgentModel."""

    client: Client
    peer: str
    model: str | None
    params: GenerationParams
    deadline_s: float | None = None  # each reply's task fails (timeout) this long after its acceptance
    family: PeerFamily = field(default_factory=PeerFamily)

    def _peer_params(self, tools: Sequence[ToolSpec], thinking: bool) -> dict[str, Any]:
        p = self.params
        out: dict[str, Any] = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
                               "thinking": thinking, "ban_bytes": p.ban_bytes}
        if p.seed is not None:
            out["seed"] = p.seed
        if p.stop:
            out["stop"] = list(p.stop)
        if p.max_think_tokens is not None:
            out["max_think_tokens"] = p.max_think_tokens
        if p.tool_grammar is not None and tools:  # without tools the reply is a plain answer anyway
            out["tool_grammar"] = p.tool_grammar.model_dump()
        elif p.grammar is not None:
            out["grammar"] = p.grammar
        return out

    async def reply(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *,
                    thinking: bool = False) -> str:
        task = await self.client.delegate(
            self.peer, infer=[_wire_message(m) for m in messages], model=self.model,
            max_tokens=self.params.max_tokens, params=self._peer_params(tools, thinking), deadline_s=self.deadline_s,
            tools=[{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools] or None)
        result = await task.result()
        if result.tool_family in {f.value for f in ToolFamily}:  # a node of before families: not said
            self.family.family = ToolFamily(result.tool_family)
        return result.text
