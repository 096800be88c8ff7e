"""The `psymesh` command line. Every command takes --home and --json; data goes to
stdout, logs and hints to stderr (see node/cli/output.py)."""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio
import click
from rich.markup import escape

from ..control.client import Client
from ..core.db import storage_error
from ..core.home import NodeHome
from .output import Output
from .output import table as out_table
from ...protocol import control as c
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.limits import Limits
from ...protocol.tasks import InferResult

T = TypeVar("T")

home_option = click.option(
    "--home", type=click.Path(file_okay=False), envvar="PSYMESH_HOME", default=None,
    help="Node home directory (default: $PSYMESH_HOME, else the platform data dir).",
)
json_option = click.option("--json", "json_mode", is_flag=True, help="Print data as JSON on stdout.")


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """All commands run on trio: the daemon needs it, and the SDK works on it too."""
    return anyio.run(fn, backend="trio")


def _as_psymesh_error(exc: BaseException, home: str | None) -> PsymeshError | None:
    """The one error to show the user for `exc`, or None for a bug (which keeps its traceback).

    Task groups wrap what their tasks raised in exception groups (a refused control
    socket surfaces that way from `node start`), so a group whose every member maps is
    shown as its first member; SQLite errors from any store are explained like open_db's.
    """
    if isinstance(exc, PsymeshError):
        return exc
    if isinstance(exc, EvalStopped):
        return exc.error
    if isinstance(exc, sqlite3.Error):
        return storage_error(exc, NodeHome(home).db_path)
    if isinstance(exc, BaseExceptionGroup):
        mapped = [_as_psymesh_error(e, home) for e in exc.exceptions]
        if mapped and all(m is not None for m in mapped):
            return mapped[0]
    return None


class EvalStopped(Exception):
    """An eval that cannot mean anything (not a PsymeshError, so the scoring loops, which
    count a model error as one failed case, let it through): `error` is what to tell."""

    def __init__(self, error: PsymeshError) -> None:
        super().__init__(error.message)
        self.error = error


class _StopOverContext:
    """An eval's model, stopping the whole eval at the first prompt over the model's
    context: every case would fail the same way and score 0 % with exit status 0. Both
    eval paths (a case file, --bfcl) wrap their model in it."""

    def __init__(self, model: Any, name: str, n_ctx: int) -> None:
        self.model, self.name, self.n_ctx = model, name, n_ctx

    async def reply(self, *args: Any, **kwargs: Any) -> Any:
        from ...agent.inference import PromptTooLong

        try:
            return await self.model.reply(*args, **kwargs)
        except PromptTooLong as exc:
            raise EvalStopped(PsymeshError(
                f"eval stopped: {exc.message}; give model {self.name} a larger context: "
                f"psymesh model add {self.name} PATH.gguf --ctx {max(2 * self.n_ctx, 8192)}",
                code=ErrorCode.TOO_LARGE)) from None


def command(f: Callable[..., Any]) -> Callable[..., Any]:
    """Common options, and PsymeshError -> a clear message and exit status 1 (never a traceback)."""

    @home_option
    @json_option
    @functools.wraps(f)
    def wrapper(*args: Any, home: str | None, json_mode: bool, **kwargs: Any) -> Any:
        out = Output(json_mode)
        try:
            return f(*args, home=home, out=out, **kwargs)
        except (PsymeshError, EvalStopped, sqlite3.Error, BaseExceptionGroup) as exc:
            error = _as_psymesh_error(exc, home)
            if error is None:
                raise
            out.error(error)
            sys.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="psymesh")
def main() -> None:
    """psymesh: a peer-to-peer mesh for small on-device AI agents."""
    # Whatever this process creates is its owner's alone: the explicit 0600/0700 modes of
    # node/core/home.py and node/core/db.py cover psymesh's own files, this also covers files that
    # libraries create (the download cache of `psymesh model pull`).
    os.umask(0o077)


@main.command("id")
@command
def id_cmd(home: str | None, out: Output) -> None:
    """Show this node's peer id and fingerprint (creates the home on first use)."""
    node_home = NodeHome(home)
    identity = node_home.init()
    data = {"peer_id": identity.peer_id, "fingerprint": identity.fingerprint, "home": str(node_home.path)}
    out.data(data, lambda con: con.print(
        f"peer id:     {identity.peer_id}\nfingerprint: {identity.fingerprint}\nhome:        {node_home.path}"))


@main.group()
def node() -> None:
    """Run and stop the node daemon."""


@node.command("start")
@command
@click.option("--listen", multiple=True, metavar="MULTIADDR",
              help="Listen address (repeatable), e.g. /ip4/127.0.0.1/tcp/4001 (saved in config.toml).")
@click.option("--profile", type=click.Choice(["home", "phone"]), default=None, help="Node profile (saved in config.toml).")
@click.option("--name", default=None, help="Human name of this node (saved in config.toml).")
@click.option("--share", type=click.Path(file_okay=False, exists=True), default=None,
              help="Directory the files.* tools may read (saved in config.toml).")
@click.option("--log-json", is_flag=True, help="Log one JSON object per line (stderr).")
@click.option("--log-file", type=click.Path(dir_okay=False), default=None,
              help="Log to this file, rotated by size, instead of stderr (what `node install` sets up "
                   "where no journald keeps stderr).")
