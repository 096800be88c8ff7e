"""`psymesh agent run` (here or delegated to a home PC) and `psymesh eval` (a case file, or
BFCL, scored). One job: running the agent on a model and showing what it did; the two
share the model set-up and the stop at the first prompt over the model's context."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import click

from .output import Output, escape, visible
from ...protocol import control as c
from ...protocol.errors import ErrorCode, PsymeshError
from .common import EvalStopped, command, home_at, on_node, run_async
from .model import _local_runner, _models
from .msg import _away_text
from .task import _follow, _print_outcome

if TYPE_CHECKING:
    from ..control.client import Client
    from ..core.home import NodeHome
    from ...agent.evaluation.bfcl import BfclReport


@click.group()
def agent() -> None:
    """Run the BotPsy agent on a goal, here or on a paired home PC."""


class _StopOverContext:
    """An eval's model, stopping the whole eval where every case would fail the same way and
    score 0 % with exit status 0: at the first prompt over the model's context, or at the
    first request with tools to a model that cannot call tools (`unsupported`: then no
    category ran, and the error says so, naming each with the reason). Every eval path (a
    case file, --bfcl here or --via a peer) wraps its model in it."""

    def __init__(self, model: Any, name: str, n_ctx: int | None, out: Output, categories: Any) -> None:
        self.model, self.name, self.n_ctx, self.out = model, name, n_ctx, out
        self.categories = sorted(set(categories))

    async def reply(self, *args: Any, **kwargs: Any) -> Any:
        from ...agent.runtime.api import PromptTooLong

        try:
            return await self.model.reply(*args, **kwargs)
        except PromptTooLong as exc:
            ctx = max(2 * (self.n_ctx or 4096), 8192)
            raise EvalStopped(PsymeshError(
                f"eval stopped: {exc.message}; give model {self.name} a larger context: "
                + self.out.suggest("model add", f"{self.name} PATH.gguf --ctx {ctx}"),
                code=ErrorCode.TOO_LARGE)) from None
        except PsymeshError as exc:
            if exc.code != ErrorCode.UNSUPPORTED:
                raise
            raise EvalStopped(PsymeshError(
                f"not run: {', '.join(self.categories)}: {exc.message}", code=ErrorCode.UNSUPPORTED,
                details={"not_run": {c: exc.message for c in self.categories}})) from None


def _print_agent_event(out: Output, ev: Any, simulated: frozenset[str] = frozenset()) -> None:
    """One event of a run here, on stderr; a call of a tool in `simulated` is marked so."""
    d = ev.data
    if ev.kind == "step":
        out.err.print(f"[dim]step {d['step']}/{d['max_steps']}[/dim]")
    elif ev.kind == "thinking" and d.get("text"):
        out.err.print(f"[dim]  thinking: {escape(d['text'][:200])}[/dim]")
    elif ev.kind == "tool_call":
        mark = " [yellow](simulated)[/yellow]" if d["name"] in simulated else ""
        out.err.print(f"  -> {escape(d['name'])}({escape(json.dumps(d.get('arguments', {}))[:200])}){mark}")
    elif ev.kind == "tool_result":
        body = d.get("result") if d.get("ok") else d.get("error")
        mark = "[green]ok[/green]" if d.get("ok") else f"[red]{escape(str(d.get('status')))}[/red]"
        out.err.print(f"  <- {mark} {escape(json.dumps(body, default=str)[:200])}")
    elif ev.kind in ("guard", "error"):
        out.err.print(f"  [yellow]{ev.kind}[/yellow]: {escape(str(d.get('message', d)))}")


@agent.command("run")
@command
@click.argument("goal")
@click.option("--model", "model_name", default=None, help="Model name (default: the node's first model).")
@click.option("--delegate", type=click.Choice(["auto", "never", "always"]), default="auto", show_default=True,
              help="Run here, on a paired home PC, or let the delegation policy decide.")
@click.option("--to", default=None, help="The home PC to delegate to (default: the best one).")
@click.option("--max-steps", default=8, show_default=True, type=click.IntRange(1, 64))
@click.option("--thinking", is_flag=True, help="Let the model think before answering.")
@click.option("--free", "free_form", is_flag=True, help="No grammar: let the model write calls freely.")
@click.option("--yes", is_flag=True, help="Approve irreversible tool calls without asking.")
@click.option("--no-tools", "no_tools", is_flag=True,
              help="Offer the model no tools: it answers from what it knows (for a model that cannot call tools; "
                   "`psymesh model ps` shows each model's tool family).")
@click.option("--ban-bytes", is_flag=True, hidden=True, help="Keep random-weight test models in ASCII.")
@click.option("--seed", type=int, default=None, hidden=True)
def agent_run(home: str | None, out: Output, goal: str, model_name: str | None, delegate: str, to: str | None,
              max_steps: int, thinking: bool, free_form: bool, yes: bool, no_tools: bool, ban_bytes: bool,
              seed: int | None) -> None:
    """Work on GOAL with this node's tools; irreversible calls ask first (or --yes)."""
    from ...agent.acting.policy import DelegationInputs, decide
    from ..control.client import Client

    node_home = home_at(home)
    node_home.init()
    config = node_home.load_config()
    params: dict[str, Any] = {"max_steps": max_steps, "thinking": thinking, "grammar": not free_form}
    if ban_bytes:
        params["ban_bytes"] = True
    if seed is not None:
        params["seed"] = seed
    if model_name:
        params["model"] = model_name
    if no_tools:
        params["tools"] = False

    async def remote_offers() -> tuple[list[c.Offer], list[str]]:
        """The paired peers that would take the goal now; when none, each one granting it that
        this node could not reach (`home is unreachable since 19:20:01 (...)`)."""
        try:
            async with Client(home) as client:
                offers = await client.offers(operation="task.agent")
                if offers:
                    return offers, []
                return [], [_away_text(p.name, p.away) for p in await client.peers(include_revoked=False)
                            if p.away is not None and "task.agent" in p.received and to in (None, p.name, p.peer_id)]
        except PsymeshError:
            return [], []  # no daemon: nothing to delegate to

    async def go() -> Any:
        registry = _models(node_home)
        offers, away = await remote_offers() if delegate != "never" else ([], [])
        local = frozenset(registry.names())
        # No model named and none here: the task needs "a model", which only a remote may have.
        needed = frozenset([model_name]) if model_name else (frozenset() if local else frozenset(["(any model)"]))
        remote_models = frozenset(m for o in offers for m in o.models) if offers and model_name else None
        decision = decide(DelegationInputs(
            profile=config.profile, force={"never": "local", "always": "remote"}.get(delegate),  # type: ignore[arg-type]
            remote_available=bool(offers), needed_models=needed, local_models=local, remote_models=remote_models,
            battery_low=config.battery_low, memory_low=config.memory_low))
        if away and decision.rule == "no_remote":
            out.warn(f"{'; '.join(away)}; running here")
        else:
            out.hint(f"running {'on a paired home PC' if decision.where == 'remote' else 'here'}: {decision.reason}")
        if decision.where == "remote":
            remote = await _agent_remote(home, out, goal, to, params, yes, fall_back=delegate == "auto")
            if remote is not None:
                return remote
        try:
            return await _agent_local(node_home, config, registry, out, goal, model_name, params, yes)
        except PsymeshError as exc:
            if not away or exc.code is not ErrorCode.NOT_FOUND:
                raise
            # the model lives at home, which is away: say that, not "run it there" (issue 34 item 13)
            raise PsymeshError(f"{'; '.join(away)}, and this node cannot run the goal itself "
                               f"({exc.message.split('; ')[0]}); try again once it is back (see: "
                               f"{out.suggest('peers')})", code=ErrorCode.UNAVAILABLE) from None

    result = run_async(go)
    out.data(result, lambda con: con.print(escape(str(result["answer"]), lines=True)))


