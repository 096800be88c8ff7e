"""MCP servers' tools as this node's tools: `[[mcp]]` in config.toml mounts a server
(stdio: the node runs its command; or streamable HTTP at a URL) through the official
`mcp` SDK, and each of its tools joins the node's ToolRegistry as `mcp.NAME.TOOL`.

From there an MCP tool is like any other: a paired peer calls it with a delegated
`tool` task, or an agent run uses it, only where the peer's grant covers it
(`tool:mcp.files.*`; the door checks a tool task, `granted_tools` an agent run's
offer); its arguments are checked against the server's `inputSchema` before the call
leaves the node; its result is marked `"untrusted": true`, since it is whatever the
server (or what the server read) says. An unannotated tool counts as irreversible, as
the MCP spec's defaults (not read-only, destructive) say, so an agent asks first.

A server that dies (its process exits, its connection drops, a probe fails) is
restarted with exponential backoff (`restart_min_s` doubling to `restart_max_s`); its
tools stay registered and answer ToolError UNAVAILABLE meanwhile, so a caller learns
why, and when to try again. A quiet server is probed (`tools/list`) every `probe_s`,
which also picks up tools it added.

The SDK is anyio-based; its client (stdio included) runs unchanged on the daemon's
trio loop, so no asyncio thread or bridge is needed.

MCP tool names allow capitals, dashes and dots; ours are lowercase words joined by
dots (agent/acting/tools.py TOOL_NAME_RE), so `readFile` / `read-file` become `read_file`,
and a name that would collide or run past 64 characters gets a short hash.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from pydantic import BaseModel, ConfigDict, ValidationError

from ...agent.formats.chatformat import ToolSpec
from ...agent.acting.tools import MAX_TOOL_NAME, TOOL_NAME_RE, Tool, ToolError, ToolRegistry, schema_for_prompt
from ..core.bridgeconfig import McpServerConfig
from ..core.paths import private_opener
from ...protocol.errors import ErrorCode, PsymeshError

log = logging.getLogger("psymesh.mcp")

STARTUP_WAIT_S = 15.0       # the node reports ready after every server's first attempt, or this long
MAX_ERROR_TEXT = 2000       # of a server's error text, in a ToolError
MAX_LISTED_PAGES = 20       # tools/list pages read from one server
LOG_ROTATE_BYTES = 1 << 20  # a stdio server's stderr log is rotated past this at each start


class _Arguments(BaseModel):
    """Whatever the inputSchema allowed (it is checked by McpTool.validate)."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True)
class McpTool(Tool):
    """A tool of a mounted MCP server: its schema is the server's, not a signature's."""

    server: str = ""
    remote_name: str = ""
    input_schema: Mapping[str, Any] = field(default_factory=dict, compare=False)
    validator: Any = field(default=None, compare=False, repr=False)  # jsonschema's, for input_schema

    def parameters_schema(self) -> dict[str, Any]:
        return schema_for_prompt(self.input_schema)

    def validate(self, args: Any) -> BaseModel:
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise ToolError(f"arguments for {self.name} must be a JSON object, not {type(args).__name__}")
        args = self._without_unset(args)
        problems = [f"{'.'.join(str(p) for p in e.absolute_path) or 'arguments'}: {e.message}"
                    for e in sorted(self.validator.iter_errors(dict(args)), key=lambda e: list(e.absolute_path))]
        if problems:
            raise ToolError(f"invalid arguments for {self.name}: " + "; ".join(problems[:8]))
        return _Arguments.model_validate(dict(args))

    def _without_unset(self, args: Mapping[str, Any]) -> Mapping[str, Any]:
        """`args` less the optional ones given as null, where the schema does not take null
        there: null means "not given" (a model writes it so; MCP 2026-07-28 omits a null
        parameter's Mcp-Param header), so it is not sent, rather than the call refused."""
        required = set(self.input_schema.get("required", []))
        unset = {k for k, v in args.items() if v is None and k not in required}
        if not unset or self.validator.is_valid(dict(args)):
            return args
        return {k: v for k, v in args.items() if k not in unset}


