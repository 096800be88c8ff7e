"""`psymesh serve openai|a2a` (the HTTP faces, in the daemon or in the foreground) and
`psymesh mcp` (the MCP servers the node's agent may use); see docs/bridges.md."""
from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import click

from ..core.paths import HomePaths
from .output import Output, escape
from ...protocol import control as c
from ...protocol.errors import ErrorCode, PsymeshError
from .common import command, home_at, on_node, run_async

if TYPE_CHECKING:
    from rich.console import Console
    from ..control.client import Client


@click.group()
def serve() -> None:
    """Serve this node's models (OpenAI) or its agent (A2A) to apps that speak another API."""


def _serve_options(section: Literal["openai", "a2a"], default_port: int, env: str) -> Callable[..., Any]:
    """The options `serve openai` and `serve a2a` share. `--api-key` is kept hidden only to
    refuse it with the ways that replace it."""

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed([
            click.option("--host", default=None, help=f"Address to bind (default: [serve.{section}] host, 127.0.0.1)."),
            click.option("--port", type=click.IntRange(0, 65535), default=None,
                         help=f"Port (default: [serve.{section}] port, {default_port}; 0: any free port, logged at "
                              "start)."),
            click.option("--api-key-file", type=click.Path(dir_okay=False, exists=True), default=None,
                         help=f"A file (mode 0600) holding the key clients send as `Authorization: Bearer KEY`. "
                              f"Default: ${env} if set, else [serve.{section}] api_key_file, else "
                              f"<home>/{section}.key, made on first use."),
            # Gone: a command line is readable by every local user (/proc/PID/cmdline).
            click.option("--api-key", "api_key_given", default=None, hidden=True),
            click.option("--show-key", is_flag=True, help="Print the key (making it if there is none yet) and exit."),
            click.option("--save", is_flag=True, help=f"Also write these settings to config.toml ([serve.{section}] "
                                                      "enabled), so `node start` serves it from now on."),
            click.option("--log-json", is_flag=True, help="Log one JSON object per line (stderr)."),
        ]):
            f = option(f)
        return f

    return wrap


@serve.command("openai")
@command
@_serve_options("openai", 8080, "PSYMESH_OPENAI_API_KEY")
def serve_openai(home: str | None, out: Output, host: str | None, port: int | None, api_key_file: str | None,
                 api_key_given: str | None, show_key: bool, save: bool, log_json: bool) -> None:
    """Serve the OpenAI-compatible endpoint: in the running daemon, or in a node run in the foreground.

    Models are this node's (`tiny`) and, as `PEER/MODEL` (`home/tiny`), each model of a
    paired peer whose grant to this node covers it (task.infer, models=... included).
    Clients need the key (--show-key prints it).
    With a daemon already running for this home (a service, say), the endpoint is turned
    on in it instead, until it stops (--save: at every start).
    """
    _serve_foreground(home, out, "openai", host, port, api_key_file, api_key_given, show_key, save, log_json)


@serve.command("a2a")
@command
@_serve_options("a2a", 8081, "PSYMESH_A2A_API_KEY")
def serve_a2a(home: str | None, out: Output, host: str | None, port: int | None, api_key_file: str | None,
              api_key_given: str | None, show_key: bool, save: bool, log_json: bool) -> None:
    """Serve the node's agent over A2A: in the running daemon, or in a node run in the foreground.

    The agent card is at /.well-known/agent-card.json; a message runs this node's agent
    with its tools (irreversible ones refused). Clients need the key (--show-key prints
    it). With a daemon already running for this home (a service, say), the agent is served
    by it instead, until it stops (--save: at every start).
    """
    _serve_foreground(home, out, "a2a", host, port, api_key_file, api_key_given, show_key, save, log_json)


