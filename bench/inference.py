"""Inference benchmark on a random-weight model with BotPsy-0.8B's exact shapes.

Random weights cost exactly what real weights cost per token, so these numbers are
what the phone runtime pays; only the text is nonsense. Two questions:

1. Does the model's path cost generation speed compared with bare llama-cpp-python?
   The baseline is the leanest loop the bindings allow (``llama_decode`` on a one-token
   batch, the same sampler chain, no Python-side logits), on the same context settings;
   against it, the engine in this process (ModelWorker: worker thread, async streaming,
   our sampler loop) and the path the node really takes, a runner process
   (node/models/runner.py: the engine in a child, every piece a frame over a pipe).
   Rates count from the first token the caller holds to the last; the first token's
   latency is the request's, through the engine in process and through the runner.
3. Memory: a home daemon and its runners, idle before the model was ever loaded, with
   the model loaded, and after its keep-alive ran out (the runner gone).
2. What does an agent conversation cost per step? Steps 1-8 of a real ``run_agent``
   (a ~1.5k-token system turn: persona, two tool schemas, the calling instructions),
   every step asked of a worker with state reuse and of one evaluating every prompt
   from scratch, back to back: tokens evaluated, time to the first token, the model's
   time for the step, and the memory the saved states hold.

4. The real model (SmolLM2-135M-Instruct, psymesh.agent.runtime.realmodel; `--real` runs this part
   alone): a chat question, greedy, through bare llama-cpp-python tuned as an expert would
   (same n_threads and n_batch, mmap, warm, the same renderer and sampler chain, the lean
   decode loop, the context kept and cut back to the common prefix as our engine does), through the runner (the chat path: template, saved-state marks, a pipe),
   and through a home daemon's OpenAI endpoint (HTTP, the daemon, its runner): time to the
   first token and tokens/s. Each run asks with a system turn of its own, so no path can
   reuse a state another run left.

Random weights cannot pick a tool, so each step's reply is forced by a grammar to one
call (the same text in both runs), and the model is steered to spell it the way a
trained model does (``<tool_call>`` as its one special token, merges where they
apply): a random model writing it byte by byte would be non-canonical, and such a
reply is never continued (see agent/runtime/worker.py), which no trained model provokes.

    .venv/bin/python bench/inference.py               # Q4_K_M, 2 threads
    .venv/bin/python bench/inference.py --wtype Q8_0 --runs 2
    .venv/bin/python bench/inference.py --model tiny.gguf --runs 1 --steps 3   # a smoke run
    .venv/bin/python bench/inference.py --real --runs 10                       # the real model only

The model is generated once into .bench/ (F16 written, then quantized by llama.cpp).
Every loop is bounded by --runs, --steps and the token counts. On a shared 2-core
machine the numbers are noisy: the two generation loops are interleaved so they share
the noise, and each run's figures are printed.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import llama_cpp
from llama_cpp import Llama

from psymesh.agent.formats.chatformat import EMPTY_THINK, ChatMessage, ToolSpec, render_prompt
from psymesh.agent.runtime.generate import GenerationParams
from psymesh.agent.acting.loop import AgentConfig, LlamaAgentModel, ModelReply, StepUsage, run_agent
from psymesh.agent.runtime.api import Completion, ModelSettings
from psymesh.agent.runtime.worker import ModelWorker
from psymesh.node.models import ModelRunner
from psymesh.agent.runtime.testmodel import make_botpsy_shaped_gguf
from psymesh.agent.acting.tools import ToolContext, ToolRegistry
from _common import model_arguments

ROOT = Path(__file__).resolve().parent.parent
SHORT_PROMPT = "<|im_start|>user\nTell me a story about a robot.<|im_end|>\n<|im_start|>assistant\n"
PERSONA = ("You are BotPsy, a concise on-device assistant. Prefer tools over guessing; delegate heavy work to "
           "the user's home PC.")
CITIES = ["Paris", "Oslo", "Lima", "Kyoto", "Accra", "Quito", "Perth", "Turin"]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _steering(model: Path) -> dict[int, float]:
    """End of generation banned (the reply is the forced call, whole); every multi-byte
    token that is not a control token favoured by its length, so the forced text comes
    out in its canonical tokens, as a trained model writes it."""
    llm = Llama(model_path=str(model), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        bias = {}
        for token in range(llm.n_vocab()):
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                bias[token] = float("-inf")
            elif llama_cpp.llama_vocab_get_attr(vocab, token) & llama_cpp.LLAMA_TOKEN_ATTR_UNUSED:
                continue
            elif not llama_cpp.llama_vocab_is_control(vocab, token):
                piece = llm.detokenize([token], special=True)
                if len(piece) > 1:
                    bias[token] = 8.0 * len(piece)
        return bias
    finally:
        llm.close()


# --------------------------------------------------------------------------- 1. generation speed


def bench_bare(llm: Llama, n_gen: int, no_eog: dict[int, float]) -> tuple[float, float]:
    """(tokens/s from the evaluated prompt to the last token, wall seconds) with the
    leanest loop llama-cpp-python allows: the sampler chain the worker builds for a
    greedy request (logit bias, greedy), one-token batches straight to llama_decode,
    and each token's text, as the worker streams it."""
    tokens = llm.tokenize(SHORT_PROMPT.encode(), add_bos=False, special=True)
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    biases = (llama_cpp.llama_logit_bias * len(no_eog))(*(llama_cpp.llama_logit_bias(t, b) for t, b in no_eog.items()))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_logit_bias(llm.n_vocab(), len(no_eog),
                                                                                      biases))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    piece = ctypes.create_string_buffer(64)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    one = (llama_cpp.llama_token * 1)()
    try:
        start = time.perf_counter()
        prompt = (llama_cpp.llama_token * len(tokens))(*tokens)
        if llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(prompt, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        first = 0.0
        for i in range(n_gen):
            token = llama_cpp.llama_sampler_sample(chain, llm.ctx, -1)
            llama_cpp.llama_token_to_piece(vocab, token, piece, len(piece), 0, False)
            if i == 0:
                first = time.perf_counter()  # the caller holds its first token
            if i < n_gen - 1:
                one[0] = token
                if llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(one, 1)) != 0:
                    raise RuntimeError("llama_decode failed")
        end = time.perf_counter()
    finally:
        llama_cpp.llama_sampler_free(chain)
    return (n_gen - 1) / (end - first), first - start, end - start