def node_start(home: str | None, out: Output, listen: tuple[str, ...], profile: str | None,
               name: str | None, share: str | None, log_json: bool, log_file: str | None) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM."""
    from ..daemon import Node
    from ..core.logs import setup_logging

    node_home = NodeHome(home)
    node_home.init(profile=profile, name=name)  # type: ignore[arg-type]
    config = node_home.load_config()
    changes: dict[str, Any] = {}
    if profile and profile != config.profile:
        changes["profile"] = profile
    if name and name != config.name:
        changes["name"] = name
    if share:
        changes["share_dir"] = str(Path(share).resolve())
    if listen and list(listen) != config.listen:  # remembered: `serve` and the unit `node install` writes use it
        changes["listen"] = list(listen)
    if changes:
        config = config.model_copy(update=changes)
        node_home.save_config(config)
    setup_logging(json_lines=log_json or config.log_json, log_file=Path(log_file) if log_file else None)
    daemon = Node(node_home, config)
    # What is loaded by now (modules, schemas, the node's services) lives as long as the
    # daemon: keep it out of every full collection, each a pause of ~80 ms otherwise
    # (seen as p99 outliers in bench/messaging.py).
    gc.collect()
    gc.freeze()
    run_async(daemon.run)


@node.command("stop")
@command
def node_stop(home: str | None, out: Output) -> None:
    """Ask the running daemon to shut down cleanly."""

    async def go() -> None:
        async with Client(home) as client:
            await client.shutdown()

    run_async(go)
    out.data({"stopped": True}, lambda con: con.print("daemon stopping"))


@node.command("install")
@command
@click.option("--user", "user_service", is_flag=True, default=True,
              help="A service of your own user (the only kind: psymesh never runs as root for you).")
@click.option("--dry-run", is_flag=True, help="Show the file and the commands; change nothing.")
@click.option("--platform", "platform_name", type=click.Choice(["linux", "macos", "termux"]), default=None,
              help="Render for this platform (default: this machine's); with --dry-run, for another machine.")
def node_install(home: str | None, out: Output, user_service: bool, dry_run: bool,
                 platform_name: str | None) -> None:
    """Start the daemon by itself: a systemd user unit (Linux), a launchd agent (macOS), or a
    Termux:Boot script (Android), restarted when it fails."""
    _service_change(home, out, platform_name, dry_run, installing=True)


@node.command("uninstall")
@command
@click.option("--dry-run", is_flag=True, help="Show what would be removed; change nothing.")
@click.option("--platform", "platform_name", type=click.Choice(["linux", "macos", "termux"]), default=None,
              help="The platform whose service to remove (default: this machine's).")
def node_uninstall(home: str | None, out: Output, dry_run: bool, platform_name: str | None) -> None:
    """Stop and remove what `psymesh node install` set up."""
    _service_change(home, out, platform_name, dry_run, installing=False)


def _service_change(home: str | None, out: Output, platform_name: str | None, dry_run: bool, *,
                    installing: bool) -> None:
    import shlex
    import shutil

    from ..control import install as svc

    node_home = NodeHome(home)
    platform = svc.PLATFORMS[svc.PLATFORMS.index(platform_name)] if platform_name else svc.this_platform()
    plan = svc.plan(platform, sys.executable, node_home.path, Path.home(), os.getuid())
    if dry_run:
        commands = (plan.unload if not installing else ()) + (plan.load if installing else plan.forget)
        data = {"platform": plan.platform, "path": str(plan.path), "content": plan.content if installing else None,
                "commands": [list(cmd) for cmd in commands], "dry_run": True}
        out.data(data, lambda con: con.print(
            (f"would write {plan.path}:\n\n{escape(plan.content)}" if installing else f"would remove {plan.path}")
            + "".join(f"\nwould run: {escape(shlex.join(cmd))}" for cmd in commands)))
        return
    if installing:
        node_home.init()  # the home exists, private, before a service runs in it
    available = svc.manager_available(plan, shutil.which, svc.run_command)
    change = svc.install if installing else svc.uninstall
    done = change(plan, available=available, run=svc.run_command)
    data = {"platform": plan.platform, "path": str(done.path), "changed": done.changed,
            "ran": [list(cmd) for cmd in done.ran], "to_run": [list(cmd) for cmd in done.to_run],
            "notes": list(done.notes), "dry_run": False}

    def human(con: Any) -> None:
        if installing:
            con.print(f"wrote {done.path}")
        else:
            con.print(f"removed {done.path}" if done.changed else f"nothing installed at {done.path}")
        for cmd in done.ran:
            con.print(f"ran: {escape(shlex.join(cmd))}")
        if done.to_run:
            con.print(f"{plan.manager or 'the service manager'} is not available here; run:")
            for cmd in done.to_run:
                con.print(f"  {escape(shlex.join(cmd))}")
        for note in done.notes:
            out.hint(note)

    out.data(data, human)


# -- bridges: HTTP faces for apps of other ecosystems (docs/bridges.md) -----------------------


@main.group()
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

    Models are this node's (`tiny`) and, as `PEER/MODEL` (`home/tiny`), those of paired
    peers that granted this node task.infer. Clients need the key (--show-key prints it).
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
    node_home = NodeHome(home)
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

    async def go() -> c.ServeReply:
        async with Client(home) as client:
            return await client.serve(section, host=host, port=port, api_key_file=given["api_key_file"])

    try:
        reply = run_async(go)
    except DaemonNotRunning:
        return False
    what = "OpenAI-compatible endpoint" if section == "openai" else "A2A agent"
    url = reply.url + ("/v1" if section == "openai" else "")
    state = "was already on" if reply.already else "is on"
    out.data({"section": section, "url": url, "already": reply.already},
             lambda con: con.print(f"the running daemon's {what} {state} at {url}"))
    out.hint("it stays on until the daemon stops" + ("; config.toml turns it on at every start (--save)" if save
                                                     else "; add --save to turn it on at every start")
             + f"; clients need its key: psymesh serve {section} --show-key")
    if reply.already and (host is not None or port is not None or given["api_key_file"]):
        out.warn("it kept the settings it started with; restart the daemon to change them")
    return True


@main.group()
def mcp() -> None:
    """MCP servers whose tools this node serves as mcp.NAME.* (the [[mcp]] tables of config.toml)."""


def _restart_hint(out: Output, home: str | None) -> None:
    if NodeHome(home).socket_path.exists():
        out.hint("restart the daemon to apply it: psymesh node stop, then psymesh node start")


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
    try:
        entry = McpServerConfig(name=name, command=list(server_command) or None, url=url, env=env, cwd=cwd)
    except ValidationError as exc:
        raise click.UsageError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    node_home = NodeHome(home)
    node_home.init()
    config = node_home.load_config()
    servers = [m for m in config.mcp if m.name != name] + [entry]
    node_home.save_config(config.model_copy(update={"mcp": servers}))
    out.data(entry, lambda con: con.print(f"mcp server {name} added: its tools are mcp.{name}.*"))
    _restart_hint(out, home)


@mcp.command("remove")
@command
@click.argument("name")
def mcp_remove(home: str | None, out: Output, name: str) -> None:
    """Remove the MCP server NAME from config.toml."""
    node_home = NodeHome(home)
    config = node_home.load_config()
    if not any(m.name == name for m in config.mcp):
        raise PsymeshError(f"no MCP server {name!r} in {node_home.config_path}; see: psymesh mcp list",
                           code=ErrorCode.NOT_FOUND)
    node_home.save_config(config.model_copy(update={"mcp": [m for m in config.mcp if m.name != name]}))
    out.data({"removed": name}, lambda con: con.print(f"mcp server {name} removed"))
    _restart_hint(out, home)


@mcp.command("list")
@command
def mcp_list(home: str | None, out: Output) -> None:
    """The MCP servers in config.toml."""
    servers = NodeHome(home).load_config().mcp

    def human(con: Any) -> None:
        if not servers:
            con.print("no MCP servers (add one: psymesh mcp add NAME -- COMMAND ...)")
        for m in servers:
            con.print(escape(f"{m.name}: {' '.join(m.command) if m.command else m.url}  (tools mcp.{m.name}.*)"))

    out.data(servers, human)


@main.command()
@command
def status(home: str | None, out: Output) -> None:
    """Peer id, addresses, uptime and connected peers of the running daemon."""

    async def go() -> Any:
        async with Client(home) as client:
            return await client.status()

    st = run_async(go)

    def human(con: Any) -> None:
        con.print(f"[bold]{st.name}[/bold] ({st.profile}) psymesh {st.version}, up {st.uptime_s:.0f} s")
        con.print(f"peer id:     {st.peer_id}\nfingerprint: {st.fingerprint}")
        for a in st.addrs:
            con.print(f"listening:   {a}")
        for line in _reachability_lines(st.reachability):
            con.print(f"reachable:   {escape(line)}")
        table = out_table("connected peer", "addresses")
        for p in st.connected_peers:
            table.add_row(p.name or p.peer_id, " ".join(p.addrs))
        con.print(table if st.connected_peers else "no connected peers")

    out.data(st, human)


def _reachability_lines(reach: c.Reachability) -> list[str]:
    """How peers reach this node, in words: proven addresses first, then relays, then the rest."""
    now = time.time()
    lines = [f"{a.addr} (dialed back by {a.by_name} {max(0.0, now - a.at):.0f} s ago)" for a in reach.confirmed]
    lines += [f"{a} (through a relay)" for a in reach.relayed]
    beyond = [a for a in reach.direct if not a.startswith(("/ip4/127.", "/ip6/::1/"))]
    if not lines:
        lines += [f"{a} (from where it routes; not yet confirmed: psymesh doctor)" for a in beyond]
    if not lines:
        lines.append("only from this machine, or over connections this node opens itself "
                     "(listen on a LAN address, or keep a relay: docs/deploy.md)")
    return lines


@main.command()
@command
@click.option("--timeout", "timeout_s", type=click.FloatRange(1, 60), default=10, show_default=True,
              metavar="SECONDS", help="How long the daemon may take to probe the peers.")
def doctor(home: str | None, out: Output, timeout_s: float) -> None:
    """Check this node: its home, disk, database, listen addresses, and each paired peer
    (reachable? direct or relayed? its clock? can it dial back?). Exit status 1 if a check fails."""
    from ..control.doctor import failed, run_checks

    checks = run_async(lambda: run_checks(NodeHome(home), timeout_s=timeout_s))
    colors = {"ok": "green", "warn": "yellow", "fail": "red"}

    def human(con: Any) -> None:
        for check in checks:
            con.print(f"[{colors[check.status]}]{check.status:<4}[/{colors[check.status]}] "
                      f"{escape(check.name)}: {escape(check.detail)}")
            if check.next_step:
                con.print(f"       [dim]next:[/dim] {escape(check.next_step)}")

    out.data({"ok": not failed(checks), "checks": checks}, human)
    if failed(checks):
        sys.exit(1)


@main.command()
@command
@click.argument("peer")
@click.option("--count", "-c", default=4, show_default=True, type=click.IntRange(1, 1000), help="Round trips.")
@click.option("--size", default=32, show_default=True, type=click.IntRange(0, 65536), help="Payload bytes.")
def ping(home: str | None, out: Output, peer: str, count: int, size: int) -> None:
    """Round trips to PEER (a multiaddr ending /p2p/<id>) over the encrypted channel."""

    async def go() -> Any:
        async with Client(home) as client:
            return await client.ping(peer, count=count, payload_size=size)

    r = run_async(go)

    def human(con: Any) -> None:
        for i, rtt in enumerate(r.rtts_ms):
            con.print(f"{size} bytes from {r.peer_id[:16]}…: seq={i} time={rtt:.3f} ms")
        con.print(f"connect {r.connect_ms:.2f} ms; rtt min/median/max = "
                  f"{r.min_ms:.3f}/{r.median_ms:.3f}/{r.max_ms:.3f} ms")

    out.data(r, human)


def parse_duration(text: str) -> float:
    """`90s`, `10m`, `2h`, `30d` or plain seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    text = text.strip().lower()
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration like 90s, 10m, 2h or 30d") from None
    if value <= 0:
        raise click.BadParameter("a duration must be positive")
    return value


class Duration(click.ParamType):
    name = "DURATION"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        return value if isinstance(value, float) else parse_duration(str(value))