def _serve_foreground(home: str | None, out: Output, section: Literal["openai", "a2a"], host: str | None,
                      port: int | None, api_key_file: str | None, api_key_given: str | None, show_key: bool,
                      save: bool, log_json: bool) -> None:
    """The endpoint on in the running daemon, or else `node start` with [serve.SECTION] turned
    on for this run (and saved with --save); or, with --show-key, the key clients need."""
    from ..bridges.apikey import load_api_key
    from ..core.bridgeconfig import A2AServe, OpenAIServe
    from ..daemon import Node
    from ..core.logs import setup_logging

    if api_key_given is not None:
        env = {"openai": OpenAIServe, "a2a": A2AServe}[section].KEY_ENV
        raise PsymeshError(f"--api-key is gone: a command line is readable by every local user (/proc/PID/cmdline); "
                           f"put the key in a file (mode 0600) and use --api-key-file FILE, or set ${env}",
                           code=ErrorCode.BAD_REQUEST)
    node_home = home_at(home)
    node_home.init()
    config = node_home.load_config()
    current = getattr(config.serve, section)
    given = {"host": host, "port": port,
             "api_key_file": str(Path(api_key_file).resolve()) if api_key_file else None}
    settings = current.model_copy(update={"enabled": True, **{k: v for k, v in given.items() if v is not None}})
    if show_key:
        key = load_api_key(settings, node_home, os.environ)
        out.data({"key": key.value, "source": key.source}, lambda con: con.print(escape(key.value)))
        if not out.json_mode:
            out.hint(f"from {key.source}")
        return
    config = config.model_copy(update={"serve": config.serve.model_copy(update={section: settings})})
    if save:
        node_home.save_config(config)
    if node_home.socket_path.exists() and _serve_in_daemon(home, out, section, host, port, given, save):
        return
    setup_logging(json_lines=log_json or config.log_json)
    run_async(Node(node_home, config).run)


def _serve_in_daemon(home: str | None, out: Output, section: Literal["openai", "a2a"], host: str | None,
                     port: int | None, given: dict[str, Any], save: bool) -> bool:
    """A daemon runs for this home (as a service, say): turn the endpoint on in it instead of
    starting a second node. False if no daemon answers (then `serve` runs one itself)."""
    from ..control.client import DaemonNotRunning

    async def go(client: Client) -> c.ServeReply:
        return await client.serve(section, host=host, port=port, api_key_file=given["api_key_file"])

    try:
        reply = on_node(home, go)
    except DaemonNotRunning:
        return False
    what = "OpenAI-compatible endpoint" if section == "openai" else "A2A agent"
    url = reply.url + ("/v1" if section == "openai" else "")
    state = "was already on" if reply.already else "is on"
    out.data({"section": section, "url": url, "already": reply.already},
             lambda con: con.print(f"the running daemon's {what} {state} at {url}"))
    out.hint("it stays on until the daemon stops" + ("; config.toml turns it on at every start (--save)" if save
                                                     else "; add --save to turn it on at every start")
             + f"; clients need its key: {out.suggest(f'serve {section}', '--show-key')}")
    if reply.already and (host is not None or port is not None or given["api_key_file"]):
        out.warn("it kept the settings it started with; restart the daemon to change them")
    return True


@click.group()
def mcp() -> None:
    """MCP servers whose tools this node serves as mcp.NAME.* (the [[mcp]] tables of config.toml)."""


def _restart_hint(out: Output, home: str | None) -> None:
    if HomePaths(home).socket_path.exists():
        out.hint(f"restart the daemon to apply it: {out.suggest('node stop')}, then {out.suggest('node start')}")


