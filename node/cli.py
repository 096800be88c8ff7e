"""The `psymesh` command line. Every command takes --home and --json; data goes to
stdout, logs and hints to stderr (see node/output.py)."""
from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import click
from rich.table import Table

from psymesh.node.client import Client
from psymesh.node.home import NodeHome
from psymesh.node.output import Output
from psymesh.protocol.errors import PsymeshError

T = TypeVar("T")

home_option = click.option(
    "--home", type=click.Path(file_okay=False), envvar="PSYMESH_HOME", default=None,
    help="Node home directory (default: $PSYMESH_HOME, else the platform data dir).",
)
json_option = click.option("--json", "json_mode", is_flag=True, help="Print data as JSON on stdout.")


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """All commands run on trio: the daemon needs it, and the SDK works on it too."""
    return anyio.run(fn, backend="trio")


def command(f: Callable[..., Any]) -> Callable[..., Any]:
    """Common options, and PsymeshError -> a clear message and exit status 1 (never a traceback)."""

    @home_option
    @json_option
    @functools.wraps(f)
    def wrapper(*args: Any, home: str | None, json_mode: bool, **kwargs: Any) -> Any:
        out = Output(json_mode)
        try:
            return f(*args, home=home, out=out, **kwargs)
        except PsymeshError as exc:
            out.error(exc)
            sys.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="psymesh")
def main() -> None:
    """psymesh: a peer-to-peer mesh for small on-device AI agents."""


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
@click.option("--listen", multiple=True, metavar="MULTIADDR", help="Listen address (repeatable), e.g. /ip4/127.0.0.1/tcp/4001.")
@click.option("--profile", type=click.Choice(["home", "phone"]), default=None, help="Node profile (saved in config.toml).")
@click.option("--name", default=None, help="Human name of this node (saved in config.toml).")
@click.option("--log-json", is_flag=True, help="Log one JSON object per line (stderr).")
def node_start(home: str | None, out: Output, listen: tuple[str, ...], profile: str | None,
               name: str | None, log_json: bool) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM."""
    from psymesh.node.daemon import Node
    from psymesh.node.logs import setup_logging

    node_home = NodeHome(home)
    node_home.init(profile=profile, name=name)  # type: ignore[arg-type]
    config = node_home.load_config()
    changes: dict[str, Any] = {}
    if profile and profile != config.profile:
        changes["profile"] = profile
    if name and name != config.name:
        changes["name"] = name
    if changes:
        config = config.model_copy(update=changes)
        node_home.save_config(config)
    if listen:
        config = config.model_copy(update={"listen": list(listen)})  # for this run only
    setup_logging(json_lines=log_json or config.log_json)
    daemon = Node(node_home, config)
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
        table = Table("connected peer", "addresses")
        for p in st.connected_peers:
            table.add_row(p.name or p.peer_id, " ".join(p.addrs))
        con.print(table if st.connected_peers else "no connected peers")

    out.data(st, human)


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


if __name__ == "__main__":
    main()
