"""ModelWorker on real llama-cpp-python with a generated tiny Qwen3.5 (qwen35) GGUF.

Random weights babble, so outputs are steered the way the runtime is meant to be
used: grammar-constrained tool calls (which must always parse), or free sampling
with stray UTF-8 lead bytes (ids 128-255) and end-of-generation tokens banned when
a test needs a known number of tokens.
"""
from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import anyio
import pytest
from llama_cpp import LlamaGrammar

from waiting import wait_until

from psymesh.agent.formats.chatformat import (
    ChatMessage,
    ToolSpec,
    parse_reply,
    render_prefix,
    render_prompt,
    split_generation_prompt,
)
from psymesh.agent.formats.grammar import tool_call_grammar
from psymesh.agent.runtime.api import (
    Completion,
    GrammarError,
    ModelLoadError,
    ModelSettings,
    PromptTooLong,
    WorkerBusy,
    WorkerClosed,
)
from psymesh.agent.runtime.worker import ModelWorker
from psymesh.agent.runtime.testmodel import make_tiny_gguf, tiny_model_path
from psymesh.protocol.errors import ErrorCode

TEMPLATE = (Path(__file__).parent / "data" / "qwen35_chat_template.jinja").read_text(encoding="utf-8")
NO_HIGH_BYTES = {t: float("-inf") for t in range(128, 256)}

TOOLS = [
    ToolSpec(name="get_weather", description="Current weather for a city.", parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["c", "f"]},
                       "days": {"type": "integer", "minimum": 1}, "alerts": {"type": "boolean"}},
        "required": ["city", "unit"]}),
    ToolSpec(name="set_alarm", description="Set an alarm.", parameters={
        "type": "object",
        "properties": {"time": {"type": "string", "maxLength": 8},
                       "repeat": {"type": "array", "items": {"type": "string", "enum": ["mon", "tue", "wed"]}},
                       "options": {"type": "object"}, "volume": {"type": "number"}},
        "required": ["time"]}),
    ToolSpec(name="send_sms", description="Send a text.", irreversible=True, parameters={
        "type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
        "required": ["to", "body"]}),
]
CONVERSATION = [ChatMessage.system("You are BotPsy, a phone agent."), ChatMessage.user("Weather in Paris?")]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def model_path(model_dir: Path) -> Path:
    return tiny_model_path(model_dir)


def _settings(path: Path, **kw: object) -> ModelSettings:
    return ModelSettings(path=path, n_ctx=4096, n_threads=2, **kw)  # type: ignore[arg-type]


def _free(worker: ModelWorker) -> dict[int, float]:
    """Logit bias for free-running generation: ASCII only and no end of generation."""
    return {**NO_HIGH_BYTES, **{t: float("-inf") for t in worker.info.eog_token_ids}}


# --------------------------------------------------------------------------- loading


@pytest.mark.anyio
async def test_loads_model_and_exposes_its_facts(model_dir: Path) -> None:
    templated = tiny_model_path(model_dir, chat_template=TEMPLATE)
    async with ModelWorker(_settings(templated)) as worker:
        assert worker.info.n_ctx == 4096
        assert worker.chat_template == TEMPLATE
        assert worker.info.eog_token_ids  # <|im_end|> at least
        assert await worker.tokenize("<|im_start|>user") == [*(await worker.tokenize("<|im_start|>")),
                                                             *b"user"]
    async with ModelWorker(_settings(templated, chat_template="{{ 'override' }}")) as worker:
        assert worker.chat_template == "{{ 'override' }}"


@pytest.mark.anyio
async def test_generated_models_are_cached_by_their_parameters(model_dir: Path, model_path: Path) -> None:
    before = model_path.stat().st_mtime_ns
    assert tiny_model_path(model_dir) == model_path and model_path.stat().st_mtime_ns == before
    wider = tiny_model_path(model_dir, n_embd=128, n_ff=256)
    dense = make_tiny_gguf(model_dir, arch="qwen3")
    assert len({model_path, wider, dense}) == 3
    assert 100_000 < model_path.stat().st_size < 400_000
    for path in (wider, dense):
        async with ModelWorker(_settings(path)) as worker:
            done = await worker.complete("<|im_start|>user\nhi<|im_end|>\n", max_tokens=8, logit_bias=_free(worker))
            assert done.tokens == 8


