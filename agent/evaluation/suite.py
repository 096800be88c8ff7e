"""Function-calling evaluation: does the model pick the right tool with the right arguments?

Cases are JSON lines. A line ``{"tool": {...ToolSpec...}}`` defines a tool for the
cases after it; a case line looks like::

    {"id": "s01", "category": "single", "question": "Turn on Wi-Fi.",
     "expected": [{"name": "wifi.set", "arguments": {"enabled": [true]}}]}

`question` is a one-turn conversation; `messages` gives a longer one (earlier tool
calls and their observations: the multi-turn cases). `system` adds case facts
("Now: 2025-06-02 09:30") to the agent's system prompt. `tools` lists tool names
(default: every tool defined so far). `expected: []` means no tool fits: the model
must answer in text.

Scoring is BFCL's AST matching, by the one checker in :mod:`psymesh.agent.evaluation.bfcl`
(BFCL's own rules: exact names, required and declared parameters, Python type
strictness with int accepted for a number, BFCL's string normalisation, ``""`` among
an argument's values meaning it may be left out, several calls in any order). Around
it this format adds: a malformed reply fails, and a case with ``expected: []`` also
needs a non-empty text answer.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .bfcl import OMITTABLE, CategoryScore, ExpectedCall, check_calls
from ..formats.chatformat import ChatMessage, ToolCall, ToolSpec, parse_reply
from ..formats.families import ReplyParser
from ..acting.loop import AgentModel, default_system_prompt
from ...protocol.errors import ErrorCode, PsymeshError

__all__ = [
    "CaseResult",
    "CategoryScore",
    "EvalCase",
    "EvalCaseError",
    "EvalReport",
    "ExpectedCall",
    "OMITTABLE",
    "evaluate",
    "format_report",
    "load_cases",
]


class EvalCaseError(PsymeshError):
    """A case file that cannot be used (bad JSON, unknown tool, impossible expectation)."""

    default_code = ErrorCode.BAD_REQUEST


class EvalCase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1)
    category: str = Field(min_length=1)
    tools: list[ToolSpec]
    messages: list[ChatMessage] = Field(min_length=1)
    system: str | None = None
    expected: list[ExpectedCall]

    @model_validator(mode="after")
    def _expectation_is_possible(self) -> EvalCase:
        by_name = {t.name: t for t in self.tools}
        for exp in self.expected:
            spec = by_name.get(exp.name)
            if spec is None:
                raise ValueError(f"expected call {exp.name!r} is not among the case's tools")
            props = spec.parameters.get("properties", {})
            unknown = sorted(set(exp.arguments) - set(props))
            if unknown:
                raise ValueError(f"{exp.name}: expected arguments {unknown} are not parameters of the tool")
            for pname in spec.parameters.get("required", []):
                alts = exp.arguments.get(pname, [])
                if all(a == OMITTABLE for a in alts):
                    raise ValueError(f"{exp.name}: required argument {pname!r} needs expected values")
            empty = sorted(p for p, alts in exp.arguments.items() if not alts)
            if empty:
                raise ValueError(f"{exp.name}: arguments {empty} have no acceptable values")
        if self.messages[-1].role not in ("user", "tool"):
            raise ValueError("the conversation must end with a user turn or a tool observation")
        return self

    def conversation(self, profile: str = "phone") -> list[ChatMessage]:
        """The messages the model sees: the agent's system prompt, then the case."""
        system = default_system_prompt(profile) + (f"\n\n{self.system}" if self.system else "")
        return [ChatMessage.system(system), *self.messages]


# --------------------------------------------------------------------------- loading


