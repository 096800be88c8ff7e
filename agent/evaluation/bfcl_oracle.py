"""The oracle: a case's first acceptable ground-truth answer written as a model writes calls
(Java and JavaScript values in those languages' syntax), so the harness can be shown to
lose no correct answer (:func:`single_turn_oracle`; :func:`.bfcl.oracle_reply` for any case).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..formats.chatformat import ToolSpec
from ..acting.loop import tool_call_text
from .bfcl_categories import OMITTABLE, PYTHON, JAVA, JAVASCRIPT
from .bfcl_checker import ExpectedCall, declared_type, check_value
from .bfcl_data import BfclCase


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


def oracle_arguments(expected: ExpectedCall, spec: ToolSpec) -> dict[str, Any]:
    """The first acceptable value of each parameter (see _first_acceptable)."""
    args: dict[str, Any] = {}
    for param, value, _values, schema in _first_acceptable(expected, spec):
        if declared_type(schema) is dict and isinstance(value, Mapping):
            value = _first_of_each(value)
        elif declared_type(schema) is list and declared_type(schema.get("items")) is dict and isinstance(value, list):
            value = [_first_of_each(v) if isinstance(v, Mapping) else v for v in value]
        args[param] = value
    return args


def single_turn_oracle(case: BfclCase) -> str:
    """The reply a perfect model writes to a single-turn case: the ground truth's first
    acceptable answer, each call in the Qwen3.5 tool-call form; plain text where no function fits."""
    if case.wants_call:  # BFCL's relevance check asks for any well-formed call
        return tool_call_text(case.tools[0].name, {})
    if case.expected is None:
        return "None of the functions I have can do that, so I will answer directly."
    specs = {t.name: t for t in case.tools}
    if case.language == PYTHON:
        return "\n".join(tool_call_text(e.name, oracle_arguments(e, specs[e.name])) for e in case.expected)
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
                            if check_value(spec.name, param, s, values, schema, language) is None), spellings[0])
    return args
