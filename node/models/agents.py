"""Agent runs on a node: the same loop (agent/acting/loop.py) whether the owner runs a goal here
(`psymesh agent run`) or a paired phone delegates one (an `agent` task).

The node supplies what the loop must not decide for itself: which model, which tools
(this node's profile), which limits a peer may set, and how an irreversible call is
confirmed (the person at the CLI, or the submitter through `input-required`).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...agent.runtime.generate import GenerationParams, ToolGrammar
from ...agent.acting.loop import AgentConfig, AgentEvent, AgentResult, Confirm, Emit, LlamaAgentModel, run_agent
from ...agent.acting.tools import ToolContext, ToolRegistry
from ..core.home import NodeConfig, NodeHome
from . import ModelPool, ModelRegistry
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.manifest import Manifest, Operation, check
from ...protocol.tasks import AgentTaskResult, AgentToolCall, EventKind

if TYPE_CHECKING:
    from ...agent.runtime.api import TextModel

# What a delegating peer may set, and the most it may ask for. A peer never sets the
# system prompt: that is where the node's own rules live.
PEER_MAX_STEPS = 32

TaskEmit = Callable[..., Awaitable[None]]
Ask = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


def node_tools(home: NodeHome, config: NodeConfig, environ: Mapping[str, str] = os.environ) -> ToolRegistry:
    """The tools this node offers: built-ins for its profile, the phone's on a phone (each
    through the device's own commands where `environ`'s PATH has them and config `device` is
    "auto", else through a simulated phone, so phone scenarios run anywhere), and any
    installed `psymesh.tools` plugins."""
    from ...agent.acting.builtin_tools import default_registry
    from ...agent.acting.tools import load_entry_points

    phone = None
    if config.profile == "phone":
        from ...agent.acting.device import DeviceState, Phone
        from ...agent.acting.device_commands import detect_phone

        device = DeviceState(home.private_file("device.db"))  # born 0600, like all of the home
        phone = Phone.simulated(device) if config.device == "simulated" else \
            detect_phone(device, lambda name: shutil.which(name, path=environ.get("PATH")))
    registry = default_registry(config.profile, phone=phone)
    load_entry_points(registry)
    return registry


class PeerAgentParams(BaseModel):
    """The params a delegating peer may set, type-checked: they come from another machine,
    so a wrong type is the peer's BAD_REQUEST, not a crash here. None (or absent) keeps
    the default of agent_config()/llama_model(); unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str | None = None
    max_steps: int | None = Field(default=None, ge=1)
    thinking: bool | None = None
    deadline_s: float | None = Field(default=None, ge=0)
    grammar: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    seed: int | None = None
    ban_bytes: bool | None = None
    tools: bool | None = None  # False: run without tools (for a model that cannot call them)


def peer_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A peer's agent params, checked (PsymeshError BAD_REQUEST naming each bad one)."""
    try:
        checked = PeerAgentParams.model_validate(dict(params))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'params'}: {e['msg']}"
                             for e in exc.errors(include_url=False))
        raise PsymeshError(f"bad agent params: {problems}", code=ErrorCode.BAD_REQUEST) from None
    return checked.model_dump(exclude_none=True)


def offered_tools(params: Mapping[str, Any], tools: ToolRegistry) -> ToolRegistry:
    """The tools a run offers its model: `tools`, or none when its params say "tools": false
    (`agent run --no-tools`, for a model whose template cannot call tools)."""
    return tools if params.get("tools", True) else ToolRegistry()


def agent_config(params: Mapping[str, Any], *, from_peer: bool) -> AgentConfig:
    """Loop limits from task params (a peer's are clamped; see PEER_MAX_STEPS)."""
    max_steps = int(params.get("max_steps", 8))
    if from_peer:
        max_steps = min(max_steps, PEER_MAX_STEPS)
    return AgentConfig(max_steps=max_steps, thinking=bool(params.get("thinking", False)),
                       deadline_s=params.get("deadline_s"))


def pick_model(registry: ModelRegistry, requested: str | None, default: str | None,
               profile: str = "home", *, tools: bool = True) -> str:
    """The model a run here uses: `requested`, else the node's default, else the first one
    registered (with `tools`, the first that can call tools, if any can: a chat-only model
    added beside a tool-calling one does not take its runs); NOT_FOUND naming what to do (on
    a phone, the model usually lives on its home PC, so the hint says how to run there
    rather than to add the model here)."""
    name = requested or default
    try:
        if name:
            registry.get(name)  # NOT_FOUND with the known names
            return name
        names = registry.names()
        if not names:
            raise PsymeshError("no model on this node for the agent; add one with: "
                               f"{registry.commands('model add', 'NAME PATH.gguf')}",
                               code=ErrorCode.NOT_FOUND)
        callers = [r["name"] for r in registry.list() if r.get("tool_family") != "none"] if tools else []
        return callers[0] if callers else names[0]
    except PsymeshError as exc:
        if profile != "phone":
            raise
        wanted = name or "NAME"
        raise PsymeshError(
            f"{exc.message.split('; add one with')[0]}; on a phone the model usually lives on the home PC: "
            f"run there with --delegate auto (agent run), or task send --to HOME --infer ... --model {wanted}; "
            f"to run it here instead: {registry.commands('model add', f'{wanted} PATH.gguf')}", code=exc.code) from None


