"""How a psymesh command for a home is spelled for a person to run next: the CLI's hints
(node/cli/output.py `Output.suggest`), doctor's next steps (node/control/doctor.py), and the
daemon's own hints (`Commands`)."""
from __future__ import annotations

from pathlib import Path

from .paths import is_default_home


def spell_command(command: str, rest: str = "", *, home: str | None = None) -> str:
    """A psymesh command for a person to run next, for the home they named: `command` is its
    words, `rest` its arguments as shown (placeholders included), `home` the --home they gave
    (None: leave it out, as they did), put between them so it is read whatever `rest` holds.
    `spell_command("task watch", "t1", home="~/psy-phone")` -> `psymesh task watch --home '~/psy-phone' t1`."""
    import shlex  # here: most commands print no hint

    where = f" --home {shlex.quote(home)}" if home is not None else ""
    return f"psymesh {command}{where}" + (f" {rest}" if rest else "")


class Commands:
    """How a node's own messages spell a psymesh command for its owner to run next (its log's
    hints, its refusals on the control socket, its setup notes): with `--home DIR` when the node
    runs in a home other than the platform's default, so the command as printed reaches this
    node and not the default one. `Commands()` (no home: the default's, or a component used on
    its own) leaves it out; the daemon makes one with `Commands.of(home)` and hands it on."""

    def __init__(self, home: str | None = None) -> None:
        self.home = home

    @classmethod
    def of(cls, home: Path) -> Commands:
        return cls(None if is_default_home(home) else str(home))

    def __call__(self, command: str, rest: str = "") -> str:
        return spell_command(command, rest, home=self.home)