async def _agent_local(node_home: NodeHome, config: Any, registry: Any, out: Output, goal: str,
                       model_name: str | None, params: dict[str, Any], yes: bool) -> dict[str, Any]:
    from ...protocol.devices import SIMULATED
    from ...agent.acting.loop import run_agent
    from ...agent.acting.tools import ToolContext
    from .status import device_lines
    from ..models.agents import agent_config, llama_model, node_tools, offered_tools, pick_model, result_of

    name = pick_model(registry, model_name, config.agent_model, config.profile, tools=params.get("tools", True))

    async def confirm(call: Any, tool: Any) -> bool:
        if yes:
            return True
        if not sys.stdin.isatty():
            out.warn(f"{call.name} is irreversible and there is no terminal to ask; pass --yes to allow it")
            return False
        return await anyio.to_thread.run_sync(
            lambda: click.confirm(visible(f"allow {call.name}({json.dumps(call.arguments)})?"), default=False,
                                 err=True))

    tools = offered_tools(params, node_tools(node_home, config))
    for line in device_lines((t.name, t.backend) for t in tools if t.backend):
        out.hint(f"device tools: {line}")
    simulated = frozenset(t.name for t in tools if t.backend == SIMULATED)

    async def emit(ev: Any) -> None:
        if not out.json_mode:
            _print_agent_event(out, ev, simulated)

    ctx = ToolContext(share_dir=Path(config.share_dir) if config.share_dir else None, profile=config.profile)
    async with _local_runner(node_home, registry, name) as worker:
        run = await run_agent(goal, model=llama_model(worker, params), tools=tools, ctx=ctx, profile=config.profile,
                              config=agent_config(params, from_peer=False), confirm=confirm, emit=emit)
    return {**result_of(run), "where": "local", "model": name}


