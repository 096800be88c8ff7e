"""The real-model tier: SmolLM2-135M-Instruct (a real Q4_1 GGUF with its own chat template), where
every other model test runs on random weights.

What a user of a real model relies on, each against bare llama-cpp-python on the same file, the
same prompt and the same threads, greedy: the text the local runner writes, the text a paired home
writes for a delegated infer task (two daemons talking libp2p), and the text the OpenAI endpoint
returns (real HTTP, the official client, whole and streamed, of this node's model and of the
home's), are the bare run's, token for token; and a multi-turn chat that continues from the state
the runner kept writes the very tokens a runner evaluating every prompt from scratch writes.

The file comes from scripts/bootstrap.sh (psymesh.agent.runtime.realmodel); without it these tests skip
and say why. Replies are short (the tier's wall time is the suite's) and one thread each, so the
two ends of a comparison never fight over the cores.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from conftest import pair, run_nodes, serving_openai
from psymesh.agent.formats.chatformat import ChatMessage, render_prompt
from psymesh.agent.runtime.generate import Generation, GenerationParams, complete
from psymesh.agent.runtime.api import ModelSettings
from psymesh.agent.runtime.realmodel import missing_reason, real_model_path
from psymesh.agent.runtime.worker import ModelWorker
from psymesh.node.control.client import Client
from psymesh.node.core.home import NodeHome
from psymesh.node.daemon import Node
from psymesh.node.models import ModelRegistry, ModelRunner
from psymesh.node.core.db import open_db

pytestmark = pytest.mark.realmodel

QUESTION = "Which city is the capital of France?"  # SmolLM2 answers this one: "The capital of France is Paris."
N = 12          # tokens a reply may take: enough to tell two runs apart, cheap at one thread
N_CTX = 2048
GREEDY = {"temperature": 0}


@pytest.fixture(scope="session")
def real_model() -> Path:
    path = real_model_path()
    if path is None:
        pytest.skip(missing_reason())
    return path


def _settings(path: Path, **kw: Any) -> ModelSettings:
    return ModelSettings(path=path, n_ctx=N_CTX, n_threads=1, keep_alive_s=None, **kw)


def bare_greedy(path: Path, prompt: str, n: int) -> tuple[str, int]:
    """(text, tokens) of bare llama-cpp-python's greedy continuation of `prompt`: its own
    `Llama.generate`, the prompt tokenized as llama.cpp's tokenizer says (BOS if the vocabulary
    wants one, special tokens parsed), stopping at an end-of-generation token or after `n`."""
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        tokens = llm.tokenize(prompt.encode(), add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)), special=True)
        out: list[int] = []
        for token in llm.generate(tokens, temp=0.0):
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            out.append(token)
            if len(out) == n:
                break
        return llm.detokenize(out).decode("utf-8"), len(out)
    finally:
        llm.close()


def _prompt(path: Path, messages: Sequence[ChatMessage]) -> str:
    """The prompt psymesh renders for `messages` with the GGUF's own chat template."""
    from psymesh.node.models.ggufheader import read_gguf_header

    template = read_gguf_header(path).str("tokenizer.chat_template")
    assert template and "<|im_start|>" in template  # SmolLM2's own ChatML template, not a built-in one
    return render_prompt(messages, (), thinking=False, template=template)


@pytest.fixture(scope="module")
def expected(real_model: Path) -> tuple[str, int]:
    """The bare run every path is compared with."""
    text, n = bare_greedy(real_model, _prompt(real_model, [ChatMessage.user(QUESTION)]), N)
    assert text.startswith("The capital of France is Paris"), text  # real words, not noise
    return text, n


@pytest.mark.anyio
async def test_the_local_runner_writes_what_bare_llama_cpp_writes(real_model: Path,
                                                                  expected: tuple[str, int]) -> None:
    async with ModelRunner(_settings(real_model)) as runner:
        assert runner.chat_template and "SmolLM" in runner.chat_template  # the GGUF's template is the one used
        done = await complete(runner, [ChatMessage.user(QUESTION)], params=GenerationParams(max_tokens=N, **GREEDY))
    assert (done.text, done.usage.completion_tokens) == expected
    assert done.finish_reason == ("length" if expected[1] == N else "stop")


@asynccontextmanager
async def mesh(tmp_path: Path, model: Path) -> AsyncIterator[dict[str, Node]]:
    """home and phone (two daemons, libp2p on 127.0.0.1), paired with the phone preset; both have
    the model as `smol`; the phone serves the OpenAI endpoint."""
    serving_openai(tmp_path / "phone", "phone", "phone")
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        for node in nodes.values():
            node.models.registry.add("smol", model, n_ctx=N_CTX, n_threads=1)
        yield nodes