def _show_invite(out: Output, inv: Any) -> None:
    if out.json_mode:
        return
    import io

    import segno

    qr = io.StringIO()
    segno.make(inv.invite.upper(), error="l").terminal(out=qr, compact=True)
    out.out.print(qr.getvalue(), end="")
    out.out.print(f"code:   [bold]{inv.code}[/bold]   (read it aloud; valid until "
                  f"{time.strftime('%H:%M:%S', time.localtime(inv.expires_at))}, grant preset: {inv.grant})")
    out.out.print(f"invite: {inv.invite}")
    out.hint(f"on the other device: psymesh pair join {inv.invite}")


def _show_paired(out: Output, p: Any) -> None:
    def human(con: Any) -> None:
        con.print(f"[green]paired[/green] with [bold]{escape(p.name)}[/bold] ({p.role}) {p.peer_id}")
        if p.asked_name:
            con.print(f"[yellow]named {escape(p.name)} here[/yellow]: another paired peer is called "
                      f"{escape(p.asked_name)}; commands take {escape(p.name)} (or its peer id) for this one")
        con.print(f"verification words: [bold]{p.verification}[/bold]  (both screens must show the same)")
        con.print(f"it may ask this node:  {', '.join(p.granted) or 'nothing'}")
        if p.received:
            con.print(f"this node may ask it:  {', '.join(p.received)}")

    out.data(p, human)


@main.group()
def pair() -> None:
    """Pair devices with a short one-time code."""


@pair.command("invite")
@command
@click.option("--name", default=None, help="What to call the device that joins (default: its own name).")
@click.option("--grant", default="phone", show_default=True, help="Grant preset for the joiner (phone, messaging).")
@click.option("--ttl", type=Duration(), default="10m", show_default=True, help="How long the invite stays valid.")
@click.option("--grant-ttl", type=Duration(), default=None, help="Lifetime of the grant (default: until revoked).")
@click.option("--wait/--no-wait", default=None, help="Wait for the device to join (default: yes, except with --json).")
def pair_invite(home: str | None, out: Output, name: str | None, grant: str, ttl: float,
                grant_ttl: float | None, wait: bool | None) -> None:
    """Make a one-time invite (code + QR) for a device to join."""
    wait = (not out.json_mode) if wait is None else wait

    async def go() -> Any:
        async with Client(home) as client:
            if not wait:
                return await client.pair_invite(name=name, grant=grant, ttl_s=ttl, grant_ttl_s=grant_ttl)

            def shown(inv: Any) -> None:
                _show_invite(out, inv)
                if out.json_mode:
                    out.data(inv)
                out.hint("waiting for the device to join (Ctrl-C to stop)...")

            return await client.pair_invite_and_wait(shown, name=name, grant=grant, ttl_s=ttl, grant_ttl_s=grant_ttl)

    result = run_async(go)
    if wait:
        _show_paired(out, result)
    else:
        _show_invite(out, result)
        if out.json_mode:
            out.data(result)


@pair.command("join")
@command
@click.argument("invite")
@click.option("--address", default=None, help="The inviter's address, when INVITE is a bare code (default: the "
                                               "unpaired nodes discovered on the LAN are tried in turn).")
@click.option("--grant", default=None, help="Grant preset to give the inviter in return (e.g. messaging).")
def pair_join(home: str | None, out: Output, invite: str, address: str | None, grant: str | None) -> None:
    """Join a node with its invite string (or its code plus --address)."""

    async def go() -> Any:
        async with Client(home) as client:
            return await client.pair_join(invite, address=address, grant=grant)

    _show_paired(out, run_async(go))


@main.command()
@command
@click.option("--active", is_flag=True, help="Hide revoked peers.")
def peers(home: str | None, out: Output, active: bool) -> None:
    """Paired peers, with what each may ask of this node and what we may ask of it."""

    async def go() -> Any:
        async with Client(home) as client:
            return await client.peers(include_revoked=not active)

    rows: list[c.PeerView] = run_async(go)

    def human(con: Any) -> None:
        if not rows:
            con.print("no paired peers; pair one with: psymesh pair invite")
            return
        table = out_table("name", "role", "peer id", "state", "may ask us", "its limits", "we may ask")
        for p in rows:
            state = ("[red]revoked[/red]" if p.revoked_at else "[red]revoked us[/red]" if p.revoked_us_at
                     else "connected" if p.connected else "paired")
            table.add_row(escape(p.name), p.role, p.peer_id, state, "\n".join(p.granted) or "-",
                          limits_text(p.granted_limits) if p.granted else "-", "\n".join(p.received) or "-")
        con.print(table)

    out.data(rows, human)



@main.command()
@command
@click.option("--wait", "wait_s", type=click.FloatRange(0, 60), default=0, show_default=True, metavar="SECONDS",
              help="With no node seen yet, listen up to this many seconds for the first one.")
def discover(home: str | None, out: Output, wait_s: float) -> None:
    """Nodes seen on the LAN (mDNS) or at static addresses, paired or not, with fingerprints.

    Compare a node's fingerprint with `psymesh id` on that device before pairing with it:
    anyone on the LAN can announce anything, and pairing is what proves the key."""

    async def go() -> Any:
        async with Client(home) as client:
            return await client.discovered(wait_s)

    reply: c.DiscoverReply = run_async(go)
    if not reply.mdns and not reply.static_peers:
        out.hint("discovery is off: set mdns = true (and listen on the LAN) or static_peers in config.toml")
    elif reply.mdns and not reply.announced:
        out.hint("mdns is on, but this node announces nothing: it listens on no LAN address (listen = "
                 "[\"/ip4/0.0.0.0/tcp/4001\"]), or mDNS could not start (see the daemon's log)")

    def human(con: Any) -> None:
        if not reply.nodes:
            con.print("no nodes seen yet" + ("; try: psymesh discover --wait 5" if reply.mdns else ""))
            return
        table = out_table("name", "peer id", "fingerprint", "addresses", "via", "last seen")
        now = time.time()
        for n in reply.nodes:
            table.add_row(f"[green]{escape(n.name)}[/green]" if n.name else "[dim]not paired[/dim]",
                          n.peer_id[:20] + "…", n.fingerprint or "-", escape("\n".join(n.addrs)), n.source,
                          f"{max(0.0, now - n.last_seen):.0f} s ago")
        con.print(table)

    out.data(reply.nodes, human)


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


LIMIT_WORDS = {  # how `psymesh peers` shows each limit
    "requests_per_minute": lambda v: f"{v} req/min",
    "concurrent_tasks": lambda v: f"{v} at once",
    "max_runtime_s": lambda v: f"{v} s/task",
    "max_payload_bytes": lambda v: f"{_size(v)} payload",
}


def limits_text(limits: Limits) -> str:
    """One line per limit the grant sets; `none` when it sets none (the node's own limits apply)."""
    values = limits.model_dump()
    return "\n".join(LIMIT_WORDS[k](v) for k, v in values.items() if v is not None) or "none"


def parse_limits(text: str) -> dict[str, int | None]:
    """`requests_per_minute=600,concurrent_tasks=8` (and `NAME=none` to clear one) -> changes,
    checked against `Limits`; a bad spelling is a BAD_REQUEST saying which part and why."""
    changes: dict[str, int | None] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise PsymeshError(f"--limits: {part!r} is not NAME=NUMBER or NAME=none, e.g. concurrent_tasks=8",
                               code=ErrorCode.BAD_REQUEST)
        if value.lower() == "none":
            changes[name] = None
        else:
            try:
                changes[name] = int(value)
            except ValueError:
                raise PsymeshError(f"--limits: {name}={value}: not a whole number (or none)",
                                   code=ErrorCode.BAD_REQUEST) from None
    if not changes:
        raise PsymeshError("--limits: no limits given, e.g. --limits concurrent_tasks=8", code=ErrorCode.BAD_REQUEST)
    try:
        return c.check_limit_changes(changes)
    except ValueError as exc:
        raise PsymeshError(f"--limits: {exc}", code=ErrorCode.BAD_REQUEST) from None


@main.command(context_settings={"ignore_unknown_options": True})
@command
@click.argument("peer")
@click.argument("capabilities", nargs=-1, metavar="[CAP | +CAP | -CAP]...")
@click.option("--preset", default=None, metavar="PRESET",
              help="Start from a preset's capabilities and limits (phone, messaging).")
@click.option("--expires", type=Duration(), default=None, help="Grant lifetime (default: until revoked).")
@click.option("--preset-limits", "preset_limits", default=None, metavar="PRESET",
              help="Start from a preset's limits (phone, messaging) instead of the current grant's.")
@click.option("--limits", "limits_spec", default=None, metavar="NAME=N,...",
              help="Set single limits: requests_per_minute, concurrent_tasks, max_runtime_s, max_payload_bytes "
                   "(N, or none for no limit).")
