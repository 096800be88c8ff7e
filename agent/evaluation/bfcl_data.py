"""BFCL's data read as our cases: its function docs converted to ToolSpecs as BFCL's
``convert_to_tool`` converts them (with its language hint; Java and JavaScript parameters as
strings), and its question / possible_answer files paired into :class:`BfclCase`
(:func:`load_bfcl`), from the installed bfcl-eval or any folder in BFCL's layout.
"""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..formats.chatformat import ChatMessage, ToolSpec
from ...protocol.errors import ErrorCode
from .bfcl_categories import (
    FILE_PREFIX, BFCL_EVAL_VERSION, AST_CATEGORIES, IRRELEVANCE_CATEGORIES, RELEVANCE_CATEGORIES,
    MEMORY_CATEGORIES, WEB_CATEGORIES, CATEGORIES, PYTHON,
    JAVA, JAVASCRIPT, LANGUAGE_HINTS, FLOAT_NOTE, BfclDataError,
)
from .bfcl_checker import ExpectedCall


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


def json_lines(path: Path, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
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


def expected_calls(ground_truth: Any, tools: Sequence[ToolSpec]) -> tuple[ExpectedCall, ...]:
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


def load_single_turn(directory: Path, category: str, limit: int | None) -> list[BfclCase]:
    """A single-turn category's cases (AST, irrelevance, relevance), paired with their
    ground truth where the category is graded by it; the first `limit` of them."""
    questions = json_lines(directory / f"{FILE_PREFIX}{category}.json", limit)
    answers: dict[str, Any] = {}
    language = language_of(category)
    graded = category in AST_CATEGORIES
    if graded:
        answer_lines = json_lines(directory / "possible_answer" / f"{FILE_PREFIX}{category}.json", None)
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
                expected = expected_calls(answers[obj["id"]], tools)
        except (KeyError, TypeError, ValueError, ValidationError) as exc:  # a ValidationError is a ValueError
            raise BfclDataError(f"{where}: {exc}") from None
        cases.append(BfclCase(obj["id"], category, messages, tools, expected, language, check_tools))
    return cases

