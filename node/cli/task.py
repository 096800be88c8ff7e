"""`psymesh task`: delegate a task to a paired peer, follow it, list and cancel tasks."""
from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import anyio
import click

from .output import Output, escape, table as out_table, visible
from ...protocol import control as c
from .common import Duration, command, on_node
from .msg import _away_since, _away_text

if TYPE_CHECKING:
    from rich.console import Console
    from ..control.client import Client, TaskHandle
    from ...protocol.tasks import Outcome, TaskEvent


@click.group()
def task() -> None:
    """Delegate work to paired nodes, and follow it."""


def _event_line(ev: TaskEvent) -> str:
    data = ev.data
    if ev.kind == "token":
        return data.get("text", "")
    detail = {k: v for k, v in data.items() if k != "result"}
    text = f"[{ev.seq}] {ev.kind} -> {ev.state}" + (f" {json.dumps(detail)}" if detail else "")
    return text


async def _answer_input(handle: TaskHandle, out: Output, ev: TaskEvent, approve: bool) -> None:
    """The remote agent asks to run an irreversible tool: ask the person (or --yes)."""
    question = ev.data.get("question", "the task needs an answer")
    if not approve and sys.stdin.isatty():
        approve = await anyio.to_thread.run_sync(lambda: click.confirm(visible(question), default=False, err=True))
    elif not approve:
        out.warn(f"{question} -- declined: no terminal to ask (pass --yes to allow)")
    await handle.respond({"approve": approve})


async def _follow(handle: TaskHandle, out: Output, after_seq: int = 0, approve: bool = False,
                  events: list[TaskEvent] | None = None) -> Outcome | None:
    """Follow a task's events (a live view on a terminal; with --json nothing is printed on the
    way, the one document comes at the end) and return its outcome; each event is added to
    `events` if given, for that document. An `input-required` event is answered here (see
    _answer_input)."""
    last = None
    streaming_tokens = False
    status = None
    if not out.json_mode and out.out.is_terminal:
        status = out.err.status(f"task {handle.id}: waiting", spinner="dots")
        status.start()
    try:
        async for ev in handle.events(after_seq):
            last = ev
            if ev.state.value == "input-required":
                await _answer_input(handle, out, ev, approve)
            if events is not None:
                events.append(ev)
            if out.json_mode:
                continue
            if status is not None:
                status.update(f"task {handle.id}: {ev.state.value} ({ev.seq} events)")
            if ev.kind == "token":
                out.out.print(escape(ev.data.get("text", ""), lines=True), end="")
                streaming_tokens = True
                continue
            if streaming_tokens:
                out.out.print()
                streaming_tokens = False
            if ev.kind != "result":
                out.err.print(escape(_event_line(ev)))
    finally:
        if status is not None:
            status.stop()
    return last.outcome if last is not None else None


@task.command("send")
@command
@click.option("--to", default=None, help="Paired peer (name or id); default: the best one offering the task.")
@click.option("--tool", default=None, help="Run this tool on the peer.")
@click.option("--args", "args_json", default="{}", help="Tool arguments as a JSON object.")
@click.option("--infer", "prompt", default=None, help="A prompt for a chat completion on the peer.")
@click.option("--model", default=None, help="Model name on the peer (with --infer).")
@click.option("--max-tokens", type=int, default=None)
@click.option("--goal", default=None, help="A goal for the peer's agent loop.")
@click.option("--timeout", type=Duration(), default=None, help="Deadline, counted from acceptance.")
@click.option("--id", "task_id", default=None, help="Task id (resending the same id is harmless).")
@click.option("--wait", is_flag=True, help="Follow the task until it ends and print its result.")
def task_send(home: str | None, out: Output, to: str | None, tool: str | None, args_json: str, prompt: str | None,
              model: str | None, max_tokens: int | None, goal: str | None, timeout: float | None,
              task_id: str | None, wait: bool) -> None:
    """Delegate one task: --tool NAME --args JSON | --infer PROMPT --model NAME | --goal TEXT."""
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"--args is not JSON: {exc}") from None
    if prompt is not None and model is None:
        raise click.UsageError("--infer needs --model NAME (a model registered on the peer)")

    events: list[TaskEvent] = []
    sent: dict[str, Any] = {}

    async def go(client: Client) -> Any:
        handle = await client.delegate(to, tool=tool, args=args if tool else None, infer=prompt, model=model,
                                       max_tokens=max_tokens, goal=goal, deadline_s=timeout, task_id=task_id)
        where = "accepted by" if handle.accepted else "queued for"
        out.hint(f"task {handle.id} {where} {handle.target_name}")
        if handle.away is not None:
            out.warn(f"{_away_text(handle.target_name, handle.away)}; the task is kept here and delivered "
                     f"when {handle.target_name} is back"
                     + ("; waiting for it (Ctrl-C stops waiting, the task stays queued)" if wait
                        else f" (see: {out.suggest('task watch', handle.id)})"))
        sent.update(task_id=handle.id, target=handle.target, accepted=handle.accepted,
                    away=handle.away.model_dump() if handle.away else None)
        if not wait:
            return sent
        return await _follow(handle, out, events=events)

    result = on_node(home, go)
    if not wait:
        out.data(result, lambda con: con.print(result["task_id"]))
        return
    _print_outcome(out, result, {**sent, "events": events})


