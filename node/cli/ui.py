"""`psymesh ui`: open the dashboard of the running daemon."""
from __future__ import annotations

import click

from .output import Output
from .common import command, on_node


@click.command()
@command
@click.option("--no-open", is_flag=True, help="Print the link only; do not open a browser.")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="If it is not running yet: serve it on this port (0: any free one), not [ui] port.")
def ui(home: str | None, out: Output, no_open: bool, port: int | None) -> None:
    """The dashboard in a browser: starts it in the running daemon if needed (a phone runs it
    only on demand), prints its link with the token, and opens it."""
    r = on_node(home, lambda client: client.ui(port=port))
    if not no_open and not out.json_mode:
        import webbrowser

        webbrowser.open(r.login_url)
    out.data(r, lambda con: con.print(f"dashboard: {r.url}\nopen (the link holds the token, keep it to yourself):"
                                      f"\n  {r.login_url}"))
