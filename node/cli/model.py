"""`psymesh model`: register, pull, list and inspect this node's models (the registry is read
straight from the database: no daemon needed, except for `model ps`); and the local runner
`agent run` and `eval` use."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from .output import Output, escape, table as out_table
from .common import command, home_at, on_node, parse_duration

if TYPE_CHECKING:
    from ..core.home import NodeHome
    from ..models import ModelRegistry, ModelRunner
    from rich.console import Console


@click.group()
def model() -> None:
    """Models this node can run (GGUF files for llama.cpp)."""


@model.command("add")
@command
@click.argument("name")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--ctx", "n_ctx", default=None, type=click.IntRange(64, 1 << 20),
              help="Context length in tokens (default: what the GGUF declares, capped to fit this machine's "
                   "memory, at most 32768).")
@click.option("--threads", "n_threads", default=None, type=click.IntRange(1, 512))
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Jinja chat template file overriding the one inside the GGUF.")
@click.option("--keep-alive", "keep_alive", default=None, metavar="DURATION",
              help="How long the model stays loaded when idle (e.g. 90s, 10m, 1h; 0: unload after each "
                   "request; forever). Default: [models] keep_alive_s, else 5 min on a home PC, 1 min on a phone.")
@click.option("--split", "split", default=None, metavar="PEER[,PEER...]",
              help="Run the model's last layers on these paired homes (each lends its compute: `psymesh worker "
                   "start` there, and grants this node compute.rpc). Layers are shared evenly with this node.")
@click.option("--on-worker-loss", type=click.Choice(["reload", "wait"]), default=None,
              help="A split model whose worker is away: load without it (reload, the default) or fail "
                   "`unavailable` until it is back (wait).")
def model_add(home: str | None, out: Output, name: str, path: str, n_ctx: int | None, n_threads: int | None,
              chat_template: str | None, keep_alive: str | None, split: str | None, on_worker_loss: str | None) -> None:
    """Register PATH (a .gguf file) as model NAME. A running daemon uses it at once."""
    node_home = home_at(home)
    node_home.init()
    template = open(chat_template).read() if chat_template else None
    registry = _models(node_home)
    workers = _workers(node_home, split) if split else []
    choice = None
    if n_ctx is None:  # the header is read once, here (the registry would read it for n_ctx None)
        from ..models.registry import default_context

        choice = default_context(Path(path).expanduser())
    row = registry.add(name, path, n_ctx=choice.n_ctx if choice else n_ctx, n_threads=n_threads,
                       chat_template=template, keep_alive_s=_keep_alive(keep_alive),
                       split=[peer_id for peer_id, _ in workers], on_worker_loss=on_worker_loss)
    if choice is not None:
        out.hint(f"context {row['n_ctx']} tokens: the GGUF declares {choice.declared or 'none'}"
                 + (f", capped to {choice.memory_cap} for this machine's memory" if row["n_ctx"] < (choice.declared or 0)
                    else "") + "; --ctx N sets another")
    out.data({k: v for k, v in row.items() if k != "chat_template"},
             lambda con: con.print(f"model {name} -> {row['path']} (context {row['n_ctx']}, "
                                   f"tools: {_family_text(row['tool_family'])})"
                                   + (f", split across this node and {', '.join(n for _, n in workers)}"
                                      if workers else "")))
    if row["tool_family"] == "none":
        out.warn(f"{name} cannot call tools (its chat template has no tool section): agent run, eval and requests "
                 "with tools will refuse it; `agent run --no-tools` asks it without tools")


def _workers(node_home: NodeHome, text: str) -> list[tuple[str, str]]:
    """`--split tablet,laptop` -> [(peer id, name), ...] of paired peers (BAD_REQUEST naming the one not)."""
    from ..core.db import open_db
    from ..door.trust import TrustStore
    from ...protocol.errors import ErrorCode, PsymeshError

    trust = TrustStore(open_db(node_home.db_path))
    out = []
    for word in filter(None, (w.strip() for w in text.split(","))):
        peer = trust.resolve(word)
        if peer.revoked:
            raise PsymeshError(f"--split: {word!r} is not a paired peer of this node (psymesh peers lists them)",
                               code=ErrorCode.BAD_REQUEST)
        if peer.peer_id in (p for p, _ in out):
            raise PsymeshError(f"--split: {word!r} named twice", code=ErrorCode.BAD_REQUEST)
        out.append((peer.peer_id, peer.name))
    if not out:
        raise PsymeshError("--split: no peer named, e.g. --split laptop,tablet", code=ErrorCode.BAD_REQUEST)
    return out


@model.command("pull")
@command
@click.argument("repo_id")
@click.option("--file", "quant", default="Q8_0", show_default=True, help="Which quantization (matched in the file name).")
@click.option("--name", default=None, help="Register it under this name (default: the repo's name).")
def model_pull(home: str | None, out: Output, repo_id: str, quant: str, name: str | None) -> None:
    """Download a GGUF model from the Hugging Face hub and register it."""
    from ..models import pull_model

    node_home = home_at(home)
    node_home.init()
    out.hint(f"fetching the {quant} GGUF of {repo_id} ...")
    path = pull_model(repo_id, quant, node_home.models_dir / repo_id.replace("/", "--"),
                      add_command=out.suggest("model add", "NAME /path/to/that.gguf"))
    name = name or repo_id.split("/")[-1].lower()
    row = _models(node_home).add(name, path)
    out.data({k: v for k, v in row.items() if k != "chat_template"},
             lambda con: con.print(f"model {name} -> {path}"))


@model.command("list")
@command
def model_list(home: str | None, out: Output) -> None:
    """Registered models."""
    node_home = home_at(home)
    rows = _models(node_home).list() if node_home.db_path.exists() else []
    rows = [{**{k: v for k, v in r.items() if k != "chat_template"}, "chat_template_override": bool(r["chat_template"])}
            for r in rows]

    def human(con: Console) -> None:
        table = out_table("name", "path", "context", "threads", "tools")
        for r in rows:
            table.add_row(r["name"], r["path"], str(r["n_ctx"]), str(r["n_threads"] or "all"),
                          _family_text(r.get("tool_family")))
        con.print(table if rows else escape(f"no models; add one with: {out.suggest('model add', 'NAME PATH.gguf')}"))

    out.data(rows, human)


@model.command("ps")
@command
def model_ps(home: str | None, out: Output) -> None:
    """Models and their runner processes in the running daemon: loaded or not, pid, memory
    (RSS and saved states), idle time against keep-alive, requests served, crashes."""
    models = on_node(home, lambda client: client.models_ps())

    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:.0f} MiB"

    def human(con: Console) -> None:
        if not models:
            con.print(escape(f"no models; add one with: {out.suggest('model add', 'NAME PATH.gguf')}"))
            return
        table = out_table("name", "state", "tools", "pid", "memory", "idle/keep", "served")
        for m in models:
            state = ("busy" if m.pending else "loaded") if m.loaded else "unloaded"
            if m.crashes:
                state += f", {m.crashes} crash{'es' if m.crashes > 1 else ''}"
            memory = f"{mib(m.rss_bytes)}, {mib(m.state_cache_bytes)} saved" if m.loaded else "-"
            idle = "-" if m.idle_s is None else f"{m.idle_s:.0f}s"
            keep = "forever" if m.keep_alive_s is None else f"{m.keep_alive_s:g}s"
            table.add_row(m.name, state, _family_text(m.tool_family), str(m.pid or "-"), memory, f"{idle}/{keep}",
                          str(m.jobs_served))
        con.print(table)
        for m in models:
            if not m.split:
                continue
            if not m.shares:
                con.print(escape(f"{m.name}: split across this node and {', '.join(m.split)} (not loaded yet)"))
                continue
            parts = out_table("part", "layers", "weights", "budget", "link")
            for share in m.shares:
                parts.add_row(share.where, str(share.layers), f"~{share.weights_mb} MB" if share.layers else "-",
                              "-" if share.memory_mb is None else f"{share.memory_mb} MB", share.link)
            con.print(escape(f"{m.name}, split:"))
            con.print(parts)

    out.data([m.model_dump() for m in models], human)


@click.command("worker")
@command
@click.argument("action", type=click.Choice(["start", "stop", "status"]), default="status")
def worker(home: str | None, out: Output, action: str) -> None:
    """Lend this node's CPU and memory to paired peers' split models (llama.cpp's RPC server,
    reached only through psymesh by peers granted compute.rpc): start, stop, or status."""
    reply = on_node(home, lambda client: client.worker(action))  # type: ignore[arg-type]

    def human(con: Console) -> None:
        if not reply.running:
            con.print(escape("not lending compute" + (f": {reply.error}" if reply.error else "")
                             + ("" if action == "stop" else f" (start: {out.suggest('worker start')})")))
        else:
            memory = f"{reply.memory_mb} MB" if reply.memory_mb else "no cap ([worker] memory_mb)"
            con.print(escape(f"lending compute: llama.cpp RPC {reply.rpc} ({reply.build}), pid {reply.pid}, "
                             f"{reply.threads} threads, memory {memory}"))
            con.print(escape("reachable only through psymesh" if reply.isolation == "netns" else
                             "its port is on this machine's loopback: other local users can reach it"))
            con.print(escape(f"serving {reply.serving} ({reply.bytes_in} B in, {reply.bytes_out} B out)"
                             if reply.serving else f"idle; {reply.streams_served} stream(s) served"
                             + (f", the last {reply.last_end}" if reply.last_end else "")))
        con.print(escape("granted compute.rpc: " + (", ".join(reply.granted) if reply.granted else
                         f"nobody ({out.suggest('grant', 'PEER +compute.rpc')})")))

    out.data(reply.model_dump(exclude={"type"}), human)


# -- the agent -----------------------------------------------------------------------


def _models(node_home: NodeHome) -> ModelRegistry:
    """This node's model registry (read straight from its database: no daemon needed)."""
    from ..core.commands import Commands
    from ..core.db import open_db
    from ..models import ModelRegistry

    return ModelRegistry(open_db(node_home.db_path), commands=Commands.of(node_home.path))


def _family_text(family: str | None) -> str:
    """A model's tool-calling family as the tables show it (agent/formats/families.py)."""
    return {None: "?", "none": "none (cannot call tools)"}.get(family, family or "?")


def _keep_alive(text: str | None) -> float | None:
    """`--keep-alive`: None keeps the node's default; "forever" is stored as -1."""
    if text is None:
        return None
    word = text.strip().lower()
    if word in ("forever", "-1"):
        return -1.0
    if word in ("0", "0s"):
        return 0.0
    return parse_duration(word)


def _local_runner(node_home: NodeHome, registry: ModelRegistry, name: str) -> ModelRunner:
    """Model `name` for a command that runs it here (`agent run`, `eval`): in a runner
    process, as the daemon runs its models, so an abort in llama.cpp fails the command
    with `model_crashed` instead of killing it. It lives as long as the command."""
    from ..models import ModelRunner

    config = node_home.load_config()
    return ModelRunner(registry.settings(name, keep_alive_s=None, memory_limit_mb=config.models.memory_limit_mb),
                       name=name, log_path=node_home.logs_dir / f"model-{name}.log")
