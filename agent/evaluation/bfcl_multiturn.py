"""BFCL v4's multi-turn categories, run through the agent loop on BFCL's own backends and
judged by BFCL's own ``multi_turn_checker``.

A multi-turn case is a conversation of several user turns against stateful APIs (a file
system, a trading bot, a travel agency, ...: the classes in ``involved_classes``, set up
from ``initial_config``). It runs as BFCL's ``inference_multi_turn_FC`` runs it:

* the tools are the classes' function docs (``multi_turn_func_doc/``), converted as the
  single-turn docs are (:func:`psymesh.agent.evaluation.bfcl.tool_spec`); in miss_func, the functions
  named in ``missed_function`` are held back and arrive at their turn, whose user message
  is then BFCL's "I have updated some more functions you can choose from. What about now?";
* each turn's user messages are appended; then the model is asked again and again: every
  reply with calls has them executed, in order, on the case's backend instances (BFCL's
  ``execute_multi_turn_func_call``, the same instances across turns), each result becoming
  a tool turn; the first reply without a call ends the turn. More than BFCL's 20 steps in
  one turn force-terminates the case, which then fails, as in BFCL;
* the calls of every step (as BFCL's decoder writes them: ``name(k=repr(v),...)``) go to
  ``multi_turn_checker`` with the ground truth: after every turn whose ground truth is not
  empty, the backend state must equal the ground truth's, and every result the ground
  truth's calls returned must be among the model's.

What is BFCL's here and what is ours: the backends, the executor and the checkers are
bfcl-eval's own modules (they import only the standard library and mpmath, and the
memory ones overrides, rank-bm25 and filelock, so they load with the package installed
``--no-deps``). Ours are the prompt (the model's chat
template, as for every model here), the reply parser, and one guard: BFCL ``eval``s the
call strings it decodes, so a model could run any Python builtin (``open(...)``) that way.
Here a call is executed only if its name is a public method of one of the case's classes
and its argument names are identifiers (values are JSON, written with ``repr``, so they
are literals); any other call gets the error BFCL's own execution gives an unknown name
(``Error during execution: name 'x' is not defined``) and is not passed on to be run.

Memory (memory_kv, memory_rec_sum) takes the same loop: BFCL's own loader builds the
cases (each scenario's prerequisite conversations, then its questions); the backend keeps
its snapshots in a folder of the run; after each prerequisite conversation the memory is
flushed to it, and each question starts from it with BFCL's memory system prompt (the
core memory shown). A question is right when BFCL's ``agentic_checker`` finds one of the
answers in the model's final text; prerequisites are not scored, as in BFCL.

``--oracle`` answers each turn with its ground-truth calls, written as a model writes
calls (positional arguments named by the method's signature), so they go through the
same render -> parse -> execute -> check path as a model's.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import json
import keyword
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from .bfcl_categories import FILE_PREFIX, MULTI_TURN_CATEGORIES, BfclDataError, bfcl_module, offline_vector_encoder
from .bfcl_data import json_lines, tool_spec
from .bfcl_score import BfclResult, scoring_spec
from ..formats.chatformat import ChatMessage, ParsedReply, ToolCall, ToolSpec, parse_reply
from ..formats.families import ReplyParser
from ..acting.loop import AgentModel, ScriptedModel, tool_call_text
from ...protocol.errors import PsymeshError
from ...protocol.web import WebPage, WebResults

__all__ = [
    "ADDITIONAL_FUNCTION_PROMPT",
    "MAX_STEPS",
    "WEB_NOTE",
    "MemorySetup",
    "MultiTurnCase",
    "WebRoute",
    "WebSetup",
    "bfcl_call",
    "load_memory",
    "load_multi_turn",
    "load_web_search",
    "oracle_model",
    "run_multi_turn_case",
]

# BFCL's DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC and MAXIMUM_STEP_LIMIT (constants/default_prompts.py;
# that module imports nothing, but it is read here by value so the prompt is visible where it is used).
ADDITIONAL_FUNCTION_PROMPT = "I have updated some more functions you can choose from. What about now?"
MAX_STEPS = 20
ORACLE_DONE = "Done."


@dataclass(frozen=True)
class MemorySetup:
    """A memory case: a prerequisite conversation (the model stores what it is told; not
    scored) or a question about it, right when the final answer names one of `answers`."""

    scenario: str
    prereq: bool
    answers: tuple[str, ...] = ()


@dataclass(frozen=True)
class WebSetup:
    """A web search question: right when the final answer names one of `answers`.
    `show_snippet` False is web_search_no_snippet (results without their text)."""

    answers: tuple[str, ...]
    show_snippet: bool


class WebRoute(Protocol):
    """How web_search reaches the web: this node's own route (``psymesh.Client`` has these)."""

    async def web_search(self, query: str, *, limit: int = 5) -> WebResults: ...

    async def web_fetch(self, url: str) -> WebPage: ...


