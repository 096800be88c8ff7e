"""The delegation decision of a phone node, as a table of situations."""
from __future__ import annotations

import pytest

from psymesh.agent.acting.policy import DelegationInputs, decide

PHONE = dict(profile="phone", remote_available=True, local_models=frozenset({"botpsy-0.8b"}),
             local_tools=frozenset({"wifi.set", "messages.send"}), local_context_tokens=4096)

CASES = [
    # (name, inputs, where, rule)
    ("fits", {}, "local", "fits_locally"),
    ("forced local beats everything", dict(force="local", battery_low=True, needed_models={"qwen-7b"}),
     "local", "forced"),
    ("forced remote", dict(force="remote"), "remote", "forced"),
    ("forced remote with no PC stands", dict(force="remote", remote_available=False), "remote", "forced"),
    ("home nodes do not delegate", dict(profile="home", battery_low=True), "local", "not_a_phone"),
    ("home node forced remote", dict(profile="home", force="remote"), "remote", "forced"),
    ("no PC: local even when lacking", dict(remote_available=False, needed_tools={"files.search"}),
     "local", "no_remote"),
    ("no PC: local even on low battery", dict(remote_available=False, battery_low=True), "local", "no_remote"),
    ("missing model", dict(needed_models={"qwen-7b"}), "remote", "missing_model"),
    ("missing model the PC has", dict(needed_models={"qwen-7b"}, remote_models={"qwen-7b"}),
     "remote", "missing_model"),
    ("missing model nobody has", dict(needed_models={"qwen-7b"}, remote_models={"llama-3b"}), "local", "nowhere"),
    ("model the phone has", dict(needed_models={"botpsy-0.8b"}), "local", "fits_locally"),
    ("missing tool", dict(needed_tools={"files.search", "wifi.set"}), "remote", "missing_tool"),
    ("missing tool nobody has", dict(needed_tools={"files.search"}, remote_tools={"files.read"}),
     "local", "nowhere"),
    ("too long for the phone", dict(prompt_tokens=9000), "remote", "context"),
    ("exactly fits the context", dict(prompt_tokens=4096), "local", "fits_locally"),
    ("unknown context size", dict(prompt_tokens=9000, local_context_tokens=None), "local", "fits_locally"),
    ("low battery", dict(battery_low=True), "remote", "battery_low"),
    ("low memory", dict(memory_low=True), "remote", "memory_low"),
    ("capability gap outranks battery", dict(battery_low=True, needed_tools={"files.read"}),
     "remote", "missing_tool"),
]


@pytest.mark.parametrize(("overrides", "where", "rule"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(overrides: dict, where: str, rule: str) -> None:
    decision = decide(DelegationInputs(**{**PHONE, **overrides}))
    assert (decision.where, decision.rule) == (where, rule)
    assert decision.reason


def test_reasons_name_what_is_missing() -> None:
    assert "qwen-7b" in decide(DelegationInputs(**{**PHONE, "needed_models": {"qwen-7b"}})).reason
    lonely = decide(DelegationInputs(**{**PHONE, "remote_available": False, "needed_tools": {"files.read"},
                                        "prompt_tokens": 10_000}))
    assert "files.read" in lonely.reason and "context" in lonely.reason
    assert "llama-3b" not in decide(DelegationInputs(**{**PHONE, "needed_models": {"qwen-7b", "llama-3b"},
                                                         "remote_models": {"llama-3b"}})).reason


def test_inputs_are_checked_and_normalised() -> None:
    assert DelegationInputs(needed_tools=["a", "a"]).needed_tools == frozenset({"a"})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DelegationInputs(force="elsewhere")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DelegationInputs(prompt_tokens=-1)
