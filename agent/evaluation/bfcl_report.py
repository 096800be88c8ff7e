"""What a run's results add up to: per-category scores, BFCL's summaries and overall as its
``generate_leaderboard_csv`` computes them (:class:`BfclReport`), the text table, the
spread over several runs, and BFCL's score files (:func:`write_score_files`).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean
from typing import Any

from .bfcl_categories import (
    FILE_PREFIX, LIVE_AST, MULTI_TURN_CATEGORIES, WEB_CATEGORIES, FORMAT_SENSITIVITY, CATEGORIES, NOT_RUN,
)
from .bfcl_format import FormatSensitivity, all_configs, format_sensitivity
from .bfcl_multiturn import WEB_NOTE
from .bfcl_score import BfclResult


# --------------------------------------------------------------------------- reporting


@dataclass(frozen=True)
class CategoryScore:
    """How one category scored: `correct` of `cases` (BFCL's runs and our own suite alike)."""

    category: str
    cases: int
    correct: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.cases if self.cases else 0.0


# BFCL's data sizes (bfcl-eval 2026.3.23), for a category not run: BFCL counts it as 0 in
# the summaries that weigh by count, and shows it as N/A.
CATEGORY_SIZES = {"simple_python": 400, "simple_java": 100, "simple_javascript": 50, "multiple": 200,
                  "parallel": 200, "parallel_multiple": 200, "live_simple": 258, "live_multiple": 1053,
                  "live_parallel": 16, "live_parallel_multiple": 24, "irrelevance": 240, "live_irrelevance": 884,
                  "live_relevance": 16, "multi_turn_base": 200, "multi_turn_miss_func": 200,
                  "multi_turn_miss_param": 200, "multi_turn_long_context": 200, "web_search_base": 100,
                  "web_search_no_snippet": 100, "memory_kv": 155, "memory_vector": 155, "memory_rec_sum": 155}
OVERALL_WEIGHTS = {"non_live": 10, "live": 10, "irrelevance": 10, "multi_turn": 30, "agentic": 40}


@dataclass(frozen=True)
class Summary:
    """One of BFCL's aggregate scores. `complete`: every category it averages was run
    (BFCL shows N/A otherwise, and counts the missing ones as 0)."""

    name: str
    accuracy: float
    total_count: int
    complete: bool
    na_if_missing: bool = True  # BFCL's display_na_if_category_missing (False for its overall_accuracy_*)
    touched: bool = True        # at least one of its categories ran (the report leaves out the others)

    @property
    def display(self) -> str:
        return f"{self.accuracy:.2%}" if self.complete or not self.na_if_missing else "N/A"

    def shown(self) -> Summary:
        return Summary(self.name, self.accuracy, self.total_count, self.complete, False, self.touched)


def _weighted(name: str, parts: Sequence[Summary]) -> Summary:
    total = sum(p.total_count for p in parts)
    return Summary(name, sum(p.accuracy * p.total_count for p in parts) / total if total else 0.0, total,
                   all(p.complete for p in parts), touched=any(p.touched for p in parts))


def _unweighted(name: str, parts: Sequence[Summary]) -> Summary:
    return Summary(name, fmean(p.accuracy for p in parts), sum(p.total_count for p in parts),
                   all(p.complete for p in parts), touched=any(p.touched for p in parts))


@dataclass(frozen=True)
class BfclReport:
    results: list[BfclResult]
    categories: dict[str, CategoryScore] = field(init=False)

    def __post_init__(self) -> None:
        by_category = {c: [r for r in self.results if r.category == c] for c in CATEGORIES}
        object.__setattr__(self, "categories", {
            c: CategoryScore(c, len(rs), sum(r.passed for r in rs)) for c, rs in by_category.items() if rs})

    def score(self, category: str) -> Summary:
        """BFCL's get_category_score: a category not run is 0 over its full size, shown N/A."""
        s = self.categories.get(category)
        if s is None:
            return Summary(category, 0.0, CATEGORY_SIZES.get(category, 0), False, touched=False)
        return Summary(category, s.accuracy, s.cases, True)

    def summaries(self) -> dict[str, Summary]:
        """BFCL's eval_runner_helper.generate_leaderboard_csv aggregates, rule for rule:
        simple averages Python, Java and JavaScript; non-live averages simple, multiple,
        parallel and parallel_multiple; live weighs its four AST categories by size;
        irrelevance averages irrelevance and live_irrelevance; multi-turn averages its
        four; agentic averages web search and memory; overall weighs non-live, live,
        irrelevance, multi-turn and agentic 10/10/10/30/40. A category not run counts 0."""
        sc = self.score
        simple = _unweighted("simple", [sc("simple_python"), sc("simple_java"), sc("simple_javascript")])
        non_live = _unweighted("non_live", [simple, sc("multiple"), sc("parallel"), sc("parallel_multiple")])
        live = _weighted("live", [sc(c) for c in LIVE_AST])
        irrelevance = _unweighted("irrelevance", [sc("irrelevance"), sc("live_irrelevance")])
        multi_turn = _unweighted("multi_turn", [sc(c) for c in MULTI_TURN_CATEGORIES])
        web = _unweighted("web_search", [sc("web_search_base"), sc("web_search_no_snippet")])
        memory = _unweighted("memory", [sc("memory_kv"), sc("memory_vector"), sc("memory_rec_sum")])
        agentic = _unweighted("agentic", [web, memory])
        non_live, live, multi_turn, agentic = non_live.shown(), live.shown(), multi_turn.shown(), agentic.shown()
        parts = {"non_live": non_live, "live": live, "irrelevance": irrelevance, "multi_turn": multi_turn,
                 "agentic": agentic}
        weight = sum(OVERALL_WEIGHTS.values())
        overall = Summary("overall", sum(parts[k].accuracy * w / weight for k, w in OVERALL_WEIGHTS.items()),
                          sum(p.total_count for p in parts.values()), all(p.complete for p in parts.values()), False,
                          any(p.touched for p in parts.values()))
        return {"overall": overall, "non_live": non_live, "simple": simple, "live": live,
                "irrelevance": irrelevance, "relevance": replace(sc("live_relevance"), name="relevance"),
                "multi_turn": multi_turn, "web_search": web, "memory": memory, "agentic": agentic}

    def format_sensitivity(self) -> FormatSensitivity | None:
        """BFCL's format_sensitivity statistics (per config; max delta, variance, std)."""
        return format_sensitivity(self.results)

    def data(self) -> dict[str, Any]:
        """The report as JSON-ready data (--json)."""
        return {
            "categories": {c: {"cases": s.cases, "correct": s.correct, "accuracy": s.accuracy}
                           for c, s in self.categories.items()},
            "summaries": {k: {"accuracy": v.accuracy, "total_count": v.total_count, "complete": v.complete}
                          for k, v in self.summaries().items()},
            "not_run": {c: why for c, why in NOT_RUN.items()},
            **({"format_sensitivity": fs.header_fields()} if (fs := self.format_sensitivity()) else {}),
            "notes": [WEB_NOTE] if any(c in self.categories for c in WEB_CATEGORIES) else [],
            "cases": len(self.results),
            "correct": sum(r.passed for r in self.results),
            "failures": [{"id": r.id, "category": r.category, "kind": r.kind, "reason": r.reason}
                         for r in self.results if not r.passed],
        }

    def score_files(self, model_name: str) -> dict[str, list[dict[str, Any]]]:
        """BFCL's score files (save_eval_results): per category ``BFCL_v4_<category>_score.json``,
        JSON lines, a header {accuracy, correct_count, total_count} then one entry per failure."""
        out = {}
        for c, s in self.categories.items():
            lines: list[dict[str, Any]] = [{"accuracy": s.accuracy, "correct_count": s.correct, "total_count": s.cases,
                                            **(fs.header_fields() if c == FORMAT_SENSITIVITY and
                                               (fs := self.format_sensitivity()) else {})}]
            lines += [{"id": r.id, "model_name": model_name, "test_category": c, "valid": False,
                       "error": [r.reason], "error_type": r.kind, "model_result_raw": r.reply}
                      for r in self.results if r.category == c and not r.passed]
            out[f"{FILE_PREFIX}{c}_score.json"] = lines
        return out


def format_bfcl_report(report: BfclReport, asked: Sequence[str] = ()) -> str:
    """The per-category table, then BFCL's summaries as its leaderboard computes them. `asked`:
    the categories the run was limited to (none: all), for which of NOT_RUN to mention."""
    width = max([len("category"), *(len(c) for c in report.categories)])
    lines = [f"{'category':<{width}}  cases  correct  accuracy"]
    for s in report.categories.values():
        lines.append(f"{s.category:<{width}}  {s.cases:>5}  {s.correct:>7}  {s.accuracy:>8.1%}")
    fs = report.format_sensitivity()
    if fs is not None:
        lines.append(f"{'':<{width}}  format sensitivity over {len(fs.by_config)} prompt formats: max delta "
                     f"{fs.max_delta:.2f}, std {fs.std:.2f} (points; in no summary, as in BFCL)")
    summaries = report.summaries()
    lines += ["", "BFCL summaries, as BFCL computes them: a category not run counts 0, and a summary missing one"
                  " is shown N/A (overall and non_live as a figure):"]
    for s in summaries.values():
        if s.touched:
            shown = s.display if s.complete else f"{s.display} (not all of its categories ran; those count 0)"
            lines.append(f"  {s.name:<12} {shown}")
    untouched = [s.name for s in summaries.values() if not s.touched]
    if untouched:
        lines.append(f"  none of the categories of {', '.join(untouched)} ran")
    cannot = {c: why for c, why in NOT_RUN.items() if not asked or c in asked}
    if cannot:
        lines.append("this harness cannot run here: " + "; ".join(f"{c} ({why})" for c, why in cannot.items()))
    if any(c in report.categories for c in WEB_CATEGORIES):
        lines.append(f"note: {WEB_NOTE}")
    return "\n".join(lines) + "\n"


def run_spread(reports: Sequence[BfclReport]) -> dict[str, dict[str, float]]:
    """Min / median / max over runs, per category and per BFCL summary (--runs N)."""
    from statistics import median

    def spread(xs: list[float]) -> dict[str, float]:
        return {"min": min(xs), "median": median(xs), "max": max(xs)}

    return {**{c: spread([r.categories[c].accuracy for r in reports if c in r.categories])
               for c in reports[0].categories},
            **{f"summary: {k}": spread([r.summaries()[k].accuracy for r in reports])
               for k, s in reports[0].summaries().items() if s.touched}}  # none of its categories ran: no row


def format_run_spread(reports: Sequence[BfclReport]) -> str:
    spread = run_spread(reports)
    width = max(len(k) for k in spread)
    lines = [f"\nover {len(reports)} runs (seeds 0..{len(reports) - 1}):", f"{'':<{width}}     min  median     max"]
    lines += [f"{k:<{width}}  {v['min']:>6.1%}  {v['median']:>6.1%}  {v['max']:>6.1%}" for k, v in spread.items()]
    return "\n".join(lines) + "\n"


def write_score_files(report: BfclReport, directory: Path, model_name: str) -> list[Path]:
    """BFCL's score files and a data_overall.csv-like summary line, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, lines in report.score_files(model_name).items():
        path = directory / name
        path.write_text("".join(json.dumps(x, ensure_ascii=False, default=str) + "\n" for x in lines),
                        encoding="utf-8")
        written.append(path)
    sums = report.summaries()
    cols = ["Overall Acc", "Non-Live AST Acc", "Live Acc", "Multi Turn Acc", "Agentic Acc", "Relevance Detection",
            "Irrelevance Detection"]
    keys = ["overall", "non_live", "live", "multi_turn", "agentic", "relevance", "irrelevance"]
    path = directory / "data_overall.csv"
    path.write_text(",".join(["Model", *cols]) + "\n" + ",".join([model_name, *(sums[k].display for k in keys)]) + "\n",
                    encoding="utf-8")
    written.append(path)
    fs = report.format_sensitivity()
    if fs is not None:  # BFCL's data_format_sensitivity.csv: its columns, its 26 configs in its order
        configs = all_configs()
        path = directory / "data_format_sensitivity.csv"
        cells = [f"{k / n * 100:.2f}%" if n else "N/A" for k, n in (fs.by_config.get(c, (0, 0)) for c in configs)]
        path.write_text(",".join(["Rank", "Model", "Format Sensitivity Max Delta", "Format Sensitivity Standard Deviation",
                                  *(f"Config {c}" for c in configs)]) + "\n"
                        + ",".join(["1", model_name, str(fs.max_delta), str(fs.std), *cells]) + "\n", encoding="utf-8")
        written.append(path)
    return written