async def _agent_remote(home: str | None, out: Output, goal: str, to: str | None, params: dict[str, Any],
                        yes: bool, fall_back: bool = False) -> dict[str, Any] | None:
    """Run the goal as a delegated agent task. `fall_back`: if the home PC turns out to be
    unreachable, take the task back and return None (the caller runs it here)."""
    from ..control.client import Client

    async with Client(home) as client:
        handle = await client.delegate(to, goal=goal, params=params)
        if handle.away is not None and fall_back:
            await handle.cancel()
            out.warn(f"{_away_text(handle.target_name, handle.away)}; running here instead")
            return None
        if handle.away is not None:
            out.warn(f"{_away_text(handle.target_name, handle.away)}; the task is kept and delivered when it "
                     "is back; waiting for it (Ctrl-C stops waiting, the task stays queued)")
        out.hint(f"task {handle.id} -> {handle.target_name}")
        outcome = await _follow(handle, out, approve=yes)
    if outcome is None:
        raise PsymeshError(f"task {handle.id} ended without a final event", code=ErrorCode.INTERNAL)
    if not outcome.ok:
        _print_outcome(out, outcome)  # prints the failure and exits 1
    return {**outcome.value, "where": "remote", "task_id": handle.id}


@click.command("eval")
@command
@click.argument("cases", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--model", "model_name", default=None, help="Registered model to evaluate.")
@click.option("--bfcl", "bfcl_dir", is_flag=False, flag_value="", default=None, metavar="[DIR]",
              help="Score BFCL v4 (default: the installed bfcl-eval's data; or DIR, a folder in BFCL's layout) "
                   "as BFCL scores it, instead of a case file.")
@click.option("--category", "categories", multiple=True, metavar="NAME",
              help="With --bfcl: a category to score (repeatable; default: every supported one present).")
@click.option("--score-dir", type=click.Path(file_okay=False), default=None,
              help="With --bfcl: also write BFCL's score files (BFCL_v4_<category>_score.json, data_overall.csv).")
@click.option("--via", "via", default=None, metavar="PEER",
              help="With --bfcl: ask --model on this paired node (delegated infer tasks) instead of loading it here.")
@click.option("--runs", type=click.IntRange(min=1), default=1,
              help="With --bfcl: run N times, seeds 0..N-1, and report min/median/max per category.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0,
              help="With --bfcl: sampling temperature (0: greedy, when --runs gives N identical runs).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="With --bfcl: the first N cases of each "
                                                                         "category.")
@click.option("--oracle", is_flag=True, help="With --bfcl, without --model: answer with the ground truth instead of a model, "
                                              "through the same render/parse/score path (checks the harness).")
@click.option("--free", "free_form", is_flag=True, help="No grammar constraint (measures the raw model).")
@click.option("--thinking", is_flag=True, help="Let the model think (its <think> block) before each answer.")
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=None, metavar="N",
              help="Tokens a reply may take. Default: 256 with a case file; with --bfcl 512 a single-turn reply "
                   "and 1024 a multi-turn step (each +1024 with --thinking; BFCL itself allows 4096).")