WEB_NOTE = ("web_search runs through this node's web route (web.search / web.fetch via its exit), not BFCL's "
            "fixed search API (SerpAPI through its WebSearchAPI): the results a model reads, and so its scores, "
            "differ from BFCL's")


@dataclass(frozen=True)
class MultiTurnCase:
    """One BFCL multi-turn question. `turns[i]` are turn i's user messages (empty on a
    turn where held-back functions arrive); `held_out[i]` the tools that arrive then."""

    id: str
    category: str
    turns: tuple[tuple[ChatMessage, ...], ...]
    tools: tuple[ToolSpec, ...]
    held_out: Mapping[int, tuple[ToolSpec, ...]]
    ground_truth: tuple[tuple[str, ...], ...]
    involved_classes: tuple[str, ...]
    initial_config: Mapping[str, Any]
    memory: MemorySetup | None = None
    web: WebSetup | None = None

    @property
    def long_context(self) -> bool:
        return "long_context" in self.category  # BFCL: "long_context" (or "composite") in the category

    def entry(self) -> dict[str, Any]:
        """The test entry as BFCL's checker reads it."""
        return {"id": self.id, "initial_config": dict(self.initial_config),
                "involved_classes": list(self.involved_classes)}


def _classes() -> Mapping[str, str]:
    return bfcl_module("constants.executable_backend_config").CLASS_FILE_PATH_MAPPING


def _func_docs(directory: Path, class_name: str) -> list[dict[str, Any]]:
    mapping = bfcl_module("constants.executable_backend_config").MULTI_TURN_FUNC_DOC_FILE_MAPPING
    if class_name not in mapping:
        raise ValueError(f"unknown BFCL class {class_name!r}")
    return [obj for _, obj in _json_lines_any(directory / "multi_turn_func_doc" / mapping[class_name])]


