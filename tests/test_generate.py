"""agent.runtime.generate: the one way to ask the model, on real llama-cpp-python with the generated
tiny qwen35 GGUF.

What the callers (infer tasks, the agent loop, a future OpenAI-style endpoint) rely on:
the streamed deltas are the final text, the usage counts are the model's tokens, a
grammar-constrained tool call comes back parsed in the result, bad parameters are a typed
BAD_REQUEST, and the same messages, parameters and seed give the same reply whichever
caller asks (an infer task on a node, the agent's model, or generate() itself).
"""
from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import anyio
import pytest
from pydantic import ValidationError

from conftest import pair, run_nodes
from psymesh.agent.formats.chatformat import ChatMessage, ToolSpec, render_prefix, render_prompt
from psymesh.agent.runtime.generate import (
    Generation,
    GenerationError,
    GenerationParams,
    TextDelta,
    ToolGrammar,
    complete,
    generate,
)
from psymesh.agent.runtime.api import ModelSettings
from psymesh.agent.runtime.worker import ModelWorker
from psymesh.agent.runtime.testmodel import tiny_model_path
from psymesh.node.models.agents import llama_model
from psymesh.node.control.client import Client
from psymesh.protocol.errors import ErrorCode, RemoteError
from psymesh.protocol.tasks import EventKind
from waiting import wait_until

NO_HIGH_BYTES = {t: float("-inf") for t in range(128, 256)}
TOOLS = [
    ToolSpec(name="get_weather", description="Current weather for a city.", parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                       "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "unit"]}),
    ToolSpec(name="set_alarm", description="Set an alarm.", parameters={
        "type": "object", "properties": {"time": {"type": "string"}}, "required": ["time"]}),
]
CHAT = [ChatMessage.system("You are BotPsy, a phone agent."), ChatMessage.user("Weather in Paris?")]
# The node registers the model with these settings; direct workers use the same, so that
# every caller runs the same arithmetic.
MODEL = {"n_ctx": 4096, "n_threads": 1}


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory.getbasetemp() / "models")


def _worker(path: Path) -> ModelWorker:
    return ModelWorker(ModelSettings(path=path, **MODEL))  # type: ignore[arg-type]


def _free(worker: ModelWorker) -> dict[int, float]:
    """ASCII only and no end of generation: the reply runs to max_tokens."""
    return {**NO_HIGH_BYTES, **{t: float("-inf") for t in worker.info.eog_token_ids}}


async def _pieces(worker: ModelWorker, *args: object, **kwargs: object) -> tuple[list[str], Generation]:
    deltas: list[str] = []
    async with aclosing(generate(worker, *args, **kwargs)) as stream:  # type: ignore[arg-type]
        async for piece in stream:
            if isinstance(piece, TextDelta):
                deltas.append(piece.text)
            else:
                return deltas, piece
    raise AssertionError("generate() ended without a Generation")


# --------------------------------------------------------------------------- streaming and usage


@pytest.mark.anyio
async def test_deltas_add_up_to_the_text_and_usage_counts_model_tokens(model_path: Path) -> None:
    async with _worker(model_path) as worker:
        params = GenerationParams(max_tokens=40, temperature=1.0, seed=3, logit_bias=_free(worker))
        deltas, done = await _pieces(worker, CHAT, params=params)
        prompt = render_prompt(CHAT, thinking=False, template=worker.chat_template)
        prefix = render_prefix(CHAT, template=worker.chat_template)
        n_prompt, n_prefix = len(await worker.tokenize(prompt)), len(await worker.tokenize(prefix))

        assert len(deltas) > 1 and "".join(deltas) == done.text
        assert done.finish_reason == "length" and done.reply is None and done.tool_calls == ()
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (n_prompt, 40)
        assert done.usage.prompt_tokens_cached == 0 and not done.opened_think

        # Another question under the same system turn: only the new part is evaluated.
        other = [CHAT[0], ChatMessage.user("And in Oslo?")]
        again = await complete(worker, other, params=params)
        assert again.usage.prompt_tokens_cached == n_prefix and worker.stats.snapshot_hits == 1
        assert again.usage.prompt_tokens == len(await worker.tokenize(
            render_prompt(other, thinking=False, template=worker.chat_template)))

        # Thinking opens a <think> block in the prompt; the result says so.
        thought = await complete(worker, CHAT, params=params.model_copy(update={"thinking": True}))
        assert thought.opened_think and thought.usage.completion_tokens == 40


@pytest.mark.anyio
async def test_stop_strings_and_closing_early(model_path: Path) -> None:
    async with _worker(model_path) as worker:
        free = GenerationParams(max_tokens=3000, temperature=1.0, seed=5, logit_bias=_free(worker))
        full = await complete(worker, CHAT, params=free.model_copy(update={"max_tokens": 60}))
        stop = full.text[30:32]
        cut = await complete(worker, CHAT, params=free.model_copy(update={"max_tokens": 60, "stop": (stop,)}))
        assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]

        before = worker.stats.generated_tokens
        async with aclosing(generate(worker, CHAT, params=free)) as stream:
            async for piece in stream:
                assert isinstance(piece, TextDelta)
                break  # leaving early cancels the request on the worker thread
        await wait_until(lambda: worker.stats.cancelled == 1, "the abandoned request to be cancelled")
        assert worker.stats.generated_tokens - before < 3000


# --------------------------------------------------------------------------- tool calls