async def bench_stream(model: ModelWorker | ModelRunner, n_gen: int,
                       no_eog: dict[int, float]) -> tuple[float, float, float]:
    """The same as the caller of `model` sees it: (tokens/s from the first piece it holds
    to the last, seconds to the first piece, wall seconds), every hop included. Every run
    evaluates its prompt (nothing saved is a proper prefix of it)."""
    start = time.perf_counter()
    first = 0.0
    done: Completion | None = None
    async for event in model.stream(SHORT_PROMPT, max_tokens=n_gen, temperature=0.0, logit_bias=no_eog):
        if isinstance(event, str):
            first = first or time.perf_counter()
        else:
            done = event
    end = time.perf_counter()
    assert done is not None and done.tokens == n_gen and done.prompt_tokens_reused == 0, done
    if not first:  # no text piece at all (random weights may write only pieces that decode to
        # nothing): the engine's own clock, which leaves out the hops to the caller
        return n_gen / done.generation_seconds, done.prompt_seconds, end - start
    return (n_gen - 1) / (end - first), first - start, end - start


async def generation_rows(model: Path, args: argparse.Namespace) -> list[tuple[str, str]]:
    settings = ModelSettings(path=model, n_ctx=4096, n_threads=args.threads, keep_alive_s=None)
    rates: dict[str, list[float]] = {"bare": [], "worker": [], "runner": []}
    firsts: dict[str, list[float]] = {"bare": [], "worker": [], "runner": []}
    walls: dict[str, list[float]] = {"bare": [], "worker": [], "runner": []}

    def note(kind: str, sample: tuple[float, float, float]) -> None:
        rates[kind].append(sample[0])
        firsts[kind].append(sample[1] * 1000)
        walls[kind].append(sample[2])

    async with ModelWorker(settings) as worker, ModelRunner(settings) as runner:
        bare = Llama(model_path=str(model), n_ctx=settings.n_ctx, n_batch=settings.n_batch,
                     n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
        # No end of generation, and no control token (its piece is empty: greedy on random weights
        # can pick one for ever, and then no caller would ever hold a first token).
        vocab = llama_cpp.llama_model_get_vocab(bare.model)
        no_eog = {t: float("-inf") for t in range(bare.n_vocab())
                  if llama_cpp.llama_vocab_is_eog(vocab, t) or llama_cpp.llama_vocab_is_control(vocab, t)}
        bench_bare(bare, 4, no_eog)  # warm-up: page in the weights
        await bench_stream(worker, 4, no_eog)
        await bench_stream(runner, 4, no_eog)
        for _ in range(args.runs):  # interleaved, so all three see the machine's noise alike
            note("bare", bench_bare(bare, args.gen_tokens, no_eog))
            note("worker", await bench_stream(worker, args.gen_tokens, no_eog))
            note("runner", await bench_stream(runner, args.gen_tokens, no_eog))
        bare.close()

    def runs(xs: list[float], fmt: str = ".2f") -> str:
        return ", ".join(f"{x:{fmt}}" for x in xs)

    rows = [(f"generation, {label}", f"{_median(rates[kind]):6.2f} tok/s  (runs: {runs(rates[kind])})")
            for kind, label in (("bare", "bare llama_decode loop"), ("worker", "ModelWorker in process"),
                                ("runner", "runner process (the node's path)"))]
    rows += [
        ("in process / bare", f"{_median(rates['worker']) / _median(rates['bare']):6.3f}"),
        ("runner / bare (target >= 0.97)", f"{_median(rates['runner']) / _median(rates['bare']):6.3f}"),
        ("first token: bare, in process, runner", f"{_median(firsts['bare']):.1f} ms, {_median(firsts['worker']):.1f} ms, "
                                                  f"{_median(firsts['runner']):.1f} ms (runner runs: "
                                                  f"{runs(firsts['runner'], '.1f')})"),
        ("first token, runner - in process (target <= +2 ms)",
         f"{_median(firsts['runner']) - _median(firsts['worker']):+.2f} ms"),
        (f"wall, prompt + {args.gen_tokens} tokens", f"bare {_median(walls['bare']):.2f} s, in process "
                                                     f"{_median(walls['worker']):.2f} s, runner "
                                                     f"{_median(walls['runner']):.2f} s"),
    ]
    return rows


# --------------------------------------------------------------------------- 2. agent steps


def _registry() -> ToolRegistry:
    reg = ToolRegistry()
    calls = {"n": 0}

    @reg.tool("get_weather")
    def get_weather(city: str, unit: str = "c", days: int = 1) -> dict:
        """Current weather and forecast for a city: temperature, sky, wind. unit is c or f; days 1-7."""
        calls["n"] += 1
        return {"city": city, "temp": 17 + calls["n"], "sky": "clear", "wind_kmh": 4 + calls["n"]}

    @reg.tool("send_sms")
    def send_sms(to: str, body: str) -> dict:
        """Send a text message to a contact (a name from the address book, or a number)."""
        return {"sent": True, "to": to}

    return reg


def _forced_call() -> str:
    """GBNF for a reply that is one get_weather call (random weights cannot choose one)."""
    alternatives = " | ".join(f'"{c}"' for c in CITIES)
    return ('root ::= "<tool_call>\\n<function=get_weather>\\n<parameter=city>\\n" city '
            '"\\n</parameter>\\n<parameter=unit>\\nc\\n</parameter>\\n</function>\\n</tool_call>"\n'
            f"city ::= {alternatives}\n")


@dataclass
class PairedModel:
    """Asks every step of both workers, back to back (which one first alternates), so the
    run with state reuse and the one without share the machine's noise. The loop goes on
    with the reusing worker's reply; both read the same prompt text. (Their replies may
    differ: the one without reuse evaluates in a batch the reply tokens the other
    evaluated one at a time, which rounds differently, and random weights are full of
    near-ties; the bench counts how often.)"""

    reuse: LlamaAgentModel
    scratch: LlamaAgentModel
    steps: list[tuple[StepUsage, StepUsage, float, float]] = field(default_factory=list)
    same: int = 0  # steps where both wrote the same reply

    async def reply(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *,
                    thinking: bool = False) -> str:
        return (await self.step(messages, tools, thinking=thinking, max_think_tokens=None)).text

    async def step(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *,
                   thinking: bool, max_think_tokens: int | None) -> ModelReply:
        said: dict[str, tuple[ModelReply, float]] = {}
        order = ("reuse", "scratch") if len(self.steps) % 2 == 0 else ("scratch", "reuse")
        for name in order:
            start = time.perf_counter()
            reply = await getattr(self, name).step(messages, tools, thinking=thinking,
                                                   max_think_tokens=max_think_tokens)
            said[name] = (reply, time.perf_counter() - start)
        (warm, warm_s), (cold, cold_s) = said["reuse"], said["scratch"]
        assert warm.usage and cold.usage and warm.usage.prompt_tokens == cold.usage.prompt_tokens
        self.steps.append((warm.usage, cold.usage, warm_s, cold_s))
        self.same += warm.raw == cold.raw
        return warm


async def agent_rows(model: Path, args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[str]]:
    """Summary rows, and a table of the steps with and without state reuse."""
    steering = await anyio.to_thread.run_sync(_steering, model)
    params = GenerationParams(max_tokens=200, temperature=0.0, grammar=_forced_call(), call_limit=1,
                              logit_bias=steering)
    reg = _registry()
    with_reuse = ModelSettings(path=model, n_ctx=4096, n_threads=args.threads)
    async with ModelRunner(with_reuse) as warm, \
            ModelRunner(with_reuse.model_copy(update={"reuse": False})) as cold:  # as the node runs a step
        paired = PairedModel(LlamaAgentModel(warm, params), LlamaAgentModel(cold, params))
        result = await run_agent("What's the weather in each city on my trip, one by one?", model=paired,
                                 tools=reg, ctx=ToolContext(), profile="phone",
                                 config=AgentConfig(max_steps=args.steps, system_prompt=PERSONA))
        # The tokens each step adds to the last prompt and reply (step 1: the system turn).
        turns = [i for i, m in enumerate(result.transcript) if m.role == "assistant"]
        prompts = [render_prompt(result.transcript[:i], reg.specs("phone"), thinking=False,
                                 template=warm.chat_template) for i in turns]
        added = [len(await warm.tokenize(prompts[0].split("<|im_start|>user")[0]))]
        for k in range(1, len(turns)):
            before = prompts[k - 1] + (result.transcript[turns[k - 1]].raw or "")[len(EMPTY_THINK):]
            assert prompts[k].startswith(before)
            added.append(len(await warm.tokenize(prompts[k][len(before):])))
        stats = warm.stats

    table = ["step  prompt   new | evaluated: reuse   none | first token: reuse    none | "
             "model step: reuse    none  speed-up",
             "-" * 105]
    for k, (w, c, ws, cs) in enumerate(paired.steps):
        table.append(f"{k + 1:4d}  {w.prompt_tokens:6d} {'-' if k == 0 else added[k]:>5} | "
                     f"{w.prompt_tokens_evaluated:16d} {c.prompt_tokens_evaluated:6d} | "
                     f"{w.prompt_seconds:17.2f}s {c.prompt_seconds:6.2f}s | "
                     f"{ws:15.2f}s {cs:6.2f}s  x{cs / ws:.1f}")
    reply_s = _median([w.generation_seconds for w, *_ in paired.steps])
    rows = [("system turn (persona, 2 tools, calling instructions)", f"{added[0]} tokens"),
            ("reply per step (one forced tool call)",
             f"{paired.steps[0][0].completion_tokens} tokens, {reply_s:.2f} s")]
    if len(paired.steps) >= 5:
        w, c, ws, cs = paired.steps[4]
        rows += [
            ("step 5: evaluated <= new + 16 (target)", f"{w.prompt_tokens_evaluated} <= {added[4]} + 16: "
                                                       f"{w.prompt_tokens_evaluated <= added[4] + 16}"),
            ("step 5: speed-up to the first token (target >= 10)", f"x{c.prompt_seconds / w.prompt_seconds:.1f}"),
            ("step 5: speed-up of the whole step, reply included", f"x{cs / ws:.1f}"),
        ]
    rows += [
        ("the same reply with and without reuse", f"{paired.same} of {len(paired.steps)} steps"),
        ("saved states held after the run", f"{stats.state_cache_entries} states, "
                                            f"{stats.state_cache_bytes / 1e6:.1f} MB (budget "
                                            f"{with_reuse.state_cache_bytes / 1e6:.0f} MB)"),
        ("runner counters with reuse", f"continued {stats.continuation_hits}, restored "
                                       f"{stats.snapshot_hits}, from scratch {stats.misses}, "
                                       f"states saved {stats.snapshots_saved}"),
    ]
    return rows, table


# --------------------------------------------------------------------------- 3. memory


def _tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of `pid`, RSS of its descendants) in bytes, from /proc."""
    def rss(p: int) -> int:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def children(p: int) -> list[int]:
        kids: list[int] = []
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return kids

    todo, below = children(pid), 0
    while todo:
        p = todo.pop()
        below += rss(p)
        todo += children(p)
    return rss(pid), below


async def memory_rows(model: Path, args: argparse.Namespace) -> list[tuple[str, str]]:
    """A home daemon (a real process) serving a phone's infer task: its memory and its
    runners', idle before the model was loaded, loaded, and after the keep-alive."""
    import shutil

    from psymesh.node.control.client import Client
    from psymesh.node.core.db import open_db
    from psymesh.node.core.home import NodeHome
    from psymesh.node.models import ModelRegistry
    from psymesh.node.control.process import DaemonProcess, pair_homes

    base = ROOT / ".bench" / "memory"
    shutil.rmtree(base, ignore_errors=True)
    home = DaemonProcess(base / "home", name="home")
    phone = DaemonProcess(base / "phone", profile="phone", name="phone")
    NodeHome(home.home).init(name="home")
    conn = open_db(NodeHome(home.home).db_path)
    ModelRegistry(conn).add("botpsy", model, n_ctx=4096, n_threads=args.threads, keep_alive_s=args.keep_alive)
    conn.close()

    async def settled() -> tuple[int, int]:  # the median of a few readings a moment apart
        readings = []
        for _ in range(5):
            await anyio.sleep(0.2)
            assert home.proc is not None
            readings.append(_tree_rss(home.proc.pid))
        return tuple(statistics.median(r[i] for r in readings) for i in (0, 1))  # type: ignore[return-value]

    await home.start()
    await phone.start()
    try:
        await pair_homes(home.home, phone.home)
        async with Client(phone.home) as p, Client(home.home) as h:
            await (await p.delegate("home", tool="system.info")).result()  # warm the path, no model
            idle = await settled()
            await (await p.delegate("home", infer="Hi", model="botpsy", max_tokens=16,
                                    params={"temperature": 0})).result()
            loaded = await settled()
            with anyio.fail_after(args.keep_alive + 30):
                while (await h.models_ps())[0].loaded:
                    await anyio.sleep(0.2)
            after = await settled()
    finally:
        await phone.stop()
        await home.stop()

    def mb(pair: tuple[int, int]) -> str:
        return f"{(pair[0] + pair[1]) / 2**20:7.1f} MiB (daemon {pair[0] / 2**20:.1f}, runners {pair[1] / 2**20:.1f})"

    growth = (after[0] + after[1] - idle[0] - idle[1]) / 2**20
    return [("home node idle, model never loaded", mb(idle)),
            ("home node, model loaded after one task", mb(loaded)),
            (f"home node after the {args.keep_alive:g} s keep-alive", mb(after)),
            ("after keep-alive - idle (target <= 10 MiB)", f"{growth:+.1f} MiB")]


