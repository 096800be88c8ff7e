"""Inference benchmark on a random-weight model with BotPsy-0.8B's exact shapes.

Random weights cost exactly what real weights cost per token, so these numbers are
what the phone runtime pays; only the text is nonsense. Two questions:

1. Does ModelWorker (worker thread + async streaming + our sampler loop) cost
   generation speed compared with bare llama-cpp-python (``Llama.generate``)?
2. How much does the prefix cache save on the 5th turn of an agent conversation
   whose fixed head (persona + tool schemas) is ~1.5k tokens?

    .venv/bin/python bench/inference.py               # Q4_K_M, 2 threads
    .venv/bin/python bench/inference.py --wtype Q8_0 --runs 2

The model is generated once into .bench/ (F16 written, then quantized by llama.cpp).
Every loop is bounded by --runs and the token counts; on 2 cores a run takes a few
minutes, most of it the uncached 5th-turn prompt evaluation.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio
from llama_cpp import Llama

from psymesh.agent.chatformat import ChatMessage, ToolCall, ToolSpec, render_prefix, render_prompt
from psymesh.agent.runtime import Completion, ModelSettings, ModelWorker
from psymesh.agent.testmodel import make_botpsy_shaped_gguf

ROOT = Path(__file__).resolve().parent.parent
SHORT_PROMPT = "<|im_start|>user\nTell me a story about a robot.<|im_end|>\n<|im_start|>assistant\n"


def _tools() -> list[ToolSpec]:
    """Persona + these two tools + the Qwen3.5 calling instructions: a ~1.5k-token head."""
    def tool(name: str, desc: str, props: dict[str, dict[str, object]], required: list[str]) -> ToolSpec:
        return ToolSpec(name=name, description=desc,
                        parameters={"type": "object", "properties": props, "required": required})

    return [
        tool("get_weather", "Current weather and forecast for a city.",
             {"city": {"type": "string", "description": "City name"},
              "unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer"}}, ["city"]),
        tool("send_sms", "Send a text message to a contact.",
             {"to": {"type": "string", "description": "Contact name or number"},
              "body": {"type": "string", "description": "Message text"}}, ["to", "body"]),
    ]


def _conversation(turns: int) -> list[ChatMessage]:
    """An agent conversation: each turn is a query, a tool call, its result and an answer."""
    msgs = [ChatMessage.system("You are BotPsy, a concise on-device assistant. Prefer tools over guessing; "
                               "delegate heavy work to the user's home PC.")]
    cities = ["Paris", "Oslo", "Lima", "Kyoto", "Accra", "Quito"]
    for i in range(turns - 1):
        call = ToolCall(name="get_weather", arguments={"city": cities[i], "unit": "c"})
        msgs += [ChatMessage.user(f"What's the weather in {cities[i]} today?"),
                 ChatMessage.assistant("", tool_calls=[call]),
                 ChatMessage.tool(call, f'{{"temp": {18 + i}, "sky": "clear", "wind_kmh": {5 + i}}}'),
                 ChatMessage.assistant(f"{cities[i]}: {18 + i}C and clear.")]
    msgs.append(ChatMessage.user(f"And in {cities[turns - 1]}?"))
    return msgs


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_bare(llm: Llama, n_gen: int) -> tuple[float, float]:
    """(tokens/s from first to last token, wall seconds) with Llama.generate."""
    tokens = llm.tokenize(SHORT_PROMPT.encode(), add_bos=False, special=True)
    llm.reset()
    start = time.perf_counter()
    stamps: list[float] = []
    for token in llm.generate(tokens, temp=0.0, reset=True):
        llm.detokenize([token])
        stamps.append(time.perf_counter())
        if len(stamps) == n_gen:
            break
    return (n_gen - 1) / (stamps[-1] - stamps[0]), stamps[-1] - start


async def bench_worker(worker: ModelWorker, n_gen: int) -> tuple[float, float]:
    """The same through ModelWorker: (tokens/s while decoding, wall seconds as the async
    consumer sees it). End-of-generation tokens are banned so every run has `n_gen` tokens.

    The rate comes from the worker's own clock because most tokens of a random-weight
    248k vocabulary are padding that detokenizes to nothing, so there are no pieces to
    time; the wall time includes every hop to the consumer.
    """
    no_eog = {t: float("-inf") for t in worker.info.eog_token_ids}
    start = time.perf_counter()
    done = await worker.complete(SHORT_PROMPT, max_tokens=n_gen, temperature=0.0, logit_bias=no_eog)
    wall = time.perf_counter() - start
    assert done.tokens == n_gen, done
    return n_gen / done.generation_seconds, wall


async def run(args: argparse.Namespace) -> None:
    cache = ROOT / ".bench"
    t0 = time.perf_counter()
    model = make_botpsy_shaped_gguf(cache, wtype=args.wtype, n_threads=args.threads)
    print(f"model: {model.name} ({model.stat().st_size / 1e9:.2f} GB, {args.wtype}), "
          f"ready in {time.perf_counter() - t0:.1f} s; {args.threads} threads")

    settings = ModelSettings(path=model, n_ctx=4096, n_threads=args.threads)
    rows: list[tuple[str, str]] = []
    async with ModelWorker(settings) as worker:
        # ---- 1. generation speed, bare vs worker, interleaved to share the machine's noise
        bare = Llama(model_path=str(model), n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
                     verbose=False)
        bench_bare(bare, 4)  # warm-up: page in the weights
        await bench_worker(worker, 4)
        bare_rates, worker_rates, bare_wall, worker_wall = [], [], [], []
        for _ in range(args.runs):
            r, w = bench_bare(bare, args.gen_tokens)
            bare_rates.append(r)
            bare_wall.append(w)
            r, w = await bench_worker(worker, args.gen_tokens)
            worker_rates.append(r)
            worker_wall.append(w)
        bare.close()
        del bare
        ratio = _median(worker_rates) / _median(bare_rates)
        rows += [
            ("generation, bare Llama.generate", f"{_median(bare_rates):6.2f} tok/s  "
                                                f"(runs: {', '.join(f'{x:.2f}' for x in bare_rates)})"),
            ("generation, ModelWorker stream", f"{_median(worker_rates):6.2f} tok/s  "
                                               f"(runs: {', '.join(f'{x:.2f}' for x in worker_rates)})"),
            ("worker / bare", f"{ratio:6.3f}"),
            (f"wall, prompt + {args.gen_tokens} tokens", f"bare {_median(bare_wall):.2f} s, "
                                                         f"worker {_median(worker_wall):.2f} s"),
        ]

        # ---- 2. fifth agent turn with and without the prefix cache
        msgs = _conversation(5)
        tools = _tools()
        prefix = render_prefix(msgs, tools)
        turn1 = render_prompt(_conversation(1), tools, thinking=False)
        turn5 = render_prompt(msgs, tools, thinking=False)
        n_prefix = len(await worker.tokenize(prefix))
        n_turn5 = len(await worker.tokenize(turn5))
        kw = dict(max_tokens=args.reply_tokens, temperature=0.0,
                  logit_bias={t: float("-inf") for t in worker.info.eog_token_ids})
        warm = await worker.complete(turn1, prefix=prefix, **kw)  # turn 1 pays for the prefix once
        cached: list[Completion] = []
        uncached: list[Completion] = []
        timed: list[tuple[str, float]] = []
        for _ in range(args.turn_runs):
            for label, pre, sink in (("cached", prefix, cached), ("uncached", None, uncached)):
                t = time.perf_counter()
                sink.append(await worker.complete(turn5, prefix=pre, **kw))
                timed.append((label, time.perf_counter() - t))
        lat_c = _median([s for label, s in timed if label == "cached"])
        lat_u = _median([s for label, s in timed if label == "uncached"])
        stats = worker.stats
        rows += [
            ("agent prompt: prefix / 5th-turn prompt", f"{n_prefix} / {n_turn5} tokens"),
            ("turn 1 (fills the cache)", f"{warm.prompt_seconds:.2f} s to first token"),
            (f"5th turn, prefix cache ({args.reply_tokens}-token reply)",
             f"{lat_c:.2f} s  (first token {_median([c.prompt_seconds for c in cached]):.2f} s, "
             f"{cached[0].prompt_tokens - cached[0].prompt_tokens_reused} tokens evaluated)"),
            (f"5th turn, no cache ({args.reply_tokens}-token reply)",
             f"{lat_u:.2f} s  (first token {_median([c.prompt_seconds for c in uncached]):.2f} s, "
             f"{uncached[0].prompt_tokens} tokens evaluated)"),
            ("speed-up", f"{lat_u / lat_c:.2f}x"),
            ("prompt eval rate (uncached)", f"{n_turn5 / _median([c.prompt_seconds for c in uncached]):.1f} tok/s"),
            ("prefix state held in memory", f"{stats.prefix_cache_bytes / 1e6:.1f} MB"),
        ]
    width = max(len(k) for k, _ in rows)
    print()
    print(f"{'measure':<{width}}  value")
    print("-" * (width + 60))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wtype", default="Q4_K_M", choices=["Q4_K_M", "Q8_0", "Q4_0", "Q6_K", "F16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--turn-runs", type=int, default=2)
    args = p.parse_args(argv)
    anyio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
