"""Run here or hand it to the home PC? The delegation decision of a phone node.

A pure function of facts the node gathers (what the task needs, what this
phone has, how it is doing, whether a paired home PC may take the task), so it
is decided the same way everywhere and tested as a table. Rules, first match wins:

1. the user forced a side (a forced "remote" stands even with no PC at hand:
   the delegation then fails with a clear error instead of silently running here);
2. only phones delegate: other profiles run their own tasks;
3. without a paired home PC that accepts the task, run locally (and say what
   will be missing);
4. the task needs a model or a tool the phone lacks: delegate, unless the PC is
   known to lack it too (then running anywhere is as good as here);
5. the prompt would not fit the phone's context window;
6. the phone is low on battery, then low on memory;
7. otherwise run locally: on-device is private and needs no network.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DelegationDecision", "DelegationInputs", "Rule", "decide"]

Where = Literal["local", "remote"]
Rule = Literal["forced", "not_a_phone", "no_remote", "nowhere", "missing_model", "missing_tool", "context",
               "battery_low", "memory_low", "fits_locally"]


@dataclass(frozen=True)
class DelegationInputs:
    """What the decision depends on. Sets are names; `None` for the remote's
    models/tools means "not known" (assume it has them: its manifest said yes)."""

    profile: str = "phone"
    force: Where | None = None
    remote_available: bool = False            # a paired home PC whose manifest allows this task
    needed_models: frozenset[str] = frozenset()
    local_models: frozenset[str] = frozenset()
    remote_models: frozenset[str] | None = None
    needed_tools: frozenset[str] = frozenset()
    local_tools: frozenset[str] = frozenset()
    remote_tools: frozenset[str] | None = None
    prompt_tokens: int = 0                    # estimated context the task needs
    local_context_tokens: int | None = None   # the phone model's window; None: unknown
    battery_low: bool = False
    memory_low: bool = False

    def __post_init__(self) -> None:
        for name in ("needed_models", "local_models", "remote_models", "needed_tools", "local_tools", "remote_tools"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, frozenset):
                object.__setattr__(self, name, frozenset(value))  # accept any iterable of names
        if self.force not in (None, "local", "remote"):
            raise ValueError(f"force must be 'local', 'remote' or None, not {self.force!r}")
        if self.prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")


@dataclass(frozen=True)
class DelegationDecision:
    where: Where
    reason: str   # for people (logs, `psymesh agent run` output)
    rule: Rule    # stable, for code and tests


def _names(items: frozenset[str]) -> str:
    return ", ".join(sorted(items))


def decide(inputs: DelegationInputs) -> DelegationDecision:
    """Where to run a task; see the module docstring for the rules and their order."""
    i = inputs
    if i.force == "local":
        return DelegationDecision("local", "the user asked to run it here", "forced")
    if i.force == "remote":
        caveat = "" if i.remote_available else " (but no paired home PC can take it now)"
        return DelegationDecision("remote", "the user asked to run it on the home PC" + caveat, "forced")
    if i.profile != "phone":
        return DelegationDecision("local", f"a {i.profile} node runs its own tasks", "not_a_phone")

    missing_models = i.needed_models - i.local_models
    missing_tools = i.needed_tools - i.local_tools
    too_long = i.local_context_tokens is not None and i.prompt_tokens > i.local_context_tokens
    if not i.remote_available:
        gaps = [f"model {_names(missing_models)}" if missing_models else "",
                f"tool {_names(missing_tools)}" if missing_tools else "",
                "enough context" if too_long else ""]
        lacking = "; it lacks " + ", ".join(g for g in gaps if g) if any(gaps) else ""
        return DelegationDecision("local", f"no paired home PC can take the task{lacking}", "no_remote")

    remote_lacks_models = i.remote_models is not None and not missing_models <= i.remote_models
    remote_lacks_tools = i.remote_tools is not None and not missing_tools <= i.remote_tools
    if (missing_models and remote_lacks_models) or (missing_tools and remote_lacks_tools):
        absent = (missing_models - (i.remote_models or frozenset()) if remote_lacks_models
                  else missing_tools - (i.remote_tools or frozenset()))
        return DelegationDecision("local", f"neither this phone nor the home PC has {_names(absent)}; "
                                           "running here with what there is", "nowhere")
    if missing_models:
        return DelegationDecision("remote", f"needs model {_names(missing_models)}, which this phone lacks",
                                  "missing_model")
    if missing_tools:
        return DelegationDecision("remote", f"needs tool {_names(missing_tools)}, which this phone lacks",
                                  "missing_tool")
    if too_long:
        return DelegationDecision("remote", f"needs ~{i.prompt_tokens} tokens of context; the phone model "
                                            f"holds {i.local_context_tokens}", "context")
    if i.battery_low:
        return DelegationDecision("remote", "the phone is low on battery", "battery_low")
    if i.memory_low:
        return DelegationDecision("remote", "the phone is low on memory", "memory_low")
    return DelegationDecision("local", "the phone has what the task needs", "fits_locally")