@click.option("--ban-bytes", is_flag=True, hidden=True)
def eval_cmd(home: str | None, out: Output, cases: str | None, model_name: str | None, bfcl_dir: str | None,
             categories: tuple[str, ...], score_dir: str | None, via: str | None, runs: int, temperature: float,
             limit: int | None, oracle: bool, free_form: bool, thinking: bool, max_tokens: int | None,
             ban_bytes: bool) -> None:
    """Score a model on function-calling cases (JSONL), per category, BFCL-style; or, with
    --bfcl DIR, on BFCL v4's own files, as BFCL scores them."""
    if (cases is None) == (bfcl_dir is None):
        raise PsymeshError("give a case file or --bfcl [DIR] (one of them)", code=ErrorCode.BAD_REQUEST)
    if bfcl_dir is None and (categories or limit is not None or oracle or score_dir or via or runs > 1 or temperature):
        raise PsymeshError("--category, --limit, --oracle, --score-dir, --via, --runs and --temperature go with --bfcl",
                           code=ErrorCode.BAD_REQUEST)
    if oracle == (model_name is not None):
        raise PsymeshError("give --model NAME, or --oracle (with --bfcl)" if not oracle
                           else "--oracle answers without a model: drop --model", code=ErrorCode.BAD_REQUEST)
    if bfcl_dir is not None:
        return _eval_bfcl(home, out, bfcl_dir or None, categories, limit, model_name, free_form, thinking, ban_bytes,
                          score_dir, via, runs, temperature, max_tokens)

    from ...agent.evaluation.suite import evaluate, format_report, load_cases
    from ...agent.formats.families import FAMILIES
    from ..models.agents import llama_model, pick_model

    node_home = home_at(home)
    node_home.init()
    registry = _models(node_home)
    name = pick_model(registry, model_name, None)
    loaded = load_cases(cases)

    async def progress(r: Any) -> None:
        out.hint(f"{r.id}: {'pass' if r.passed else 'fail: ' + r.reason}")

    async def go() -> Any:
        async with _local_runner(node_home, registry, name) as worker:
            model = _StopOverContext(llama_model(worker, {"grammar": not free_form, "temperature": 0.0,
                                                          "max_tokens": max_tokens or 256,
                                                          "ban_bytes": ban_bytes}),
                                     name, worker.settings.n_ctx, out, (c.category for c in loaded))
            return await evaluate(loaded, model, thinking=thinking, on_result=progress,
                                  parse=FAMILIES[worker.info.tool_family].parse)

    report = run_async(go)
    data = {"model": name, "cases": report.total, "passed": report.passed, "accuracy": report.accuracy,
            "categories": {c: {"cases": s.cases, "passed": s.correct, "accuracy": s.accuracy}
                           for c, s in report.categories.items()}}
    out.data(data, lambda con: con.print(format_report(report)))