def llama_model(worker: TextModel, params: Mapping[str, Any]) -> LlamaAgentModel:
    """The agent's model with a run's params (a peer's already checked by peer_params):
    grammar-constrained tool calls unless `grammar` is false."""
    return LlamaAgentModel(worker, GenerationParams(
        max_tokens=int(params.get("max_tokens", 512)), temperature=float(params.get("temperature", 0.7)),
        seed=params.get("seed"), ban_bytes=bool(params.get("ban_bytes", False)),
        tool_grammar=ToolGrammar() if params.get("grammar", True) else None))


def task_event(ev: AgentEvent) -> tuple[EventKind, dict[str, Any]] | None:
    """An agent step as a task event (the RESULT event carries the final answer)."""
    d = ev.data
    if ev.kind == "tool_call":
        return EventKind.TOOL_CALL, {"name": d["name"], "id": d.get("id"), "arguments": d.get("arguments", {})}
    if ev.kind == "tool_result":
        keep = {k: d[k] for k in ("name", "id", "ok", "status", "result", "error") if k in d}
        return EventKind.TOOL_RESULT, keep
    if ev.kind == "final":
        return None
    return EventKind.PROGRESS, {"agent": ev.kind, **{k: v for k, v in d.items() if k != "arguments"}}


def result_of(run: AgentResult) -> dict[str, Any]:
    """The task's `result` (AgentTaskResult, as the submitter's SDK reads it)."""
    return AgentTaskResult(answer=run.answer, stopped=run.stopped, steps=run.steps, tool_calls=[
        AgentToolCall(name=r.call.name, arguments=r.call.arguments, status=r.status) for r in run.tool_calls
    ]).model_dump(mode="json")


class AgentTaskRunner:
    """Runs delegated `agent` tasks on the executing node (TaskExecutor.agent_runner)."""

    def __init__(self, models: ModelPool, tools: ToolRegistry, profile: str, share_dir: str | None,
                 default_model: str | None = None) -> None:
        self.models = models
        self.tools = tools
        self.profile = profile
        self.share_dir = share_dir
        self.default_model = default_model

    async def __call__(self, rec: Any, emit: TaskEmit, ask: Ask | None, tools: ToolRegistry) -> dict[str, Any]:
        """A delegated `agent` task, with `tools`: those the submitter's grant covers."""
        spec = rec.spec
        confirm: Confirm | None = None
        if ask is not None:
            async def confirm(call: Any, tool: Any) -> bool:
                answer = await ask(f"allow {call.name} (irreversible) with {call.arguments}?",
                                   {"tool_call": {"name": call.name, "arguments": call.arguments}})
                return bool(answer.get("approve"))

        async def on_event(ev: AgentEvent) -> None:
            mapped = task_event(ev)
            if mapped is not None:
                await emit(mapped[0], mapped[1])

        return await self.run(spec.goal, spec.params, peer_id=rec.submitter, deadline=rec.deadline,
                              tools=tools, confirm=confirm, emit=on_event)

    async def run(self, goal: str, params: Mapping[str, Any], *, peer_id: str, deadline: float | None,
                  tools: ToolRegistry | None = None, confirm: Confirm | None = None,
                  emit: Emit | None = None) -> dict[str, Any]:
        """One agent run for a peer: its params checked and clamped, with this node's
        tools (or `tools`, a subset), until `deadline` (Unix s). An `agent` task and an
        `msg.ask` letter (node/messaging/answering.py) both come here."""
        params = peer_params(params)
        worker = await self.models.get(pick_model(self.models.registry, params.get("model"), self.default_model,
                                                  tools=params.get("tools", True)))
        ctx = ToolContext(share_dir=Path(self.share_dir) if self.share_dir else None, profile=self.profile,
                          peer_id=peer_id, deadline=deadline)
        run = await run_agent(goal, model=llama_model(worker, params),
                              tools=offered_tools(params, self.tools if tools is None else tools),
                              ctx=ctx, profile=self.profile, config=agent_config(params, from_peer=True),
                              confirm=confirm, emit=emit)
        return result_of(run)


def granted_tools(tools: ToolRegistry, grant: Manifest | None, *, local_peer_id: str, peer_id: str,
                  now: float) -> ToolRegistry:
    """The tools `grant` lets `peer_id` call on this node, each checked as a `tool:` operation:
    what an agent run for that peer (a delegated `agent` task, an `ask`) may be offered."""
    if grant is None:
        return ToolRegistry([])
    return ToolRegistry(t for t in tools if check(grant, Operation.tool_call(t.name), local_peer_id=local_peer_id,
                                                  remote_peer_id=peer_id, now=now).allowed)

