"""Looking at this node: `id`, `status`, `doctor`, `ping`, `discover`, `audit`."""
from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import click

from .output import Output, escape, table as out_table
from ...protocol import control as c
from .common import command, home_at, on_node, peer_label, peer_names, run_async

if TYPE_CHECKING:
    from rich.console import Console

    from ..control.client import Client


@click.command("id")
@command
def id_cmd(home: str | None, out: Output) -> None:
    """Show this node's peer id and fingerprint (creates the home on first use)."""
    node_home = home_at(home)
    identity = node_home.init()
    data = {"peer_id": identity.peer_id, "fingerprint": identity.fingerprint, "home": str(node_home.path)}
    out.data(data, lambda con: con.print(
        f"peer id:     {identity.peer_id}\nfingerprint: {identity.fingerprint}\nhome:        {node_home.path}"))


@click.command()
@command
def status(home: str | None, out: Output) -> None:
    """Peer id, addresses, uptime and connected peers of the running daemon."""
    # blocking and model-free (node/control/oneshot.py): scripts call this in loops. The reply
    # holds StatusReply's fields, as attributes.
    from ..control.oneshot import ask

    st = cast("c.StatusReply", ask(home, "control.status"))

    def human(con: Console) -> None:
        con.print(f"[bold]{escape(st.name)}[/bold] (profile: {st.profile}) psymesh {st.version}, up {st.uptime_s:.0f} s")
        con.print(f"peer id:     {st.peer_id}\nfingerprint: {st.fingerprint}")
        for a in st.addrs:
            con.print(f"listening:   {escape(a)}")
        for line in _reachability_lines(st.reachability, out):
            con.print(f"reachable:   {escape(line)}")
        for line in device_lines((d.tool, d.backend) for d in st.device_tools):
            con.print(f"device:      {escape(line)}")
        table = out_table("connected peer", "addresses")
        for p in st.connected_peers:
            table.add_row(escape(p.name or p.peer_id), escape(" ".join(p.addrs)))
        con.print(table if st.connected_peers else "no connected peers")

    out.data(st, human)


def device_lines(tools: Iterable[tuple[str, str]]) -> list[str]:
    """The phone's tools grouped by what they act through: a line per backend, the simulated
    phone first (`status`, `agent run`)."""
    from ...protocol.devices import SIMULATED, backend_note

    by: dict[str, list[str]] = {}
    for tool, backend in tools:
        by.setdefault(backend, []).append(tool)
    order = sorted(by, key=lambda b: (b != SIMULATED, b))
    return [f"{backend_note(b)}: {', '.join(sorted(by[b]))}" for b in order]


def _reachability_lines(reach: c.Reachability, out: Output) -> list[str]:
    """How peers reach this node, in words: proven addresses first, then relays, then the rest."""
    now = time.time()
    lines = [f"{a.addr} (dialed back by {a.by_name} {max(0.0, now - a.at):.0f} s ago)" for a in reach.confirmed]
    lines += [f"{a} (through a relay)" for a in reach.relayed]
    beyond = [a for a in reach.direct if not a.startswith(("/ip4/127.", "/ip6/::1/"))]
    if not lines:
        lines += [f"{a} (from where it routes; not yet confirmed: {out.suggest('doctor')})" for a in beyond]
    if not lines:
        lines.append("only from this machine, or over connections this node opens itself "
                     "(listen on a LAN address, or keep a relay: docs/deploy.md)")
    return lines


@click.command()
@command
@click.option("--timeout", "timeout_s", type=click.FloatRange(1, 60), default=10, show_default=True,
              metavar="SECONDS", help="How long the daemon may take to probe the peers.")