@pytest.mark.anyio
async def test_unloadable_models_raise_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        await ModelWorker(_settings(tmp_path / "missing.gguf")).start()
    assert e.value.code == ErrorCode.UNAVAILABLE
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        await ModelWorker(_settings(junk)).start()


# --------------------------------------------------------------------------- constrained tool calls


@pytest.mark.anyio
@pytest.mark.parametrize("template", [None, TEMPLATE], ids=["builtin-renderer", "gguf-template"])
async def test_grammar_forces_a_valid_tool_call(model_dir: Path, template: str | None) -> None:
    async with ModelWorker(_settings(tiny_model_path(model_dir, chat_template=template))) as worker:
        prompt = render_prompt(CONVERSATION, TOOLS, thinking=False, template=worker.chat_template)
        prefix = render_prefix(CONVERSATION, TOOLS, template=worker.chat_template)
        grammar = tool_call_grammar(TOOLS, require_call=True, max_string_chars=32)
        for seed in range(5):
            done = await worker.complete(prompt, prefix=prefix, grammar=grammar, max_tokens=1500, temperature=1.0,
                                         seed=seed, logit_bias=NO_HIGH_BYTES)
            reply = parse_reply(done.text, TOOLS)
            assert done.finish_reason == "stop", done
            assert reply.errors == [], done.text
            assert len(reply.tool_calls) == 1
            call = reply.tool_calls[0]
            spec = next(t for t in TOOLS if t.name == call.name)
            assert set(spec.parameters["required"]) <= set(call.arguments) <= set(spec.parameters["properties"])
            if call.name == "get_weather":
                assert call.arguments["unit"] in ("c", "f")
                assert isinstance(call.arguments.get("days", 1), int)
                assert isinstance(call.arguments.get("alerts", True), bool)
            if call.name == "set_alarm":
                assert set(call.arguments.get("repeat", [])) <= {"mon", "tue", "wed"}
                assert isinstance(call.arguments.get("options", {}), dict)


@pytest.mark.anyio
async def test_grammar_allows_answers_several_calls_and_think_modes(model_path: Path) -> None:
    async with ModelWorker(_settings(model_path)) as worker:
        plain = render_prompt(CONVERSATION, TOOLS, thinking=False)
        thinking = render_prompt(CONVERSATION, TOOLS, thinking=True)
        cases = [
            (plain, tool_call_grammar(TOOLS, max_calls=3, max_string_chars=16), False),
            (thinking, tool_call_grammar(TOOLS, think="empty", max_string_chars=16), True),
            (thinking, tool_call_grammar(TOOLS, think="bounded", max_think_chars=64, max_string_chars=16), True),
        ]
        prefix = render_prefix(CONVERSATION, TOOLS)
        for prompt, grammar, in_think in cases:
            for seed in range(3):
                done = await worker.complete(prompt, prefix=prefix, grammar=grammar, max_tokens=1500,
                                             temperature=1.0, seed=seed, logit_bias=NO_HIGH_BYTES)
                reply = parse_reply(done.text, TOOLS, in_think=in_think)
                assert reply.errors == [], done.text
                assert reply.tool_calls or reply.content