def _print_outcome(out: Output, outcome: Any, summary: dict[str, Any] | None = None) -> None:
    """A task's end: with --json the one document (`summary`'s fields, e.g. the task id and
    its `events`, then `state` and `result` or `error`); else its result on stdout, or its
    failure on stderr and exit status 1."""
    if outcome is None:
        if out.json_mode and summary is not None:
            out.data({**summary, "state": None})
        return
    if outcome.ok:
        value = outcome.value
        if out.json_mode:
            out.data({**(summary or {}), "state": outcome.state.value, "result": value})
        elif isinstance(value, dict) and set(value) >= {"text", "usage"}:  # an infer task's InferResult
            from ...protocol.tasks import InferResult

            infer = InferResult.model_validate(value)
            out.hint(f"({infer.usage.completion_tokens} tokens, {infer.finish_reason})")
        else:
            out.data(value)
        return
    code = outcome.code.value if hasattr(outcome.code, "value") else str(outcome.code)
    if out.json_mode:
        out.data({**(summary or {}), "state": outcome.state.value, "error": {"code": code, "message": outcome.message}})
    out.err.print(f"[red]task {outcome.state.value}[/red] ({escape(code)}): {escape(outcome.message)}")
    sys.exit(1)


@task.command("watch")
@command
@click.argument("task_id")
@click.option("--after", type=int, default=0, help="Only events after this number.")
def task_watch(home: str | None, out: Output, task_id: str, after: int) -> None:
    """Follow a delegated task until it ends (--json: one document, its `events` included)."""
    events: list[TaskEvent] = []

    async def go(client: Client) -> Outcome | None:
        return await _follow(client.task(task_id), out, after, events=events)

    _print_outcome(out, on_node(home, go), {"task_id": task_id, "events": events})


@task.command("list")
@command
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 1000))
def task_list(home: str | None, out: Output, limit: int) -> None:
    """Tasks this node delegated, and tasks it runs for others."""
    r: c.TaskListReply = on_node(home, lambda client: client.tasks(limit))

    def table(title: str, who: str) -> Any:
        return out_table("task", "kind", who, "state", "events", title=title, title_justify="left")

    def human(con: Console) -> None:
        submitted = table("delegated by this node", "target")
        for s in r.submitted:
            state = s.state.value + (f"\n({_away_since(s.away)})" if s.away else "")
            what = escape(s.what) + (f"\n[red]{escape(s.error)}[/red]" if s.error else "")
            submitted.add_row(s.task_id, f"{s.kind.value}\n{what}", escape(s.target), state, str(s.events))
        con.print(submitted if r.submitted else "delegated by this node: none")
        executing = table("run by this node for others", "submitter")
        for e in r.executing:
            executing.add_row(e.task_id, f"{e.kind.value}\n{escape(e.what)}", escape(e.submitter), e.state.value,
                              str(e.last_seq))
        con.print(executing if r.executing else "run by this node for others: none")

    out.data(r, human)


@task.command("cancel")
@command
@click.argument("task_id")
def task_cancel(home: str | None, out: Output, task_id: str) -> None:
    """Cancel a delegated task (it stops on the node running it)."""
    on_node(home, lambda client: client.task(task_id).cancel())
    out.data({"task_id": task_id, "canceled": True}, lambda con: con.print(f"canceled {task_id}"))


# -- messages between agents --------------------------------------------------------