@pytest.mark.anyio
async def test_delegation_and_the_openai_endpoint_write_what_bare_llama_cpp_writes(
        tmp_path: Path, real_model: Path, expected: tuple[str, int]) -> None:
    async with mesh(tmp_path, real_model) as nodes:
        phone = nodes["phone"]
        async with Client(phone.home.path) as client:
            task = await client.delegate("home", infer=QUESTION, model="smol", max_tokens=N, params=GREEDY)
            streamed = [ev.data["text"] async for ev in task.events() if ev.kind.value == "token"]
            delegated = await task.result()
        assert phone.openai is not None and phone.openai.url is not None
        api = openai.OpenAI(base_url=phone.openai.url + "/v1", api_key=phone.openai.key.value, max_retries=0,
                            timeout=120)

        def ask(model: str, **kw: Any) -> Any:
            return api.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=N, temperature=0, **kw)

        with anyio.fail_after(180):
            local = await anyio.to_thread.run_sync(lambda: ask("smol"))
            chunks = await anyio.to_thread.run_sync(lambda: list(ask("home/smol", stream=True,
                                                                     stream_options={"include_usage": True})))

    text, n = expected
    assert (delegated.text, delegated.usage.completion_tokens) == (text, n)   # home's runner, over libp2p
    assert "".join(streamed) == text and len(streamed) > 1                              # streamed as it was written
    assert (local.choices[0].message.content, local.usage.completion_tokens) == (text, n)  # this node, over HTTP
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == text and len([p for p in pieces if p]) > 1                # home's, through the phone
    assert chunks[-1].usage.completion_tokens == n


@pytest.mark.anyio
async def test_a_tools_request_to_a_model_whose_template_has_none_is_unsupported(tmp_path: Path,
                                                                                 real_model: Path) -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}
    async with mesh(tmp_path, real_model) as nodes:
        phone = nodes["phone"]
        assert phone.openai is not None and phone.openai.url is not None
        api = openai.OpenAI(base_url=phone.openai.url + "/v1", api_key=phone.openai.key.value, max_retries=0,
                            timeout=120)
        with pytest.raises(openai.BadRequestError) as refused:
            await anyio.to_thread.run_sync(lambda: api.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": QUESTION}], tools=[weather], max_tokens=N))
    assert refused.value.code == "unsupported"


TURNS = (QUESTION, "And of Italy?", "Which of the two is larger?")


async def _chat(worker: ModelWorker) -> list[Generation]:
    """Three turns, each reply kept in the history as the model wrote it."""
    history: list[ChatMessage] = []
    replies = []
    for question in TURNS:
        history.append(ChatMessage.user(question))
        done = await complete(worker, history, params=GenerationParams(max_tokens=N, **GREEDY))
        replies.append(done)
        history.append(ChatMessage.assistant(done.text))
    return replies


@pytest.mark.anyio
async def test_state_reuse_over_a_multi_turn_chat_changes_no_token(real_model: Path) -> None:
    """Each turn after the first continues from the state the worker kept (its prompt and reply
    evaluated once), and writes what a worker evaluating every prompt from scratch writes. Asked
    again with another second question, it cuts its context back to what the two share (SmolLM2
    has no recurrent layers) and still writes what a fresh evaluation does; no state is copied."""
    params = GenerationParams(max_tokens=N, **GREEDY)
    async with ModelWorker(_settings(real_model)) as warm_worker:
        warm = await _chat(warm_worker)
        other = [ChatMessage.user(QUESTION), ChatMessage.assistant(warm[0].text), ChatMessage.user("And of Spain?")]
        again = await complete(warm_worker, other, params=params)
        stats = warm_worker.stats
    async with ModelWorker(_settings(real_model, reuse=False)) as cold_worker:
        cold = await _chat(cold_worker)
        fresh = await complete(cold_worker, other, params=params)
    assert [w.text for w in warm] == [c.text for c in cold]
    assert [w.usage.completion_tokens for w in warm] == [c.usage.completion_tokens for c in cold]
    assert all(c.usage.prompt_tokens_cached == 0 for c in cold)
    for before, after in zip(warm, warm[1:]):  # all of the last prompt and reply, but the reply's last token
        assert after.usage.prompt_tokens_cached >= before.usage.prompt_tokens + before.usage.completion_tokens - 1
    assert warm[-1].usage.prompt_tokens_evaluated < warm[-1].usage.prompt_tokens // 4
    assert again.text == fresh.text and again.usage.prompt_tokens_cached > warm[0].usage.prompt_tokens
    assert (stats.misses, stats.continuation_hits, stats.snapshots_saved) == (1, 3, 0)


def test_model_add_reads_the_real_gguf_in_well_under_a_second(tmp_path: Path, real_model: Path) -> None:
    """It read the whole 98 MB through gguf.GGUFReader twice: 4.7 s. Now its header only."""
    home = NodeHome(tmp_path / "h")
    home.init()
    registry = ModelRegistry(open_db(home.db_path))
    start = time.perf_counter()
    row = registry.add("smol", real_model)
    took = time.perf_counter() - start
    assert row["n_ctx"] == 8192  # what SmolLM2's header declares (llama.context_length)
    assert took < 1.0, f"model add took {took:.2f} s"
