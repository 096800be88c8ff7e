"""The `psymesh` command line, one module per command group, on top of the SDK (control/client.py).
The only subpackage that may import daemon.py at run time (`psymesh node run` starts one).

common.py holds what every command shares (--home/--json, the error mapping, `on_node`);
each other module is one command group: node (the daemon), serve (serve/mcp: the HTTP
faces), status (id/status/doctor/ping/discover/audit: looking at this node), peers
(pair/peers/grant/revoke), task, msg (msg/group), web, model, agent (agent/eval), ui.
`main` imports a group's module only when that group is the command run (or --help lists
it), so `psymesh status` does not pay for the imports of `agent` or `node start`; and what
those modules import at their top is light (click, common.py, output.py): the models, the SDK,
the home's config and rich come in when a command runs, so `--help` loads none of them
(tests/test_cli_startup.py).
"""
from __future__ import annotations

import importlib
import os

import click

# pydantic looks for plugins in every installed distribution's entry points (importlib.metadata)
# when a process builds its first model: 20-70 ms of each command that builds one, for plugins
# psymesh has none of. A documented pydantic switch; set it yourself (even to "") to keep yours.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

# command name -> "module:attribute" in this package; `psymesh --help` lists them sorted.
COMMANDS = {
    "id": "status:id_cmd", "status": "status:status", "doctor": "status:doctor", "ping": "status:ping",
    "discover": "status:discover", "audit": "status:audit",
    "node": "node:node",
    "serve": "serve:serve", "mcp": "serve:mcp",
    "pair": "peers:pair", "peers": "peers:peers", "grant": "peers:grant", "revoke": "peers:revoke",
    "ui": "ui:ui",
    "task": "task:task",
    "msg": "msg:msg", "group": "msg:group",
    "web": "web:web",
    "model": "model:model", "worker": "model:worker",
    "agent": "agent:agent", "eval": "agent:eval_cmd",
}


class LazyGroup(click.Group):
    """A click group whose commands are imported by name when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        module, attr = COMMANDS[cmd_name].split(":")
        command: click.Command = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="psymesh")
def main() -> None:
    """psymesh: a peer-to-peer mesh for small on-device AI agents."""
    # Whatever this process creates is its owner's alone: the explicit 0600/0700 modes of
    # node/core/home.py and node/core/db.py cover psymesh's own files, this also covers files that
    # libraries create (the download cache of `psymesh model pull`).
    os.umask(0o077)


__all__ = ["main"]