def load_cases(path: str | Path) -> list[EvalCase]:
    """Read a case file (see the module docstring). Errors name the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EvalCaseError(f"cannot read {path}: {exc.strerror}", code=ErrorCode.NOT_FOUND) from None
    tools: dict[str, ToolSpec] = {}
    cases: list[EvalCase] = []
    seen: set[str] = set()
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name}:{no}"
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("each line must be a JSON object")
            if "tool" in obj:
                spec = ToolSpec.model_validate(obj["tool"])
                if spec.name in tools:
                    raise ValueError(f"tool {spec.name!r} is defined twice")
                tools[spec.name] = spec
                continue
            case = EvalCase.model_validate(_case_fields(obj, tools))
        except (ValueError, ValidationError) as exc:  # json.JSONDecodeError is a ValueError
            raise EvalCaseError(f"{where}: {exc}") from None
        if case.id in seen:
            raise EvalCaseError(f"{where}: case id {case.id!r} is used twice")
        seen.add(case.id)
        cases.append(case)
    if not cases:
        raise EvalCaseError(f"{path} holds no cases")
    return cases


def _case_fields(obj: dict[str, Any], tools: dict[str, ToolSpec]) -> dict[str, Any]:
    obj = dict(obj)
    question = obj.pop("question", None)
    if question is not None:
        if "messages" in obj:
            raise ValueError("give 'question' or 'messages', not both")
        obj["messages"] = [{"role": "user", "content": question}]
    names = obj.get("tools")
    if names is None:
        obj["tools"] = list(tools.values())
    else:
        if not isinstance(names, list):
            raise ValueError("'tools' must be a list of tool names")
        missing = [n for n in names if n not in tools]
        if missing:
            raise ValueError(f"tools {missing} are not defined above this case")
        obj["tools"] = [tools[n] for n in names]
    return obj


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class CaseResult:
    id: str
    category: str
    passed: bool
    reason: str          # "" when passed
    reply: str           # the raw model output
    calls: list[ToolCall]


@dataclass(frozen=True)
class EvalReport:
    results: list[CaseResult]
    categories: dict[str, CategoryScore] = field(init=False)

    def __post_init__(self) -> None:
        cats: dict[str, list[CaseResult]] = {}
        for r in self.results:
            cats.setdefault(r.category, []).append(r)
        object.__setattr__(self, "categories", {
            c: CategoryScore(c, len(rs), sum(r.passed for r in rs)) for c, rs in sorted(cats.items())})

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def accuracy(self) -> float:
        """Over all cases (micro average)."""
        return self.passed / self.total if self.total else 0.0


def score_reply(case: EvalCase, text: str, parse: ReplyParser = parse_reply) -> CaseResult:
    """Score one raw reply against `case`, read by `parse` (the model's tool family's parser)."""
    reply = parse(text, case.tools)
    if reply.errors:
        reason = "malformed reply: " + "; ".join(reply.errors)
    elif not case.expected and not reply.tool_calls and not reply.content:
        reason = "empty reply"
    else:
        mismatch = check_calls(reply.tool_calls, case.expected, case.tools)
        reason = mismatch.message if mismatch else ""
    return CaseResult(case.id, case.category, not reason, reason, text, list(reply.tool_calls))


async def evaluate(
    cases: Iterable[EvalCase],
    model: AgentModel,
    *,
    thinking: bool = False,
    profile: str = "phone",
    on_result: Callable[[CaseResult], Awaitable[None]] | None = None,
    parse: ReplyParser = parse_reply,
) -> EvalReport:
    """Ask `model` each case in turn and score its reply (read by `parse`, the model's tool
    family's parser). A model error fails that case only."""
    results = []
    for case in cases:
        try:
            text = await model.reply(case.conversation(profile), case.tools, thinking=thinking)
        except PsymeshError as exc:
            result = CaseResult(case.id, case.category, False, f"model error: {exc}", "", [])
        else:
            result = score_reply(case, text, parse)
        results.append(result)
        if on_result is not None:
            await on_result(result)
    return EvalReport(results)


def format_report(report: EvalReport, *, failures: bool = True) -> str:
    """Accuracy per category and overall, then (optionally) why each failed case failed."""
    width = max([len("category"), len("overall"), *(len(c) for c in report.categories)])
    lines = [f"{'category':<{width}}  cases  passed  accuracy"]
    rows = [*report.categories.values(), CategoryScore("overall", report.total, report.passed)]
    for s in rows:
        lines.append(f"{s.category:<{width}}  {s.cases:>5}  {s.correct:>6}  {s.accuracy:>8.1%}")
    failed = [r for r in report.results if not r.passed]
    if failures and failed:
        lines += ["", "failed cases:"]
        lines += [f"  {r.id} ({r.category}): {r.reason}" for r in failed]
    return "\n".join(lines)