def _json_lines_any(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Function docs: JSON lines without ids."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BfclDataError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return [(f"{path.name}:{no}", json.loads(line)) for no, line in enumerate(lines, 1) if line.strip()]
    except ValueError as exc:
        raise BfclDataError(f"{path.name}: {exc}") from None


def load_multi_turn(directory: Path, category: str, limit: int | None) -> list[MultiTurnCase]:
    """The cases of one multi-turn category, with their function docs (BFCL's
    populate_test_cases_with_predefined_functions) and ground truth."""
    assert category in MULTI_TURN_CATEGORIES
    questions = json_lines(directory / f"{FILE_PREFIX}{category}.json", limit)
    answers = {obj["id"]: obj.get("ground_truth")
               for _, obj in json_lines(directory / "possible_answer" / f"{FILE_PREFIX}{category}.json", None)}
    docs_by_class: dict[str, list[dict[str, Any]]] = {}
    cases = []
    for where, obj in questions:
        try:
            classes = tuple(obj["involved_classes"])
            docs = [doc for c in classes for doc in docs_by_class.setdefault(c, _func_docs(directory, c))]
            missed = {int(turn): list(names) for turn, names in (obj.get("missed_function") or {}).items()}
            held_names = {n for names in missed.values() for n in names}
            tools = tuple(tool_spec(d) for d in docs if d["name"] not in held_names)
            by_name = {d["name"]: d for d in docs}
            held_out = {turn: tuple(tool_spec(by_name[n]) for n in names) for turn, names in missed.items()}
            turns = tuple(tuple(ChatMessage(role=m["role"], content=m["content"]) for m in turn)
                          for turn in obj["question"])
            truth = answers.get(obj["id"])
            if not isinstance(truth, list) or len(truth) != len(turns):
                raise ValueError(f"the ground truth of {obj['id']!r} must be a list of {len(turns)} turns")
            cases.append(MultiTurnCase(obj["id"], category, turns, tools, held_out,
                                       tuple(tuple(t) for t in truth), classes, obj.get("initial_config") or {}))
        except (KeyError, TypeError, ValueError, ValidationError) as exc:
            raise BfclDataError(f"{where}: {exc}") from None
    return cases


def load_memory(category: str, limit: int | None, encoder_cache: Path | None = None) -> list[MultiTurnCase]:
    """A memory category as BFCL's own loader builds it (bfcl_eval.utils.load_dataset_entry:
    each scenario's prerequisite conversations, then the questions, with the memory
    backend's docs and BFCL's answer-format system prompt), the answers aligned by index as
    BFCL's evaluation aligns them. `limit` cuts the questions; the prerequisites of their
    scenarios all stay, since the questions are about them. memory_vector's encoder is
    loaded from the packaged model (:func:`offline_vector_encoder`, its hub cache built in
    `encoder_cache`, by default the user's cache folder)."""
    if category == "memory_vector":
        import platformdirs

        offline_vector_encoder(encoder_cache or Path(platformdirs.user_cache_dir("psymesh")) / "bfcl-encoder")
    utils = bfcl_module("utils")
    entries = utils.load_dataset_entry(category, include_prereq=True, include_language_specific_hint=False)
    truths = utils.load_ground_truth_entry(category)
    questions = [e for e in entries if not utils.is_memory_prereq(e["id"])]
    answers = {q["id"]: tuple(t["ground_truth"]) for q, t in zip(questions, truths, strict=True)}
    questions = questions[:limit] if limit is not None else questions
    scenarios = {q["scenario"] for q in questions}
    chosen = [e for e in entries if utils.is_memory_prereq(e["id"]) and e["scenario"] in scenarios] + questions
    cases = []
    for e in chosen:
        prereq = bool(utils.is_memory_prereq(e["id"]))
        turns = tuple(tuple(ChatMessage(role=m["role"], content=m["content"]) for m in turn) for turn in e["question"])
        cases.append(MultiTurnCase(e["id"], category, turns, tuple(tool_spec(d) for d in e["function"]), {}, (),
                                   tuple(e["involved_classes"]), {},
                                   MemorySetup(e["scenario"], prereq, () if prereq else answers[e["id"]])))
    return cases


def load_web_search(category: str, limit: int | None) -> list[MultiTurnCase]:
    """web_search_base / web_search_no_snippet as BFCL's own loader builds them (the
    WebSearchAPI docs, BFCL's answer-format system prompt), answers aligned by index."""
    utils = bfcl_module("utils")
    entries = utils.load_dataset_entry(category, include_prereq=False, include_language_specific_hint=False)
    truths = utils.load_ground_truth_entry(category)
    cases = []
    for e, t in list(zip(entries, truths, strict=True))[:limit]:
        turns = tuple(tuple(ChatMessage(role=m["role"], content=m["content"]) for m in turn) for turn in e["question"])
        cases.append(MultiTurnCase(e["id"], category, turns, tuple(tool_spec(d) for d in e["function"]), {}, (),
                                   tuple(e["involved_classes"]), {},
                                   web=WebSetup(tuple(t["ground_truth"]), "no_snippet" not in category)))
    return cases


def _memory_prompt(case: MultiTurnCase, instance: Any) -> str:
    """BFCL's add_memory_instruction_system_prompt (model_handler/utils.py, which does not
    import cleanly): the scenario's setting and the core memory as it stands."""
    assert case.memory is not None
    prompts = bfcl_module("constants.default_prompts")
    template = (prompts.MEMORY_BACKEND_INSTRUCTION_UNIFIED if "rec_sum" in case.category
                else prompts.MEMORY_BACKEND_INSTRUCTION_CORE_ARCHIVAL)
    return template.format(scenario_setting=prompts.MEMORY_AGENT_SETTINGS[case.memory.scenario],
                           memory_content=instance._dump_core_memory_to_context())


def _with_system(turn: tuple[ChatMessage, ...], prompt: str) -> tuple[ChatMessage, ...]:
    if turn and turn[0].role == "system":
        return (ChatMessage.system(prompt + "\n\n" + turn[0].content), *turn[1:])
    return (ChatMessage.system(prompt), *turn)


# --------------------------------------------------------------------------- calls, as BFCL writes them


def _public_methods(case: MultiTurnCase) -> dict[str, str]:
    """Each public method name of the case's classes -> its class (BFCL maps methods the same way)."""
    import importlib

    out: dict[str, str] = {}
    for class_name in case.involved_classes:
        cls = getattr(importlib.import_module(_classes()[class_name]), class_name)
        out.update((name, class_name) for name, _ in inspect.getmembers(cls, inspect.isfunction)
                   if not name.startswith("_"))
    return out


def bfcl_call(call: ToolCall) -> str:
    """A parsed call as BFCL's decoder writes it for execution (convert_to_function_call)."""
    return f"{call.name}({','.join(f'{k}={v!r}' for k, v in call.arguments.items())})"


def _identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def _safe(call: ToolCall, methods: Mapping[str, str], namespace: Mapping[str, Any]) -> bool:
    """Whether BFCL's executor may `eval` the call: a method of the case's classes, or a
    name that resolves to nothing there (eval then fails with the NameError BFCL reports),
    with identifier argument names."""
    if not _identifier(call.name) or not all(_identifier(k) for k in call.arguments):
        return False
    return call.name in methods or (call.name not in namespace and call.name not in vars(builtins))


def _refused(call: ToolCall) -> str:
    return f"Error during execution: name '{call.name}' is not defined"


class _Backends:
    """One case's backend instances, living in BFCL's executor under a name of this run."""

    def __init__(self, case: MultiTurnCase, workdir: Path | None) -> None:
        self.case = case
        self.model_name = f"psymesh_{secrets.token_hex(4)}"
        self.methods = _public_methods(case)
        self._utils = bfcl_module("eval_checker.multi_turn_eval.multi_turn_utils")
        self.config = dict(case.initial_config)
        if case.memory is not None:  # BFCL's populate_initial_settings_for_memory_test_cases
            if workdir is None:
                raise BfclDataError(f"{case.id}: a memory case needs a folder for its snapshots")
            self.config = {case.involved_classes[0]: {"model_result_dir": workdir, "scenario": case.memory.scenario,
                                                      "test_id": case.id, "test_category": case.category}}
        self.instances: dict[str, Any] = {}

    async def execute(self, calls: Sequence[ToolCall]) -> list[str]:
        runnable = [bfcl_call(c) for c in calls if self.safe(c)]
        results, self.instances = self._utils.execute_multi_turn_func_call(
            runnable, self.config, list(self.case.involved_classes), self.model_name,
            self.case.id, long_context=self.case.long_context, is_evaL_run=False)
        it = iter(results)
        return [next(it) if self.safe(c) else _refused(c) for c in calls]

    def safe(self, call: ToolCall) -> bool:
        return _safe(call, self.methods, vars(self._utils))

    def close(self) -> None:
        """Drop this run's instances (BFCL keeps them in its module's globals, by name)."""
        namespace = vars(self._utils)
        for key in [k for k in namespace if k.startswith(self.model_name)]:
            del namespace[key]


def _as_result(value: Any) -> str:
    """A backend's return value as BFCL's executor writes it for the model."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


class _WebBackend:
    """BFCL's WebSearchAPI's two functions (same names, parameters and result shapes) over
    this node's web route. BFCL's own class calls SerpAPI and imports requests, bs4,
    html2text and serpapi; this one asks the node (WEB_NOTE). `raw` and `markdown` fetches
    get the page's readable text, which is all the route returns."""

    METHODS = ("search_engine_query", "fetch_url_content")

    def __init__(self, case: MultiTurnCase, web: WebRoute | None) -> None:
        assert case.web is not None
        self.show_snippet = case.web.show_snippet
        self.web = web
        self.instances: dict[str, Any] = {}

    def safe(self, call: ToolCall) -> bool:
        return call.name in self.METHODS and all(_identifier(k) for k in call.arguments)

    async def search_engine_query(self, keywords: str, max_results: int = 10, region: str = "wt-wt") -> Any:
        if self.web is None:
            raise PsymeshError("no web route: run the node (psymesh node start) with a web exit it trusts")
        found = await self.web.web_search(keywords, limit=max(1, min(int(max_results), 10)))
        return [{"title": h.title, "href": h.url, **({"body": h.snippet} if self.show_snippet else {})}
                for h in found.hits]

    async def fetch_url_content(self, url: str, mode: str = "raw") -> Any:
        if self.web is None:
            raise PsymeshError("no web route: run the node (psymesh node start) with a web exit it trusts")
        page = await self.web.web_fetch(url)
        return {"content": page.text}

    async def execute(self, calls: Sequence[ToolCall]) -> list[str]:
        out = []
        for call in calls:
            if not self.safe(call):
                out.append(_refused(call))
                continue
            try:
                out.append(_as_result(await getattr(self, call.name)(**call.arguments)))
            except (TypeError, ValueError, PsymeshError) as exc:
                out.append(f"Error during execution: {exc}")
        return out

    def close(self) -> None:
        pass


def _check(case: MultiTurnCase, decoded: list[list[list[str]]], model_name: str) -> dict[str, Any]:
    checker = bfcl_module("eval_checker.multi_turn_eval.multi_turn_checker")
    return checker.multi_turn_checker(decoded, [list(t) for t in case.ground_truth], case.entry(),
                                      case.category, model_name)


def _parse(text: str, tools: Sequence[ToolSpec], parse: ReplyParser) -> ParsedReply:
    """The reply's calls as BFCL's decoder sees them: a call to a function not offered
    (yet) is a call too (BFCL decodes without the docs); offered ones are typed by their
    schema, a value that does not fit it kept as written (BFCL's convert_value keeps it
    too), the others read as JSON where they look like it."""
    offered = {t.name for t in tools}
    extra = []
    for call in parse(text).tool_calls:
        if call.name not in offered:
            try:
                extra.append(ToolSpec(name=call.name))
            except ValidationError:
                continue
            offered.add(call.name)
    return parse(text, [*(scoring_spec(t) for t in tools), *extra])


async def run_multi_turn_case(case: MultiTurnCase, model: AgentModel, *, thinking: bool = False,
                              workdir: Path | None = None, web: WebRoute | None = None,
                              parse: ReplyParser = parse_reply) -> BfclResult | None:
    """Run `case` through `model` (its replies read by `parse`, its tool family's parser) as BFCL's multi-turn inference does, and judge it with
    BFCL's multi_turn_checker (a memory question: with BFCL's agentic_checker; a memory
    prerequisite is not judged, and gives None). `workdir` holds a run's memory snapshots."""
    backends: _Backends | _WebBackend = _WebBackend(case, web) if case.web is not None else _Backends(case, workdir)
    replies: list[str] = []
    calls_made: list[ToolCall] = []
    answer = ""
    try:
        await backends.execute([])  # BFCL sets the instances up before the first turn
        tools = list(case.tools)
        history: list[ChatMessage] = []
        decoded: list[list[list[str]]] = []
        for turn_no, messages in enumerate(case.turns):
            if turn_no in case.held_out:
                tools.extend(case.held_out[turn_no])
                messages = (ChatMessage.user(ADDITIONAL_FUNCTION_PROMPT),)
            if turn_no == 0 and case.memory is not None:
                messages = _with_system(messages, _memory_prompt(case, next(iter(backends.instances.values()))))
            history.extend(messages)
            steps: list[list[str]] = []
            for _step in range(MAX_STEPS + 1):
                try:
                    text = await model.reply(history, tools, thinking=thinking)
                except PsymeshError as exc:
                    return BfclResult(case.id, case.category, False, "model_error", f"model error: {exc}",
                                      "\n".join(replies), calls_made)
                replies.append(text)
                reply = _parse(text, tools, parse)
                history.append(reply.to_message())
                if not reply.tool_calls:
                    answer = reply.content
                    break
                results = await backends.execute(reply.tool_calls)
                calls_made.extend(reply.tool_calls)
                steps.append([bfcl_call(c) for c in reply.tool_calls if backends.safe(c)])
                history.extend(ChatMessage.tool(c, r) for c, r in zip(reply.tool_calls, results, strict=True))
            else:
                return BfclResult(case.id, case.category, False, "multi_turn:force_terminated",
                                  f"turn {turn_no}: still calling after {MAX_STEPS} steps",
                                  "\n".join(replies), calls_made)
            decoded.append([s for s in steps if s])
        if case.memory is not None or case.web is not None:
            if case.memory is not None and case.memory.prereq:  # BFCL flushes the memory after a prerequisite
                next(iter(backends.instances.values()))._flush_memory_to_local_file()
                return None
            answers = case.memory.answers if case.memory is not None else case.web.answers  # type: ignore[union-attr]
            agentic = bfcl_module("eval_checker.agentic_eval.agentic_checker")
            verdict = agentic.agentic_checker(answer, list(answers))
            return BfclResult(case.id, case.category, bool(verdict["valid"]), str(verdict.get("error_type", "")),
                              str(verdict.get("error_message", "")), "\n".join(replies), calls_made)
        assert isinstance(backends, _Backends)
        try:
            verdict = _check(case, decoded, backends.model_name)
        except Exception as exc:  # BFCL's checker asserts; an assertion is its verdict that the run is unusable
            return BfclResult(case.id, case.category, False, "multi_turn:checker_error", f"{type(exc).__name__}: {exc}",
                              "\n".join(replies), calls_made)
    finally:
        backends.close()
    if verdict.get("valid"):
        return BfclResult(case.id, case.category, True, "", "", "\n".join(replies), calls_made)
    return BfclResult(case.id, case.category, False, str(verdict.get("error_type", "multi_turn:unknown")),
                      str(verdict.get("error_message", "")), "\n".join(replies), calls_made)


# --------------------------------------------------------------------------- the oracle


def _signature_names(case: MultiTurnCase, name: str) -> list[str]:
    import importlib

    class_name = _public_methods(case).get(name)
    if class_name is None:
        return []
    cls = getattr(importlib.import_module(_classes()[class_name]), class_name)
    return [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]


def parse_ground_truth_call(case: MultiTurnCase, text: str) -> tuple[str, dict[str, Any]]:
    """A ground-truth call string ("sort('final_report.pdf')") as a name and named arguments."""
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise BfclDataError(f"{case.id}: ground-truth call {text!r} is not a plain function call")
    names = _signature_names(case, node.func.id)
    args = {names[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update((k.arg, ast.literal_eval(k.value)) for k in node.keywords if k.arg is not None)
    return node.func.id, args


def oracle_model(case: MultiTurnCase) -> ScriptedModel:
    """A model that answers each turn with its ground-truth calls (one step), then ends the
    turn with text; a turn whose ground truth is empty gets text only."""
    if case.memory is not None:  # nothing to store; the question answered in BFCL's answer format
        if case.memory.prereq:
            return ScriptedModel([ORACLE_DONE] * len(case.turns))
        return ScriptedModel([f"{{'answer': '{case.memory.answers[0]}', 'context': 'from memory'}}"])
    if case.web is not None:  # no search needed to know the truth
        return ScriptedModel([f"{{'answer': '{case.web.answers[0]}', 'context': 'known'}}"])
    replies: list[str] = []
    for turn in case.ground_truth:
        if turn:
            replies.append("\n".join(tool_call_text(*parse_ground_truth_call(case, c)) for c in turn))
        replies.append(ORACLE_DONE)
    return ScriptedModel(replies)
