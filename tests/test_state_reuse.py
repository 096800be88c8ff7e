"""Whole-conversation state reuse, the thinking budget and the early end of a reply at its
tool call: real llama-cpp-python on the generated tiny qwen35 (hybrid, recurrent) GGUF.

What the agent loop relies on at phone speed: step k+1 evaluates only what step k did
not already put in the context (the tool result and the template's glue), to the
token; a conversation that departs from what was evaluated falls back to the longest
saved state that is a true prefix of its tokens and evaluates exactly the tokens a cold
run does, so it samples the same greedy reply (on this F16 model one-token and batched
evaluation agree to ~3e-4 on the logits; agent/runtime/worker.py says why a quantized model
can part on a near-tie); conversations that take turns on one worker each keep their
state; the saved states stay within their memory bound.

Expected numbers are computed from the tokeniser, never hard-coded. Replies are greedy
and steered to canonical spelling (tests/trained.py), as a trained model's are.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path

import pytest

from psymesh.agent.formats.chatformat import (
    EMPTY_THINK,
    ChatMessage,
    ToolCall,
    ToolSpec,
    parse_reply,
    render_prefix,
    render_prompt,
    split_generation_prompt,
)
from psymesh.agent.runtime.generate import Generation, GenerationParams, TextDelta, ToolGrammar, complete, generate
from psymesh.agent.acting.loop import AgentConfig, AgentResult, LlamaAgentModel, run_agent
from psymesh.agent.runtime.api import ModelSettings
from psymesh.agent.runtime.worker import ModelWorker
from psymesh.agent.runtime.testmodel import special_token_ids, tiny_model_path
from psymesh.agent.acting.tools import ToolContext, ToolRegistry
from trained import canonical_bias

TEMPLATE = (Path(__file__).parent / "data" / "qwen35_chat_template.jinja").read_text(encoding="utf-8")
SPECIAL = special_token_ids()
ASCII = {t: float("-inf") for t in range(128, 256)}
TOOLS = [
    ToolSpec(name="get_weather", description="Current weather for a city.", parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"type": "string", "enum": ["c", "f"]},
                       "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "unit"]}),
    ToolSpec(name="set_alarm", description="Set an alarm.", parameters={
        "type": "object", "properties": {"time": {"type": "string", "maxLength": 5}}, "required": ["time"]}),
]
SYSTEM = ChatMessage.system("You are BotPsy, a phone agent.")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory.getbasetemp() / "models")


def _worker(path: Path, **kw: object) -> ModelWorker:
    return ModelWorker(ModelSettings(path=path, n_ctx=8192, n_threads=2, **kw))  # type: ignore[arg-type]


def _steer(path: Path) -> dict[int, float]:
    """ASCII, canonical spelling, and always a call (the grammar also allows an answer)."""
    return {**ASCII, **canonical_bias(path), SPECIAL["<tool_call>"]: 100.0}


def _params(path: Path, **kw: object) -> GenerationParams:
    return GenerationParams(max_tokens=300, temperature=0.0, logit_bias=_steer(path),  # type: ignore[arg-type]
                            tool_grammar=ToolGrammar(max_string_chars=8), **kw)


def _next(messages: Sequence[ChatMessage], done: Generation, result: str) -> list[ChatMessage]:
    """The history after a step: the reply as the model wrote it, then its tool result."""
    assert done.reply is not None and done.reply.tool_calls, done.text
    return [*messages, done.reply.to_message(raw=done.raw), ChatMessage.tool(done.reply.tool_calls[0], result)]


async def _new_tokens(worker: ModelWorker, before: str, reply: str, after: str) -> int:
    """Tokens of `after` past `before` + `reply`: what a step adds (tool result + template glue)."""
    assert after.startswith(before + reply)
    return len(await worker.tokenize(after[len(before) + len(reply):]))


# --------------------------------------------------------------------------- one conversation


async def _agent_run(path: Path, *, reuse: bool) -> tuple[AgentResult, list[str], list[int]]:
    """Five steps of the loop; the prompts it rendered and, from the tokeniser alone, the
    tokens each later step adds to the previous prompt and reply."""
    reg = ToolRegistry()

    @reg.tool("lights.set")
    def lights_set(on: bool) -> dict:
        """Turn the lights on or off."""
        return {"lights": "on" if on else "off"}

    @reg.tool("notes.add")
    def notes_add(text: str) -> dict:
        """Save a short note."""
        return {"saved": text}

    async with _worker(path, reuse=reuse) as worker:
        result = await run_agent("Turn the lights on, then note it.", model=LlamaAgentModel(worker, _params(path)),
                                 tools=reg, ctx=ToolContext(), profile="home", config=AgentConfig(max_steps=5))
        turns = [i for i, m in enumerate(result.transcript) if m.role == "assistant"]
        prompts = [render_prompt(result.transcript[:i], reg.specs("home"), thinking=False,
                                 template=worker.chat_template) for i in turns]
        written = [(result.transcript[i].raw or "")[len(EMPTY_THINK):] for i in turns]
        added = [await _new_tokens(worker, prompts[k - 1], written[k - 1], prompts[k]) for k in range(1, len(turns))]
    return result, prompts, added


@pytest.mark.anyio
@pytest.mark.parametrize("template", [None, TEMPLATE], ids=["builtin-renderer", "gguf-template"])
async def test_each_agent_step_evaluates_only_its_new_tokens(tmp_path_factory: pytest.TempPathFactory,
                                                             template: str | None) -> None:
    path = tiny_model_path(tmp_path_factory.getbasetemp() / "models", chat_template=template)
    warm, prompts, added = await _agent_run(path, reuse=True)
    assert (warm.stopped, warm.steps, len(warm.usage)) == ("max_steps", 5, 5)
    assert all(m.raw is not None for m in warm.transcript if m.role == "assistant")
    # Step 1 evaluates the whole prompt; every later step exactly its tool result and glue,
    # continuing from the whole previous prompt and reply.
    assert warm.usage[0].prompt_tokens_evaluated == warm.usage[0].prompt_tokens > 1000
    assert [u.prompt_tokens_evaluated for u in warm.usage[1:]] == added
    for before, now in zip(warm.usage, warm.usage[1:]):
        assert now.prompt_tokens - now.prompt_tokens_evaluated == before.prompt_tokens + before.completion_tokens

    cold, cold_prompts, _ = await _agent_run(path, reuse=False)
    assert [u.prompt_tokens_evaluated for u in cold.usage] == [u.prompt_tokens for u in cold.usage]
    assert [u.prompt_tokens for u in cold.usage] == [u.prompt_tokens for u in warm.usage]
    assert cold_prompts == prompts  # reuse changed nothing the model computed
    assert [(r.call.name, r.call.arguments) for r in cold.tool_calls] == \
        [(r.call.name, r.call.arguments) for r in warm.tool_calls]


@pytest.mark.anyio
async def test_a_reply_in_non_canonical_tokens_falls_back_to_the_checkpoint(model_path: Path) -> None:
    """A model that spells `<tool_call>` byte by byte wrote tokens no tokenisation of the
    next prompt starts with: the next step continues from the checkpoint before the
    reply (the history), not from the whole conversation again."""
    unsteered = GenerationParams(max_tokens=300, temperature=0.0, logit_bias={**ASCII, SPECIAL["<tool_call>"]: -100.0},
                                 tool_grammar=ToolGrammar(require_call=True, max_string_chars=8))
    messages = [SYSTEM, ChatMessage.user("Weather in Paris?")]
    async with _worker(model_path) as worker:
        first = await complete(worker, messages, tools=TOOLS, params=unsteered)
        assert first.text.startswith("<tool_call>")
        assert first.usage.completion_tokens > len(await worker.tokenize(first.text))  # not canonical
        history = _next(messages, first, '{"temp": 21}')
        second = await complete(worker, history, tools=TOOLS, params=unsteered)
        prompt1 = render_prompt(messages, TOOLS, thinking=False)
        prompt2 = render_prompt(history, TOOLS, thinking=False)
        checkpoint = split_generation_prompt(prompt1)[0]
        assert second.usage.prompt_tokens_cached == len(await worker.tokenize(checkpoint))
        assert second.usage.prompt_tokens_evaluated == len(await worker.tokenize(prompt2[len(checkpoint):]))
        assert worker.stats.snapshot_hits == 1


# --------------------------------------------------------------------------- divergence


@pytest.mark.anyio
async def test_diverging_conversation_falls_back_to_the_longest_true_prefix(model_path: Path) -> None:
    params = _params(model_path)
    goal = ChatMessage.user("Weather in Paris, then an alarm?")
    async with _worker(model_path) as worker, _worker(model_path, reuse=False) as cold:
        steps = [[SYSTEM, goal]]
        replies: list[Generation] = []
        for k in range(3):
            replies.append(await complete(worker, steps[-1], tools=TOOLS, params=params))
            steps.append(_next(steps[-1], replies[-1], f'{{"temp": {20 + k}}}'))
        n_prefix = len(await worker.tokenize(render_prefix(steps[0], TOOLS)))
        history3 = split_generation_prompt(render_prompt(steps[2], TOOLS, thinking=False))[0]

        async def both(messages: list[ChatMessage]) -> Generation:
            again = await complete(worker, messages, tools=TOOLS, params=params)
            fresh = await complete(cold, messages, tools=TOOLS, params=params)
            assert again.text == fresh.text  # greedy: the same tokens evaluated give the same reply
            assert fresh.usage.prompt_tokens_cached == 0 and again.usage.prompt_tokens == fresh.usage.prompt_tokens
            return again

        # Step 3 asked again: the live context went past it; its checkpoint (the history
        # before the generation prompt) is the longest true prefix.
        retried = await both(steps[2])
        assert retried.usage.prompt_tokens_cached == len(await worker.tokenize(history3))
        assert retried.text == replies[2].text
        # An earlier turn edited: only the system turn with the tools is still a prefix.
        edited = await both([SYSTEM, ChatMessage.user("Weather in Oslo, then an alarm?"), *steps[3][2:]])
        assert edited.usage.prompt_tokens_cached == n_prefix
        # Back to the original: its end was saved when the edit replaced it in the context.
        onward = await both(steps[3])
        assert onward.usage.prompt_tokens_evaluated == await _new_tokens(
            worker, render_prompt(steps[2], TOOLS, thinking=False), replies[2].text,
            render_prompt(steps[3], TOOLS, thinking=False))


# --------------------------------------------------------------------------- several conversations


@pytest.mark.anyio
async def test_interleaved_conversations_each_reuse_their_state(model_path: Path) -> None:
    params = _params(model_path)
    goals = ["Weather in Paris?", "Set an alarm for seven.", "Weather in Lima, in f?"]
    async with _worker(model_path) as worker:
        chats = [[SYSTEM, ChatMessage.user(g)] for g in goals]
        last: list[tuple[str, Generation] | None] = [None] * len(chats)
        for step in range(3):
            for c in range(len(chats)):  # each step of each conversation follows another's
                prompt = render_prompt(chats[c], TOOLS, thinking=False)
                done = await complete(worker, chats[c], tools=TOOLS, params=params)
                previous = last[c]
                if previous is None:  # a new conversation starts from the shared system turn
                    assert step == 0 and done.usage.prompt_tokens_cached == (
                        0 if c == 0 else len(await worker.tokenize(render_prefix(chats[c], TOOLS))))
                else:
                    before, reply = previous
                    assert done.usage.prompt_tokens_evaluated == await _new_tokens(worker, before, reply.text,
                                                                                   prompt)
                last[c] = (prompt, done)
                chats[c] = _next(chats[c], done, f'{{"ok": {step}}}')
        stats = worker.stats
        # Every later step restored its own conversation's end; nothing was evaluated twice.
        assert stats.snapshot_hits == 2 + 2 * len(chats) and stats.continuation_hits == 0
        assert stats.state_cache_entries <= worker.settings.state_cache_entries


@pytest.mark.anyio
async def test_saved_states_stay_within_their_memory_bound(model_path: Path) -> None:
    params = _params(model_path)
    async with _worker(model_path) as probe:
        one = await complete(probe, [SYSTEM, ChatMessage.user("Weather?")], tools=TOOLS, params=params)
        await complete(probe, [SYSTEM, ChatMessage.user("Alarm?")], tools=TOOLS, params=params)
        state = probe.stats.state_cache_bytes / probe.stats.state_cache_entries  # ~ one state at this length
    assert one.usage.prompt_tokens > 1000
    bound = int(2.5 * state)  # room for two states, not three
    async with _worker(model_path, state_cache_bytes=bound, state_cache_entries=8) as worker:
        chats = [[SYSTEM, ChatMessage.user(f"Weather in city number {c}?")] for c in range(4)]
        peak = 0
        for step in range(2):
            for c in range(len(chats)):
                done = await complete(worker, chats[c], tools=TOOLS, params=params)
                chats[c] = _next(chats[c], done, f'{{"n": {step}}}')
                peak = max(peak, worker.stats.state_cache_bytes)
        stats = worker.stats
    assert 0 < peak <= bound and stats.state_cache_entries <= 2
    assert stats.snapshots_dropped > 0  # least recently used states made room
    assert stats.snapshot_hits >= 1     # and what was kept was still restored


# --------------------------------------------------------------------------- thinking budget


@pytest.mark.anyio
async def test_thinking_budget_closes_the_thought_and_the_model_goes_on(model_path: Path) -> None:
    never_close = {**ASCII, SPECIAL["</think>"]: float("-inf")}  # the model would think forever
    messages = [SYSTEM, ChatMessage.user("Weather in Paris?")]
    async with _worker(model_path) as worker:
        free = GenerationParams(max_tokens=60, temperature=1.0, seed=4, thinking=True, max_think_tokens=12,
                                logit_bias={**never_close, **{t: float("-inf") for t in worker.info.eog_token_ids}})
        done = await complete(worker, messages, params=free)
        assert done.opened_think and done.think_closed and done.usage.completion_tokens == 60
        thought, after = done.text.split("\n</think>\n\n", 1)
        assert len(await worker.tokenize(thought)) <= 12 and len(after) > 0  # closed at 12, then it answered
        unlimited = await complete(worker, messages, params=free.model_copy(update={"max_think_tokens": None}))
        assert not unlimited.think_closed and "</think>" not in unlimited.text

        # With the tool grammar: the close is what the grammar allows there, then a call follows.
        tools = GenerationParams(max_tokens=400, temperature=1.0, seed=1, thinking=True, max_think_tokens=6,
                                 logit_bias={**never_close, SPECIAL["<tool_call>"]: 100.0},
                                 tool_grammar=ToolGrammar(require_call=True, max_think_chars=400, max_string_chars=8))
        called = await complete(worker, messages, tools=TOOLS, params=tools)
        assert called.think_closed and called.finish_reason == "tool_calls"
        assert called.reply is not None and called.reply.errors == [] and called.reply.tool_calls
        assert worker.stats.think_closes == 2

        # Through the loop: every step's thought is cut at the run's budget.
        reg = ToolRegistry()

        @reg.tool("lights.set")
        def lights_set(on: bool) -> dict:
            """Turn the lights on or off."""
            return {"on": on}

        model = LlamaAgentModel(worker, tools.model_copy(update={"max_think_tokens": None}))
        result = await run_agent("Lights on.", model=model, tools=reg, ctx=ToolContext(), profile="home",
                                 config=AgentConfig(max_steps=2, thinking=True, max_think_tokens=5))
        raws = [m.raw for m in result.transcript if m.role == "assistant"]
        assert len(raws) == 2
        for raw in raws:
            assert raw is not None and raw.startswith("<think>\n")
            thought = raw[len("<think>\n"):raw.index("</think>")]
            assert len(await worker.tokenize(thought)) <= 5 + 1  # the close's newline may be its own token


# --------------------------------------------------------------------------- the end of a reply


CALL = '<tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n' \
       '<parameter=unit>\\nc\\n</parameter>\\n</function>\\n</tool_call>'


@pytest.mark.anyio
async def test_a_reply_ends_as_soon_as_its_tool_call_is_written(model_path: Path) -> None:
    """The grammar would have the model go on after its call (as a free-running model may);
    the worker, watching the text as it streams, ends the reply at the call instead."""
    messages = [SYSTEM, ChatMessage.user("Weather in Paris?")]
    babble = f'root ::= "{CALL}" " and more" [a-z ]{{40,60}}'
    async with _worker(model_path) as worker:
        params = GenerationParams(max_tokens=400, temperature=0.0, grammar=babble, logit_bias=_steer(model_path))
        on = await complete(worker, messages, tools=TOOLS, params=params.model_copy(update={"call_limit": 1}))
        off = await complete(worker, messages, tools=TOOLS, params=params)
        assert off.text.startswith(on.text) and len(off.text) > len(on.text) + 40  # it would have gone on
        assert on.text.endswith("</tool_call>") and on.finish_reason == "tool_calls"
        assert on.reply is not None and [c.name for c in on.reply.tool_calls] == ["get_weather"]
        assert on.usage.completion_tokens == len(await worker.tokenize(on.text))

        # Streamed: the call's last piece is the last text; nothing after the call was generated.
        pieces: list[str] = []
        async with aclosing(generate(worker, messages, tools=TOOLS,
                                     params=params.model_copy(update={"call_limit": 1}))) as stream:
            async for piece in stream:
                if isinstance(piece, TextDelta):
                    pieces.append(piece.text)
        assert "".join(pieces) == on.text and pieces[-1].endswith("</tool_call>")

        # A call mused about inside the thought does not count; the one after it does.
        musing = (f'root ::= "I could write </tool_call> here." "\\n</think>\\n\\n" "{CALL}" " and more" '
                  f'[a-z ]{{40,60}}')
        thought = await complete(worker, messages, tools=TOOLS, params=params.model_copy(
            update={"call_limit": 1, "grammar": musing, "thinking": True}))
        assert thought.text.endswith("</tool_call>") and thought.text.count("</tool_call>") == 2

    # The reply ends where its state does: the next step continues from it, evaluating none of it.
    async with _worker(model_path) as worker:
        ended = await complete(worker, messages, tools=TOOLS, params=params.model_copy(update={"call_limit": 1}))
        nxt = await complete(worker, _next(messages, ended, '{"temp": 21}'), tools=TOOLS, params=params)
        assert nxt.usage.prompt_tokens_cached == ended.usage.prompt_tokens + ended.usage.completion_tokens


def test_parse_of_an_ended_reply_is_a_complete_call() -> None:
    reply = parse_reply(CALL.replace("\\n", "\n"), TOOLS)
    assert reply.errors == [] and reply.tool_calls == [ToolCall(name="get_weather", arguments={
        "city": "Paris", "unit": "c"}, id=reply.tool_calls[0].id)]