# --------------------------------------------------------------------------- 4. the real model

REAL_QUESTION = "Tell me a story about a robot who learns to paint."


def _real_messages(k: int) -> list[ChatMessage]:
    """Run k's chat: a system turn of its own, so no saved state is a prefix of another run's."""
    return [ChatMessage.system(f"You are assistant number {k}."), ChatMessage.user(REAL_QUESTION)]


@dataclass
class BareContext:
    """What bare llama.cpp has evaluated: an expert keeps it and evaluates only past the common
    prefix (as llama-cpp-python's own `generate` does), as our engine does on this model."""

    llm: Llama
    tokens: list[int] = field(default_factory=list)


def bench_bare_chat(bare: BareContext, template: str, k: int, n_gen: int) -> tuple[float, float, int]:
    """Bare llama-cpp-python as an expert drives it: render, tokenize, cut the context back to
    the common prefix, one batch, greedy chain, one-token decodes. (first token ms, tokens/s
    after it, tokens)."""
    llm = bare.llm
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    piece = ctypes.create_string_buffer(64)
    one = (llama_cpp.llama_token * 1)()
    start = time.perf_counter()
    prompt = render_prompt(_real_messages(k), (), thinking=False, template=template)
    tokens = llm.tokenize(prompt.encode(), add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)), special=True)
    same = next((i for i, (a, b) in enumerate(zip(bare.tokens, tokens[:-1])) if a != b),
                min(len(bare.tokens), len(tokens) - 1))
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), 0, same, -1)
    bare.tokens = tokens[:]
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    try:
        batch = (llama_cpp.llama_token * (len(tokens) - same))(*tokens[same:])
        if llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(batch, len(tokens) - same)) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        first = end = 0.0
        n = 0
        while n < n_gen:
            token = llama_cpp.llama_sampler_sample(chain, llm.ctx, -1)
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            llama_cpp.llama_token_to_piece(vocab, token, piece, len(piece), 0, False)
            n += 1
            end = time.perf_counter()
            first = first or end
            if n < n_gen:
                one[0] = token
                if llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(one, 1)) != 0:
                    raise RuntimeError("llama_decode failed")
                bare.tokens.append(token)
    finally:
        llama_cpp.llama_sampler_free(chain)
    return (first - start) * 1000, (n - 1) / (end - first) if n > 1 else 0.0, n


