"""The function-calling evaluation harness on the shipped case file, with scripted models
whose accuracy is known in advance. The argument checker it scores with is BFCL's
(agent/evaluation/bfcl.py); its edge cases are tested in tests/test_bfcl.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from psymesh.agent.evaluation.suite import (
    OMITTABLE,
    EvalCase,
    EvalCaseError,
    evaluate,
    format_report,
    load_cases,
)
from psymesh.agent.acting.loop import ScriptedModel, tool_call_text

CASES_FILE = Path(__file__).parent.parent / "examples" / "eval_cases.jsonl"


@pytest.fixture(scope="module")
def cases() -> list[EvalCase]:
    return load_cases(CASES_FILE)


def perfect_reply(case: EvalCase) -> str:
    if not case.expected:
        return "I can't do that with the tools I have, but here is what I know."
    calls = []
    for exp in case.expected:
        args = {}
        for name, alts in exp.arguments.items():
            given = [a for a in alts if a != OMITTABLE]
            if given:
                args[name] = given[-1]  # the last alternative: every listed value must score
        calls.append(tool_call_text(exp.name, args))
    return "\n".join(calls)


def test_case_file_covers_the_categories(cases: list[EvalCase]) -> None:
    counts = {c: sum(x.category == c for x in cases) for c in ("single", "multi_turn", "no_tool")}
    assert counts == {"single": 13, "multi_turn": 9, "no_tool": 6}
    assert {t.name for t in cases[0].tools} >= {"wifi.set", "messages.send", "calendar.add", "reminders.add",
                                                 "weather.current"}
    history = next(c for c in cases if c.id == "multi-delete-biggest").messages
    assert [m.role for m in history] == ["user", "assistant", "tool", "assistant", "tool"]
    assert history[1].tool_calls[0].name == "messages.send"


@pytest.mark.anyio
async def test_a_perfect_model_scores_100(cases: list[EvalCase]) -> None:
    model = ScriptedModel(perfect_reply(c) for c in cases)
    report = await evaluate(cases, model)
    assert [r.reason for r in report.results if not r.passed] == []
    assert {c: s.accuracy for c, s in report.categories.items()} == {"multi_turn": 1.0, "no_tool": 1.0, "single": 1.0}
    assert report.accuracy == 1.0 and model.remaining == 0
    # The model saw the agent's system prompt, the case's facts and only the case's tools.
    reminder = cases.index(next(c for c in cases if c.id == "single-reminder"))
    messages, tools = model.seen[reminder]
    assert "You are BotPsy" in messages[0].content and "2025-06-02" in messages[0].content
    assert tools == tuple(cases[reminder].tools)


def wrong_reply(case: EvalCase, index_in_category: int) -> str:
    """Known mistakes: every other single-turn case calls the wrong tool; multi-turn cases
    give up with a text answer; no-tool cases are answered with a malformed call, an
    unknown tool, a needless call, then correctly three times."""
    if case.category == "single":
        if index_in_category % 2 == 0:
            return perfect_reply(case)
        return tool_call_text("wifi.status" if case.expected[0].name != "wifi.status" else "storage.status")
    if case.category == "multi_turn":
        return "Done."
    return ["<tool_call>\n<function=wifi.set>\n", tool_call_text("pizza.order", {"size": "large"}),
            tool_call_text("wifi.status")][index_in_category] if index_in_category < 3 else "Sorry, I can't."


@pytest.mark.anyio
async def test_a_flawed_model_scores_exactly_as_expected(cases: list[EvalCase]) -> None:
    seen: dict[str, int] = {}
    replies = []
    for case in cases:
        replies.append(wrong_reply(case, seen.get(case.category, 0)))
        seen[case.category] = seen.get(case.category, 0) + 1
    report = await evaluate(cases, ScriptedModel(replies))

    scores = {c: (s.correct, s.cases) for c, s in report.categories.items()}
    assert scores == {"single": (7, 13), "multi_turn": (2, 9), "no_tool": (3, 6)}
    assert (report.passed, report.total) == (12, 28)
    reasons = {r.id: r.reason for r in report.results}
    assert reasons["single-wifi-off"] == "called wifi.status, expected wifi.set"
    assert reasons["multi-wifi-after-no-network"] == "expected wifi.set, got no tool call"
    assert reasons["none-arithmetic"].startswith("malformed reply: tool call 1: unterminated")
    assert "unknown tool 'pizza.order'" in reasons["none-joke"]
    assert reasons["none-pizza"] == "expected no tool call, got wifi.status"

    text = format_report(report)
    lines = text.splitlines()
    assert lines[0].split() == ["category", "cases", "passed", "accuracy"]
    assert lines[1].split() == ["multi_turn", "9", "2", "22.2%"]
    assert lines[2].split() == ["no_tool", "6", "3", "50.0%"]
    assert lines[3].split() == ["single", "13", "7", "53.8%"]
    assert lines[4].split() == ["overall", "28", "12", "42.9%"]
    assert "  single-wifi-off (single): called wifi.status, expected wifi.set" in lines
    assert "failed" not in format_report(report, failures=False)


@pytest.mark.anyio
async def test_a_model_error_fails_only_its_case(cases: list[EvalCase]) -> None:
    report = await evaluate(cases[:3], ScriptedModel([perfect_reply(cases[0])]))
    assert [r.passed for r in report.results] == [True, False, False]
    assert report.results[1].reason.startswith("model error:")


# --------------------------------------------------------------------------- case files

TOOL_LINE = ('{"tool": {"name": "wifi.set", "parameters": {"type": "object", "properties": '
             '{"enabled": {"type": "boolean"}}, "required": ["enabled"]}}}')


@pytest.mark.parametrize(("lines", "message"), [
    ([TOOL_LINE, "{not json"], "cases.jsonl:2:"),
    ([TOOL_LINE, '{"id": "a", "category": "single", "question": "Hi", '
                 '"expected": [{"name": "wifi.toggle", "arguments": {}}]}'], "not among the case's tools"),
    ([TOOL_LINE, '{"id": "a", "category": "single", "question": "Hi", "expected": '
                 '[{"name": "wifi.set", "arguments": {"enabled": [""]}}]}'], "required argument 'enabled'"),
    ([TOOL_LINE, '{"id": "a", "category": "single", "question": "Hi", "tools": ["nope"], "expected": []}'],
     "not defined above"),
    ([TOOL_LINE, '{"id": "a", "category": "x", "question": "Hi", "expected": []}',
      '{"id": "a", "category": "x", "question": "Yo", "expected": []}'], "used twice"),
    ([TOOL_LINE, TOOL_LINE], "defined twice"),
    ([TOOL_LINE], "holds no cases"),
])
def test_bad_case_files_are_refused_with_the_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(EvalCaseError, match=message):
        load_cases(path)


def test_missing_case_file_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(EvalCaseError, match="cannot read"):
        load_cases(tmp_path / "nope.jsonl")


@pytest.mark.anyio
async def test_harness_runs_a_real_model(cases: list[EvalCase], tmp_path_factory: pytest.TempPathFactory) -> None:
    """The tiny random-weight GGUF scores near zero, but every reply is scored, none is malformed."""
    from psymesh.agent.runtime.generate import GenerationParams, ToolGrammar
    from psymesh.agent.acting.loop import LlamaAgentModel
    from psymesh.agent.runtime.api import ModelSettings
    from psymesh.agent.runtime.worker import ModelWorker
    from psymesh.agent.runtime.testmodel import tiny_model_path

    path = tiny_model_path(tmp_path_factory.getbasetemp() / "models")
    async with ModelWorker(ModelSettings(path=path, n_ctx=8192, n_threads=2)) as worker:
        model = LlamaAgentModel(worker, GenerationParams(
            max_tokens=120, temperature=1.0, seed=1, tool_grammar=ToolGrammar(max_string_chars=16),
            logit_bias={t: float("-inf") for t in range(128, 256)}))
        report = await evaluate(cases[:3], model)
    assert report.total == 3 and all(r.reply for r in report.results)
    assert not [r for r in report.results if r.reason.startswith(("malformed", "model error"))]
