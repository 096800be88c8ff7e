"""Tools: named, typed functions an agent (or a peer's `tool` task) may call.

A :class:`Tool` pairs a callable with a pydantic model of its arguments. Arguments
arrive as JSON from a 0.8B model or from another machine, so :func:`invoke` always
validates them *before* the callable runs and turns every failure into a typed
:class:`ToolError` whose message the agent loop can hand back to the model.

Tools are written as plain functions; the signature is the schema::

    registry = ToolRegistry()

    @registry.tool("notes.add")
    def add_note(text: Annotated[str, Field(description="the note")], ctx: ToolContext) -> dict:
        '''Save a short note.'''

A parameter named ``ctx`` receives the :class:`ToolContext` and is not part of the
schema. Sync callables run on a worker thread; async ones on the caller's loop.
Third-party packages add tools through the ``psymesh.tools`` entry-point group
(see :func:`load_entry_points`).
"""
from __future__ import annotations

import difflib
import functools
import importlib.metadata
import inspect
import json
import logging
import re
import threading
import time
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_core import PydanticSerializationError, to_jsonable_python

from ..formats.chatformat import ToolSpec
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.tasks import check_json

__all__ = [
    "ALL_PROFILES",
    "ENTRY_POINT_GROUP",
    "TOOL_NAME_RE",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolRegistry",
    "ToolSpec",
    "invoke",
    "load_entry_points",
    "schema_for_prompt",
    "tool_from_function",
]

log = logging.getLogger("psymesh.tools")

TOOL_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")
MAX_TOOL_NAME = 64           # the chat format's limit for a function name
ALL_PROFILES: frozenset[str] = frozenset({"home", "phone"})
ENTRY_POINT_GROUP = "psymesh.tools"
_CTX_PARAM = "ctx"
_SHOWN_INPUT_CHARS = 60


class ToolError(PsymeshError):
    """A tool could not do what was asked. The message is written for the model to read
    (and act on: "no network: wifi is off"), so it says what is wrong and what would help."""

    default_code = ErrorCode.BAD_REQUEST


# --------------------------------------------------------------------------- context