def local_name(server: str, remote: str, taken: set[str]) -> str:
    """`mcp.SERVER.TOOL` for the MCP tool `remote`: a name TOOL_NAME_RE accepts, not in `taken`."""
    prefix = f"mcp.{server}."
    words = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", remote).lower()
    base = re.sub(r"[^a-z0-9_]+", "_", words).strip("_") or "tool"
    if not base[0].isalpha():
        base = "t_" + base
    room = MAX_TOOL_NAME - len(prefix)
    name = prefix + base
    if len(name) > MAX_TOOL_NAME or name in taken:
        name = prefix + base[:room - 9].rstrip("_") + "_" + hashlib.sha256(remote.encode()).hexdigest()[:8]
    return name


class McpServer:
    """One mounted server: its connection, its tools, its restarts."""

    def __init__(self, config: McpServerConfig, registry: ToolRegistry, log_dir: Path) -> None:
        self.config = config
        self.name = config.name
        self.registry = registry
        self.log_dir = log_dir
        self.settled = anyio.Event()         # the first attempt to connect ended, either way
        self.tools: dict[str, McpTool] = {}  # by local name: everything this server ever offered here
        self.restarts = 0
        self.problem = "starting"            # why it is down (while it is)
        self.retry_at: float | None = None   # time.time() of the next attempt, while down
        self._client: Any = None             # mcp.Client while up
        self._offered: set[str] = set()      # remote names it offers now
        self._up_since: float | None = None  # time.monotonic() since it is up
        self._lost = anyio.Event()

    @property
    def up(self) -> bool:
        return self._client is not None

    @property
    def log_path(self) -> Path | None:
        """Where a command's stderr goes (a server's own account of why it fails); None for a URL."""
        return None if self.config.command is None else self.log_dir / f"mcp-{self.name}.log"

    # -- supervision ------------------------------------------------------------------------
    async def run(self) -> None:
        """Connect, list, serve; on any failure wait (backoff) and start again, forever."""
        delay = self.config.restart_min_s
        while True:
            self._up_since = None
            try:
                await self._serve_once()
            except Exception as exc:  # the SDK raises many types (OSError, MCPError, groups): all mean "down"
                self.problem = _describe(exc)
            finally:
                self._client = None
                self.settled.set()
            if self._up_since is not None and time.monotonic() - self._up_since >= self.config.restart_max_s:
                delay = self.config.restart_min_s  # it served well for a while: start the backoff over
            log.warning("MCP server %s is down (%s)%s; next attempt in %g s", self.name, self.problem,
                        f"; its stderr: {self.log_path}" if self.log_path else "", delay)
            self.retry_at = time.time() + delay
            await anyio.sleep(delay)
            delay = min(delay * 2, self.config.restart_max_s)
            self.restarts += 1

    async def _serve_once(self) -> None:
        from mcp import Client

        self._lost = anyio.Event()
        with self._stderr() as errlog:
            async with Client(self._transport(errlog), cache=None, elicitation_callback=_nobody_to_ask) as client:
                self._publish(await self._list(client))
                self._client, self.retry_at, self.problem = client, None, ""
                self._up_since = time.monotonic()
                self.settled.set()
                log.info("MCP server %s is up: %s", self.name, ", ".join(sorted(self.tools)) or "no tools")
                while True:
                    with anyio.move_on_after(self.config.probe_s):
                        await self._lost.wait()
                    if self._lost.is_set():
                        return
                    try:
                        with anyio.fail_after(self.config.call_timeout_s):
                            self._publish(await self._list(client))
                    except TimeoutError:
                        raise PsymeshError(f"no answer to a probe within {self.config.call_timeout_s:g} s",
                                           code=ErrorCode.TIMEOUT) from None

    def _transport(self, errlog: Any) -> Any:
        """The SDK's transport: the command's stdin/stdout, or streamable HTTP."""
        if self.config.url is not None:
            from mcp.client.streamable_http import streamable_http_client

            return streamable_http_client(self.config.url)
        from mcp.client.stdio import StdioServerParameters, stdio_client

        assert self.config.command is not None
        params = StdioServerParameters(command=self.config.command[0], args=self.config.command[1:],
                                       env=self.config.env or None, cwd=self.config.cwd)
        return stdio_client(params, errlog=errlog)

    def _stderr(self) -> Any:
        """Where a stdio server's stderr goes: <home>/mcp-NAME.log (0600), rotated once big."""
        path = self.log_path
        if path is None:
            return contextlib.nullcontext()
        try:
            if path.stat().st_size > LOG_ROTATE_BYTES:
                path.replace(path.with_suffix(".log.1"))
        except FileNotFoundError:
            pass
        return open(path, "a", opener=private_opener)

    async def _list(self, client: Any) -> list[Any]:
        tools, cursor = [], None
        for _ in range(MAX_LISTED_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        return tools

    def _publish(self, listed: list[Any]) -> None:
        """Register (or update) the server's tools; a tool it stopped offering stays
        registered and answers NOT_FOUND (the registry has no removal, and a peer's
        caps may still name it)."""
        from jsonschema import SchemaError
        from jsonschema.validators import validator_for

        by_remote = {t.remote_name: t for t in self.tools.values()}
        taken = set(self.registry.names())
        offered = set()
        for remote in sorted(listed, key=lambda t: t.name):
            known = by_remote.get(remote.name)
            name = known.name if known is not None else local_name(self.name, remote.name, taken)
            schema = dict(remote.input_schema or {"type": "object", "properties": {}})
            hints = remote.annotations
            read_only = bool(hints and hints.read_only_hint)
            destructive = hints.destructive_hint if hints and hints.destructive_hint is not None else True
            try:
                validator = validator_for(schema)(schema)
                validator.check_schema(schema)
                tool = McpTool(name=name, description=(remote.description or remote.title or "").strip()[:1024],
                               args_model=_Arguments, func=self._caller(remote.name),
                               irreversible=not read_only and destructive, server=self.name,
                               remote_name=remote.name, input_schema=schema, validator=validator)
                ToolSpec.model_validate(tool.to_spec().model_dump())  # what a prompt will need of it
            except (SchemaError, ValidationError, ValueError, TypeError) as exc:
                log.warning("MCP server %s: tool %r cannot be offered here: %s", self.name, remote.name, exc)
                continue
            if not TOOL_NAME_RE.match(name):  # local_name's promise; a bug would show here
                continue
            if name in taken and name not in self.tools:
                log.warning("MCP server %s: tool %r would take %s, which another tool has", self.name,
                            remote.name, name)
                continue
            self.registry.register(tool, replace=True)
            self.tools[name] = tool
            taken.add(name)
            offered.add(remote.name)
        self._offered = offered

    def _caller(self, remote: str) -> Any:
        async def call(**arguments: Any) -> dict[str, Any]:
            return await self.call(remote, arguments)

        return call

    # -- calls -------------------------------------------------------------------------------
    async def call(self, remote: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Call tool `remote` on the server: its result, marked untrusted; ToolError
        UNAVAILABLE while the server is down (and when the call finds it dead)."""
        from mcp.shared.exceptions import MCPError

        client = self._client
        if client is None:
            raise self._unavailable()
        if remote not in self._offered:
            raise ToolError(f"MCP server {self.name} no longer offers {remote!r}", code=ErrorCode.NOT_FOUND)
        try:
            with anyio.fail_after(self.config.call_timeout_s):
                result = await client.call_tool(remote, arguments)
        except TimeoutError:
            raise ToolError(f"MCP server {self.name} did not answer {remote} within "
                            f"{self.config.call_timeout_s:g} s", code=ErrorCode.TIMEOUT) from None
        except MCPError as exc:
            if exc.code == _CONNECTION_CLOSED:
                self._lose(f"connection closed ({exc.message})")
                raise self._unavailable() from None
            raise ToolError(f"MCP server {self.name} refused {remote}: {exc.message[:MAX_ERROR_TEXT]}") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError) as exc:
            self._lose(_describe(exc))
            raise self._unavailable() from None
        except ValidationError as exc:  # the SDK could not read the server's result
            raise ToolError(f"MCP server {self.name} answered {remote} with a result this node cannot read: "
                            f"{str(exc).splitlines()[0][:MAX_ERROR_TEXT]}") from None
        content = [_content(item) for item in result.content]
        if result.is_error:
            text = " ".join(c.get("text", "") for c in content if c.get("type") == "text").strip()
            raise ToolError(f"{remote} (MCP server {self.name}) failed: {text[:MAX_ERROR_TEXT] or 'no reason given'}")
        out: dict[str, Any] = {"untrusted": True, "server": self.name, "tool": remote, "content": content}
        if result.structured_content is not None:
            out["structured"] = result.structured_content
        return out

    def _lose(self, why: str) -> None:
        """A call found the connection dead: tell the supervisor now, not at the next probe."""
        if self._client is not None:
            self.problem = why
            self._client = None
            self._lost.set()

    def _unavailable(self) -> ToolError:
        when = "" if self.retry_at is None else f"; next attempt in {max(0.0, self.retry_at - time.time()):.0f} s"
        return ToolError(f"MCP server {self.name} is unavailable ({self.problem or 'restarting'}{when})",
                         code=ErrorCode.UNAVAILABLE, retry_after=None if self.retry_at is None
                         else max(0.0, self.retry_at - time.time()))


_CONNECTION_CLOSED = -32000  # mcp_types.CONNECTION_CLOSED


async def _nobody_to_ask(context: Any, params: Any) -> Any:
    """A server asking the user for input in the middle of a call (elicitation; from MCP
    2026-07-28 an InputRequiredResult the client answers and retries with the server's
    requestState): nobody is at the node to answer, so the answer is `cancel` (dismissed,
    no choice made), and the call ends with whatever the server makes of that."""
    from mcp import types

    return types.ElicitResult(action="cancel")


def _content(item: Any) -> dict[str, Any]:
    """An MCP content block as JSON data; binary payloads (images, audio, blobs) are
    summarized, not carried: a tool result travels in a task event."""
    data = item.model_dump(mode="json", exclude_none=True, by_alias=True)
    for key in ("data", "blob"):
        if isinstance(data.get(key), str):
            data[key] = f"<{math.ceil(len(data[key]) * 3 / 4)} bytes omitted>"
    resource = data.get("resource")
    if isinstance(resource, dict) and isinstance(resource.get("blob"), str):
        resource["blob"] = f"<{math.ceil(len(resource['blob']) * 3 / 4)} bytes omitted>"
    return data


def _describe(exc: BaseException) -> str:
    """One line for a failure the SDK may have wrapped in exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


@dataclass(frozen=True)
class McpStatus:
    name: str
    up: bool
    tools: list[str]
    problem: str
    restarts: int
    log: str | None


class McpTools:
    """Every `[[mcp]]` server of a node; `run` keeps them mounted in the node's task group."""

    def __init__(self, configs: list[McpServerConfig], registry: ToolRegistry, log_dir: Path) -> None:
        names = [c.name for c in configs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PsymeshError(f"[[mcp]] names must be unique; given twice: {', '.join(twice)}",
                               code=ErrorCode.BAD_REQUEST)
        self.servers = {c.name: McpServer(c, registry, log_dir) for c in configs}

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Mount every server; ready once each has had its first try (or STARTUP_WAIT_S
        passed), so a peer's first call after the node starts finds the tools."""
        async with anyio.create_task_group() as tg:
            for server in self.servers.values():
                tg.start_soon(server.run)
            with anyio.move_on_after(STARTUP_WAIT_S):
                for server in self.servers.values():
                    await server.settled.wait()
            task_status.started()

    def status(self) -> list[McpStatus]:
        return [McpStatus(name=s.name, up=s.up, tools=sorted(s.tools), problem=s.problem, restarts=s.restarts,
                          log=None if s.log_path is None else str(s.log_path))
                for s in self.servers.values()]
