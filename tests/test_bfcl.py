"""`psymesh eval --bfcl`: BFCL v4's own files scored with BFCL's own AST-checker rules.

The oracle (the ground truth written as a model writes calls) goes through the real
render -> parse -> check path and must score 100% on every shipped category: a harness
that loses a correct answer would make every model's score wrong. The checker tests
mirror BFCL's ast_checker.py rule by rule, each named after the BFCL error_type it
reproduces. The data is the installed bfcl-eval's (scripts/bootstrap.sh installs it); the
other categories, and the cross-check against bfcl-eval's own checker, are in
tests/test_bfcl_v4.py.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from psymesh.agent.evaluation.bfcl import (
    CATEGORIES,
    FLOAT_NOTE,
    NOT_RUN,
    PYTHON_HINT,
    BfclCase,
    BfclDataError,
    BfclReport,
    ExpectedCall,
    Mismatch,
    check_call,
    check_calls,
    default_data_dir,
    format_bfcl_report,
    generation_params,
    load_bfcl,
    oracle_reply,
    run_bfcl,
    score_reply,
    standardize_string,
    tool_spec,
)
from psymesh.agent.formats.chatformat import ChatMessage, ToolCall
from psymesh.agent.acting.loop import ScriptedModel, tool_call_text
from psymesh.agent.runtime.testmodel import SPECIAL_TOKENS

CASE_COUNTS = {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200, "irrelevance": 240}
FIVE = tuple(CASE_COUNTS)  # the categories the first version ran; tests/test_bfcl_v4.py covers the rest


@pytest.fixture(scope="module")
def bfcl_dir() -> Path:
    return default_data_dir()  # the installed bfcl-eval's data (scripts/bootstrap.sh installs it)


# --------------------------------------------------------------------------- the oracle, end to end


@pytest.mark.anyio
@pytest.mark.parametrize("category", FIVE)
async def test_the_oracle_scores_100_percent(bfcl_dir: Path, category: str) -> None:
    cases = load_bfcl(bfcl_dir, [category])
    assert len(cases) == CASE_COUNTS[category]
    model = ScriptedModel(oracle_reply(c) for c in cases)
    report = await run_bfcl(cases, model)

    assert [(r.id, r.reason) for r in report.results if not r.passed] == []
    score = report.categories[category]
    assert (score.cases, score.correct, score.accuracy) == (CASE_COUNTS[category], CASE_COUNTS[category], 1.0)
    assert model.remaining == 0
    # Each reply answered the prompt rendered from the case: its question and every function offered.
    for case, prompt in zip(cases, model.prompts, strict=True):
        assert case.messages[-1].content.strip() in prompt
        assert all(f'"name": "{t.name}"' in prompt for t in case.tools)
    if category != "irrelevance":  # the oracle's calls came back through the parser, one per expected call
        assert [len(r.calls) for r in report.results] == [len(c.expected or ()) for c in cases]


def test_the_report_averages_the_ast_categories_unweighted(bfcl_dir: Path) -> None:
    cases = load_bfcl(bfcl_dir, FIVE, limit=4)
    assert {c.category for c in cases} == set(FIVE) and len(cases) == 20
    replies = {c.id: oracle_reply(c) for c in cases}
    for case in cases:  # one simple, two multiple, four parallel answers wrong: 3/4, 2/4, 0/4, 4/4
        if (case.category, int(case.id.rsplit("_", 1)[1])) in {("simple_python", 0), ("multiple", 0),
                                                               ("multiple", 1)} or case.category == "parallel":
            replies[case.id] = "I cannot say."
    report = BfclReport([score_reply(c, replies[c.id]) for c in cases])
    assert {c: s.correct for c, s in report.categories.items()} == {
        "simple_python": 3, "multiple": 2, "parallel": 0, "parallel_multiple": 4, "irrelevance": 4}
    # BFCL's simple averages Python with Java and JavaScript (not run here: 0).
    assert report.summaries()["non_live"].accuracy == pytest.approx((0.75 / 3 + 0.5 + 0.0 + 1.0) / 4)
    data = report.data()
    assert data["summaries"]["non_live"]["complete"] is False
    assert data["cases"] == 20 and data["correct"] == 13 and len(data["failures"]) == 7
    assert data["failures"][0] == {"id": "simple_python_0", "category": "simple_python",
                                   "kind": "parallel_function_checker_no_order:wrong_count",
                                   "reason": "expected calculate_triangle_area, got no tool call"}
    lines = format_bfcl_report(report).splitlines()
    assert lines[0].split() == ["category", "cases", "correct", "accuracy"]
    assert lines[1].split() == ["simple_python", "4", "3", "75.0%"]
    assert lines[3].split() == ["parallel", "4", "0", "0.0%"]
    assert lines[8].split()[:2] == ["overall", "9.38%"]  # (10 * 0.4375 + 10 * (1.0 + 0) / 2) / 100
    # a summary none of whose categories ran is named as such, not shown as a score of 0.00 %
    shown = {line.split()[0] for line in lines[8:] if line.startswith("  ") and "%" in line or "N/A" in line}
    assert "multi_turn" not in shown and "agentic" not in shown and "live" not in shown
    assert any(line.strip().startswith("none of the categories of live, relevance, multi_turn") for line in lines), lines


def test_every_case_has_a_tool_grammar(bfcl_dir: Path) -> None:
    """A model run constrains calls by each case's converted schemas: every case's grammar builds."""
    from psymesh.agent.formats.grammar import tool_call_grammar

    params = generation_params(grammar=True)
    assert params.tool_grammar is not None and params.tool_grammar.max_calls >= 8  # parallel has up to 8 calls
    for case in load_bfcl(bfcl_dir, FIVE):
        assert "tc-calls" in tool_call_grammar(case.tools, max_calls=params.tool_grammar.max_calls)


@pytest.mark.anyio
async def test_a_real_model_is_asked_and_scored(bfcl_dir: Path, tiny_model: Path) -> None:
    """The random-weight GGUF scores near zero, but every case is asked and scored."""
    from psymesh.agent.acting.loop import LlamaAgentModel
    from psymesh.agent.runtime.api import ModelSettings
    from psymesh.agent.runtime.worker import ModelWorker

    cases = load_bfcl(bfcl_dir, ["parallel", "irrelevance"], limit=1)
    params = generation_params(grammar=True, ban_bytes=True).model_copy(update={"max_tokens": 60})
    async with ModelWorker(ModelSettings(path=tiny_model, n_ctx=8192, n_threads=2)) as worker:
        report = await run_bfcl(cases, LlamaAgentModel(worker, params))
    assert len(report.results) == 2 and all(r.reply for r in report.results)
    assert not [r for r in report.results if r.kind == "model_error"]


# --------------------------------------------------------------------------- a scripted model's mistakes


@pytest.mark.anyio
async def test_a_scripted_model_s_mistakes_score_as_bfcl_scores_them(bfcl_dir: Path) -> None:
    cases = {c.id: c for c in load_bfcl(bfcl_dir, ["simple_python", "parallel"], limit=3)}
    triangle = "calculate_triangle_area"  # simple_python_0: base [10], height [5], unit ["units", ""]
    replies = {
        "simple_python_0": tool_call_text(triangle, {"base": 10}),                      # height dropped
        "simple_python_1": tool_call_text("math.factorial", {"number": '"5"'}),         # "5" for 5
        "simple_python_2": '<tool_call>\n{"name": "math.hypot", "arguments": {"x": 4.0, "y": 5}}\n</tool_call>',
        "parallel_0": calls_of(oracle_reply(cases["parallel_0"]))[0],                  # one of two calls
        "parallel_1": "\n".join(reversed(calls_of(oracle_reply(cases["parallel_1"])))),
        "parallel_2": oracle_reply(cases["parallel_2"]).replace("<function=", "<function=x", 1),
    }
    report = await run_bfcl(list(cases.values()), ScriptedModel(replies[i] for i in cases))
    kinds = {r.id: r.kind for r in report.results}
    assert kinds == {
        "simple_python_0": "simple_function_checker:missing_required",
        "simple_python_1": "type_error:simple",
        "simple_python_2": "type_error:simple",     # 4.0 for the integer x: a float is no int
        "parallel_0": "parallel_function_checker_no_order:wrong_count",
        "parallel_1": "",                            # the same calls in another order are right
        "parallel_2": "ast_decoder:decoder_failed",  # a call to a function not offered (BFCL: wrong name)
    }
    reasons = {r.id: r.reason for r in report.results}
    assert reasons["simple_python_0"] == f"{triangle}: missing required argument height"
    assert reasons["simple_python_1"] == 'math.factorial: number="\\"5\\"" is str, expected integer'


def calls_of(reply: str) -> list[str]:
    return re.findall(r"<tool_call>.*?</tool_call>", reply, re.DOTALL)


# --------------------------------------------------------------------------- the checker, rule by rule

DOC = {
    "name": "weather.forecast",
    "description": "Forecast for a city.",
    "parameters": {"type": "dict", "properties": {
        "city": {"type": "string", "description": "City name."},
        "days": {"type": "integer", "description": "Days ahead."},
        "temperature": {"type": "float", "description": "Threshold."},
        "unit": {"type": "string", "enum": ["c", "f"], "description": "Unit."},
        "coords": {"type": "tuple", "items": {"type": "float"}, "description": "(lat, lon)."},
        "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags."},
        "options": {"type": "dict", "properties": {"hourly": {"type": "boolean"}, "lang": {"type": "string"}},
                    "description": "Options."},
        "filters": {"type": "array", "items": {"type": "dict", "properties": {"field": {"type": "string"}}},
                    "description": "Filters."},
        "data": {"type": "any", "description": "Anything."},
    }, "required": ["city", "days"]},
}
SPEC = tool_spec(DOC)


def expect(**arguments: list[Any]) -> ExpectedCall:
    return ExpectedCall(name="weather.forecast", arguments={"city": ["New York, NY"], "days": [3], **arguments})


def check(arguments: dict[str, Any], expected: ExpectedCall | None = None) -> Mismatch | None:
    return check_call(ToolCall(name="weather.forecast", arguments={"city": "New York, NY", "days": 3, **arguments}),
                      expected or expect(), SPEC)


def test_bfcl_function_docs_become_json_schema_as_convert_to_tool_makes_them() -> None:
    assert SPEC.name == "weather.forecast"  # dots kept: our tool names allow them
    assert SPEC.description == "Forecast for a city." + PYTHON_HINT
    props = SPEC.parameters["properties"]
    assert SPEC.parameters["type"] == "object" and SPEC.parameters["required"] == ["city", "days"]
    assert props["temperature"] == {"type": "number", "format": "float", "description": "Threshold." + FLOAT_NOTE}
    assert props["coords"] == {"type": "array", "items": {"type": "number"}, "description": "(lat, lon)."}
    assert props["options"]["type"] == "object" and props["options"]["properties"]["hourly"] == {"type": "boolean"}
    assert props["filters"]["items"] == {"type": "object", "properties": {"field": {"type": "string"}}}
    assert props["data"]["type"] == "string" and props["unit"]["enum"] == ["c", "f"]
    assert DOC["parameters"]["properties"]["temperature"]["type"] == "float"  # the doc itself is untouched
    with pytest.raises(ValueError, match="cannot be offered"):
        tool_spec({**DOC, "name": "two words"})


@pytest.mark.parametrize(("arguments", "expected", "kind"), [
    ({}, None, None),
    # simple_function_checker:missing_required / unexpected_param / missing_optional
    ({"days": None}, None, "type_error:simple"),
    ({"color": "red"}, None, "simple_function_checker:unexpected_param"),             # not declared
    ({"unit": "c"}, None, "simple_function_checker:unexpected_param"),                # not in the ground truth
    ({}, expect(unit=["c"]), "simple_function_checker:missing_optional"),
    ({}, expect(unit=["", "c"]), None),                                                # "" listed: may be left out
    ({"unit": "c"}, expect(unit=["", "c"]), None),
    ({"unit": "f"}, expect(unit=["", "c"]), "value_error:string"),
    # types: Python's type(), with int accepted for a float
    ({"days": "3"}, None, "type_error:simple"),                                        # "3" for 3
    ({"days": 3.0}, None, "type_error:simple"),                                        # float for int
    ({"days": True}, expect(days=[1]), "type_error:simple"),                           # a bool is no int
    ({"temperature": 20}, expect(temperature=[20.0]), None),                           # int for float
    ({"temperature": 20.5}, expect(temperature=[20.5]), None),
    ({"temperature": "20.5"}, expect(temperature=[20.5]), "type_error:simple"),
    # strings: spaces and ,./-_*^ dropped, case folded, ' read as "
    ({"city": "new york,ny"}, None, None),
    ({"city": "NEW-YORK_NY."}, None, None),
    ({"city": "New York NY!"}, None, "value_error:string"),                            # "!" is not dropped
    ({"city": "Bergen"}, expect(city=["Oslo", "Bergen, Norway"]), "value_error:string"),
    ({"data": "it's"}, expect(data=['it"s']), None),
    # lists (and tuples) in order, string items normalised, item types checked one level deep
    ({"coords": [40.7, -74.0]}, expect(coords=[[40.7, -74.0]]), None),
    ({"coords": [40.7, -74]}, expect(coords=[[40.7, -74.0]]), "type_error:nested"),   # no int for float in lists
    ({"coords": [-74.0, 40.7]}, expect(coords=[[40.7, -74.0]]), "value_error:list/tuple"),
    ({"coords": ["40.7", -74.0]}, expect(coords=[[40.7, -74.0]]), "type_error:nested"),
    ({"tags": ["Sunny Day"]}, expect(tags=[["sunny-day"]]), None),
    ({"tags": ["sunny", "day"]}, expect(tags=[["sunny-day"]]), "value_error:list/tuple"),
    # dicts: keys from the ground truth, a key may be missing only if "" is among its values
    ({"options": {"hourly": True, "lang": "EN"}}, expect(options=[{"hourly": [True], "lang": ["en"]}]), None),
    ({"options": {"hourly": True}}, expect(options=[{"hourly": [True], "lang": ["en"]}]), "value_error:dict_key"),
    ({"options": {"hourly": True}}, expect(options=[{"hourly": [True], "lang": ["", "en"]}]), None),
    ({"options": {"hourly": False}}, expect(options=[{"hourly": [True]}]), "value_error:dict_value"),
    ({"options": {"hourly": True, "x": 1}}, expect(options=[{"hourly": [True]}]), "value_error:dict_key"),
    ({"filters": [{"field": "Age"}, {"field": "job"}]}, expect(filters=[[{"field": ["age"]}, {"field": ["job"]}]]),
     None),
    ({"filters": [{"field": "job"}, {"field": "age"}]}, expect(filters=[[{"field": ["age"]}, {"field": ["job"]}]]),
     "value_error:dict_value"),
    ({"filters": [{"field": "age"}]}, expect(filters=[[{"field": ["age"]}, {"field": ["job"]}]]),
     "value_error:list_dict_count"),
    # a ground truth naming a variable (BFCL's is_variable): a value of its type is compared as is
    ({"tags": "data['tags']"}, expect(tags=["data['tags']"]), None),
    ({"tags": "data['other']"}, expect(tags=["data['tags']"]), "value_error:others"),
])
def test_check_call_follows_bfcl(arguments: dict[str, Any], expected: ExpectedCall | None, kind: str | None) -> None:
    mismatch = check(arguments, expected)
    assert (mismatch and mismatch.kind) == kind, mismatch


def test_a_dropped_required_parameter_and_a_wrong_name_are_refused() -> None:
    missing = check_call(ToolCall(name="weather.forecast", arguments={"city": "New York, NY"}), expect(), SPEC)
    assert missing == Mismatch("simple_function_checker:missing_required",
                               "weather.forecast: missing required argument days")
    wrong = check_calls([ToolCall(name="weather.current", arguments={"city": "New York, NY", "days": 3})],
                        [expect()], [SPEC])
    assert wrong == Mismatch("simple_function_checker:wrong_func_name",
                             "called weather.current, expected weather.forecast")


def test_standardize_string_is_bfcl_s() -> None:
    assert standardize_string("April 1, 2024") == standardize_string("april 1 2024") == "april12024"
    assert standardize_string("a/b-c_d*e^f.g") == "abcdefg"
    assert standardize_string("it's") == 'it"s' and standardize_string("Hi!") == "hi!"


def test_parallel_calls_match_in_any_order_but_not_in_other_numbers() -> None:
    oslo, rome = ExpectedCall(name="weather.forecast", arguments={"city": ["Oslo"], "days": [1]}), \
        ExpectedCall(name="weather.forecast", arguments={"city": ["Rome"], "days": [2]})
    calls = [ToolCall(name="weather.forecast", arguments={"city": "Rome", "days": 2}),
             ToolCall(name="weather.forecast", arguments={"city": "Oslo", "days": 1})]
    assert check_calls(calls, [oslo, rome], [SPEC]) is None
    assert check_calls(calls + calls[:1], [oslo, rome], [SPEC]) == Mismatch(
        "parallel_function_checker_no_order:wrong_count", "expected 2 call(s), got 3")  # an extra call
    assert check_calls(calls[:1], [oslo, rome], [SPEC]).message == "expected 2 call(s), got 1"
    assert check_calls(calls, [oslo, oslo], [SPEC]).kind == "parallel_function_checker_no_order:cannot_find_match"
    assert check_calls([], [], [SPEC]) is None


def test_parallel_matching_is_greedy_as_bfcl_s() -> None:
    """Each expected call takes the first unmatched call that fits, in ground-truth order,
    with no backtracking: a pairing that exists can be missed, and BFCL misses it too."""
    either = ExpectedCall(name="weather.forecast", arguments={"city": ["Oslo", "Rome"], "days": [1]})
    oslo = ExpectedCall(name="weather.forecast", arguments={"city": ["Oslo"], "days": [1]})
    calls = [ToolCall(name="weather.forecast", arguments={"city": c, "days": 1}) for c in ("Oslo", "Rome")]
    assert check_calls(calls, [either, oslo], [SPEC]).kind == "parallel_function_checker_no_order:cannot_find_match"
    assert check_calls(calls, [oslo, either], [SPEC]) is None


# --------------------------------------------------------------------------- scoring replies

IRRELEVANT = BfclCase("irrelevance_x", "irrelevance", (ChatMessage.user("Tell me a joke."),), (SPEC,), None)


@pytest.mark.parametrize(("reply", "passed"), [
    ("Why did the chicken cross the road?", True),
    ("", True),
    (tool_call_text("weather.forecast", {"city": "Oslo", "days": 1}), False),
    (tool_call_text("jokes.tell"), False),                       # a call to any function counts, offered or not
    ("<tool_call>\n<function=weather.forecast>\n", True),        # too broken to decode: no call
    ("<think>\nshould I call weather.forecast?\n</think>\n\nNo.", True),
])
def test_irrelevance_is_right_exactly_when_no_call_is_made(reply: str, passed: bool) -> None:
    result = score_reply(IRRELEVANT, reply)
    assert result.passed is passed
    assert result.kind == ("" if passed else "irrelevance_error:decoder_success")


def test_a_value_that_does_not_fit_its_type_reaches_the_checker_as_written() -> None:
    """BFCL decodes without the schema and judges types in the checker: `data['x']` for an
    array is a variable it may accept; `five` for an integer is a type error, not a lost call."""
    case = BfclCase("parallel_multiple_x", "parallel_multiple", (ChatMessage.user("q"),), (SPEC,),
                    (expect(tags=["data['tags']"]),))
    ok = score_reply(case, tool_call_text("weather.forecast",
                                          {"city": "New York, NY", "days": 3, "tags": "data['tags']"}))
    assert ok.passed and ok.calls[0].arguments["tags"] == "data['tags']"
    bad = score_reply(case, tool_call_text("weather.forecast", {"city": "New York, NY", "days": "five"}))
    assert (bad.kind, bad.calls[0].arguments["days"]) == ("type_error:simple", "five")
    enum = score_reply(case, tool_call_text("weather.forecast", {"city": "New York, NY", "days": 3, "unit": "k"}))
    assert enum.kind == "simple_function_checker:unexpected_param"  # judged by the ground truth, not the enum


# --------------------------------------------------------------------------- loading


def write_bfcl(directory: Path, category: str, questions: list[Any], answers: list[Any] | None = None) -> None:
    (directory / "possible_answer").mkdir(parents=True, exist_ok=True)
    (directory / f"BFCL_v4_{category}.json").write_text("\n".join(map(json.dumps, questions)) + "\n")
    if answers is not None:
        (directory / "possible_answer" / f"BFCL_v4_{category}.json").write_text(
            "\n".join(map(json.dumps, answers)) + "\n")


QUESTION = {"id": "simple_python_0", "question": [[{"role": "user", "content": "Forecast NY, 3 days."}]],
            "function": [DOC]}
ANSWER = {"id": "simple_python_0", "ground_truth": [{"weather.forecast": {"city": ["NYC"], "days": [3]}}]}


def test_load_reads_questions_and_ground_truth(tmp_path: Path) -> None:
    write_bfcl(tmp_path, "simple_python", [QUESTION, {**QUESTION, "id": "simple_python_1"}],
               [ANSWER, {**ANSWER, "id": "simple_python_1"}])
    write_bfcl(tmp_path, "irrelevance", [{**QUESTION, "id": "irrelevance_0"}])
    cases = load_bfcl(tmp_path)
    assert [(c.id, c.category) for c in cases] == [("simple_python_0", "simple_python"),
                                                   ("simple_python_1", "simple_python"),
                                                   ("irrelevance_0", "irrelevance")]
    assert cases[0].messages == (ChatMessage.user("Forecast NY, 3 days."),) and cases[0].tools == (SPEC,)
    assert cases[0].expected == (ExpectedCall(name="weather.forecast", arguments={"city": ["NYC"], "days": [3]}),)
    assert cases[2].expected is None
    assert [c.id for c in load_bfcl(tmp_path, ["simple_python"], limit=1)] == ["simple_python_0"]


@pytest.mark.parametrize(("questions", "answers", "categories", "message"), [
    ([QUESTION], [ANSWER], ["memory_vector" if "memory_vector" in NOT_RUN else "no_such"], "unsupported BFCL categories"),
    ([QUESTION], [{**ANSWER, "id": "simple_python_9"}], [], "no ground truth for 'simple_python_0'"),
    ([QUESTION], [{**ANSWER, "ground_truth": [{"weather.other": {}}]}], [], "not among the case's functions"),
    ([QUESTION], [{**ANSWER, "ground_truth": [{"weather.forecast": {"days": 3}}]}], [], "BFCL_v4_simple_python"),
    ([{**QUESTION, "question": "hi"}], [ANSWER], [], r"BFCL_v4_simple_python.json:1: 'question' must be"),
    ([{**QUESTION, "function": [{**DOC, "name": "a b"}]}], [ANSWER], [], "cannot be offered as a tool"),
])
def test_bad_bfcl_files_are_refused_with_the_line(tmp_path: Path, questions: list[Any], answers: list[Any],
                                                  categories: list[str], message: str) -> None:
    write_bfcl(tmp_path, "simple_python", questions, answers)
    with pytest.raises(BfclDataError, match=message):
        load_bfcl(tmp_path, categories)


def test_a_directory_without_bfcl_files_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(BfclDataError, match="holds none of the BFCL files"):
        load_bfcl(tmp_path)
    with pytest.raises(BfclDataError, match="not a directory"):
        load_bfcl(tmp_path / "nope")
    (tmp_path / "BFCL_v4_multiple.json").write_text("{not json\n")
    with pytest.raises(BfclDataError, match="BFCL_v4_multiple.json:1:"):
        load_bfcl(tmp_path)


# --------------------------------------------------------------------------- the command


def psymesh(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "psymesh", "eval", *args, "--home", str(home), "--json"],
                          capture_output=True, text=True, timeout=120)


def test_eval_bfcl_for_people_names_what_did_not_run_and_not_what_was_not_asked(bfcl_dir: Path,
                                                                               tmp_path: Path) -> None:
    """One category asked: summaries none of whose categories ran are named, not scored 0 %, and a
    category the harness cannot run here is not brought up when it was not asked for."""
    done = subprocess.run([sys.executable, "-m", "psymesh", "eval", "--bfcl", "--oracle", "--category", "simple_java",
                           "--limit", "2", "--home", str(tmp_path / "home")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "none of the categories of live, irrelevance" in done.stdout
    assert "multi_turn   0.00%" not in done.stdout and "memory_vector" not in done.stdout


def test_eval_bfcl_oracle_json(bfcl_dir: Path, tmp_path: Path) -> None:
    done = psymesh(tmp_path, "--bfcl", "--oracle", "--limit", "5", "--score-dir", str(tmp_path / "scores"))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["model"] == "oracle" and data["limit"] == 5
    assert data["bfcl_dir"] == str(bfcl_dir.resolve())  # the installed data by default
    # format_sensitivity: the first 5 source cases in each of BFCL's 26 prompt formats; the 5th,
    # simple_python_96, is one BFCL's own JSON decoder cannot read (tests/test_bfcl_v4.py shows it).
    fs = {"cases": 130, "correct": 124, "accuracy": 124 / 130}
    assert data["categories"] == {c: fs if c == "format_sensitivity" else {"cases": 5, "correct": 5, "accuracy": 1.0}
                                  for c in CATEGORIES}
    assert data["summaries"]["multi_turn"]["accuracy"] == 1.0 and data["summaries"]["live"]["accuracy"] == 1.0
    others = 5 * (len(CATEGORIES) - 1)
    assert (data["cases"], data["correct"]) == (others + 130, others + 124)
    assert {(f["id"].split(":")[-1], f["id"].split(":")[1].split("&")[0]) for f in data["failures"]} == {
        ("simple_python_96", "ret_fmt=json")} and len(data["failures"]) == 6
    score_file = tmp_path / "scores" / "BFCL_v4_multi_turn_base_score.json"
    assert json.loads(score_file.read_text().splitlines()[0]) == {"accuracy": 1.0, "correct_count": 5,
                                                                  "total_count": 5}
    header = json.loads((tmp_path / "scores" / "BFCL_v4_format_sensitivity_score.json").read_text().splitlines()[0])
    assert header["accuracy_max_delta"] == 20.0 and len([k for k in header if "ret_fmt" in k]) == 26
    assert (tmp_path / "scores" / "data_format_sensitivity.csv").is_file()

    one = json.loads(psymesh(tmp_path, "--bfcl", str(bfcl_dir), "--oracle", "--limit", "2",
                             "--category", "irrelevance", "--category", "multiple").stdout)
    assert list(one["categories"]) == ["multiple", "irrelevance"]
    assert one["summaries"]["non_live"]["accuracy"] == 0.25 and not one["summaries"]["non_live"]["complete"]


@pytest.mark.parametrize(("args", "message"), [
    (["--oracle"], "give a case file or --bfcl [DIR]"),
    (["examples/eval_cases.jsonl", "--oracle"],
     "--category, --limit, --oracle, --score-dir, --via, --runs and --temperature go with --bfcl"),
    (["--bfcl", "."], "give --model NAME, or --oracle"),
    # memory_vector is supported where the bfcl-vector extra is installed
    (["--bfcl", ".", "--oracle", "--category", "memory_vector" if "memory_vector" in NOT_RUN else "no_such"],
     "unsupported BFCL categories"),
])
def test_eval_usage_errors_are_clear(tmp_path: Path, args: list[str], message: str) -> None:
    done = psymesh(tmp_path, *args)
    assert done.returncode == 1
    assert message in json.loads(done.stdout)["error"]["message"]


def test_eval_max_tokens_caps_every_reply_and_the_defaults_are_per_case_kind(bfcl_dir: Path, tiny_model: Path,
                                                                             tmp_path: Path) -> None:
    """BFCL lets a reply run to 4096 tokens, which a small model that never stops fills (SmolLM2:
    720 s for 20 cases). By default a single-turn reply gets 512 and a multi-turn step 1024
    (+1024 each with --thinking); --max-tokens N caps them all: here 1 token, so each reply the
    score files show (a multi-turn case's, one line a step) is one token of the tiny model."""
    home = tmp_path / "home"
    added = subprocess.run([sys.executable, "-m", "psymesh", "model", "add", "tiny", str(tiny_model), "--ctx", "32768",
                            "--threads", "1", "--home", str(home)], capture_output=True, text=True, timeout=120)
    assert added.returncode == 0, added.stderr
    defaults = json.loads(psymesh(home, "--bfcl", "--oracle", "--limit", "1", "--category", "simple_python").stdout)
    assert defaults["max_tokens"] == {"single_turn": 512, "multi_turn": 1024}
    thinking = json.loads(psymesh(home, "--bfcl", "--oracle", "--limit", "1", "--category", "simple_python",
                                  "--thinking").stdout)
    assert thinking["max_tokens"] == {"single_turn": 1536, "multi_turn": 2048}

    done = psymesh(home, "--bfcl", "--model", "tiny", "--limit", "1", "--category", "simple_python", "--category",
                   "multi_turn_base", "--free", "--ban-bytes", "--max-tokens", "1", "--score-dir", str(tmp_path / "s"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["max_tokens"] == {"single_turn": 1, "multi_turn": 1}
    longest = max(len(text) for text, _ in SPECIAL_TOKENS)  # the tiny vocabulary's longest piece
    replies = []
    for category in ("simple_python", "multi_turn_base"):
        lines = (tmp_path / "s" / f"BFCL_v4_{category}_score.json").read_text().splitlines()[1:]
        replies += [step for line in lines for step in json.loads(line)["model_result_raw"].split("\n")]
    assert replies and all(len(r) <= longest for r in replies), replies