def grant(home: str | None, out: Output, peer: str, capabilities: tuple[str, ...], preset: str | None,
          expires: float | None, preset_limits: str | None, limits_spec: str | None) -> None:
    """Change what PEER may ask of this node: `+CAP` adds one, `-CAP` takes one away
    (`psymesh grant phone +tool:system.info -msg.send`), bare CAPs replace the whole list
    (`psymesh grant phone tool:files.* msg.send`), `--preset phone` starts from a preset.

    Its limits stay those of the current grant unless --preset, --preset-limits or --limits change them."""
    set_limits = parse_limits(limits_spec) if limits_spec is not None else None
    unknown = [cap for cap in capabilities if cap.startswith("--")]
    if unknown:
        raise click.UsageError(f"no such option: {unknown[0]}")
    add = [cap[1:] for cap in capabilities if cap.startswith("+")]
    remove = [cap[1:] for cap in capabilities if cap.startswith("-")]
    whole = [cap for cap in capabilities if not cap.startswith(("+", "-"))]
    if not (whole or add or remove or preset):
        raise click.UsageError("name what to grant: CAP..., +CAP / -CAP, or --preset NAME")
    from ...protocol.manifest import PRESETS

    if named := next((cap for cap in whole if cap in PRESETS), None):
        raise click.UsageError(f"{named!r} is a preset, not a capability: psymesh grant {peer} --preset {named}")

    async def go() -> c.PeerReply:
        async with Client(home) as client:
            return await client.grant(peer, whole, add=add, remove=remove, preset=preset, expires_s=expires,
                                      preset_limits=preset_limits, set_limits=set_limits)

    r = run_async(go)

    def human(con: Any) -> None:
        con.print(f"{r.peer.name} may now ask: {', '.join(r.peer.granted)}"
                  + ("" if r.delivered else "  (not reachable now: it will see the new grant when next told)"))
        con.print("limits: " + limits_text(r.peer.granted_limits).replace("\n", ", "))

    out.data(r, human)


@main.command()
@command
@click.option("--no-open", is_flag=True, help="Print the link only; do not open a browser.")
def ui(home: str | None, out: Output, no_open: bool) -> None:
    """The dashboard in a browser: starts it in the running daemon if needed (a phone runs it
    only on demand), prints its link with the token, and opens it."""

    async def go() -> Any:
        async with Client(home) as client:
            return await client.ui()

    r = run_async(go)
    if not no_open and not out.json_mode:
        import webbrowser

        webbrowser.open(r.login_url)
    out.data(r, lambda con: con.print(f"dashboard: {r.url}\nopen (the link holds the token, keep it to yourself):"
                                      f"\n  {r.login_url}"))


@main.command()
@command
@click.argument("peer")
def revoke(home: str | None, out: Output, peer: str) -> None:
    """Revoke PEER now: its open connections close and every later request is refused."""

    async def go() -> Any:
        async with Client(home) as client:
            return await client.revoke(peer)

    r = run_async(go)
    out.data(r, lambda con: con.print(f"revoked {r.peer.name} ({r.peer.peer_id})"
                                      + ("" if r.delivered else "  (not reachable now: it is told when it next calls)")))


@main.command()
@command
@click.option("--peer", default=None, help="Only this peer (name or id).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10000))
@click.option("--denied", is_flag=True, help="Only refused requests.")
def audit(home: str | None, out: Output, peer: str | None, limit: int, denied: bool) -> None:
    """Every gate decision, allowed or denied."""

    async def go() -> Any:
        async with Client(home) as client:
            return await client.audit(peer=peer, limit=limit, denied_only=denied)

    rows: list[c.AuditRow] = run_async(go)

    def human(con: Any) -> None:
        table = out_table("time", "peer", "operation", "decision", "reason")
        for r in rows:
            verdict = "[green]allowed[/green]" if r.allowed else f"[red]{escape(r.code or 'denied')}[/red]"
            if r.count > 1:
                verdict += f" x{r.count}"
            table.add_row(time.strftime("%m-%d %H:%M:%S", time.localtime(r.ts)), escape(r.peer_name or r.peer_id),
                          escape(r.operation), verdict, escape(r.reason))
        con.print(table if rows else "no audit entries")

    out.data(rows, human)


# -- delegated tasks ---------------------------------------------------------------


@main.group()
def task() -> None:
    """Delegate work to paired nodes, and follow it."""


def _event_line(ev: Any) -> str:
    data = ev.data
    if ev.kind == "token":
        return data.get("text", "")
    detail = {k: v for k, v in data.items() if k != "result"}
    text = f"[{ev.seq}] {ev.kind} -> {ev.state}" + (f" {json.dumps(detail)}" if detail else "")
    return text


async def _answer_input(handle: Any, out: Output, ev: Any, approve: bool) -> None:
    """The remote agent asks to run an irreversible tool: ask the person (or --yes)."""
    question = ev.data.get("question", "the task needs an answer")
    if not approve and sys.stdin.isatty():
        approve = await anyio.to_thread.run_sync(lambda: click.confirm(question, default=False, err=True))
    elif not approve:
        out.warn(f"{question} -- declined: no terminal to ask (pass --yes to allow)")
    await handle.respond({"approve": approve})


async def _follow(handle: Any, out: Output, after_seq: int = 0, approve: bool = False,
                  json_events: bool = True) -> Any:
    """Stream a task's events (JSON lines with --json; a live view on a terminal) and return its outcome.
    An `input-required` event is answered here (see _answer_input). `json_events=False`: a command
    whose --json output is one document (its result) keeps the events off stdout."""
    last = None
    streaming_tokens = False
    status = None
    if not out.json_mode and out.out.is_terminal:
        status = out.err.status(f"task {handle.id}: waiting", spinner="dots")
        status.start()
    try:
        async for ev in handle.events(after_seq):
            last = ev
            if ev.state.value == "input-required":
                await _answer_input(handle, out, ev, approve)
            if out.json_mode:
                if json_events:
                    out.data(ev)
                continue
            if status is not None:
                status.update(f"task {handle.id}: {ev.state.value} ({ev.seq} events)")
            if ev.kind == "token":
                out.out.print(escape(ev.data.get("text", "")), end="")
                streaming_tokens = True
                continue
            if streaming_tokens:
                out.out.print()
                streaming_tokens = False
            if ev.kind != "result":
                out.err.print(escape(_event_line(ev)))
    finally:
        if status is not None:
            status.stop()
    return last.outcome if last is not None else None


@task.command("send")
@command
@click.option("--to", default=None, help="Paired peer (name or id); default: the best one offering the task.")
@click.option("--tool", default=None, help="Run this tool on the peer.")
@click.option("--args", "args_json", default="{}", help="Tool arguments as a JSON object.")
@click.option("--infer", "prompt", default=None, help="A prompt for a chat completion on the peer.")
@click.option("--model", default=None, help="Model name on the peer (with --infer).")
@click.option("--max-tokens", type=int, default=None)
@click.option("--goal", default=None, help="A goal for the peer's agent loop.")
@click.option("--timeout", type=Duration(), default=None, help="Deadline, counted from acceptance.")
@click.option("--id", "task_id", default=None, help="Task id (resending the same id is harmless).")
@click.option("--wait", is_flag=True, help="Follow the task until it ends and print its result.")
def task_send(home: str | None, out: Output, to: str | None, tool: str | None, args_json: str, prompt: str | None,
              model: str | None, max_tokens: int | None, goal: str | None, timeout: float | None,
              task_id: str | None, wait: bool) -> None:
    """Delegate one task: --tool NAME --args JSON | --infer PROMPT --model NAME | --goal TEXT."""
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"--args is not JSON: {exc}") from None
    if prompt is not None and model is None:
        raise click.UsageError("--infer needs --model NAME (a model registered on the peer)")

    async def go() -> Any:
        async with Client(home) as client:
            handle = await client.delegate(to, tool=tool, args=args if tool else None, infer=prompt, model=model,
                                           max_tokens=max_tokens, goal=goal, timeout=timeout, task_id=task_id)
            where = "accepted by" if handle.accepted else "queued for"
            out.hint(f"task {handle.id} {where} {handle.target_name}")
            if handle.away is not None:
                out.warn(f"{_away_text(handle.target_name, handle.away)}; the task is kept here and delivered "
                         f"when {handle.target_name} is back"
                         + ("; waiting for it (Ctrl-C stops waiting, the task stays queued)" if wait
                            else f" (see: psymesh task watch {handle.id})"))
            if not wait:
                return {"task_id": handle.id, "target": handle.target, "accepted": handle.accepted,
                        "away": handle.away.model_dump() if handle.away else None}
            return await _follow(handle, out)

    result = run_async(go)
    if not wait:
        out.data(result, lambda con: con.print(result["task_id"]))
        return
    _print_outcome(out, result)


