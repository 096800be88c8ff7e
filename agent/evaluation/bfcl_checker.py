"""BFCL's AST checker, mirrored rule for rule (quirks included; :mod:`.bfcl`'s docstring lists
the rules and where ours differs): is a list of parsed calls what a ground truth accepts?
:func:`check_calls` answers with BFCL's error_type and a message for people, or None.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..formats.chatformat import ToolCall, ToolSpec
from .bfcl_categories import OMITTABLE, PYTHON, JAVA, bfcl_module


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


PYTHON_TYPES: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool,
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


def declared_type(schema: Any) -> type | None:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    return PYTHON_TYPES.get(kind) if isinstance(kind, str) else None


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


def check_value(name: str, param: str, value: Any, values: Sequence[Any],
                 schema: Mapping[str, Any], language: str = PYTHON) -> Mismatch | None:
    if language == PYTHON:
        declared = declared_type(schema)
        want = declared or _answer_type(values)
        nested = declared_type(schema.get("items")) if want is list else None
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
        mismatch = check_value(call.name, param, value, expected.arguments[param], schema, language)
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