@dataclass
class ToolContext:
    """What a tool may know about the call it serves. Tools ask for it with a `ctx` parameter.

    `deadline` is absolute unix time (as in a task spec). Long-running sync tools call
    :meth:`check` between units of work: a worker thread cannot be interrupted, so this
    is how cancellation and the deadline reach it.
    """

    share_dir: Path | None = None
    profile: str = "home"
    peer_id: str | None = None          # who asked; None: the node's own owner
    deadline: float | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event, init=False, repr=False, compare=False)

    def remaining(self) -> float | None:
        """Seconds left before the deadline (may be negative), or None without one."""
        return None if self.deadline is None else self.deadline - time.time()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask a running tool to stop at its next :meth:`check` (thread-safe)."""
        self._cancelled.set()

    def check(self) -> None:
        """Raise ToolError CANCELED or TIMEOUT if the call should stop now."""
        if self._cancelled.is_set():
            raise ToolError("the tool call was canceled", code=ErrorCode.CANCELED)
        remaining = self.remaining()
        if remaining is not None and remaining <= 0:
            raise ToolError("the tool call ran past its deadline", code=ErrorCode.TIMEOUT)


# --------------------------------------------------------------------------- tools


@dataclass(frozen=True)
class Tool:
    """One callable tool. `func` takes the argument model's fields as keyword arguments
    (plus `ctx` when `wants_ctx`). `irreversible` tools are ones the agent loop should
    confirm before running (sending a message, deleting data). `backend`, for a tool that acts
    on the device rather than on data of its own: what it acts through (``"simulated"``: the
    simulated phone's SQLite file; ``"termux-api"``, ``"nmcli"``, ``"notify-send"``: the real
    device, by those commands); empty for every other tool."""

    name: str
    description: str
    args_model: type[BaseModel]
    func: Callable[..., Any]
    irreversible: bool = False
    profiles: frozenset[str] = ALL_PROFILES
    wants_ctx: bool = False
    backend: str = ""

    def __post_init__(self) -> None:
        if len(self.name) > MAX_TOOL_NAME or not TOOL_NAME_RE.match(self.name):
            raise ValueError(f"bad tool name {self.name!r}: lowercase words joined by dots, like 'files.search'")
        if not (isinstance(self.args_model, type) and issubclass(self.args_model, BaseModel)):
            raise TypeError(f"tool {self.name}: args_model must be a pydantic model class")
        object.__setattr__(self, "profiles", frozenset(self.profiles))

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.func)

    def offered_on(self, profile: str | None) -> bool:
        return profile is None or profile in self.profiles

    def validate(self, args: Any) -> BaseModel:
        """The parsed arguments, or ToolError BAD_REQUEST listing every bad field."""
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise ToolError(f"arguments for {self.name} must be a JSON object, not {type(args).__name__}")
        try:
            return self.args_model.model_validate(dict(args))
        except ValidationError as exc:
            problems = [_describe_error(e, self.args_model) for e in exc.errors(include_url=False)]
            raise ToolError(
                f"invalid arguments for {self.name}: " + "; ".join(problems),
                details={"errors": [{"loc": [str(p) for p in e["loc"]], "type": e["type"], "msg": e["msg"]}
                                    for e in exc.errors(include_url=False)]},
            ) from None

    def parameters_schema(self) -> dict[str, Any]:
        """The argument schema as the model sees it (see :func:`prompt_schema`)."""
        return prompt_schema(self.args_model)

    def to_spec(self) -> ToolSpec:
        return ToolSpec(name=self.name, description=self.description,
                        parameters=self.parameters_schema(), irreversible=self.irreversible)


def _describe_error(err: Mapping[str, Any], model: type[BaseModel]) -> str:
    where = ".".join(str(p) for p in err["loc"]) or "arguments"
    kind = err["type"]
    if kind == "missing":
        return f"{where}: missing required argument"
    if kind == "extra_forbidden":
        allowed = ", ".join(model.model_fields) or "none"
        return f"{where}: unknown argument (allowed: {allowed})"
    shown = repr(err.get("input"))
    if len(shown) > _SHOWN_INPUT_CHARS:
        shown = shown[:_SHOWN_INPUT_CHARS] + "..."
    return f"{where}: {err['msg']} (got {shown})"


def tool_from_function(
    func: Callable[..., Any],
    name: str | None = None,
    *,
    description: str | None = None,
    irreversible: bool = False,
    profiles: Iterable[str] = ALL_PROFILES,
    backend: str = "",
) -> Tool:
    """Build a Tool whose argument model comes from `func`'s type-hinted signature.

    Every parameter needs a type hint (it becomes the schema); defaults make arguments
    optional; ``Annotated[T, Field(description=...)]`` documents them for the model.
    The description defaults to the first line of the docstring.
    """
    name = name or func.__name__
    model, wants_ctx = _args_model(func, name)
    if description is None:
        doc = inspect.getdoc(func) or ""
        description = doc.strip().splitlines()[0].strip() if doc.strip() else ""
    return Tool(name=name, description=description, args_model=model, func=func,
                irreversible=irreversible, profiles=frozenset(profiles), wants_ctx=wants_ctx, backend=backend)


def _args_model(func: Callable[..., Any], name: str) -> tuple[type[BaseModel], bool]:
    try:
        hints = typing.get_type_hints(func, include_extras=True)
    except Exception as exc:  # an unresolvable forward reference
        raise TypeError(f"tool {name}: cannot resolve the type hints of {func.__qualname__}: {exc}") from exc
    fields: dict[str, Any] = {}
    wants_ctx = False
    for param in inspect.signature(func).parameters.values():
        if param.name == _CTX_PARAM:
            wants_ctx = True
            continue
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise TypeError(f"tool {name}: parameter {param.name!r} must be a named parameter, not *args/**kwargs"
                            " or positional-only")
        if param.name not in hints:
            raise TypeError(f"tool {name}: parameter {param.name!r} needs a type hint (it becomes the schema)")
        fields[param.name] = (hints[param.name], ... if param.default is param.empty else param.default)
    model_name = "".join(part.title() for part in re.split(r"[._]", name)) + "Args"
    model = create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)
    return model, wants_ctx


# --------------------------------------------------------------------------- schema

# What reaches the prompt: what the Qwen template shows, plus the bounds the
# grammar builder turns into constraints. Titles, `$defs`, formats and defaults
# are token noise for a small model; formats and defaults move into the description.
_SCHEMA_KEYS = ("type", "description", "enum", "items", "properties", "required",
                "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems")
_FORMAT_HINTS = {"date": "YYYY-MM-DD", "date-time": "YYYY-MM-DDTHH:MM", "time": "HH:MM", "uri": "a URL"}


def prompt_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The plain JSON schema of `model` for the model prompt: refs inlined, optionals
    collapsed, only type/properties/required/description/enum/items and bounds kept."""
    return schema_for_prompt(model.model_json_schema())