def _eval_bfcl(home: str | None, out: Output, bfcl_dir: str | None, categories: tuple[str, ...], limit: int | None,
               model_name: str | None, free_form: bool, thinking: bool, ban_bytes: bool,
               score_dir: str | None, via: str | None = None, runs: int = 1, temperature: float = 0.0,
               max_tokens: int | None = None) -> None:
    """`eval --bfcl`: BFCL's questions through our prompt, the model (or the oracle) and our
    parser, scored by agent/evaluation/bfcl.py's mirror of BFCL's AST checker and, for multi-turn,
    by BFCL's own multi_turn_checker."""
    from ...agent.evaluation.bfcl import (
        WEB_CATEGORIES,
        ReplyCaps,
        default_data_dir,
        format_bfcl_report,
        format_run_spread,
        generation_params,
        load_bfcl,
        run_bfcl,
        run_spread,
        write_score_files,
    )
    from ...agent.formats.families import FAMILIES
    from ...agent.acting.loop import LlamaAgentModel
    from ..control.client import Client

    data_dir = Path(bfcl_dir) if bfcl_dir else default_data_dir()
    loaded = load_bfcl(data_dir, categories, limit=limit)

    total, done = len(loaded) * runs, [0]

    async def progress(r: Any) -> None:
        done[0] += 1  # numbered: a whole run is thousands of cases, and a user wants to know how far it is
        if model_name is not None or not r.passed:  # the oracle's passes are 1240 lines of noise
            out.hint(f"[{done[0]}/{total}] {r.id}: {'pass' if r.passed else 'fail: ' + r.reason}")

    caps = ReplyCaps.of(max_tokens, thinking=thinking)

    def params(seed: int, grammar: bool = True, multi_turn: bool = False) -> Any:
        # grammar=False: format_sensitivity's prompting asks
        return generation_params(grammar=grammar and not free_form, ban_bytes=ban_bytes,
                                 max_tokens=caps.multi_turn if multi_turn else caps.single_turn).model_copy(
            update={"temperature": temperature, "seed": seed})

    if model_name is None:
        name = "oracle"
        reports = [run_async(lambda: run_bfcl(loaded, None, thinking=thinking, on_result=progress))
                   for _ in range(runs)]
    elif via is not None:
        from ..control.delegated_model import DelegatedModel, PeerFamily

        name = model_name

        async def remote(client: Client) -> list[BfclReport]:
            cats, family = [c.category for c in loaded], PeerFamily()

            def asked(p: Any) -> _StopOverContext:
                return _StopOverContext(DelegatedModel(client, via, model_name, p, family=family), model_name, None,
                                        out, cats)

            return [await run_bfcl(loaded, asked(params(seed)), thinking=thinking, on_result=progress, web=client,
                                   prompting=asked(params(seed, False)), multi_turn=asked(params(seed, multi_turn=True)),
                                   parse=family.parse)
                    for seed in range(runs)]

        reports = on_node(home, remote)
    else:
        from ..models.agents import pick_model

        node_home = home_at(home)
        node_home.init()
        registry = _models(node_home)
        name = pick_model(registry, model_name, None)

        async def go() -> Any:
            async with _local_runner(node_home, registry, name) as worker, contextlib.AsyncExitStack() as stack:
                # web_search asks the web through this node's route: its daemon must be running.
                web = await stack.enter_async_context(Client(home)) if any(c.category in WEB_CATEGORIES
                                                                           for c in loaded) else None
                n_ctx, cats = worker.settings.n_ctx, [c.category for c in loaded]

                def asked(p: Any) -> _StopOverContext:
                    return _StopOverContext(LlamaAgentModel(worker, p), name, n_ctx, out, cats)

                return [await run_bfcl(loaded, asked(params(seed)), thinking=thinking, on_result=progress, web=web,
                                       prompting=asked(params(seed, False)),
                                       multi_turn=asked(params(seed, multi_turn=True)),
                                       parse=FAMILIES[worker.info.tool_family].parse)
                        for seed in range(runs)]

        reports = run_async(go)
    report = reports[0]
    data = {"model": name, "bfcl_dir": str(data_dir.resolve()), "limit": limit, "via": via,
            "max_tokens": {"single_turn": caps.single_turn, "multi_turn": caps.multi_turn}, **report.data()}
    if runs > 1:
        data["runs"] = [{"seed": i, **r.data()} for i, r in enumerate(reports)]
        data["spread"] = run_spread(reports)
    if score_dir is not None:
        data["score_files"] = [str(p) for p in write_score_files(report, Path(score_dir), name)]
    # plain text, not markup: "pip install -e '.[bfcl-vector]'" is no style tag
    out.data(data, lambda con: con.print(format_bfcl_report(report, categories)
                                         + (format_run_spread(reports) if runs > 1 else ""), markup=False))
