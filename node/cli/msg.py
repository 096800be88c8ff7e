"""`psymesh msg` (letters to one peer, and asking its agent) and `psymesh group` (letters to
several)."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import click

from .output import Output, escape
from ...protocol import control as c
from ...protocol.errors import ErrorCode, PsymeshError
from .common import Duration, command, on_node

if TYPE_CHECKING:
    from rich.console import Console
    from ..control.client import Client


@click.group()
def msg() -> None:
    """Letters to paired peers: kept until delivered, each once, in order within a thread."""


def _json_object(text: str | None, option: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{option} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise click.BadParameter(f"{option} must be a JSON object")
    return value


def _away_since(away: c.PeerAway) -> str:
    """`unreachable since 19:20:01`: short enough for a table's state column."""
    return "unreachable since " + time.strftime("%H:%M:%S", time.localtime(away.since))


def _away_text(name: str, away: c.PeerAway, now: float | None = None) -> str:
    """`home is unreachable since 19:20:01 (connection refused at 127.0.0.1:4001; 3 min ago)`."""
    ago = max(0.0, (time.time() if now is None else now) - away.since)
    span = f"{ago:.0f} s" if ago < 120 else f"{ago / 60:.0f} min" if ago < 7200 else f"{ago / 3600:.0f} h"
    return f"{name} is {_away_since(away)} ({away.reason}; {span} ago)"


def _sent_line(s: c.SentLetter) -> str:
    why = f" ({s.code}): {s.reason}" if s.state == "refused" else ""
    away = f" ({_away_text(s.recipient_name, s.away)}; kept, delivered when it is back)" if s.away else ""
    return f"{s.id} -> {s.recipient_name} ({s.thread} #{s.tseq}): {s.state}{why}{away}"


def _code(text: str | None, default: ErrorCode) -> ErrorCode:
    """An error code a peer sent (a newer peer may send one this version does not know)."""
    try:
        return ErrorCode(text)
    except ValueError:
        return default


def _refused(s: c.SentLetter) -> PsymeshError | None:
    if s.state != "refused":
        return None
    return PsymeshError(f"{s.recipient_name} refused letter {s.id}: {s.reason}",
                        code=_code(s.code, ErrorCode.FORBIDDEN))


@msg.command("send")
@command
@click.argument("peer")
@click.argument("text")
@click.option("--thread", default="main", show_default=True, help="Conversation: order is kept within it.")
@click.option("--body", "body_json", default=None, help="Structured data beside the text, as a JSON object.")
@click.option("--id", "letter_id", default=None, help="Letter id (sending the same id again sends nothing new).")
@click.option("--wait", is_flag=True, help="Wait until PEER holds it (exit 1 if it refuses it).")
def msg_send(home: str | None, out: Output, peer: str, text: str, thread: str, body_json: str | None,
             letter_id: str | None, wait: bool) -> None:
    """Send TEXT to PEER (a paired peer's name or id). Stored here first: it leaves when PEER is reachable."""
    body = _json_object(body_json, "--body")

    async def go(client: Client) -> c.SentLetter:
        sent = await client.send(peer, text, body=body, thread=thread, letter_id=letter_id)
        return await _held(client, out, sent) if wait else sent

    sent = on_node(home, go)
    out.data(sent, lambda con: con.print(escape(_sent_line(sent))))
    _exit_if_refused(out, [sent])


async def _held(client: Client, out: Output, sent: c.SentLetter) -> c.SentLetter:
    """`sent` once its recipient holds it or refused it (--wait), saying so at once if the
    recipient is away (the letter stays queued and the wait goes on)."""
    out.hint(f"letter {sent.id} to {sent.recipient_name}: waiting until it holds it")
    sent = await client.letter(sent.id, wait=True, until_away=True)
    if sent.state == "pending" and sent.away is not None:
        out.warn(f"{_away_text(sent.recipient_name, sent.away)}; the letter is kept here and delivered "
                 "when it is back; waiting for it (Ctrl-C stops waiting, the letter stays queued)")
        sent = await client.letter(sent.id, wait=True)
    return sent


def _exit_if_refused(out: Output, letters: list[c.SentLetter]) -> None:
    refused = [(s, refusal) for s in letters if (refusal := _refused(s)) is not None]
    for s, refusal in refused:
        out.err.print(f"[red]refused[/red]: {escape(refusal.message)}")
    if refused:
        sys.exit(1)


@msg.command("status")
@command
@click.argument("letter_id")
@click.option("--wait", is_flag=True, help="Wait until it is delivered or refused.")
def msg_status(home: str | None, out: Output, letter_id: str, wait: bool) -> None:
    """The state of a letter this node sent: pending, delivered or refused."""
    sent = on_node(home, lambda client: client.letter(letter_id, wait=wait))
    out.data(sent, lambda con: con.print(escape(_sent_line(sent))))


def _letter_line(m: c.InboxLetter) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(m.received_at))
    where = f"group {m.group}" if m.group else m.thread
    kind = "" if m.kind.value == "send" else f"[{m.kind.value}] "
    gap = f"[{m.skipped} earlier letter(s) never came] " if m.skipped else ""
    return f"{m.seq:>5} {when} {m.sender_name} ({where}): {gap}{kind}{m.text}"


