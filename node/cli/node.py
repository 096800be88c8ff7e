"""`psymesh node`: run the daemon in the foreground, stop it, install or remove it as a service."""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .output import Output, escape
from .common import command, home_at, on_node, run_async

if TYPE_CHECKING:
    from rich.console import Console


@click.group()
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

    node_home = home_at(home)
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
    on_node(home, lambda client: client.shutdown())
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

    node_home = home_at(home)
    platform = svc.PLATFORMS[svc.PLATFORMS.index(platform_name)] if platform_name else svc.this_platform()
    plan = svc.plan(platform, sys.executable, node_home.path, Path.home(), os.getuid())
    if dry_run:
        commands = (plan.unload if not installing else ()) + (plan.load if installing else plan.forget)
        data = {"platform": plan.platform, "path": str(plan.path), "content": plan.content if installing else None,
                "commands": [list(cmd) for cmd in commands], "dry_run": True}
        out.data(data, lambda con: con.print(
            (f"would write {plan.path}:\n\n{escape(plan.content, lines=True)}" if installing else f"would remove {plan.path}")
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

    def human(con: Console) -> None:
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
