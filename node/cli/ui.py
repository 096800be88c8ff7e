"""`psymesh ui`: open the dashboard of the running daemon.

The link that signs the browser in works once, within a minute (node/control/uisessions.py),
and still never goes on a command line, where every local user can read it (`ps`,
/proc/PID/cmdline): the browser is given a file, `<home>/ui-open.html` (0600, in the owner's
home), that sends it on to the link, as Jupyter's launch file does."""
from __future__ import annotations

import html
import os
from pathlib import Path

import click

from ..core.paths import HomePaths, os_error, private_opener
from .output import Output
from .common import command, on_node

LAUNCH_FILE = "ui-open.html"


def launch_file(home: str | None, login_url: str) -> Path:
    """The page the browser opens (its path is all a command line shows): it goes on to
    `login_url` at once. Rewritten each time, so one file holds at most one code, used or dead."""
    path = HomePaths(home).path / LAUNCH_FILE
    link = html.escape(login_url, quote=True)
    page = (f'<!doctype html><meta charset="utf-8"><meta name="referrer" content="no-referrer">'
            f'<meta http-equiv="refresh" content="0;url={link}"><title>psymesh dashboard</title>'
            f'<p><a href="{link}">Open the psymesh dashboard</a> (this link works once).</p>\n')
    try:
        with open(path, "w", opener=lambda p, flags: private_opener(p, flags | os.O_TRUNC)) as f:
            os.fchmod(f.fileno(), 0o600)  # a file left by an older run keeps its mode otherwise
            f.write(page)
    except OSError as exc:
        raise os_error(exc, path) from None
    return path


@click.command()
@command
@click.option("--no-open", is_flag=True, help="Print the one-use link only; do not open a browser.")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="If it is not running yet: serve it on this port (0: any free one), not [ui] port.")
def ui(home: str | None, out: Output, no_open: bool, port: int | None) -> None:
    """The dashboard in a browser: starts it in the running daemon if needed (a phone runs it
    only on demand) and opens it signed in. The link it makes works once, within a minute."""
    r = on_node(home, lambda client: client.ui(port=port))
    opened = False
    if not no_open and not out.json_mode:
        import webbrowser

        opened = webbrowser.open(launch_file(home, r.login_url).as_uri())
    if opened:
        out.data(r, lambda con: con.print(f"dashboard: {r.url}\nopened in your browser, signed in"))
    else:
        out.data(r, lambda con: con.print(f"dashboard: {r.url}\nopen this link within a minute (it works once; "
                                          f"keep it to yourself until then):\n  {r.login_url}"))
