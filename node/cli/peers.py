"""Trust between nodes: `pair invite|join`, `peers`, `grant`, `revoke`."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import click

from .output import Output, escape, table as out_table
from ...protocol import control as c
from ...protocol.errors import ErrorCode, PsymeshError
from .common import Duration, command, on_node, parse_duration
from .msg import _away_since

if TYPE_CHECKING:
    from ...protocol.limits import Limits
    from rich.console import Console


def _show_invite(out: Output, inv: c.PairInviteReply) -> None:
    if out.json_mode:
        return
    import io

    import segno

    qr = io.StringIO()
    segno.make(inv.invite.upper(), error="l").terminal(out=qr, compact=True)
    out.out.print(qr.getvalue(), end="")
    out.out.print(f"code:   [bold]{inv.code}[/bold]   (read it aloud; valid until "
                  f"{time.strftime('%H:%M:%S', time.localtime(inv.expires_at))}, grant preset: {inv.grant})")
    out.out.print(f"invite: {inv.invite}")
    out.hint(f"on the other device: psymesh pair join {inv.invite}")


def _show_paired(out: Output, p: c.PairedReply) -> None:
    def human(con: Console) -> None:
        con.print(f"[green]paired[/green] with [bold]{escape(p.name)}[/bold] (profile: {p.role}) {p.peer_id}")
        if p.asked_name:
            con.print(f"[yellow]named {escape(p.name)} here[/yellow]: another paired peer is called "
                      f"{escape(p.asked_name)}; commands take {escape(p.name)} (or its peer id) for this one")
        if p.known_as:
            con.print(f"[yellow]{escape(p.name)} knows this node as {escape(p.known_as)}[/yellow]: commands on "
                      f"{escape(p.name)} name this node {escape(p.known_as)}")
        con.print(f"verification words: [bold]{p.verification}[/bold]  (both screens must show the same)")
        con.print(f"it may ask this node:  {escape(', '.join(p.granted)) or 'nothing'}")
        if p.received:
            con.print(f"this node may ask it:  {escape(', '.join(p.received))}")

    out.data(p, human)


@click.group()
def pair() -> None:
    """Pair devices with a short one-time code."""


@pair.command("invite")
@command
@click.option("--name", default=None, help="What to call the device that joins (default: its own name).")
@click.option("--grant", default="phone", show_default=True, help="Grant preset for the joiner (phone, messaging).")
@click.option("--ttl", type=Duration(), default="10m", show_default=True, help="How long the invite stays valid.")
@click.option("--grant-ttl", type=Duration(), default=None, help="Lifetime of the grant (default: until revoked).")
@click.option("--wait/--no-wait", default=None, help="Wait for the device to join (default: yes, except with --json).")
def pair_invite(home: str | None, out: Output, name: str | None, grant: str, ttl: float,
                grant_ttl: float | None, wait: bool | None) -> None:
    """Make a one-time invite (code + QR) for a device to join."""
    wait = (not out.json_mode) if wait is None else wait

    if not wait:
        invite = on_node(home, lambda client: client.pair_invite(name=name, grant=grant, ttl_s=ttl,
                                                                 grant_ttl_s=grant_ttl))
        _show_invite(out, invite)
        if out.json_mode:
            out.data(invite)
        return

    invites: list[c.PairInviteReply] = []

    def shown(inv: c.PairInviteReply) -> None:
        invites.append(inv)
        _show_invite(out, inv)
        if out.json_mode:  # stdout's one document comes at the end: the person reads the code here
            out.hint(f"code: {inv.code}  invite: {inv.invite}")
        out.hint("waiting for the device to join (Ctrl-C cancels the invite)...")

    try:
        paired = on_node(home, lambda client: client.pair_invite_and_wait(
            shown, name=name, grant=grant, ttl_s=ttl, grant_ttl_s=grant_ttl))
    except KeyboardInterrupt:  # our connection closes with us, and the daemon cancels the invite
        out.warn(f"stopped waiting: the invite is cancelled (a new one: {out.suggest('pair invite')})")
        sys.exit(130)
    if out.json_mode:
        out.data({"invite": invites[0], "paired": paired})
        return
    _show_paired(out, paired)


@pair.command("join")
@command
@click.argument("invite")
@click.option("--address", default=None, help="The inviter's address, when INVITE is a bare code (default: the "
                                               "unpaired nodes discovered on the LAN are tried in turn).")
@click.option("--grant", default=None, help="Grant preset to give the inviter in return (e.g. messaging).")
def pair_join(home: str | None, out: Output, invite: str, address: str | None, grant: str | None) -> None:
    """Join a node with its invite string (or its code plus --address)."""
    _show_paired(out, on_node(home, lambda client: client.pair_join(invite, address=address, grant=grant)))


@click.command()
@command
@click.option("--active", is_flag=True, help="Hide revoked peers.")
def peers(home: str | None, out: Output, active: bool) -> None:
    """Paired peers, with what each may ask of this node and what we may ask of it."""
    rows: list[c.PeerView] = on_node(home, lambda client: client.peers(include_revoked=not active))

    def human(con: Console) -> None:
        if not rows:
            con.print(escape(f"no paired peers; pair one with: {out.suggest('pair invite')}"))
            return
        table = out_table("name", "role", "peer id", "state", "may ask us", "we may ask")
        ours, theirs, states = [], [], []
        for p in rows:
            states.append("revoked" if p.revoked_at else "revoked us" if p.revoked_us_at
                          else "connected" if p.connected else _away_since(p.away) if p.away else "paired")
            state = f"[red]{states[-1]}[/red]" if "revoked" in states[-1] else states[-1]
            ours.append(GrantCell([], revoked=True) if p.revoked_at else
                        GrantCell(p.granted, p.granted_expires, _limit_lines(p.granted_limits)))
            theirs.append(GrantCell(p.received, p.received_expires))
            table.add_row(escape(p.name), p.role, p.peer_id, state, ours[-1].markup(), theirs[-1].markup())
        for column, cells in ((table.columns[4], ours), (table.columns[5], theirs)):
            # fixed, so that a narrow terminal takes its columns from the others (the peer id folds)
            column.width = max([len(str(column.header)), *(cell.unbroken_width() for cell in cells)])
        table.columns[3].width = max(len(state) for state in states)  # `connected`, `revoked us`: whole
        con.print(table)

    out.data(rows, human)


def until_text(expires: float | None) -> str:
    """`until 2027-01-01 14:02` for a grant that ends, `until revoked` for one that does not."""
    if expires is None:
        return "until revoked"
    return "until " + time.strftime("%Y-%m-%d %H:%M", time.localtime(expires))


@dataclass(frozen=True)
class GrantCell:
    """A peers-table cell for one direction of trust: the capabilities, comma-separated, then when
    they end (if they do), then the limits of ours, one a line; `revoked` for a grant void now.
    The column is made as wide as its longest capability (with its comma) and limit, so it wraps
    between capabilities, never inside one (`task.infer:models=botpsy*` folded over two lines at
    80 columns read as two capabilities, neither real)."""

    caps: list[str]
    expires: float | None = None
    limits: list[str] = field(default_factory=list)
    revoked: bool = False

    def markup(self) -> str:
        if self.revoked:
            return "[red]revoked[/red]"
        if not self.caps:
            return "-"
        lines = [", ".join(escape(cap) for cap in self.caps)]
        if self.expires is not None:
            lines.append(f"(all {until_text(self.expires)})")
        lines += [f"[dim]{escape(limit)}[/dim]" for limit in self.limits]
        return "\n".join(lines)

    def unbroken_width(self) -> int:
        """What the column needs so that no capability and no limit is folded."""
        words = [len(cap) + 1 for cap in self.caps[:-1]] + [len(cap) for cap in self.caps[-1:]]
        return max([*words, *(len(limit) for limit in self.limits if self.caps), len("revoked" if self.revoked else "-")])


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


LIMIT_WORDS = {  # how `psymesh peers` shows each limit
    "requests_per_minute": lambda v: f"{v} req/min",
    "concurrent_tasks": lambda v: f"{v} at once",
    "max_runtime_s": lambda v: f"{v} s/task",
    "max_payload_bytes": lambda v: f"{_size(v)} payload",
    "rpc_memory_mb": lambda v: f"{v} MB for compute.rpc",
}


def _limit_lines(limits: Limits) -> list[str]:
    """The limits as the peers table shows them under the capabilities."""
    text = limits_text(limits)
    return ["no limits"] if text == "none" else text.splitlines()


def limits_text(limits: Limits) -> str:
    """One line per limit the grant sets; `none` when it sets none (the node's own limits apply)."""
    values = limits.model_dump()
    return "\n".join(LIMIT_WORDS[k](v) for k, v in values.items() if v is not None) or "none"


def parse_limits(text: str) -> dict[str, int | None]:
    """`requests_per_minute=600,concurrent_tasks=8` (and `NAME=none` to clear one) -> changes,
    checked against `Limits`; a bad spelling is a BAD_REQUEST saying which part and why."""
    changes: dict[str, int | None] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise PsymeshError(f"--limits: {part!r} is not NAME=NUMBER or NAME=none, e.g. concurrent_tasks=8",
                               code=ErrorCode.BAD_REQUEST)
        if value.lower() == "none":
            changes[name] = None
        else:
            try:
                changes[name] = int(value)
            except ValueError:
                raise PsymeshError(f"--limits: {name}={value}: not a whole number (or none)",
                                   code=ErrorCode.BAD_REQUEST) from None
    if not changes:
        raise PsymeshError("--limits: no limits given, e.g. --limits concurrent_tasks=8", code=ErrorCode.BAD_REQUEST)
    try:
        return c.check_limit_changes(changes)
    except ValueError as exc:
        raise PsymeshError(f"--limits: {exc}", code=ErrorCode.BAD_REQUEST) from None


# `-CAP` is an argument: no short options here, not even -h (it would take `-web.search` for -w -e -b ... -h)
@click.command(context_settings={"ignore_unknown_options": True, "help_option_names": ["--help"]})
@command
@click.argument("peer")
@click.argument("capabilities", nargs=-1, metavar="[CAP | +CAP | -CAP]...")
@click.option("--preset", default=None, metavar="PRESET",
              help="Start from a preset's capabilities and limits (phone, messaging).")
@click.option("--expires", default=None, metavar="DURATION|never",
              help="How long the grant lasts (30d, 12h, ...; never: until revoked). Default: as long as the "
                   "current grant.")
@click.option("--preset-limits", "preset_limits", default=None, metavar="PRESET",
              help="Start from a preset's limits (phone, messaging) instead of the current grant's.")
@click.option("--limits", "limits_spec", default=None, metavar="NAME=N,...",
              help="Set single limits: requests_per_minute, concurrent_tasks, max_runtime_s, max_payload_bytes, "
                   "rpc_memory_mb (N, or none for no limit).")
def grant(home: str | None, out: Output, peer: str, capabilities: tuple[str, ...], preset: str | None,
          expires: str | None, preset_limits: str | None, limits_spec: str | None) -> None:
    """Change what PEER may ask of this node: `+CAP` adds one, `-CAP` takes one away
    (`psymesh grant phone +tool:system.info -msg.send`), bare CAPs replace the whole list
    (`psymesh grant phone tool:files.* msg.send`), `--preset phone` starts from a preset.

    Its limits stay those of the current grant unless --preset, --preset-limits or --limits change them,
    and so does its end unless --expires sets another."""
    set_limits = parse_limits(limits_spec) if limits_spec is not None else None
    forever = expires is not None and expires.strip().lower() == "never"
    expires_s = None if expires is None or forever else parse_duration(expires)
    unknown = [cap for cap in capabilities if cap.startswith("--")]
    if unknown:
        raise click.UsageError(f"no such option: {unknown[0]}")
    add = [cap[1:] for cap in capabilities if cap.startswith("+")]
    remove = [cap[1:] for cap in capabilities if cap.startswith("-")]
    whole = [cap for cap in capabilities if not cap.startswith(("+", "-"))]
    if not (whole or add or remove or preset):
        raise click.UsageError("name what to grant: CAP..., +CAP / -CAP, or --preset NAME")
    from ...protocol.manifest import PRESETS

    if named := next((cap for cap in whole if cap in PRESETS), None):
        raise click.UsageError(f"{named!r} is a preset, not a capability: "
                               f"{out.suggest('grant', f'{peer} --preset {named}')}")

    r = on_node(home, lambda client: client.grant(peer, whole, add=add, remove=remove, preset=preset, expires_s=expires_s,
                                                  until_revoked=forever,
                                                  preset_limits=preset_limits, set_limits=set_limits))

    def human(con: Console) -> None:
        con.print(f"{escape(r.peer.name)} may now ask: {escape(', '.join(r.peer.granted))}"
                  + ("" if r.delivered else "  (not reachable now: it will see the new grant when next told)"))
        con.print(f"the whole grant lasts {until_text(r.peer.granted_expires)}")
        con.print("limits: " + limits_text(r.peer.granted_limits).replace("\n", ", "))

    out.data(r, human)


@click.command()
@command
@click.argument("peer")
def revoke(home: str | None, out: Output, peer: str) -> None:
    """Revoke PEER now: its open connections close and every later request is refused."""
    r = on_node(home, lambda client: client.revoke(peer))
    out.data(r, lambda con: con.print(f"revoked {escape(r.peer.name)} ({r.peer.peer_id})"
                                      + ("" if r.delivered else "  (not reachable now: it is told when it next calls)")))
