"""CLI output: data to stdout (JSON with --json, rich tables otherwise); everything else to stderr.

Scripts can always parse stdout of a `--json` command: it holds exactly one JSON
document (an object, a list — `[]` when empty — or {"error": {...}} on failure), printed
when the command ends. A command that waits (`--wait`, `task watch`) prints nothing on the
way and puts what happened into that one document (a task's `events`; the invite and the
pairing of `pair invite --wait`). The one exception is `msg inbox --follow`, which never ends:
one JSON object per line, one line per letter as it comes (JSON Lines).

Text a peer controls (letters, names, results, answers, audit reasons, web pages) reaches the
terminal only through `escape`: its control characters shown as escapes (node/core/visible.py),
so it cannot clear the screen, rewrite a line or pass for another letter, and one letter is one
line. `--json` writes JSON, whose escapes do the same.

A failure is one line on stderr, and exit status 1. The network failing (a NetworkError:
a peer or a server that could not be reached or stopped answering) reads apart from a
refusal, its JSON error says `"network": <how>`, and when it was the daemon that could
not reach a peer, the line ends with what to check next.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..control.oneshot import Reply
from ..core.commands import spell_command
from ..core.visible import visible
from ...protocol.errors import NetworkError, PsymeshError, network_kind

if TYPE_CHECKING:
    from rich.console import Console

PEER_NEXT_STEP = "is its daemon running and reachable? try again later, or see: {peers}"


def escape(text: str, *, lines: bool = False) -> str:
    """`text` as a rich console may print it: its control characters shown as escapes (one
    line unless `lines`: see node/core/visible.py), then rich's markup escaped. Every text
    from a peer or the web goes through it. rich is imported on first use: a `--json`
    command prints no markup, and rich is a good part of what a short command would load."""
    from rich.markup import escape as rich_escape

    return rich_escape(visible(text, lines=lines))


def table(*headers: str, **options: Any) -> Any:
    """A rich table whose cells wrap (folding a long word such as a peer id over lines) instead
    of ending in `…` when the terminal, or a pipe's 80 columns, is narrow. A column whose words
    must stay whole (the peers table's capabilities) is given its width by its command."""
    from rich.table import Table

    t = Table(**options)
    for header in headers:
        t.add_column(header, overflow="fold")
    return t


def to_data(obj: Any) -> Any:
    if isinstance(obj, Reply):  # a one-shot reply: the map the daemon made of its model
        return obj.fields
    # nothing is a model unless pydantic was loaded: `psymesh --help` and `status` load none
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(obj, pydantic.BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, list):
        return [to_data(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj


class Output:
    """`out` and `err` (rich consoles) are made on first use, so a command that only writes
    JSON never loads rich. `home`: the --home this command was given on its command line
    (None when it came from $PSYMESH_HOME, which the next command sees as well, or the
    default), repeated by `suggest` in every command a hint names."""

    def __init__(self, json_mode: bool = False, home: str | None = None) -> None:
        self.json_mode = json_mode
        self.home = home

    def suggest(self, command: str, rest: str = "") -> str:
        """A psymesh command to run next, as the user would type it for this home:
        `suggest("task watch", task_id)` -> `psymesh task watch --home ~/psy-phone t18...`.
        `command` is the command's words, `rest` its arguments as shown (placeholders such as
        `NAME PATH.gguf` included); --home goes between them, where it is read whatever
        `rest` holds (a `-- COMMAND` included)."""
        return spell_command(command, rest, home=self.home)

    @cached_property
    def out(self) -> Console:
        from rich.console import Console

        # emoji=False: `peer:phone:` is a check's name, not the ☎ emoji code
        return Console(highlight=False, soft_wrap=True, emoji=False)

    @cached_property
    def err(self) -> Console:
        from rich.console import Console

        return Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)

    def data(self, obj: Any, human: Callable[[Console], None] | None = None) -> None:
        if self.json_mode or human is None:
            sys.stdout.write(json.dumps(to_data(obj), indent=None if self.json_mode else 2) + "\n")
            sys.stdout.flush()
        else:
            human(self.out)

    def hint(self, message: str) -> None:
        self.err.print(f"[dim]{escape(message)}[/dim]")

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {escape(message)}")

    def error(self, exc: PsymeshError) -> None:
        network = isinstance(exc, NetworkError)
        if self.json_mode:
            error: dict[str, Any] = {"code": exc.code.value, "message": exc.message}
            if network:
                error["network"] = network_kind(exc)
            if "not_run" in exc.details:  # an eval that could not run: each category and why
                error["not_run"] = exc.details["not_run"]
            self.data({"error": error})
        code = escape(f"[{exc.code.value}]")
        if network:
            message = " ".join(exc.message.split())  # one line, whatever the transport said
            if "network" in exc.details:  # the daemon said so: it could not reach a peer
                message += "; " + PEER_NEXT_STEP.format(peers=self.suggest("peers"))
            self.err.print(f"[red]network error[/red] {code}: {escape(message)}")
        else:
            self.err.print(f"[red]error[/red] {code}: {escape(exc.message)}")