def _print_outcome(out: Output, outcome: Any) -> None:
    if outcome is None:
        return
    if outcome.ok:
        value = outcome.value
        if out.json_mode:
            out.data({"state": outcome.state.value, "result": value})
        elif isinstance(value, dict) and set(value) >= {"text", "usage"}:  # an infer task's InferResult
            infer = InferResult.model_validate(value)
            out.hint(f"({infer.usage.completion_tokens} tokens, {infer.finish_reason})")
        else:
            out.data(value)
        return
    code = outcome.code.value if hasattr(outcome.code, "value") else str(outcome.code)
    if out.json_mode:
        out.data({"state": outcome.state.value, "error": {"code": code, "message": outcome.message}})
    out.err.print(f"[red]task {outcome.state.value}[/red] ({escape(code)}): {escape(outcome.message)}")
    sys.exit(1)


@task.command("watch")
@command
@click.argument("task_id")
@click.option("--after", type=int, default=0, help="Only events after this number.")
def task_watch(home: str | None, out: Output, task_id: str, after: int) -> None:
    """Follow a delegated task (events as JSON lines with --json) until it ends."""

    async def go() -> Any:
        async with Client(home) as client:
            return await _follow(client.task(task_id), out, after)

    _print_outcome(out, run_async(go))


@task.command("list")
@command
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 1000))
def task_list(home: str | None, out: Output, limit: int) -> None:
    """Tasks this node delegated, and tasks it runs for others."""

    async def go() -> Any:
        async with Client(home) as client:
            return await client.tasks(limit)

    r: c.TaskListReply = run_async(go)

    def table(title: str, who: str) -> Any:
        return out_table("task", "kind", who, "state", "events", title=title, title_justify="left")

    def human(con: Any) -> None:
        submitted = table("delegated by this node", "target")
        for s in r.submitted:
            state = s.state.value + (f" ({_away_text(s.target, s.away)})" if s.away else "")
            submitted.add_row(s.task_id, s.kind.value, s.target, state, str(s.events))
        con.print(submitted if r.submitted else "delegated by this node: none")
        executing = table("run by this node for others", "submitter")
        for e in r.executing:
            executing.add_row(e.task_id, e.kind.value, e.submitter, e.state.value, str(e.last_seq))
        con.print(executing if r.executing else "run by this node for others: none")

    out.data(r, human)


@task.command("cancel")
@command
@click.argument("task_id")
def task_cancel(home: str | None, out: Output, task_id: str) -> None:
    """Cancel a delegated task (it stops on the node running it)."""

    async def go() -> None:
        async with Client(home) as client:
            await client.task(task_id).cancel()

    run_async(go)
    out.data({"task_id": task_id, "canceled": True}, lambda con: con.print(f"canceled {task_id}"))


# -- messages between agents --------------------------------------------------------


@main.group()
def msg() -> None:
    """Letters to paired peers: kept until delivered, each once, in order within a thread."""


def _json_object(text: str | None, option: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{option} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise click.BadParameter(f"{option} must be a JSON object")
    return value


def _away_text(name: str, away: c.PeerAway, now: float | None = None) -> str:
    """`home is unreachable since 19:20:01 (3 min ago): <why>`."""
    ago = max(0.0, (time.time() if now is None else now) - away.since)
    when = time.strftime("%H:%M:%S", time.localtime(away.since))
    span = f"{ago:.0f} s" if ago < 120 else f"{ago / 60:.0f} min" if ago < 7200 else f"{ago / 3600:.0f} h"
    return f"{name} is unreachable since {when} ({span} ago): {away.reason}"


def _sent_line(s: c.SentLetter) -> str:
    why = f": {s.code} {s.reason}" if s.state == "refused" else ""
    away = f" ({_away_text(s.recipient_name, s.away)}; kept, delivered when it is back)" if s.away else ""
    return f"{s.id} -> {s.recipient_name} ({s.thread} #{s.tseq}): {s.state}{why}{away}"


def _code(text: str | None, default: ErrorCode) -> ErrorCode:
    """An error code a peer sent (a newer peer may send one this version does not know)."""
    try:
        return ErrorCode(text)
    except ValueError:
        return default


def _refused(s: c.SentLetter) -> PsymeshError | None:
    if s.state != "refused":
        return None
    return PsymeshError(f"{s.recipient_name} refused letter {s.id}: {s.reason}",
                        code=_code(s.code, ErrorCode.FORBIDDEN))


@msg.command("send")
@command
@click.argument("peer")
@click.argument("text")
@click.option("--thread", default="main", show_default=True, help="Conversation: order is kept within it.")
@click.option("--body", "body_json", default=None, help="Structured data beside the text, as a JSON object.")
@click.option("--id", "letter_id", default=None, help="Letter id (sending the same id again sends nothing new).")
@click.option("--wait", is_flag=True, help="Wait until PEER holds it (exit 1 if it refuses it).")
def msg_send(home: str | None, out: Output, peer: str, text: str, thread: str, body_json: str | None,
             letter_id: str | None, wait: bool) -> None:
    """Send TEXT to PEER (a paired peer's name or id). Stored here first: it leaves when PEER is reachable."""
    body = _json_object(body_json, "--body")

    async def go() -> c.SentLetter:
        async with Client(home) as client:
            sent = await client.send(peer, text, body=body, thread=thread, letter_id=letter_id)
            if not wait:
                return sent
            out.hint(f"letter {sent.id} to {sent.recipient_name}: waiting until it holds it")
            sent = await client.letter(sent.id, wait=True, until_away=True)
            if sent.state == "pending" and sent.away is not None:
                out.warn(f"{_away_text(sent.recipient_name, sent.away)}; the letter is kept here and delivered "
                         "when it is back; waiting for it (Ctrl-C stops waiting, the letter stays queued)")
                sent = await client.letter(sent.id, wait=True)
            return sent

    sent = run_async(go)
    out.data(sent, lambda con: con.print(escape(_sent_line(sent))))
    if (refusal := _refused(sent)) is not None:
        out.err.print(f"[red]refused[/red]: {escape(refusal.message)}")
        sys.exit(1)


@msg.command("status")
@command
@click.argument("letter_id")
@click.option("--wait", is_flag=True, help="Wait until it is delivered or refused.")
def msg_status(home: str | None, out: Output, letter_id: str, wait: bool) -> None:
    """The state of a letter this node sent: pending, delivered or refused."""

    async def go() -> c.SentLetter:
        async with Client(home) as client:
            return await client.letter(letter_id, wait=wait)

    sent = run_async(go)
    out.data(sent, lambda con: con.print(escape(_sent_line(sent))))


def _letter_line(m: c.InboxLetter) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(m.received_at))
    where = f"group {m.group}" if m.group else m.thread
    kind = "" if m.kind.value == "send" else f"[{m.kind.value}] "
    gap = f"[{m.skipped} earlier letter(s) never came] " if m.skipped else ""
    return f"{m.seq:>5} {when} {m.sender_name} ({where}): {gap}{kind}{m.text}"


@msg.command("inbox")
@command
@click.option("--follow", "-f", is_flag=True, help="Keep printing letters as they come (Ctrl-C stops).")
@click.option("--after", default=0, show_default=True, type=click.IntRange(0), help="Only letters after this number.")
@click.option("--limit", default=None, type=click.IntRange(1), help="At most this many letters.")
def msg_inbox(home: str | None, out: Output, follow: bool, after: int, limit: int | None) -> None:
    """Letters from peers, in order, numbered. --json prints a list, or with --follow one JSON
    object per line; resume later with --after the last number seen."""

    async def go() -> list[c.InboxLetter]:
        got: list[c.InboxLetter] = []
        async with Client(home) as client:
            async for m in client.inbox(after, follow=follow, limit=limit):
                if follow:
                    out.data(m, lambda con: con.print(escape(_letter_line(m))))
                else:
                    got.append(m)
        return got

    try:
        letters = run_async(go)
    except KeyboardInterrupt:
        sys.exit(130)
    if follow:
        return

    def human(con: Any) -> None:
        for m in letters:
            con.print(escape(_letter_line(m)))
        if not letters:
            con.print("no letters" + (f" after {after}" if after else ""))

    out.data(letters, human)


@msg.command("ask")
@command
@click.argument("peer")
@click.argument("question")
@click.option("--thread", default="main", show_default=True)
@click.option("--timeout", type=Duration(), default="120s", show_default=True, help="How long to wait for the answer.")
@click.option("--max-steps", type=click.IntRange(1, 64), default=None, help="Agent steps PEER may take (it caps them).")
@click.option("--seed", type=int, default=None, hidden=True)
@click.option("--ban-bytes", is_flag=True, hidden=True, help="Keep random-weight test models in ASCII.")
def msg_ask(home: str | None, out: Output, peer: str, question: str, thread: str, timeout: float,
            max_steps: int | None, seed: int | None, ban_bytes: bool) -> None:
    """Ask PEER's agent QUESTION (it needs msg.ask from PEER) and print its answer."""
    params: dict[str, Any] = {"max_steps": max_steps, "seed": seed, "ban_bytes": ban_bytes or None}

    async def go() -> c.InboxLetter:
        async with Client(home) as client:
            return await client.ask(peer, question, thread=thread, timeout=timeout,
                                    params={k: v for k, v in params.items() if v is not None})

    answer = run_async(go)
    error = answer.body.get("error") if answer.body.get("ok") is False else None
    if error is not None:
        out.error(PsymeshError(f"{answer.sender_name} could not answer: {error.get('message', '')}",
                               code=_code(error.get("code"), ErrorCode.INTERNAL)))
        sys.exit(1)

    def human(con: Any) -> None:
        calls = answer.body.get("tool_calls") or []
        if calls:
            out.hint("tools: " + ", ".join(f"{t.get('name')} ({t.get('status')})" for t in calls))
        con.print(escape(answer.text))

    out.data(answer, human)