def doctor(home: str | None, out: Output, timeout_s: float) -> None:
    """Check this node: its home, disk, database, listen addresses, and each paired peer
    (reachable? direct or relayed? its clock? can it dial back?). Exit status 1 if a check fails."""
    from ..control.doctor import failed, run_checks
    checks = run_async(lambda: run_checks(home_at(home), timeout_s=timeout_s, suggest=out.suggest))
    colors = {"ok": "green", "warn": "yellow", "fail": "red"}

    def human(con: Console) -> None:
        for check in checks:
            con.print(f"[{colors[check.status]}]{check.status:<4}[/{colors[check.status]}] "
                      f"{escape(check.name)}: {escape(check.detail)}")
            if check.next_step:
                con.print(f"       [dim]next:[/dim] {escape(check.next_step)}")

    out.data({"ok": not failed(checks), "checks": checks}, human)
    if failed(checks):
        sys.exit(1)


@click.command()
@command
@click.argument("peer")
@click.option("--count", "-c", default=4, show_default=True, type=click.IntRange(1, 1000), help="Round trips.")
@click.option("--size", default=32, show_default=True, type=click.IntRange(0, 65536), help="Payload bytes.")
def ping(home: str | None, out: Output, peer: str, count: int, size: int) -> None:
    """Round trips to PEER (a multiaddr ending /p2p/<id>) over the encrypted channel."""
    async def ask(client: Client) -> tuple[c.PingReply, dict[str, str]]:
        return await client.ping(peer, count=count, payload_size=size), await peer_names(client)

    r, names = on_node(home, ask)

    def human(con: Console) -> None:
        for i, rtt in enumerate(r.rtts_ms):
            con.print(f"{size} bytes from {escape(peer_label(r.peer_id, names))}: seq={i} time={rtt:.3f} ms")
        con.print(f"connect {r.connect_ms:.2f} ms; rtt min/median/max = "
                  f"{r.min_ms:.3f}/{r.median_ms:.3f}/{r.max_ms:.3f} ms")

    out.data(r, human)


@click.command()
@command
@click.option("--wait", "wait_s", type=click.FloatRange(0, 60), default=0, show_default=True, metavar="SECONDS",
              help="With no node seen yet, listen up to this many seconds for the first one.")
def discover(home: str | None, out: Output, wait_s: float) -> None:
    """Nodes seen on the LAN (mDNS) or at static addresses, paired or not, with fingerprints.

    Compare a node's fingerprint with `psymesh id` on that device before pairing with it:
    anyone on the LAN can announce anything, and pairing is what proves the key."""
    reply: c.DiscoverReply = on_node(home, lambda client: client.discovered(wait_s))
    if not reply.mdns and not reply.static_peers:
        out.hint("discovery is off: set mdns = true (and listen on the LAN) or static_peers in config.toml")
    elif reply.mdns and not reply.announced:
        out.hint("mdns is on, but this node announces nothing: it listens on no LAN address (listen = "
                 "[\"/ip4/0.0.0.0/tcp/4001\"]), or mDNS could not start (see the daemon's log)")

    def human(con: Console) -> None:
        if not reply.nodes:
            more = f"; try: {out.suggest('discover', '--wait 5')}" if reply.mdns else ""
            con.print(escape(f"no nodes seen yet{more}"))
            return
        table = out_table("name", "peer id", "fingerprint", "addresses", "via", "last seen")
        now = time.time()
        for n in reply.nodes:
            table.add_row(f"[green]{escape(n.name)}[/green]" if n.name else "[dim]not paired[/dim]",
                          n.peer_id[:20] + "…", n.fingerprint or "-", "\n".join(escape(a) for a in n.addrs), n.source,
                          f"{max(0.0, now - n.last_seen):.0f} s ago")
        con.print(table)

    out.data(reply.nodes, human)


@click.command()
@command
@click.option("--peer", default=None, help="Only this peer (name or id).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10000))
@click.option("--denied", is_flag=True, help="Only refused requests.")
def audit(home: str | None, out: Output, peer: str | None, limit: int, denied: bool) -> None:
    """Every gate decision, allowed or denied."""
    rows: list[c.AuditRow] = on_node(home, lambda client: client.audit(peer=peer, limit=limit, denied_only=denied))

    def human(con: Console) -> None:
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