def schema_for_prompt(raw: Mapping[str, Any]) -> dict[str, Any]:
    """An object's JSON schema from elsewhere (an MCP server's `inputSchema`) cleaned as
    :func:`prompt_schema` cleans ours."""
    out = _clean(raw, raw.get("$defs", {}))
    out["type"] = "object"
    out.setdefault("properties", {})
    return out


def _clean(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    schema = dict(schema)
    ref = schema.pop("$ref", None)
    if isinstance(ref, str):
        schema = {**defs.get(ref.rsplit("/", 1)[-1], {}), **schema}
    for key in ("allOf", "anyOf", "oneOf"):
        branches = [b for b in schema.pop(key, None) or () if isinstance(b, Mapping) and b.get("type") != "null"]
        if len(branches) == 1:  # Optional[X] and single allOf: X, keeping the outer description/default
            schema = {**_clean(branches[0], defs), **schema}
        elif branches:
            cleaned = [_clean(b, defs) for b in branches]
            if all(set(c) == {"type"} and isinstance(c["type"], str) for c in cleaned):
                schema["type"] = [c["type"] for c in cleaned]
            else:
                schema["anyOf"] = cleaned
    if "const" in schema and "enum" not in schema:
        schema["enum"] = [schema["const"]]

    out: dict[str, Any] = {k: schema[k] for k in _SCHEMA_KEYS if k in schema}
    if "anyOf" in schema:
        out["anyOf"] = schema["anyOf"]
    if isinstance(out.get("properties"), Mapping):
        out["properties"] = {k: _clean(v, defs) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), Mapping):
        out["items"] = _clean(out["items"], defs)
    if not out.get("required"):
        out.pop("required", None)

    notes = []
    if schema.get("format") in _FORMAT_HINTS:
        notes.append(_FORMAT_HINTS[schema["format"]])
    if schema.get("default") is not None:
        notes.append(f"default: {json.dumps(schema['default'], ensure_ascii=False)}")
    if notes:
        text = out.get("description", "")
        out["description"] = f"{text} ({', '.join(notes)})" if text else ", ".join(notes)
    order = {k: i for i, k in enumerate(_SCHEMA_KEYS)}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


# --------------------------------------------------------------------------- invoking