# -- web queries ------------------------------------------------------------------------


@main.group()
def web() -> None:
    """Web queries run by a trusted paired peer (the exit): this node never touches the web."""


def _route_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--hops", type=click.IntRange(1, 2), default=None,
                     help="1: ask the exit directly; 2: sealed through a relay, so the exit never learns who "
                          "asked (default: [web] hops).")(f)
    f = click.option("--relay", default=None, help="The relay for two hops (default: [web] relay, or the one "
                                                    "paired peer granting web.relay).")(f)
    return click.option("--via", default=None, help="The exit (default: [web] via, or the one paired peer "
                                                     "granting the query).")(f)


def _way(reply: c.WebQueryReply) -> str:
    return f"via {reply.exit[:16]}..." + (f" through relay {reply.relay[:16]}..." if reply.relay else "")


@web.command("search")
@command
@click.argument("query")
@click.option("--limit", type=click.IntRange(1, 20), default=5, show_default=True)
@_route_options
def web_search(home: str | None, out: Output, query: str, limit: int, via: str | None, relay: str | None,
               hops: int | None) -> None:
    """Search the web for QUERY through a trusted exit."""
    async def go() -> c.WebQueryReply:
        async with Client(home) as client:
            return await client.web_query(search=query, limit=limit, via=via, relay=relay, hops=hops)

    reply = run_async(go)
    results = reply.results
    assert results is not None

    def human(con: Any) -> None:
        out.hint(f"{len(results.hits)} result(s) {_way(reply)}" + (" (cached)" if results.cached else "")
                 + "; untrusted text from the web")
        for hit in results.hits:
            con.print(f"[bold]{escape(hit.title)}[/bold]\n  {escape(hit.url)}")
            if hit.snippet:
                con.print(f"  {escape(hit.snippet)}")

    out.data(reply, human)


@web.command("fetch")
@command
@click.argument("url")
@click.option("--max-chars", type=click.IntRange(1, 100_000), default=8000, show_default=True)
@_route_options
def web_fetch(home: str | None, out: Output, url: str, max_chars: int, via: str | None, relay: str | None,
              hops: int | None) -> None:
    """Fetch URL's readable text through a trusted exit."""
    async def go() -> c.WebQueryReply:
        async with Client(home) as client:
            return await client.web_query(url=url, max_chars=max_chars, via=via, relay=relay, hops=hops)

    reply = run_async(go)
    page = reply.page
    assert page is not None

    def human(con: Any) -> None:
        out.hint(f"{page.status} {page.content_type} from {page.final_url} {_way(reply)}"
                 + (" (cached)" if page.cached else "") + ("; cut" if page.truncated else "")
                 + "; untrusted text from the web")
        if page.title:
            con.print(f"[bold]{escape(page.title)}[/bold]")
        con.print(escape(page.text))

    out.data(reply, human)


# -- groups ---------------------------------------------------------------------------


@main.group()
def group() -> None:
    """Named lists of paired peers on this node: one message to all of them."""


def _group_text(g: c.GroupView) -> str:
    return f"{g.name}: " + (", ".join(m.name for m in g.members) or "no members")


@group.command("create")
@command
@click.argument("name")
@click.argument("members", nargs=-1)
def group_create(home: str | None, out: Output, name: str, members: tuple[str, ...]) -> None:
    """Make group NAME of paired peers (names or ids). Only this node knows it."""
    _group_change(home, out, lambda client: client.group_create(name, list(members)))


def _group_change(home: str | None, out: Output,
                  change: Callable[[Client], Awaitable[c.GroupView]]) -> None:
    """Run one change to a group on the daemon and show the group as it now is."""

    async def go() -> c.GroupView:
        async with Client(home) as client:
            return await change(client)

    g = run_async(go)
    out.data(g, lambda con: con.print(escape(_group_text(g))))


@group.command("add")
@command
@click.argument("name")
@click.argument("members", nargs=-1, required=True)
def group_add(home: str | None, out: Output, name: str, members: tuple[str, ...]) -> None:
    """Add paired peers to group NAME."""
    _group_change(home, out, lambda client: client.group_add(name, list(members)))


@group.command("remove")
@command
@click.argument("name")
@click.argument("members", nargs=-1, required=True)
def group_remove(home: str | None, out: Output, name: str, members: tuple[str, ...]) -> None:
    """Take members out of group NAME."""
    _group_change(home, out, lambda client: client.group_remove(name, list(members)))


@group.command("list")
@command
def group_list(home: str | None, out: Output) -> None:
    """This node's groups and their members."""

    async def go() -> list[c.GroupView]:
        async with Client(home) as client:
            return await client.groups()

    groups = run_async(go)

    def human(con: Any) -> None:
        for g in groups:
            con.print(escape(_group_text(g)))
        if not groups:
            con.print("no groups; make one with: psymesh group create NAME PEER...")

    out.data(groups, human)


@group.command("send")
@command
@click.argument("name")
@click.argument("text")
@click.option("--body", "body_json", default=None, help="Structured data beside the text, as a JSON object.")
def group_send(home: str | None, out: Output, name: str, text: str, body_json: str | None) -> None:
    """Send TEXT to every member of group NAME (one letter each, thread group:NAME)."""
    body = _json_object(body_json, "--body")

    async def go() -> list[c.SentLetter]:
        async with Client(home) as client:
            return await client.group_send(name, text, body=body)

    letters = run_async(go)

    def human(con: Any) -> None:
        for s in letters:
            con.print(escape(_sent_line(s)))

    out.data(letters, human)


# -- models ---------------------------------------------------------------------------


@main.group()
def model() -> None:
    """Models this node can run (GGUF files for llama.cpp)."""


@model.command("add")
@command
@click.argument("name")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--ctx", "n_ctx", default=None, type=click.IntRange(64, 1 << 20),
              help="Context length in tokens (default: what the GGUF declares, capped to fit this machine's "
                   "memory, at most 32768).")
@click.option("--threads", "n_threads", default=None, type=click.IntRange(1, 512))
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Jinja chat template file overriding the one inside the GGUF.")
@click.option("--keep-alive", "keep_alive", default=None, metavar="DURATION",
              help="How long the model stays loaded when idle (e.g. 90s, 10m, 1h; 0: unload after each "
                   "request; forever). Default: [models] keep_alive_s, else 5 min on a home PC, 1 min on a phone.")
def model_add(home: str | None, out: Output, name: str, path: str, n_ctx: int | None, n_threads: int | None,
              chat_template: str | None, keep_alive: str | None) -> None:
    """Register PATH (a .gguf file) as model NAME. A running daemon uses it at once."""
    node_home = NodeHome(home)
    node_home.init()
    template = open(chat_template).read() if chat_template else None
    row = _models(node_home).add(name, path, n_ctx=n_ctx, n_threads=n_threads,
                                 chat_template=template, keep_alive_s=_keep_alive(keep_alive))
    if n_ctx is None:
        from ..models.registry import default_context

        choice = default_context(Path(row["path"]))
        out.hint(f"context {row['n_ctx']} tokens: the GGUF declares {choice.declared or 'none'}"
                 + (f", capped to {choice.memory_cap} for this machine's memory" if row["n_ctx"] < (choice.declared or 0)
                    else "") + "; --ctx N sets another")
    out.data({k: v for k, v in row.items() if k != "chat_template"},
             lambda con: con.print(f"model {name} -> {row['path']} (context {row['n_ctx']})"))


@model.command("pull")
@command
@click.argument("repo_id")
@click.option("--file", "quant", default="Q8_0", show_default=True, help="Which quantization (matched in the file name).")
@click.option("--name", default=None, help="Register it under this name (default: the repo's name).")
def model_pull(home: str | None, out: Output, repo_id: str, quant: str, name: str | None) -> None:
    """Download a GGUF model from the Hugging Face hub and register it."""
    from ..models import pull_model

    node_home = NodeHome(home)
    node_home.init()
    out.hint(f"fetching the {quant} GGUF of {repo_id} ...")
    path = pull_model(repo_id, quant, node_home.models_dir / repo_id.replace("/", "--"))
    name = name or repo_id.split("/")[-1].lower()
    row = _models(node_home).add(name, path)
    out.data({k: v for k, v in row.items() if k != "chat_template"},
             lambda con: con.print(f"model {name} -> {path}"))


