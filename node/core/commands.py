"""How a psymesh command for a home is spelled for a person to run next: the CLI's hints
(node/cli/output.py `Output.suggest`) and doctor's next steps (node/control/doctor.py)."""
from __future__ import annotations


def spell_command(command: str, rest: str = "", *, home: str | None = None) -> str:
    """A psymesh command for a person to run next, for the home they named: `command` is its
    words, `rest` its arguments as shown (placeholders included), `home` the --home they gave
    (None: leave it out, as they did), put between them so it is read whatever `rest` holds.
    `spell_command("task watch", "t1", home="~/psy-phone")` -> `psymesh task watch --home '~/psy-phone' t1`."""
    import shlex  # here: most commands print no hint

    where = f" --home {shlex.quote(home)}" if home is not None else ""
    return f"psymesh {command}{where}" + (f" {rest}" if rest else "")