async def bench_runner_chat(runner: ModelRunner, k: int, n_gen: int) -> tuple[float, float, int]:
    """The chat path of the node's models: agent.generate over a runner process."""
    from psymesh.agent.runtime.generate import Generation, TextDelta, generate

    start = time.perf_counter()
    first = end = 0.0
    n = 0
    params = GenerationParams(max_tokens=n_gen, temperature=0)
    async for piece in generate(runner, _real_messages(k), params=params):
        if isinstance(piece, TextDelta):
            end = time.perf_counter()
            first = first or end
        elif isinstance(piece, Generation):
            n = piece.usage.completion_tokens
    return (first - start) * 1000, (n - 1) / (end - first) if n > 1 else 0.0, n


async def bench_endpoint_chat(http: Any, url: str, key: str, k: int, n_gen: int) -> tuple[float, float, int]:
    """A streamed chat completion from a daemon's OpenAI endpoint (its model, its runner)."""
    body = {"model": "smol", "messages": [m.to_template_dict() for m in _real_messages(k)], "max_tokens": n_gen,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = end = 0.0
    n = 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                end = time.perf_counter()
                first = first or end
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return (first - start) * 1000, (n - 1) / (end - first) if n > 1 else 0.0, n


async def _first_token_cpu(bare: BareContext, template: str, runner: ModelRunner, http: Any, url: str, key: str,
                           daemon: Any, n: int) -> dict[str, float]:
    """CPU ms a one-token reply costs each path, all its processes counted (the bench's own for
    bare and for the runner's caller; the runner's; the daemon's and its runner's, not the HTTP
    client's), over `n` replies each. CPU time, unlike wall time, does not grow when other work
    shares the cores, so this is what the first token's overhead is on a busy machine."""
    from _common import cpu_ms

    def tree(pid: int) -> float:
        kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
        return cpu_ms(pid) + sum(tree(c) for c in kids)

    me = os.getpid()
    start = time.process_time()
    for k in range(n):
        bench_bare_chat(bare, template, 10_000 + k, 1)
    out = {"bare": (time.process_time() - start) * 1000 / n}
    assert runner.pid is not None and daemon.proc is not None
    before = cpu_ms(me) + tree(runner.pid)
    for k in range(n):
        await bench_runner_chat(runner, 20_000 + k, 1)
    out["runner"] = (cpu_ms(me) + tree(runner.pid) - before) / n
    before = tree(daemon.proc.pid)
    for k in range(n):
        await bench_endpoint_chat(http, url, key, 30_000 + k, 1)
    out["endpoint"] = (tree(daemon.proc.pid) - before) / n
    return out


async def real_model_rows(args: argparse.Namespace) -> list[tuple[str, str]]:
    import re
    import shutil

    import httpx

    from psymesh.agent.runtime.realmodel import missing_reason, real_model_path
    from psymesh.node.control.process import DaemonProcess
    from psymesh.node.core.db import open_db
    from psymesh.node.core.home import NodeHome
    from psymesh.node.models import ModelRegistry

    path = real_model_path()
    if path is None:
        return [("real model", f"skipped: {missing_reason()}")]
    settings = ModelSettings(path=path, n_ctx=2048, n_threads=args.threads, keep_alive_s=None)
    base = ROOT / ".bench" / "real"
    shutil.rmtree(base, ignore_errors=True)
    node = NodeHome(base / "home")
    node.init(name="home")
    conn = open_db(node.db_path)
    ModelRegistry(conn).add("smol", path, n_ctx=settings.n_ctx, n_threads=args.threads, keep_alive_s=-1)
    conn.close()
    key = "sk-bench-0123456789abcdef"
    (base / "key").write_text(key + "\n")
    (base / "key").chmod(0o600)
    config = node.load_config()
    served = config.serve.openai.model_copy(update={"enabled": True, "port": 0, "api_key_file": str(base / "key")})
    node.save_config(config.model_copy(update={"serve": config.serve.model_copy(update={"openai": served})}))
    daemon = DaemonProcess(node.path, name="home")
    await daemon.start()
    kinds = ("bare", "runner", "endpoint")
    firsts: dict[str, list[float]] = {k: [] for k in kinds}
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    counts: set[int] = set()
    try:
        url = re.findall(r"OpenAI-compatible endpoint at (http://127\.0\.0\.1:\d+)/v1", daemon.log_path.read_text())[0]
        bare = BareContext(Llama(model_path=str(path), n_ctx=settings.n_ctx, n_batch=settings.n_batch,
                                 n_threads=args.threads, n_threads_batch=args.threads, use_mmap=True, verbose=False))
        async with ModelRunner(settings) as runner, httpx.AsyncClient(timeout=120) as http:
            template = runner.chat_template or ""
            for k in range(2 + args.runs):  # two warm-up runs: weights paged in, every path loaded
                samples = {"bare": bench_bare_chat(bare, template, 3 * k, args.gen_tokens),
                           "runner": await bench_runner_chat(runner, 3 * k + 1, args.gen_tokens),
                           "endpoint": await bench_endpoint_chat(http, url, key, 3 * k + 2, args.gen_tokens)}
                if k >= 2:
                    for kind, (first, rate, n) in samples.items():
                        firsts[kind].append(first)
                        rates[kind].append(rate)
                        counts.add(n)
            cpu = await _first_token_cpu(bare, template, runner, http, url, key, daemon, args.cpu_runs)
        bare.llm.close()
    finally:
        await daemon.stop()

    def runs(xs: list[float]) -> str:
        return ", ".join(f"{x:.1f}" for x in xs)

    m = {kind: (_median(firsts[kind]), _median(rates[kind])) for kind in kinds}
    rows = [(f"real model: {path.name}, {args.threads} threads", f"tokens per reply: {sorted(counts)}")]
    rows += [(f"real, {label}", f"first token {m[kind][0]:6.1f} ms, {m[kind][1]:6.1f} tok/s  "
                                f"(first: {runs(firsts[kind])})")
             for kind, label in (("bare", "bare llama-cpp-python"), ("runner", "runner (chat path)"),
                                 ("endpoint", "daemon's OpenAI endpoint"))]
    rows += [(f"real, CPU for a first token ({args.cpu_runs} one-token replies), {label}", f"{cpu[kind]:6.2f} ms")
             for kind, label in (("bare", "bare"), ("runner", "runner + its caller"),
                                 ("endpoint", "daemon + its runner"))]
    rows += [
        ("real, CPU for a first token: endpoint - bare (robust to other work)",
         f"{cpu['endpoint'] - cpu['bare']:+.2f} ms"),
        ("real, first token: runner - bare", f"{m['runner'][0] - m['bare'][0]:+.1f} ms"),
        ("real, first token: endpoint - bare (target <= +5 ms)", f"{m['endpoint'][0] - m['bare'][0]:+.1f} ms"),
        ("real, tok/s: runner / bare", f"{m['runner'][1] / m['bare'][1]:.3f}"),
        ("real, tok/s: endpoint / bare (target >= 0.97)", f"{m['endpoint'][1] / m['bare'][1]:.3f}"),
    ]
    return rows


async def run(args: argparse.Namespace) -> None:
    if args.real:
        _print_rows(await real_model_rows(args))
        return
    t0 = time.perf_counter()
    model = args.model or make_botpsy_shaped_gguf(ROOT / ".bench", wtype=args.wtype, n_threads=args.threads)
    print(f"model: {model.name} ({model.stat().st_size / 1e9:.2f} GB), ready in {time.perf_counter() - t0:.1f} s; "
          f"{args.threads} threads")
    rows = await generation_rows(model, args)
    agent, table = await agent_rows(model, args)
    rows += agent
    rows += await memory_rows(model, args)
    rows += await real_model_rows(args)
    _print_rows(rows)
    print()
    print(f"agent conversation, {args.steps} steps, with state reuse and without:")
    print("\n".join(table))


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--keep-alive", type=float, default=3.0, help="the memory part's keep-alive, in seconds")
    p.add_argument("--real", action="store_true", help="only the real model's rows (part 4)")
    p.add_argument("--cpu-runs", type=int, default=30, help="part 4: one-token replies per path for the CPU rows")
    args = p.parse_args(argv)
    anyio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