@pytest.mark.anyio
async def test_grammar_handles_richer_schemas(model_path: Path) -> None:
    tool = ToolSpec(name="configure", parameters={"type": "object", "properties": {
        "mode": {"const": "auto"},
        "level": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 4}]},
        "label": {"type": ["string", "null"], "maxLength": 6},
        "ratio": {"type": "number"},
        "limits": {"type": "object", "properties": {"low": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string"}}}, "required": ["low"]},
        "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    }, "required": ["mode", "level", "label", "ratio", "limits", "ids"]})
    conversation = [ChatMessage.user("configure it")]
    async with ModelWorker(_settings(model_path)) as worker:
        prompt = render_prompt(conversation, [tool], thinking=False)
        grammar = tool_call_grammar([tool], require_call=True, max_string_chars=12)
        for seed in range(3):
            done = await worker.complete(prompt, grammar=grammar, max_tokens=1500, temperature=1.0, seed=seed,
                                         logit_bias=NO_HIGH_BYTES)
            reply = parse_reply(done.text, [tool])
            assert reply.errors == [], done.text
            args = reply.tool_calls[0].arguments
            assert args["mode"] == "auto"
            assert isinstance(args["level"], (int, str)) and isinstance(args["ratio"], (int, float))
            assert isinstance(args["limits"]["low"], int) and all(isinstance(i, int) for i in args["ids"])
            assert len(args["ids"]) <= 3 and (args["label"] is None or len(args["label"]) <= 6)


# --------------------------------------------------------------------------- streaming, stop, cancel


@pytest.mark.anyio
async def test_streaming_pieces_add_up_to_the_completion(model_path: Path) -> None:
    async with ModelWorker(_settings(model_path)) as worker:
        pieces: list[str] = []
        final: Completion | None = None
        async with aclosing(worker.stream("<|im_start|>user\nhi<|im_end|>\n", max_tokens=40, temperature=1.0,
                                          seed=3, logit_bias=_free(worker))) as events:
            async for event in events:
                if isinstance(event, str):
                    pieces.append(event)
                else:
                    final = event
        assert final is not None and final.finish_reason == "length" and final.tokens == 40
        assert len(pieces) > 1 and "".join(pieces) == final.text
        again = "".join([p async for p in worker.generate("<|im_start|>user\nhi<|im_end|>\n", max_tokens=40,
                                                           temperature=1.0, seed=3, logit_bias=_free(worker))])
        assert again == final.text  # same seed, same text


@pytest.mark.anyio
async def test_stop_strings_end_the_completion(model_path: Path) -> None:
    async with ModelWorker(_settings(model_path)) as worker:
        prompt = render_prompt(CONVERSATION, TOOLS[:1], thinking=False)
        done = await worker.complete(prompt, grammar=tool_call_grammar(TOOLS[:1], require_call=True),
                                     stop=["</parameter>"], max_tokens=1500, temperature=1.0, seed=1,
                                     logit_bias=NO_HIGH_BYTES)
        assert done.finish_reason == "stop"
        assert done.text.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\n")
        assert "</parameter>" not in done.text


@pytest.mark.anyio
async def test_cancelling_the_consumer_stops_generation(model_path: Path) -> None:
    async with ModelWorker(_settings(model_path)) as worker:
        received = 0
        with anyio.CancelScope() as scope:
            async for _ in worker.generate("<|im_start|>user\nwrite forever<|im_end|>\n", max_tokens=3500,
                                           temperature=1.0, seed=0, logit_bias=_free(worker)):
                received += 1
                if received == 3:
                    scope.cancel()  # takes effect at the consumer's next checkpoint
        assert scope.cancelled_caught and 3 <= received < 3500
        # The worker drops the cancelled request and serves the next one.
        done = await worker.complete("<|im_start|>user\nhi<|im_end|>\n", max_tokens=8, temperature=1.0, seed=0,
                                     logit_bias=_free(worker))
        assert done.tokens == 8
        stats = worker.stats
        assert stats.cancelled == 1
        assert stats.generated_tokens < 3500  # the 3,500-token request did not run to the end

        # Leaving the loop early (break) cancels too.
        async with aclosing(worker.generate("<|im_start|>user\nmore<|im_end|>\n", max_tokens=3500,
                                            temperature=1.0, seed=1, logit_bias=_free(worker))) as gen:
            async for _ in gen:
                break
        await wait_until(lambda: worker.stats.cancelled == 2, "the second cancellation", timeout=5)
        assert worker.stats.generated_tokens < 2 * 3500


@pytest.mark.anyio
async def test_concurrent_requests_are_queued_and_isolated(model_path: Path) -> None:
    prompt = "<|im_start|>user\ncount<|im_end|>\n"
    async with ModelWorker(_settings(model_path)) as worker:
        alone = {seed: (await worker.complete(prompt, max_tokens=48, temperature=1.0, seed=seed,
                                              logit_bias=_free(worker))).text for seed in range(6)}
        together: dict[int, str] = {}

        async def one(seed: int) -> None:
            together[seed] = (await worker.complete(prompt, max_tokens=48, temperature=1.0, seed=seed,
                                                    logit_bias=_free(worker))).text

        async with anyio.create_task_group() as tg:
            for seed in range(6):
                tg.start_soon(one, seed)
        assert together == alone
        assert worker.stats.requests == 12


@pytest.mark.anyio
async def test_full_queue_rejects_with_busy(model_path: Path) -> None:
    async with ModelWorker(_settings(model_path, max_pending=1)) as worker:
        long = dict(max_tokens=3500, temperature=1.0, seed=0, logit_bias=_free(worker))
        async with anyio.create_task_group() as tg:
            first = worker.generate("<|im_start|>user\na<|im_end|>\n", **long)
            await first.__anext__()  # running on the worker thread
            tg.start_soon(functools.partial(worker.complete, "<|im_start|>user\nb<|im_end|>\n", **long))  # queued
            await wait_until(lambda: worker.pending == 1, "the queued request", timeout=5)
            with pytest.raises(WorkerBusy) as e:
                await worker.complete("<|im_start|>user\nc<|im_end|>\n", max_tokens=4)
            assert e.value.code == ErrorCode.BUSY
            await first.aclose()
            tg.cancel_scope.cancel()


# --------------------------------------------------------------------------- prefix cache


@pytest.mark.anyio
async def test_prefix_cache_restores_state_and_evaluates_only_the_suffix(model_path: Path) -> None:
    turn1 = render_prompt(CONVERSATION, TOOLS, thinking=False)
    turn2 = render_prompt([*CONVERSATION, ChatMessage.assistant("It is 21C."), ChatMessage.user("And Oslo?")],
                          TOOLS, thinking=False)
    prefix = render_prefix(CONVERSATION, TOOLS)
    kw = dict(max_tokens=32, temperature=1.0, seed=7, logit_bias=NO_HIGH_BYTES)
    async with ModelWorker(_settings(model_path)) as worker:
        n_prefix = len(await worker.tokenize(prefix))
        first = await worker.complete(turn1, prefix=prefix, **kw)
        second = await worker.complete(turn2, prefix=prefix, **kw)
        third = await worker.complete(turn2, prefix=prefix, **kw)
        stats = worker.stats
    assert n_prefix > 1000  # the tool block dominates the prompt
    assert (first.prompt_tokens_reused, second.prompt_tokens_reused) == (0, n_prefix)
    assert (stats.misses, stats.snapshot_hits) == (1, 2)
    assert stats.prompt_tokens_reused == 2 * n_prefix
    assert stats.prompt_tokens_evaluated == first.prompt_tokens + 2 * (second.prompt_tokens - n_prefix)
    assert third.text == second.text

    async with ModelWorker(_settings(model_path, reuse=False)) as fresh:
        uncached = await fresh.complete(turn2, prefix=prefix, **kw)
        assert fresh.stats.prompt_tokens_reused == fresh.stats.snapshots_saved == 0
    assert uncached.text == second.text  # a restored prefix state behaves like a fresh evaluation


@pytest.mark.anyio
async def test_prompt_extending_the_context_continues_without_reevaluation(model_path: Path) -> None:
    head = "<|im_start|>user\nstep one<|im_end|>\n<|im_start|>assistant\n"
    longer = head + "ok<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    kw = dict(temperature=1.0, seed=5, logit_bias=NO_HIGH_BYTES)
    async with ModelWorker(_settings(model_path)) as worker:
        first = await worker.complete(head, max_tokens=1, **kw)  # leaves exactly `head` in the context
        second = await worker.complete(longer, max_tokens=24, **kw)
        assert worker.stats.continuation_hits == 1
        assert second.prompt_tokens_reused == first.prompt_tokens
    async with ModelWorker(_settings(model_path)) as fresh:
        assert (await fresh.complete(longer, max_tokens=24, **kw)).text == second.text


@pytest.mark.anyio
async def test_a_model_without_recurrent_layers_cuts_its_context_back_and_saves_no_state(model_dir: Path) -> None:
    """A dense (attention-only) model's context can be cut back to any prefix: a prompt that
    departs from what was evaluated (another question after the same system turn, with its
    prefix and checkpoint named) keeps their longest common prefix, is evaluated in one go, and
    no state is copied; the reply is a fresh evaluation's."""
    dense = make_tiny_gguf(model_dir, arch="qwen3")
    one = render_prompt(CONVERSATION, TOOLS, thinking=False)
    other = render_prompt([CONVERSATION[0], ChatMessage.user("And the weather in Oslo?")], TOOLS, thinking=False)
    prefix = render_prefix(CONVERSATION, TOOLS)
    kw = dict(max_tokens=24, temperature=1.0, seed=3, logit_bias=NO_HIGH_BYTES, prefix=prefix)
    async with ModelWorker(_settings(dense)) as worker:
        shared = len(await worker.tokenize(prefix))
        first = await worker.complete(one, checkpoint=split_generation_prompt(one)[0], **kw)
        second = await worker.complete(other, checkpoint=split_generation_prompt(other)[0], **kw)
        stats = worker.stats
    assert first.prompt_tokens_reused == 0 and second.prompt_tokens_reused >= shared > 1000
    assert (stats.misses, stats.continuation_hits, stats.snapshots_saved, stats.state_cache_bytes) == (1, 1, 0, 0)
    async with ModelWorker(_settings(dense, reuse=False)) as fresh:
        assert (await fresh.complete(other, **kw)).text == second.text


# --------------------------------------------------------------------------- errors and lifecycle


@pytest.mark.anyio
async def test_bad_requests_raise_typed_errors_and_leave_the_worker_usable(model_path: Path) -> None:
    async with ModelWorker(_settings(model_path)) as worker:
        with pytest.raises(PromptTooLong) as e:
            await worker.complete("x" * 5000, max_tokens=4)
        assert e.value.code == ErrorCode.TOO_LARGE
        with pytest.raises(GrammarError) as g:
            await worker.complete("<|im_start|>user\nhi<|im_end|>\n", grammar="root ::= [a-", max_tokens=4)
        assert g.value.code == ErrorCode.BAD_REQUEST
        done = await worker.complete("<|im_start|>user\nhi<|im_end|>\n", max_tokens=4, logit_bias=_free(worker),
                                     grammar=LlamaGrammar.from_string('root ::= "ok" [a-z]{2,}', verbose=False))
        assert done.tokens == 4 and done.text.startswith("ok")


@pytest.mark.anyio
async def test_closing_fails_queued_requests_and_refuses_new_ones(model_path: Path) -> None:
    worker = ModelWorker(_settings(model_path))
    await worker.start()
    outcomes: dict[str, object] = {}

    async def request(name: str) -> None:
        try:
            outcomes[name] = await worker.complete(f"<|im_start|>user\n{name}<|im_end|>\n", max_tokens=3500,
                                                   temperature=1.0, seed=0, logit_bias=_free(worker))
        except WorkerClosed as exc:
            outcomes[name] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(request, "running")
        await wait_until(lambda: worker.stats.requests == 1, "the first request to start", timeout=5)
        tg.start_soon(request, "queued")
        await wait_until(lambda: worker.pending == 1, "the second request to queue", timeout=5)
        await worker.aclose()
    assert isinstance(outcomes["queued"], WorkerClosed)
    assert isinstance(outcomes["running"], Completion)  # cut short ("cancelled") unless it had just finished
    with pytest.raises(WorkerClosed):
        await worker.complete("<|im_start|>user\nlate<|im_end|>\n", max_tokens=4)


# --------------------------------------------------------------------------- asyncio


async def _tool_call_on(worker: ModelWorker) -> tuple[str, int]:
    prompt = render_prompt(CONVERSATION, TOOLS, thinking=False)
    done = await worker.complete(prompt, prefix=render_prefix(CONVERSATION, TOOLS), max_tokens=1500,
                                 grammar=tool_call_grammar(TOOLS, require_call=True, max_string_chars=16),
                                 temperature=1.0, seed=2, logit_bias=NO_HIGH_BYTES)
    reply = parse_reply(done.text, TOOLS)
    assert reply.errors == [] and len(reply.tool_calls) == 1
    received = 0
    stream: AsyncIterator[str] = worker.generate("<|im_start|>user\nhi<|im_end|>\n", max_tokens=3500,
                                                 temperature=1.0, seed=0, logit_bias=_free(worker))
    async with aclosing(stream):  # type: ignore[type-var]
        async for _ in stream:
            received += 1
            if received == 5:
                break
    return reply.tool_calls[0].name, received


@pytest.mark.asyncio
async def test_works_under_asyncio(model_path: Path) -> None:
    import asyncio

    async with ModelWorker(_settings(model_path)) as worker:
        name, received = await _tool_call_on(worker)
        assert name in {t.name for t in TOOLS} and received == 5
        results = await asyncio.gather(*(worker.complete("<|im_start|>user\nx<|im_end|>\n", max_tokens=16,
                                                         temperature=1.0, seed=s, logit_bias=_free(worker))
                                         for s in range(3)))
        assert [r.tokens for r in results] == [16, 16, 16]
        await asyncio.wait_for(_until_idle(worker), timeout=10)


async def _until_idle(worker: ModelWorker) -> None:
    await wait_until(lambda: worker.stats.cancelled == 1, "the abandoned stream to be cancelled", timeout=5)


@pytest.mark.anyio
async def test_works_under_trio(model_path: Path) -> None:
    async with ModelWorker(_settings(model_path)) as worker:
        name, received = await _tool_call_on(worker)
        assert name in {t.name for t in TOOLS} and received == 5