@msg.command("inbox")
@command
@click.option("--follow", "-f", is_flag=True, help="Keep printing letters as they come (Ctrl-C stops).")
@click.option("--after", default=0, show_default=True, type=click.IntRange(0), help="Only letters after this number.")
@click.option("--limit", default=None, type=click.IntRange(1), help="At most this many letters.")
def msg_inbox(home: str | None, out: Output, follow: bool, after: int, limit: int | None) -> None:
    """Letters from peers, in order, numbered. --json prints a list, or with --follow one JSON
    object per line; resume later with --after the last number seen."""

    async def go(client: Client) -> list[c.InboxLetter]:
        got: list[c.InboxLetter] = []
        async for m in client.inbox(after, follow=follow, limit=limit):
            if follow:
                out.data(m, lambda con: con.print(escape(_letter_line(m))))
            else:
                got.append(m)
        return got

    try:
        letters = on_node(home, go)
    except KeyboardInterrupt:
        sys.exit(130)
    if follow:
        return

    def human(con: Console) -> None:
        for m in letters:
            con.print(escape(_letter_line(m)))
        if not letters:
            con.print("no letters" + (f" after {after}" if after else ""))

    out.data(letters, human)


@msg.command("ask")
@command
@click.argument("peer")
@click.argument("question")
@click.option("--thread", default="main", show_default=True)
@click.option("--timeout", type=Duration(), default="120s", show_default=True, help="How long to wait for the answer.")
@click.option("--max-steps", type=click.IntRange(1, 64), default=None, help="Agent steps PEER may take (it caps them).")
@click.option("--seed", type=int, default=None, hidden=True)
@click.option("--ban-bytes", is_flag=True, hidden=True, help="Keep random-weight test models in ASCII.")
def msg_ask(home: str | None, out: Output, peer: str, question: str, thread: str, timeout: float,
            max_steps: int | None, seed: int | None, ban_bytes: bool) -> None:
    """Ask PEER's agent QUESTION (it needs msg.ask from PEER) and print its answer."""
    params: dict[str, Any] = {"max_steps": max_steps, "seed": seed, "ban_bytes": ban_bytes or None}

    answer = on_node(home, lambda client: client.ask(peer, question, thread=thread, timeout=timeout,
                                                     params={k: v for k, v in params.items() if v is not None}))
    error = answer.body.get("error") if answer.body.get("ok") is False else None
    if error is not None:
        out.error(PsymeshError(f"{answer.sender_name} could not answer: {error.get('message', '')}",
                               code=_code(error.get("code"), ErrorCode.INTERNAL)))
        sys.exit(1)

    def human(con: Console) -> None:
        calls = answer.body.get("tool_calls") or []
        if calls:
            out.hint("tools: " + ", ".join(f"{t.get('name')} ({t.get('status')})" for t in calls))
        con.print(escape(answer.text, lines=True))

    out.data(answer, human)


# -- web queries ------------------------------------------------------------------------


@click.group()
def group() -> None:
    """Named lists of paired peers on this node: one message to all of them."""


def _group_text(g: c.GroupView) -> str:
    return f"{g.name}: " + (", ".join(m.name for m in g.members) or "no members")


@group.command("create")
@command
@click.argument("name")
@click.argument("members", nargs=-1)
def group_create(home: str | None, out: Output, name: str, members: tuple[str, ...]) -> None:
    """Make group NAME of paired peers (names or ids). Only this node knows it."""
    _group_change(home, out, lambda client: client.group_create(name, list(members)))


def _group_change(home: str | None, out: Output,
                  change: Callable[[Client], Awaitable[c.GroupView]]) -> None:
    """Run one change to a group on the daemon and show the group as it now is."""
    g = on_node(home, change)
    out.data(g, lambda con: con.print(escape(_group_text(g))))


@group.command("add")
@command
@click.argument("name")
@click.argument("members", nargs=-1, required=True)
def group_add(home: str | None, out: Output, name: str, members: tuple[str, ...]) -> None:
    """Add paired peers to group NAME."""
    _group_change(home, out, lambda client: client.group_add(name, list(members)))


@group.command("remove")
@command
@click.argument("name")
@click.argument("members", nargs=-1, required=True)
def group_remove(home: str | None, out: Output, name: str, members: tuple[str, ...]) -> None:
    """Take members out of group NAME."""
    _group_change(home, out, lambda client: client.group_remove(name, list(members)))


@group.command("list")
@command
def group_list(home: str | None, out: Output) -> None:
    """This node's groups and their members."""
    groups = on_node(home, lambda client: client.groups())

    def human(con: Console) -> None:
        for g in groups:
            con.print(escape(_group_text(g)))
        if not groups:
            con.print(escape(f"no groups; make one with: {out.suggest('group create', 'NAME PEER...')}"))

    out.data(groups, human)


@group.command("send")
@command
@click.argument("name")
@click.argument("text")
@click.option("--body", "body_json", default=None, help="Structured data beside the text, as a JSON object.")
@click.option("--wait", is_flag=True, help="Wait until every member holds it (exit 1 if one refuses it).")
def group_send(home: str | None, out: Output, name: str, text: str, body_json: str | None, wait: bool) -> None:
    """Send TEXT to every member of group NAME (one letter each, thread group:NAME)."""
    body = _json_object(body_json, "--body")

    async def go(client: Client) -> list[c.SentLetter]:
        letters = await client.group_send(name, text, body=body)
        return [await _held(client, out, s) for s in letters] if wait else letters

    letters = on_node(home, go)

    def human(con: Console) -> None:
        for s in letters:
            con.print(escape(_sent_line(s)))

    out.data(letters, human)
    _exit_if_refused(out, letters)


# -- models ---------------------------------------------------------------------------