@pytest.mark.anyio
async def test_grammar_constrained_tool_call_comes_back_parsed(model_path: Path) -> None:
    async with _worker(model_path) as worker:
        for seed, thinking in ((1, False), (2, False), (3, True)):
            params = GenerationParams(max_tokens=1500, temperature=1.0, seed=seed, logit_bias=NO_HIGH_BYTES,
                                      thinking=thinking,
                                      tool_grammar=ToolGrammar(require_call=True, max_string_chars=16,
                                                               max_think_chars=32))
            deltas, done = await _pieces(worker, CHAT, tools=TOOLS, params=params)
            assert "".join(deltas) == done.text
            assert done.finish_reason == "tool_calls", done
            assert done.reply is not None and done.reply.errors == [], done.text
            assert done.opened_think is thinking
            (call,) = done.tool_calls
            spec = next(t for t in TOOLS if t.name == call.name)
            assert set(spec.parameters["required"]) <= set(call.arguments)
            if call.name == "get_weather":
                assert call.arguments["unit"] in ("c", "f") and isinstance(call.arguments.get("days", 1), int)

        # Tools offered but no grammar: the reply is still parsed, against those tools.
        loose = await complete(worker, CHAT, tools=TOOLS[:1], params=GenerationParams(
            max_tokens=16, temperature=1.0, seed=1, logit_bias=NO_HIGH_BYTES))
        assert loose.reply is not None and loose.finish_reason in ("stop", "length")


def test_bad_params_are_typed_errors() -> None:
    with pytest.raises(ValidationError, match="not both"):
        GenerationParams(grammar='root ::= "x"', tool_grammar=ToolGrammar())
    with pytest.raises(ValidationError):
        GenerationParams(temprature=0.5)  # type: ignore[call-arg]  # a typo is not silently ignored
    assert GenerationParams(stop="\n").stop == ("\n",)

    for knob in ("max_think_tokens", "call_limit"):
        with pytest.raises(ValidationError):
            GenerationParams(**{knob: 0})  # type: ignore[arg-type]

    peer = {"temperature": 0.2, "stop": ["</s>"], "seed": 9, "logit_bias": {"7": 50}, "future_knob": 1,
            "max_think_tokens": 64, "call_limit": 3}
    got = GenerationParams.from_untrusted(peer, max_tokens=32)
    assert (got.temperature, got.stop, got.seed, got.max_tokens) == (0.2, ("</s>",), 9, 32)
    assert got.logit_bias == {}  # a peer cannot bias token ids
    assert (got.max_think_tokens, got.call_limit) == (64, None)  # it may cap thinking; how replies end is ours
    with pytest.raises(GenerationError) as bad:
        GenerationParams.from_untrusted({"temperature": "hot", "top_p": 2, "max_think_tokens": -1}, max_tokens=8)
    assert bad.value.code is ErrorCode.BAD_REQUEST
    assert all(k in bad.value.message for k in ("temperature", "top_p", "max_think_tokens"))


@pytest.mark.anyio
async def test_requests_that_cannot_run_fail_before_the_model_runs(model_path: Path) -> None:
    async with _worker(model_path) as worker:
        with pytest.raises(GenerationError, match="needs tools"):
            await complete(worker, CHAT, params=GenerationParams(tool_grammar=ToolGrammar()))
        with pytest.raises(GenerationError, match="tool grammar"):
            await complete(worker, CHAT, tools=[], params=GenerationParams(tool_grammar=ToolGrammar(require_call=True)))
        with pytest.raises(GenerationError, match="outside the vocabulary") as e:
            await complete(worker, CHAT, params=GenerationParams(logit_bias={worker.info.n_vocab: 1.0}))
        assert e.value.code is ErrorCode.BAD_REQUEST
        assert worker.stats.requests == 0


# --------------------------------------------------------------------------- one reply, whoever asks


@pytest.mark.anyio
async def test_infer_task_agent_model_and_generate_give_the_same_reply(tmp_path: Path, model_path: Path) -> None:
    peer_params = {"temperature": 1.0, "seed": 4, "ban_bytes": True}
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        async with Client(nodes["home"].home.path) as home:
            await home.grant("phone", ["task.infer"])
        nodes["home"].models.registry.add("tiny", model_path, **MODEL)
        async with Client(nodes["phone"].home.path) as phone:
            task = await phone.delegate("home", infer=[m.model_dump(include={"role", "content"}) for m in CHAT],
                                        model="tiny", max_tokens=48, params=peer_params)
            with anyio.fail_after(60):
                events = [ev async for ev in task.events()]
            by_task = await task.result()

            bad = await phone.delegate("home", infer="hi", model="tiny", params={"temperature": "hot"})
            with pytest.raises(RemoteError) as err:
                await bad.result()
        worker = await nodes["home"].models.get("tiny")
        direct = await complete(worker, CHAT, params=GenerationParams(max_tokens=48, **peer_params))
        by_agent = await llama_model(worker, {"grammar": False, "max_tokens": 48, **peer_params}).reply(
            CHAT, [], thinking=False)

    streamed = "".join(e.data["text"] for e in events if e.kind is EventKind.TOKEN)
    assert by_task.text == streamed == direct.text == by_agent
    assert by_task.finish_reason == direct.finish_reason
    assert (by_task.usage.prompt_tokens, by_task.usage.completion_tokens) == (direct.usage.prompt_tokens,
                                                                              direct.usage.completion_tokens)
    assert err.value.code is ErrorCode.BAD_REQUEST and "temperature" in err.value.message
