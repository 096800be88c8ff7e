"""What every command shares: --home and --json (`command`), the one mapping of errors to a
message and exit status 1, running on trio (`run_async`), a connected SDK Client (`on_node`),
and durations on the command line (`Duration`).

Start-up is paid on every command, and scripts call the CLI in loops (issue 22 item 13): this
module, and what a command that only asks the daemon imports, stay clear of the node's config
models and keys (core/home.py), trio, libp2p and rich; and `status`, which asks with the blocking
one-shot client (node/control/oneshot.py), of anyio, asyncio and pydantic too
(tests/test_cli_startup.py checks it)."""
from __future__ import annotations

import atexit
import functools
import gc
import sqlite3
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource

from ..core.paths import HomePaths
from .output import Output
from ...protocol.errors import PsymeshError

if TYPE_CHECKING:
    from ..control.client import Client
    from ..core.home import NodeHome


T = TypeVar("T")

home_option = click.option(
    "--home", type=click.Path(file_okay=False), envvar="PSYMESH_HOME", default=None,
    help="Node home directory (default: $PSYMESH_HOME, else the platform data dir).",
)
json_option = click.option("--json", "json_mode", is_flag=True, help="Print data as JSON on stdout.")


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """Run `fn` on trio: for what runs node code in this process (a daemon, a model runner, an
    agent run), which is written for trio and tested on it."""
    import anyio  # here: `psymesh status` runs no event loop (node/control/oneshot.py)

    return anyio.run(fn, backend="trio")


def home_at(home: str | None) -> NodeHome:
    """The node home `home` names (--home; else $PSYMESH_HOME, else the platform's data dir), for
    a command that reads its key or config.toml. core/home.py (the config models, the key's
    cryptography) is imported here, at the call: `psymesh --help` imports every command's
    module, and a command that only asks the daemon needs no more of the home than its paths."""
    from ..core.home import NodeHome

    return NodeHome(home)


def on_node(home: str | None, ask: Callable[[Client], Awaitable[T]]) -> T:
    """`ask` the running daemon of `home` through a connected SDK Client, and its typed reply:
    what every command that talks to the daemon does. Its errors (DaemonNotRunning, a
    refusal) are shown by `command`. The SDK is imported here, at the call: the commands
    that never reach a daemon (`id`, `model add`) do not load it.

    On asyncio, not trio: the SDK works on both (its tests run it on each), the only IO here
    is the control socket, and asyncio costs a command a third of what importing trio does."""
    import anyio

    from ..control.client import Client

    async def go() -> T:
        async with Client(home) as client:
            return await ask(client)

    _no_collections_at_exit()
    return anyio.run(go, backend="asyncio")


@functools.cache
def _no_collections_at_exit() -> None:
    """What a command loaded lives until it exits: keep it out of the full collections the
    interpreter runs as it exits (their walk over pydantic's schemas was a sixth of
    `psymesh status`'s CPU time, bench/cli.py), as `node start` keeps the daemon's out of
    its collections. Once per process."""
    atexit.register(gc.freeze)


async def peer_names(client: Client) -> dict[str, str]:
    """Paired peers' names by peer id, for output that would otherwise show an id (a name
    is what the user typed and sees in `psymesh peers`)."""
    return {p.peer_id: p.name for p in await client.peers() if p.name}


def peer_label(peer_id: str, names: dict[str, str]) -> str:
    """A peer as output shows it: its name if it is paired under one, else the start of its id."""
    return names.get(peer_id) or f"{peer_id[:16]}…"


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
        from ..core.db import storage_error

        return storage_error(exc, HomePaths(home).db_path)
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


def command(f: Callable[..., Any]) -> Callable[..., Any]:
    """Common options, and PsymeshError -> a clear message and exit status 1 (never a traceback)."""

    @home_option
    @json_option
    @functools.wraps(f)
    def wrapper(*args: Any, home: str | None, json_mode: bool, **kwargs: Any) -> Any:
        given = click.get_current_context().get_parameter_source("home") is ParameterSource.COMMANDLINE
        out = Output(json_mode, home=home if given else None)
        try:
            return f(*args, home=home, out=out, **kwargs)
        except (PsymeshError, EvalStopped, sqlite3.Error, BaseExceptionGroup) as exc:
            error = _as_psymesh_error(exc, home)
            if error is None:
                raise
            out.error(error)
            sys.exit(1)

    return wrapper


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