@model.command("list")
@command
def model_list(home: str | None, out: Output) -> None:
    """Registered models."""
    node_home = NodeHome(home)
    rows = _models(node_home).list() if node_home.db_path.exists() else []
    rows = [{**{k: v for k, v in r.items() if k != "chat_template"}, "chat_template_override": bool(r["chat_template"])}
            for r in rows]

    def human(con: Any) -> None:
        table = out_table("name", "path", "context", "threads")
        for r in rows:
            table.add_row(r["name"], r["path"], str(r["n_ctx"]), str(r["n_threads"] or "all"))
        con.print(table if rows else "no models; add one with: psymesh model add NAME PATH.gguf")

    out.data(rows, human)


@model.command("ps")
@command
def model_ps(home: str | None, out: Output) -> None:
    """Models and their runner processes in the running daemon: loaded or not, pid, memory
    (RSS and saved states), idle time against keep-alive, requests served, crashes."""

    async def go() -> list[Any]:
        async with Client(home) as client:
            return await client.models_ps()

    models = run_async(go)

    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:.0f} MiB"

    def human(con: Any) -> None:
        if not models:
            con.print("no models; add one with: psymesh model add NAME PATH.gguf")
            return
        table = out_table("name", "state", "pid", "memory", "idle/keep", "served")
        for m in models:
            state = ("busy" if m.pending else "loaded") if m.loaded else "unloaded"
            if m.crashes:
                state += f", {m.crashes} crash{'es' if m.crashes > 1 else ''}"
            memory = f"{mib(m.rss_bytes)}, {mib(m.state_cache_bytes)} saved" if m.loaded else "-"
            idle = "-" if m.idle_s is None else f"{m.idle_s:.0f}s"
            keep = "forever" if m.keep_alive_s is None else f"{m.keep_alive_s:g}s"
            table.add_row(m.name, state, str(m.pid or "-"), memory, f"{idle}/{keep}", str(m.jobs_served))
        con.print(table)

    out.data([m.model_dump() for m in models], human)


# -- the agent -----------------------------------------------------------------------


@main.group()
def agent() -> None:
    """Run the BotPsy agent on a goal, here or on a paired home PC."""


def _models(node_home: NodeHome) -> Any:
    """This node's model registry (read straight from its database: no daemon needed)."""
    from ..core.db import open_db
    from ..models import ModelRegistry

    return ModelRegistry(open_db(node_home.db_path))


def _keep_alive(text: str | None) -> float | None:
    """`--keep-alive`: None keeps the node's default; "forever" is stored as -1."""
    if text is None:
        return None
    word = text.strip().lower()
    if word in ("forever", "-1"):
        return -1.0
    if word in ("0", "0s"):
        return 0.0
    return parse_duration(word)


def _local_runner(node_home: NodeHome, registry: Any, name: str) -> Any:
    """Model `name` for a command that runs it here (`agent run`, `eval`): in a runner
    process, as the daemon runs its models, so an abort in llama.cpp fails the command
    with `model_crashed` instead of killing it. It lives as long as the command."""
    from ..models import ModelRunner

    config = node_home.load_config()
    return ModelRunner(registry.settings(name, keep_alive_s=None, memory_limit_mb=config.models.memory_limit_mb),
                       name=name, log_path=node_home.logs_dir / f"model-{name}.log")


def _print_agent_event(out: Output, ev: Any) -> None:
    d = ev.data
    if ev.kind == "step":
        out.err.print(f"[dim]step {d['step']}/{d['max_steps']}[/dim]")
    elif ev.kind == "thinking" and d.get("text"):
        out.err.print(f"[dim]  thinking: {escape(d['text'][:200])}[/dim]")
    elif ev.kind == "tool_call":
        out.err.print(f"  -> {escape(d['name'])}({escape(json.dumps(d.get('arguments', {}))[:200])})")
    elif ev.kind == "tool_result":
        body = d.get("result") if d.get("ok") else d.get("error")
        mark = "[green]ok[/green]" if d.get("ok") else f"[red]{escape(str(d.get('status')))}[/red]"
        out.err.print(f"  <- {mark} {escape(json.dumps(body, default=str)[:200])}")
    elif ev.kind in ("guard", "error"):
        out.err.print(f"  [yellow]{ev.kind}[/yellow]: {escape(str(d.get('message', d)))}")


@agent.command("run")
@command
@click.argument("goal")
@click.option("--model", "model_name", default=None, help="Model name (default: the node's first model).")
@click.option("--delegate", type=click.Choice(["auto", "never", "always"]), default="auto", show_default=True,
              help="Run here, on a paired home PC, or let the delegation policy decide.")
@click.option("--to", default=None, help="The home PC to delegate to (default: the best one).")
@click.option("--max-steps", default=8, show_default=True, type=click.IntRange(1, 64))
@click.option("--thinking", is_flag=True, help="Let the model think before answering.")
@click.option("--free", "free_form", is_flag=True, help="No grammar: let the model write calls freely.")
@click.option("--yes", is_flag=True, help="Approve irreversible tool calls without asking.")
@click.option("--ban-bytes", is_flag=True, hidden=True, help="Keep random-weight test models in ASCII.")
@click.option("--seed", type=int, default=None, hidden=True)
def agent_run(home: str | None, out: Output, goal: str, model_name: str | None, delegate: str, to: str | None,
              max_steps: int, thinking: bool, free_form: bool, yes: bool, ban_bytes: bool, seed: int | None) -> None:
    """Work on GOAL with this node's tools; irreversible calls ask first (or --yes)."""
    from ...agent.policy import DelegationInputs, decide

    node_home = NodeHome(home)
    node_home.init()
    config = node_home.load_config()
    params: dict[str, Any] = {"max_steps": max_steps, "thinking": thinking, "grammar": not free_form}
    if ban_bytes:
        params["ban_bytes"] = True
    if seed is not None:
        params["seed"] = seed
    if model_name:
        params["model"] = model_name

    async def remote_offers() -> list[c.Offer]:
        try:
            async with Client(home) as client:
                return await client.offers(operation="task.agent")
        except PsymeshError:
            return []  # no daemon: nothing to delegate to

    async def go() -> Any:
        registry = _models(node_home)
        offers = await remote_offers() if delegate != "never" else []
        local = frozenset(registry.names())
        # No model named and none here: the task needs "a model", which only a remote may have.
        needed = frozenset([model_name]) if model_name else (frozenset() if local else frozenset(["(any model)"]))
        remote_models = frozenset(m for o in offers for m in o.models) if offers and model_name else None
        decision = decide(DelegationInputs(
            profile=config.profile, force={"never": "local", "always": "remote"}.get(delegate),  # type: ignore[arg-type]
            remote_available=bool(offers), needed_models=needed, local_models=local, remote_models=remote_models,
            battery_low=config.battery_low, memory_low=config.memory_low))
        out.hint(f"running {'on a paired home PC' if decision.where == 'remote' else 'here'}: {decision.reason}")
        if decision.where == "remote":
            remote = await _agent_remote(home, out, goal, to, params, yes, fall_back=delegate == "auto")
            if remote is not None:
                return remote
        return await _agent_local(node_home, config, registry, out, goal, model_name, params, yes)

    result = run_async(go)
    out.data(result, lambda con: con.print(result["answer"]))


async def _agent_local(node_home: NodeHome, config: Any, registry: Any, out: Output, goal: str,
                       model_name: str | None, params: dict[str, Any], yes: bool) -> dict[str, Any]:
    from ...agent.loop import run_agent
    from ...agent.tools import ToolContext
    from ..models.agents import agent_config, llama_model, node_tools, pick_model, result_of

    name = pick_model(registry, model_name, config.agent_model, config.profile)

    async def confirm(call: Any, tool: Any) -> bool:
        if yes:
            return True
        if not sys.stdin.isatty():
            out.warn(f"{call.name} is irreversible and there is no terminal to ask; pass --yes to allow it")
            return False
        return await anyio.to_thread.run_sync(
            lambda: click.confirm(f"allow {call.name}({json.dumps(call.arguments)})?", default=False, err=True))

    async def emit(ev: Any) -> None:
        if not out.json_mode:
            _print_agent_event(out, ev)

    tools = node_tools(node_home, config)
    ctx = ToolContext(share_dir=Path(config.share_dir) if config.share_dir else None, profile=config.profile)
    async with _local_runner(node_home, registry, name) as worker:
        run = await run_agent(goal, model=llama_model(worker, params), tools=tools, ctx=ctx, profile=config.profile,
                              config=agent_config(params, from_peer=False), confirm=confirm, emit=emit)
    return {**result_of(run), "where": "local", "model": name}


