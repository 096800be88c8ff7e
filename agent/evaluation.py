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

Scoring is BFCL's AST matching: the reply is parsed (never executed) and each call
must have the expected name; every argument it gives must be a declared parameter
listed in `expected` and equal one of the alternatives; every required parameter
must be given; an expected parameter may be left out only if it is optional and
its alternatives include ``""`` (BFCL's "may be omitted"). Values compare leniently
by type where that is safe: ``1 == 1.0``, but ``"1" != 1`` and ``true != 1``;
strings ignore case, spaces and the punctuation ``,./-_*^'"!?:;``. Several
expected calls match in any order.
"""
from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from psymesh.agent.chatformat import ChatMessage, ToolCall, ToolSpec, parse_reply
from psymesh.agent.loop import AgentModel, default_system_prompt
from psymesh.protocol.errors import ErrorCode, PsymeshError

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
    "match_call",
    "match_calls",
    "values_equal",
]

OMITTABLE = ""  # among an argument's alternatives: the argument may be left out (BFCL)
_STRING_NOISE = re.compile(r"[\s,./\-_*^'\"!?:;]")


class EvalCaseError(PsymeshError):
    """A case file that cannot be used (bad JSON, unknown tool, impossible expectation)."""

    default_code = ErrorCode.BAD_REQUEST


class ExpectedCall(BaseModel):
    """One call the model should make: each argument maps to its acceptable values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    arguments: dict[str, list[Any]] = Field(default_factory=dict)


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
                alts = exp.arguments.get(pname)
                if not alts or all(_omittable(a) for a in alts):
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


# --------------------------------------------------------------------------- matching


def _norm(text: str) -> str:
    return _STRING_NOISE.sub("", text).casefold()


def values_equal(got: Any, want: Any) -> bool:
    """Equality for checking arguments: numbers by value, strings leniently, no
    cross-type matches ("1" vs 1, true vs 1); lists in order, objects by key."""
    if isinstance(got, bool) or isinstance(want, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return got == want
    if isinstance(got, str) and isinstance(want, str):
        return _norm(got) == _norm(want)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(values_equal(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(values_equal(got[k], want[k]) for k in got)
    return got is None and want is None


def _omittable(alt: Any) -> bool:
    return isinstance(alt, str) and alt == OMITTABLE


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def match_call(call: ToolCall, expected: ExpectedCall, spec: ToolSpec) -> str | None:
    """None if `call` matches, else why not (for the report)."""
    if call.name != expected.name:
        return f"called {call.name}, expected {expected.name}"
    props = spec.parameters.get("properties", {})
    missing = sorted(set(spec.parameters.get("required", [])) - set(call.arguments))
    if missing:
        return f"{call.name}: missing required argument {', '.join(missing)}"
    for pname, value in call.arguments.items():
        if pname not in props:
            return f"{call.name}: unknown argument {pname!r}"
        if pname not in expected.arguments:
            return f"{call.name}: unexpected argument {pname}={_show(value)}"
        alts = [a for a in expected.arguments[pname] if not _omittable(a)]
        if not any(values_equal(value, alt) for alt in alts):
            return f"{call.name}: {pname}={_show(value)}, expected {' or '.join(_show(a) for a in alts) or 'nothing'}"
    for pname, alts in expected.arguments.items():
        if pname not in call.arguments and not any(_omittable(a) for a in alts):
            return f"{call.name}: missing argument {pname!r}"
    return None


def match_calls(calls: Sequence[ToolCall], expected: Sequence[ExpectedCall], specs: Sequence[ToolSpec]) -> str | None:
    """None if `calls` are exactly the expected calls, in any order; else why not."""
    if len(calls) != len(expected):
        if not expected:
            return f"expected no tool call, got {', '.join(c.name for c in calls)}"
        if not calls:
            return f"expected {', '.join(e.name for e in expected)}, got no tool call"
        return f"expected {len(expected)} call(s), got {len(calls)}"
    by_name = {s.name: s for s in specs}
    first_reason: str | None = None

    def assign(i: int, free: list[int]) -> bool:  # backtracking: a handful of calls at most
        nonlocal first_reason
        if i == len(calls):
            return True
        for k in free:
            spec = by_name.get(expected[k].name)
            reason = match_call(calls[i], expected[k], spec) if spec else f"no tool {expected[k].name!r}"
            if reason is None:
                if assign(i + 1, [j for j in free if j != k]):
                    return True
            elif first_reason is None:
                first_reason = reason
        return False

    return None if assign(0, list(range(len(expected)))) else (first_reason or "calls do not match")


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
class CategoryScore:
    category: str
    total: int
    passed: int

    @property
    def accuracy(self) -> float:
        return self.passed / self.total if self.total else 0.0


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


def score_reply(case: EvalCase, text: str) -> CaseResult:
    """Score one raw reply against `case`."""
    reply = parse_reply(text, case.tools)
    if reply.errors:
        reason = "malformed reply: " + "; ".join(reply.errors)
    elif not case.expected and not reply.tool_calls and not reply.content:
        reason = "empty reply"
    else:
        reason = match_calls(reply.tool_calls, case.expected, case.tools) or ""
    return CaseResult(case.id, case.category, not reason, reason, text, list(reply.tool_calls))


async def evaluate(
    cases: Iterable[EvalCase],
    model: AgentModel,
    *,
    thinking: bool = False,
    profile: str = "phone",
    on_result: Callable[[CaseResult], Awaitable[None]] | None = None,
) -> EvalReport:
    """Ask `model` each case in turn and score its reply. A model error fails that case only."""
    results = []
    for case in cases:
        try:
            text = await model.reply(case.conversation(profile), case.tools, thinking=thinking)
        except PsymeshError as exc:
            result = CaseResult(case.id, case.category, False, f"model error: {exc}", "", [])
        else:
            result = score_reply(case, text)
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
        lines.append(f"{s.category:<{width}}  {s.total:>5}  {s.passed:>6}  {s.accuracy:>8.1%}")
    failed = [r for r in report.results if not r.passed]
    if failures and failed:
        lines += ["", "failed cases:"]
        lines += [f"  {r.id} ({r.category}): {r.reason}" for r in failed]
    return "\n".join(lines)
