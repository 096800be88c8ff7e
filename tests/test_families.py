"""Tool calling by template family (agent/formats/families.py), on real templates and real llama.cpp.

Each family gets a generated tiny GGUF carrying a real model's chat template
(tests/data/templates/, sources in its README) and that model's special tokens. Through the
real llama-cpp-python the test proves: the family is detected from the GGUF, the tools are
rendered the way that template renders them, a grammar-forced reply of the random-weight
model is a well-formed call of that family, the family's parser reads it back, and the call
and its result render back through the template. A template without a tool section (SmolLM2's)
is family "none", and a request with tools to it fails with `unsupported`.

The parser corpus (tests/data/replies/families/) holds replies in each family's format,
malformed ones included: parsing never raises.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from psymesh.agent.formats.chatformat import ChatMessage, ToolCall, ToolSpec, render_prompt
from psymesh.agent.formats.families import FAMILIES, FAMILY_TOKENS, ToolFamily, ToolsUnsupported, detect_family
from psymesh.agent.runtime.generate import GenerationParams, ToolGrammar, complete
from psymesh.agent.runtime.api import ModelSettings
from psymesh.agent.runtime.worker import ModelWorker
from psymesh.agent.runtime.testmodel import tiny_model_path
from psymesh.protocol.errors import ErrorCode

pytestmark = pytest.mark.anyio

DATA = Path(__file__).parent / "data"
TEMPLATES = DATA / "templates"
CORPUS = DATA / "replies" / "families"

TOOLS = [
    ToolSpec(name="get_weather", description="Current weather for a city.", parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name"},
                       "unit": {"type": "string", "enum": ["c", "f"], "description": "Unit"},
                       "days": {"type": "integer", "minimum": 1, "description": "Days ahead"}},
        "required": ["city", "unit"]}),
    ToolSpec(name="set_alarm", description="Set an alarm.", parameters={
        "type": "object", "properties": {"time": {"type": "string", "description": "HH:MM"}}, "required": ["time"]}),
]
CHAT = [ChatMessage.system("You are a phone agent."), ChatMessage.user("Weather in Paris?")]

# (template file, vocabulary family, expected family, how the template shows the tools, how a call starts)
CASES = {
    "qwen35": ("../qwen35_chat_template.jinja", None, ToolFamily.QWEN35, "<tools>", "<tool_call>\n<function="),
    "qwen3": ("qwen3.jinja", None, ToolFamily.HERMES, "<tools>", '<tool_call>\n{'),
    "hermes3": ("hermes-3-llama-3.1-tool_use.jinja", None, ToolFamily.HERMES, "Here are the available tools",
                '<tool_call>\n{'),
    "llama32": ("llama-3.2-3b-instruct.jinja", "llama3", ToolFamily.LLAMA3, "Given the following functions",
                '{'),
    "mistral03": ("mistral-7b-instruct-v0.3.jinja", "mistral", ToolFamily.MISTRAL, "[AVAILABLE_TOOLS]",
                  '[TOOL_CALLS] ['),
}


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.getbasetemp() / "models"
    out = {name: tiny_model_path(cache, chat_template=_template(t), family=vocab)
           for name, (t, vocab, *_rest) in CASES.items()}
    out["smollm2"] = tiny_model_path(cache, chat_template=_template("smollm2-135m-instruct.jinja"))
    return out


def _worker(path: Path) -> ModelWorker:
    return ModelWorker(ModelSettings(path=path, n_ctx=4096, n_threads=1))


@pytest.mark.parametrize("case", sorted(CASES))
async def test_family_detect_render_grammar_parse(models: dict[str, Path], case: str) -> None:
    _, _, family, tools_shown, call_start = CASES[case]
    async with _worker(models[case]) as worker:
        assert worker.info.tool_family == family  # detected from the GGUF's template and tokens
        prompt = render_prompt(CHAT, TOOLS, thinking=False, template=worker.chat_template, family=family)
        assert tools_shown in prompt and "get_weather" in prompt and "set_alarm" in prompt
        if case != "hermes3":  # Hermes 3's tool_use template is for requests with tools only
            assert prompt != render_prompt(CHAT, (), thinking=False, template=worker.chat_template, family=family)

        seen = set()
        for seed in range(3):  # random weights, a forced call: each a well-formed call of this family
            params = GenerationParams(max_tokens=200, temperature=1.0, seed=seed, ban_bytes=True,
                                      tool_grammar=ToolGrammar(require_call=True, max_string_chars=12))
            done = await complete(worker, CHAT, tools=TOOLS, params=params)
            assert done.text.lstrip().startswith(call_start.strip()), done.text
            assert done.reply is not None and not done.reply.errors, (done.text, done.reply.errors)
            [call] = done.reply.tool_calls
            assert call.name in {"get_weather", "set_alarm"}
            if call.name == "get_weather":
                assert isinstance(call.arguments["city"], str) and call.arguments["unit"] in ("c", "f")
            seen.add(call.name)
            assert FAMILIES[family].parse(done.text, TOOLS).tool_calls[0].arguments == call.arguments

            # The call and its result go back through the template (Mistral's wants 9-character ids).
            history = [*CHAT, done.reply.to_message(raw=done.raw), ChatMessage.tool(call, '{"ok": true}')]
            again = render_prompt(history, TOOLS, thinking=False, template=worker.chat_template, family=family)
            assert call.name in again.split("Weather in Paris?", 1)[1]
            assert '"ok' in again.rsplit(call.name, 1)[1]  # the result (Llama's template JSON-encodes it again)


async def test_a_template_without_tools_is_unsupported(models: dict[str, Path]) -> None:
    async with _worker(models["smollm2"]) as worker:
        assert worker.info.tool_family == ToolFamily.NONE
        with pytest.raises(ToolsUnsupported) as err:
            await complete(worker, CHAT, tools=TOOLS, params=GenerationParams(max_tokens=8, ban_bytes=True))
        assert err.value.code == ErrorCode.UNSUPPORTED
        assert models["smollm2"].name in err.value.message and "--no-tools" in err.value.message
        # Without tools it is an ordinary chat model.
        done = await complete(worker, CHAT, params=GenerationParams(max_tokens=8, ban_bytes=True, seed=1))
        assert done.usage.completion_tokens > 0


def test_detection_follows_llama_cpp() -> None:
    assert detect_family(None, FAMILY_TOKENS) == ToolFamily.QWEN35  # the built-in Qwen3.5 renderer
    assert detect_family(None, ()) == ToolFamily.NONE  # no template, no <tool_call> token: nothing to call with
    assert detect_family(_template("smollm2-135m-instruct.jinja"), FAMILY_TOKENS) == ToolFamily.NONE
    assert detect_family(_template("../qwen35_chat_template.jinja"), ()) == ToolFamily.QWEN35
    assert detect_family(_template("qwen3.jinja"), ()) == ToolFamily.HERMES
    assert detect_family(_template("hermes-3-llama-3.1-tool_use.jinja"), ()) == ToolFamily.HERMES
    assert detect_family(_template("llama-3.2-3b-instruct.jinja"), ()) == ToolFamily.LLAMA3
    assert detect_family(_template("mistral-7b-instruct-v0.3.jinja"), ()) == ToolFamily.MISTRAL


def _corpus() -> list[str]:
    return sorted(p.stem for p in CORPUS.glob("*.txt"))


def test_corpus_covers_each_family() -> None:
    families = {json.loads((CORPUS / f"{n}.json").read_text())["family"] for n in _corpus()}
    assert families == {"qwen35", "hermes", "llama3", "mistral"}
    assert len(_corpus()) >= 20


@pytest.mark.parametrize("name", _corpus())
def test_family_reply_corpus(name: str) -> None:
    text = (CORPUS / f"{name}.txt").read_text(encoding="utf-8")
    want: dict[str, Any] = json.loads((CORPUS / f"{name}.json").read_text(encoding="utf-8"))
    got = FAMILIES[ToolFamily(want["family"])].parse(text, TOOLS, in_think=False)
    assert got.content == want["content"]
    assert [(c.name, c.arguments) for c in got.tool_calls] == [(c["name"], c["arguments"]) for c in want["tool_calls"]]
    assert len(got.errors) == len(want["errors"]), got.errors
    for fragment, error in zip(want["errors"], got.errors):
        assert fragment in error


@pytest.mark.parametrize("family", [f for f in ToolFamily])
@pytest.mark.parametrize("text", ["", "{", "[TOOL_CALLS]", "[TOOL_CALLS] [1, 2]", "<|python_tag|>", "{\"name\": 3}",
                                  "<tool_call>{\"name\": \"x\"", "\x00\ufffd", "[TOOL_CALLS]x[ARGS][]", "{" * 5000,
                                  "{\"name\": \"set_alarm\", \"parameters\": \"{bad\"}"])
def test_parse_never_raises(family: ToolFamily, text: str) -> None:
    FAMILIES[family].parse(text, TOOLS, in_think=False)
    FAMILIES[family].parse(text, None, in_think=True)


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    fmt = FAMILIES[ToolFamily.MISTRAL]
    call = ToolCall(name="set_alarm", arguments={"time": "07:00"})
    spelled = fmt.call_id(call.id)
    assert len(spelled) == 9 and spelled.isalnum() and spelled == fmt.call_id(call.id)


@pytest.mark.parametrize("reply", ['Sure. [TOOL_CALLS] [{"name": "set_alarm", "arguments": {}}]',
                                   'Sure. <|python_tag|>{"name": "set_alarm", "parameters": {}}',
                                   'Sure. <tool_call>\n{"name": "set_alarm", "arguments": {}}\n</tool_call>'])
def test_a_streamed_call_is_held_back_in_any_family(reply: str) -> None:
    from psymesh.node.bridges.openai import VisibleText

    visible = VisibleText(hide_calls=True)
    shown = "".join(visible.feed(reply[i:i + 3]) for i in range(0, len(reply), 3)) + visible.flush()
    assert shown == "Sure. "


def test_an_observation_without_a_call_renders_for_mistral() -> None:
    """The loop answers a malformed reply with a tool turn that answers no call; Mistral's
    template refuses a result without a call id and two assistant turns in a row, so the
    family shows that turn as the user's."""
    history = [*CHAT, ChatMessage.assistant('[TOOL_CALLS] [{"name": '), ChatMessage(role="tool", content="bad call"),
               ChatMessage.assistant("Sorry.")]
    prompt = render_prompt(history, TOOLS, thinking=False, template=_template("mistral-7b-instruct-v0.3.jinja"),
                           family=ToolFamily.MISTRAL)
    assert "[INST] bad call[/INST] Sorry.</s>" in prompt


async def test_a_peer_model_is_read_by_its_family(tmp_path: Path, models: dict[str, Path]) -> None:
    """`eval --via`: the peer builds the grammar for its own model (params.tool_grammar), and its
    result names the family, so the asker reads the reply with the right parser."""
    from conftest import pair, run_nodes
    from psymesh.node.control.client import Client
    from psymesh.node.control.delegated_model import DelegatedModel

    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        nodes["home"].models.registry.add("llama", models["llama32"], n_ctx=4096, n_threads=1)
        async with Client(nodes["phone"].home.path) as phone:
            model = DelegatedModel(phone, "home", "llama", GenerationParams(
                max_tokens=200, temperature=1.0, seed=1, ban_bytes=True,
                tool_grammar=ToolGrammar(require_call=True, max_string_chars=12)), deadline_s=120)
            text = await model.reply(CHAT, TOOLS)
    assert model.family.family == ToolFamily.LLAMA3
    reply = model.family.parse(text, TOOLS)
    assert not reply.errors and len(reply.tool_calls) == 1, text