async def _agent_remote(home: str | None, out: Output, goal: str, to: str | None, params: dict[str, Any],
                        yes: bool, fall_back: bool = False) -> dict[str, Any] | None:
    """Run the goal as a delegated agent task. `fall_back`: if the home PC turns out to be
    unreachable, take the task back and return None (the caller runs it here)."""
    async with Client(home) as client:
        handle = await client.delegate(to, goal=goal, params=params)
        if handle.away is not None and fall_back:
            await handle.cancel()
            out.warn(f"{_away_text(handle.target_name, handle.away)}; running here instead")
            return None
        if handle.away is not None:
            out.warn(f"{_away_text(handle.target_name, handle.away)}; the task is kept and delivered when it "
                     "is back; waiting for it (Ctrl-C stops waiting, the task stays queued)")
        out.hint(f"task {handle.id} -> {handle.target_name}")
        outcome = await _follow(handle, out, approve=yes, json_events=False)
    if outcome is None:
        raise PsymeshError(f"task {handle.id} ended without a final event", code=ErrorCode.INTERNAL)
    if not outcome.ok:
        _print_outcome(out, outcome)  # prints the failure and exits 1
    return {**outcome.value, "where": "remote", "task_id": handle.id}


@main.command("eval")
@command
@click.argument("cases", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--model", "model_name", default=None, help="Registered model to evaluate.")
@click.option("--bfcl", "bfcl_dir", is_flag=False, flag_value="", default=None, metavar="[DIR]",
              help="Score BFCL v4 (default: the installed bfcl-eval's data; or DIR, a folder in BFCL's layout) "
                   "as BFCL scores it, instead of a case file.")
@click.option("--category", "categories", multiple=True, metavar="NAME",
              help="With --bfcl: a category to score (repeatable; default: every supported one present).")
@click.option("--score-dir", type=click.Path(file_okay=False), default=None,
              help="With --bfcl: also write BFCL's score files (BFCL_v4_<category>_score.json, data_overall.csv).")
@click.option("--via", "via", default=None, metavar="PEER",
              help="With --bfcl: ask --model on this paired node (delegated infer tasks) instead of loading it here.")
@click.option("--runs", type=click.IntRange(min=1), default=1,
              help="With --bfcl: run N times, seeds 0..N-1, and report min/median/max per category.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0,
              help="With --bfcl: sampling temperature (0: greedy, when --runs gives N identical runs).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="With --bfcl: the first N cases of each "
                                                                         "category.")
@click.option("--oracle", is_flag=True, help="With --bfcl: answer with the ground truth instead of a model, "
                                              "through the same render/parse/score path (checks the harness).")
@click.option("--free", "free_form", is_flag=True, help="No grammar constraint (measures the raw model).")
@click.option("--thinking", is_flag=True)
@click.option("--ban-bytes", is_flag=True, hidden=True)
def eval_cmd(home: str | None, out: Output, cases: str | None, model_name: str | None, bfcl_dir: str | None,
             categories: tuple[str, ...], score_dir: str | None, via: str | None, runs: int, temperature: float,
             limit: int | None, oracle: bool, free_form: bool, thinking: bool, ban_bytes: bool) -> None:
    """Score a model on function-calling cases (JSONL), per category, BFCL-style; or, with
    --bfcl DIR, on BFCL v4's own files, as BFCL scores them."""
    if (cases is None) == (bfcl_dir is None):
        raise PsymeshError("give a case file or --bfcl [DIR] (one of them)", code=ErrorCode.BAD_REQUEST)
    if bfcl_dir is None and (categories or limit is not None or oracle or score_dir or via or runs > 1 or temperature):
        raise PsymeshError("--category, --limit, --oracle, --score-dir, --via, --runs and --temperature go with --bfcl",
                           code=ErrorCode.BAD_REQUEST)
    if oracle == (model_name is not None):
        raise PsymeshError("give --model NAME, or --oracle (with --bfcl)" if not oracle
                           else "--oracle answers without a model: drop --model", code=ErrorCode.BAD_REQUEST)
    if bfcl_dir is not None:
        return _eval_bfcl(home, out, bfcl_dir or None, categories, limit, model_name, free_form, thinking, ban_bytes,
                          score_dir, via, runs, temperature)

    from ...agent.evaluation import evaluate, format_report, load_cases
    from ..models.agents import llama_model, pick_model

    node_home = NodeHome(home)
    node_home.init()
    registry = _models(node_home)
    name = pick_model(registry, model_name, None)
    loaded = load_cases(cases)

    async def progress(r: Any) -> None:
        out.hint(f"{r.id}: {'pass' if r.passed else 'fail: ' + r.reason}")

    async def go() -> Any:
        async with _local_runner(node_home, registry, name) as worker:
            model = _StopOverContext(llama_model(worker, {"grammar": not free_form, "temperature": 0.0,
                                                          "max_tokens": 256, "ban_bytes": ban_bytes}),
                                     name, worker.settings.n_ctx)
            return await evaluate(loaded, model, thinking=thinking,
                                  on_result=progress)

    report = run_async(go)
    data = {"model": name, "cases": report.total, "passed": report.passed, "accuracy": report.accuracy,
            "categories": {c: {"cases": s.cases, "passed": s.correct, "accuracy": s.accuracy}
                           for c, s in report.categories.items()}}
    out.data(data, lambda con: con.print(format_report(report)))


def _eval_bfcl(home: str | None, out: Output, bfcl_dir: str | None, categories: tuple[str, ...], limit: int | None,
               model_name: str | None, free_form: bool, thinking: bool, ban_bytes: bool,
               score_dir: str | None, via: str | None = None, runs: int = 1, temperature: float = 0.0) -> None:
    """`eval --bfcl`: BFCL's questions through our prompt, the model (or the oracle) and our
    parser, scored by agent/bfcl.py's mirror of BFCL's AST checker and, for multi-turn,
    by BFCL's own multi_turn_checker."""
    from ...agent.bfcl import (
        WEB_CATEGORIES,
        default_data_dir,
        format_bfcl_report,
        format_run_spread,
        generation_params,
        load_bfcl,
        run_bfcl,
        run_spread,
        write_score_files,
    )
    from ...agent.loop import LlamaAgentModel

    data_dir = Path(bfcl_dir) if bfcl_dir else default_data_dir()
    loaded = load_bfcl(data_dir, categories, limit=limit)

    async def progress(r: Any) -> None:
        if model_name is not None or not r.passed:  # the oracle's passes are 1240 lines of noise
            out.hint(f"{r.id}: {'pass' if r.passed else 'fail: ' + r.reason}")

    def params(seed: int, grammar: bool = True) -> Any:  # grammar=False: format_sensitivity's prompting asks
        return generation_params(grammar=grammar and not free_form, ban_bytes=ban_bytes).model_copy(
            update={"temperature": temperature, "seed": seed})

    if model_name is None:
        name = "oracle"
        reports = [run_async(lambda: run_bfcl(loaded, None, thinking=thinking, on_result=progress))
                   for _ in range(runs)]
    elif via is not None:
        from ..control.delegated_model import DelegatedModel

        name = model_name

        async def remote() -> list[Any]:
            async with Client(home) as client:
                return [await run_bfcl(loaded, DelegatedModel(client, via, model_name, params(seed)),
                                       thinking=thinking, on_result=progress, web=client,
                                       prompting=DelegatedModel(client, via, model_name, params(seed, False)))
                        for seed in range(runs)]

        reports = run_async(remote)
    else:
        from ..models.agents import pick_model

        node_home = NodeHome(home)
        node_home.init()
        registry = _models(node_home)
        name = pick_model(registry, model_name, None)

        async def go() -> Any:
            async with _local_runner(node_home, registry, name) as worker, contextlib.AsyncExitStack() as stack:
                # web_search asks the web through this node's route: its daemon must be running.
                web = await stack.enter_async_context(Client(home)) if any(c.category in WEB_CATEGORIES
                                                                           for c in loaded) else None
                n_ctx = worker.settings.n_ctx
                return [await run_bfcl(loaded, _StopOverContext(LlamaAgentModel(worker, params(seed)), name, n_ctx),
                                       thinking=thinking, on_result=progress, web=web,
                                       prompting=_StopOverContext(LlamaAgentModel(worker, params(seed, False)),
                                                                  name, n_ctx))
                        for seed in range(runs)]

        reports = run_async(go)
    report = reports[0]
    data = {"model": name, "bfcl_dir": str(data_dir.resolve()), "limit": limit, "via": via, **report.data()}
    if runs > 1:
        data["runs"] = [{"seed": i, **r.data()} for i, r in enumerate(reports)]
        data["spread"] = run_spread(reports)
    if score_dir is not None:
        data["score_files"] = [str(p) for p in write_score_files(report, Path(score_dir), name)]
    out.data(data, lambda con: con.print(format_bfcl_report(report)
                                         + (format_run_spread(reports) if runs > 1 else "")))


if __name__ == "__main__":
    main()