async def invoke(tool: Tool, args: Mapping[str, Any] | None, ctx: ToolContext | None = None) -> Any:
    """Validate `args`, run the tool, and return its result as JSON-safe data.

    Sync tools run on a worker thread. If the call is canceled or passes
    `ctx.deadline`, the caller gets control back at once and the context is marked
    canceled so a sync tool stops at its next ``ctx.check()``. Failures are typed:
    ToolError (BAD_REQUEST for bad arguments, TIMEOUT, or whatever the tool raised),
    other PsymeshErrors pass through, and a bug in a tool becomes ToolError INTERNAL.
    """
    ctx = ctx if ctx is not None else ToolContext()
    parsed = tool.validate(args)
    kwargs = dict(parsed)  # shallow: nested models stay models, as the signature declared
    if tool.wants_ctx:
        kwargs[_CTX_PARAM] = ctx
    ctx.check()
    result: Any = None
    try:
        with anyio.move_on_after(ctx.remaining()) as scope:
            if tool.is_async:
                result = await tool.func(**kwargs)
            else:
                result = await anyio.to_thread.run_sync(functools.partial(tool.func, **kwargs),
                                                        abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        ctx.cancel()
        raise
    except PsymeshError:
        raise
    except Exception as exc:
        log.warning("tool %s failed", tool.name, exc_info=True)
        raise ToolError(f"{tool.name} failed: {type(exc).__name__}: {exc}", code=ErrorCode.INTERNAL) from exc
    if scope.cancelled_caught:
        ctx.cancel()
        raise ToolError(f"{tool.name} did not finish before the deadline", code=ErrorCode.TIMEOUT)
    return _json_result(tool.name, result)


def _json_result(name: str, result: Any) -> Any:
    try:
        value = to_jsonable_python(result)
    except PydanticSerializationError as exc:
        raise ToolError(f"{name} returned a value that is not JSON data: {exc}", code=ErrorCode.INTERNAL) from None
    try:
        return check_json(value, f"result of {name}")
    except ValueError as exc:
        raise ToolError(str(exc), code=ErrorCode.TOO_LARGE) from None


# --------------------------------------------------------------------------- registry


class ToolRegistry:
    """The tools a node offers, by name. Names are unique; registering twice is an error."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    def register(self, tool: Tool, *, replace: bool = False) -> Tool:
        if not isinstance(tool, Tool):
            raise TypeError(f"expected a Tool, got {type(tool).__name__}")
        if tool.name in self._tools and not replace:
            raise PsymeshError(f"a tool named {tool.name!r} is already registered", code=ErrorCode.CONFLICT)
        self._tools[tool.name] = tool
        return tool

    def tool(
        self,
        name: str | None = None,
        *,
        description: str | None = None,
        irreversible: bool = False,
        profiles: Iterable[str] = ALL_PROFILES,
        backend: str = "",
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register a function as a tool (see :func:`tool_from_function`).
        The function itself is returned unchanged, so it stays directly callable."""

        def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
            self.register(tool_from_function(func, name, description=description,
                                             irreversible=irreversible, profiles=profiles, backend=backend))
            return func

        return decorate

    def get(self, name: str, profile: str | None = None) -> Tool:
        """The tool called `name` (offered on `profile`, if given), or ToolError NOT_FOUND."""
        tool = self._tools.get(name)
        if tool is not None and tool.offered_on(profile):
            return tool
        known = self.names(profile)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6) if isinstance(name, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else f" (available: {', '.join(known) or 'none'})"
        raise ToolError(f"no tool named {name!r}{hint}", code=ErrorCode.NOT_FOUND)

    def names(self, profile: str | None = None) -> list[str]:
        return sorted(n for n, t in self._tools.items() if t.offered_on(profile))

    def specs(self, profile: str | None = None) -> list[ToolSpec]:
        """What to announce to the model: the tools offered on `profile`, sorted by name."""
        return [self._tools[n].to_spec() for n in self.names(profile)]

    async def invoke(self, name: str, args: Mapping[str, Any] | None, ctx: ToolContext | None = None,
                     *, profile: str | None = None) -> Any:
        """Look up and :func:`invoke` a tool in one step."""
        return await invoke(self.get(name, profile), args, ctx)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter([self._tools[n] for n in sorted(self._tools)])

    def __len__(self) -> int:
        return len(self._tools)


# --------------------------------------------------------------------------- plugins


def load_entry_points(registry: ToolRegistry, group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Register the tools that installed packages declare, and return their names.

    An entry point may name a :class:`Tool`, an iterable of Tools, a ToolRegistry, or a
    callable that takes a registry and registers tools on it (a setup hook)::

        [project.entry-points."psymesh.tools"]
        weather = "psymesh_weather:register"

    Each plugin is all-or-nothing: it is loaded into a scratch registry first, so one
    that fails to import, raises, or reuses a taken name is skipped with a warning and
    leaves `registry` untouched. A bad plugin never stops the node.
    """
    loaded: list[str] = []
    for ep in importlib.metadata.entry_points(group=group):
        try:
            scratch = ToolRegistry()
            _register_plugin(scratch, ep.load())
            taken = [t.name for t in scratch if t.name in registry]
            if taken:
                raise ValueError(f"tool names already taken: {', '.join(taken)}")
        except (Exception, SystemExit) as exc:
            log.warning("skipping tool plugin %r (%s): %s: %s", ep.name, ep.value, type(exc).__name__, exc)
            continue
        for t in scratch:
            registry.register(t)
            loaded.append(t.name)
    return loaded


def _register_plugin(registry: ToolRegistry, obj: Any) -> None:
    if isinstance(obj, Tool):
        registry.register(obj)
    elif isinstance(obj, ToolRegistry):
        for t in obj:
            registry.register(t)
    elif callable(obj):
        obj(registry)
    elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        for t in obj:
            registry.register(t)
    else:
        raise TypeError(f"a plugin must be a Tool, tools, a ToolRegistry or a setup function, not {type(obj).__name__}")
    if not len(registry):
        raise ValueError("the plugin registered no tools")
