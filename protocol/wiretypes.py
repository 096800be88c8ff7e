"""The msgpack types a message's fields must arrive as (protocol.md §3, "Types on the wire").

pydantic's lax mode, which the models use so that a list may fill a tuple and a string an
enum, also turns `"1"` into the integer 1, `1.0` into 1 and `1` into `True`. A peer that
sends `ping {seq: "1"}` would be answered as if it had sent `seq: 1`, so two nodes could
disagree on what a frame says. Before a frame from the wire is validated, `wire_type_error`
checks each field the spec gives a scalar type against the type msgpack decoded:

    int    an integer (never a bool, a float or a string)
    float  a float or an integer (msgpack writers encode 2.0 as 2; both are numbers)
    str    a string          bool  a bool          bytes  a bin
    X | None   nil, or X     list / tuple of X: an array, each item X     a model: a map, by its fields

Other types (enums, maps of anything, unions of several kinds) are left to the model's own
validation, which takes only their exact values. Pure: no IO.
"""
from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

_Check = Callable[[Any], str | None]  # the problem with a value (None: none), and where, as "a.b: problem"

_SCALARS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    bool: ("a bool", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
    bytes: ("bin (bytes)", lambda v: isinstance(v, (bytes, bytearray))),
}


def wire_type_error(model: type[BaseModel], obj: Mapping[str, Any]) -> str | None:
    """Where and how a decoded map's fields are of the wrong msgpack type for `model`
    ("seq: must be an integer, not str"), or None. Unknown keys are not looked at (§3)."""
    return _model_check(model)(obj)


@functools.cache
def _model_check(model: type[BaseModel]) -> _Check:
    fields = [(info.alias or name, _check_for(info.annotation)) for name, info in model.model_fields.items()]
    fields = [(key, check) for key, check in fields if check is not None]

    def check(obj: Any) -> str | None:
        if not isinstance(obj, Mapping):
            return None  # not a map: the model's own validation says so
        for key, field_check in fields:
            if key in obj and (problem := field_check(obj[key])) is not None:
                return f"{key}{'' if problem.startswith('.') else ': '}{problem}"
        return None

    return check


def _check_for(annotation: Any) -> _Check | None:
    """The check of one annotation, or None for a type left to the model's validation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _check_for(args[0])
    if annotation in _SCALARS:
        what, ok = _SCALARS[annotation]
        return lambda v: None if ok(v) else f"must be {what}, not {type(v).__name__}"
    if origin in (typing.Union, types.UnionType):
        others = [a for a in args if a is not type(None)]
        if len(others) != 1:
            return None  # several kinds: the model decides
        inner = _check_for(others[0])
        nullable = len(others) < len(args)
        if inner is None:
            return None
        return lambda v: None if (v is None and nullable) else inner(v)
    if origin in (list, tuple, frozenset, set) or (origin is not None and _is_sequence(origin)):
        item = args[0] if args else None
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return None  # a fixed-length tuple: left to the model
        inner = _check_for(item) if item is not None else None
        if inner is None:
            return None

        def each(v: Any) -> str | None:
            if not isinstance(v, (list, tuple)):
                return None  # not an array: the model's own validation says so
            for i, x in enumerate(v):
                if (problem := inner(x)) is not None:
                    return f".{i}{'' if problem.startswith('.') else ': '}{problem}"
            return None

        return each
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        def within(v: Any) -> str | None:
            problem = _model_check(annotation)(v)  # looked up when used: a model may hold its own kind
            return None if problem is None else f".{problem}"

        return within
    return None  # enums, maps, Any, literals: the model's own validation


def _is_sequence(origin: Any) -> bool:
    return isinstance(origin, type) and issubclass(origin, Sequence) and not issubclass(origin, (str, bytes))