def _absolute_command(command: tuple[str, ...], cwd: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """`command` as the daemon can run it from any directory: the program found on PATH (or a
    relative path to it) made absolute, and each argument that names an existing file or
    directory relative to here made absolute; with what changed, (given, stored). Paths are
    made absolute, not resolved: a venv's `python` stays the venv's, not the one it links to.
    With a `cwd` of its own, relative paths mean paths in it: only a bare program name is
    looked up on PATH."""
    import shutil

    if not command:
        return [], []
    program, *args = command
    found = shutil.which(program) if cwd is None or os.sep not in program else None
    stored = [os.path.abspath(found) if found else program]
    for arg in args:
        stored.append(os.path.abspath(arg) if cwd is None and not arg.startswith("-") and not os.path.isabs(arg)
                      and os.path.exists(arg) else arg)
    return stored, [(given, now) for given, now in zip(command, stored) if given != now]


@mcp.command("add")
@command
@click.argument("name")
@click.argument("server_command", nargs=-1, required=False, metavar="-- COMMAND [ARGS]...")
@click.option("--url", default=None, help="A streamable HTTP server instead of a command.")
@click.option("--env", "env_pairs", multiple=True, metavar="KEY=VALUE", help="Environment for a command (repeatable).")
@click.option("--cwd", default=None, help="Working directory for a command.")
def mcp_add(home: str | None, out: Output, name: str, server_command: tuple[str, ...], url: str | None,
            env_pairs: tuple[str, ...], cwd: str | None) -> None:
    """Add (or replace) the MCP server NAME: `psymesh mcp add notes -- python server.py ~/notes`.
    Its tools become mcp.NAME.*; grant them to a peer with `psymesh grant PEER +tool:mcp.NAME.*`."""
    from pydantic import ValidationError

    from ..core.bridgeconfig import McpServerConfig

    env = {}
    for pair_ in env_pairs:
        key, sep, value = pair_.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair_!r} is not KEY=VALUE", param_hint="--env")
        env[key] = value
    command_line, made_absolute = _absolute_command(server_command, cwd)
    if server_command and os.sep not in command_line[0]:
        out.warn(f"{server_command[0]!r} is not on this PATH; the daemon will look for it on its own")
    try:
        entry = McpServerConfig(name=name, command=command_line or None, url=url, env=env,
                                cwd=os.path.abspath(cwd) if cwd else None)
    except ValidationError as exc:
        raise click.UsageError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    node_home = home_at(home)
    node_home.init()
    config = node_home.load_config()
    servers = [m for m in config.mcp if m.name != name] + [entry]
    node_home.save_config(config.model_copy(update={"mcp": servers}))
    out.data(entry, lambda con: con.print(f"mcp server {name} added: its tools are mcp.{name}.*"))
    if made_absolute:  # the daemon may run from another directory (a service's is /)
        out.hint("stored with absolute paths, as the daemon runs it from any directory: "
                 + ", ".join(f"{given} -> {now}" for given, now in made_absolute))
    _restart_hint(out, home)


@mcp.command("remove")
@command
@click.argument("name")
def mcp_remove(home: str | None, out: Output, name: str) -> None:
    """Remove the MCP server NAME from config.toml."""
    node_home = home_at(home)
    config = node_home.load_config()
    if not any(m.name == name for m in config.mcp):
        raise PsymeshError(f"no MCP server {name!r} in {node_home.config_path}; see: {out.suggest('mcp list')}",
                           code=ErrorCode.NOT_FOUND)
    node_home.save_config(config.model_copy(update={"mcp": [m for m in config.mcp if m.name != name]}))
    out.data({"removed": name}, lambda con: con.print(f"mcp server {name} removed"))
    _restart_hint(out, home)


@mcp.command("list")
@command
def mcp_list(home: str | None, out: Output) -> None:
    """The MCP servers in config.toml, and whether each is up in the running daemon."""
    from ..control.client import DaemonNotRunning

    servers = home_at(home).load_config().mcp
    running: dict[str, c.McpServerState] | None = None
    if servers:
        try:
            running = {s.name: s for s in on_node(home, lambda client: client.mcp_status())}
        except DaemonNotRunning:
            pass

    def state(name: str) -> str:
        if running is None:
            return "no daemon runs: cannot tell whether it is up"
        s = running.get(name)
        if s is None:
            return f"not in the running daemon: {out.suggest('node stop')}, then {out.suggest('node start')}"
        if s.up:
            return f"up, {len(s.tools)} tool{'s' if len(s.tools) != 1 else ''}"
        return f"down ({s.problem or 'starting'})" + (f"; its stderr: {s.log}" if s.log else "")

    def human(con: Console) -> None:
        if not servers:
            con.print(escape(f"no MCP servers (add one: {out.suggest('mcp add', 'NAME -- COMMAND ...')})"))
        for m in servers:
            con.print(escape(f"{m.name}: {' '.join(m.command) if m.command else m.url}  (tools mcp.{m.name}.*)"))
            con.print(escape(f"  {state(m.name)}"))

    # JSON: each config entry, with `running` the daemon's view of it (null: no daemon, or not in it)
    rows = [{**m.model_dump(mode="json"), "running": None if running is None or m.name not in running
             else running[m.name].model_dump(mode="json")} for m in servers]
    out.data(rows, human)
