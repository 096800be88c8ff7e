"""A model that cannot call tools says so, everywhere (issue 33, item 2).

A generated tiny GGUF carries SmolLM2-135M-Instruct's real chat template, which has no tool
section (family "none", agent/formats/families.py). A request with tools to it must fail with
`unsupported` and a message naming the model and what to do, never come back as an answer
invented without the tools with exit status 0: through `psymesh agent run` (and `--no-tools`
runs it), `model add`/`model list`, the OpenAI endpoint over real HTTP (400, OpenAI's error
format), an `msg ask` between two nodes, `eval` and `eval --bfcl`, and a delegated agent task between
two real daemons.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from conftest import home_and_phone_daemons, pair, register_model, run_nodes
from psymesh.agent.runtime.testmodel import tiny_model_path
from psymesh.node.core.home import NodeHome
from psymesh.node.control.client import Client

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent
MODEL = {"n_ctx": 8192, "n_threads": 1}
SMOLLM2 = (Path(__file__).parent / "data" / "templates" / "smollm2-135m-instruct.jinja").read_text(encoding="utf-8")
KEY = "sk-test-psymesh-0123456789"


@pytest.fixture(scope="module")
def chat_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory.getbasetemp() / "models", chat_template=SMOLLM2)


async def _cli(home: Path, *args: str) -> tuple[int, str, str]:
    done = await anyio.run_process([sys.executable, "-m", "psymesh", *args, "--home", str(home)], check=False,
                                   cwd=REPO)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def _register(home: Path, path: Path, profile: str) -> None:
    register_model(home, path, name="smol", profile=profile, **MODEL)


def _unsupported(out: str, model_file: str) -> None:
    error = json.loads(out)["error"]
    assert error["code"] == "unsupported", error
    assert model_file in error["message"] and "--no-tools" in error["message"]


async def test_agent_run_refuses_a_model_without_tools(tmp_path: Path, chat_only: Path) -> None:
    home = tmp_path / "phone"
    NodeHome(home).init(profile="phone", name="phone")
    rc, out, err = await _cli(home, "model", "add", "smol", str(chat_only), "--ctx", "8192")
    assert rc == 0, err
    assert "cannot call tools" in err and "--no-tools" in err  # said when it is added
    rc, out, err = await _cli(home, "model", "list", "--json")
    assert [(m["name"], m["tool_family"]) for m in json.loads(out)] == [("smol", "none")]

    goal = ["agent", "run", "How much disk space is free?", "--model", "smol", "--delegate", "never",
            "--ban-bytes", "--seed", "1", "--max-steps", "1", "--json"]
    rc, out, err = await _cli(home, *goal)
    assert rc == 1 and "Traceback" not in err, err
    _unsupported(out, chat_only.name)

    rc, out, err = await _cli(home, *goal, "--no-tools")  # asked without tools, it is a chat model
    assert rc == 0, err
    result = json.loads(out)
    assert result["tool_calls"] == [] and result["where"] == "local"


async def test_openai_endpoint_answers_400_unsupported(tmp_path: Path, chat_only: Path) -> None:
    home = NodeHome(tmp_path / "home")
    home.init(profile="home", name="home")
    key_file = tmp_path / "openai.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    config = home.load_config()
    openai_cfg = config.serve.openai.model_copy(update={"enabled": True, "port": 0, "api_key_file": str(key_file)})
    home.save_config(config.model_copy(update={"serve": config.serve.model_copy(update={"openai": openai_cfg})}))
    tool = {"type": "function", "function": {"name": "disk_free", "description": "Free disk space.",
                                             "parameters": {"type": "object", "properties": {}}}}
    ask = {"model": "smol", "messages": [{"role": "user", "content": "How much disk space is free?"}],
           "max_tokens": 8, "ban_bytes": True}
    async with run_nodes(tmp_path, "home") as nodes:
        node = nodes["home"]
        node.models.registry.add("smol", chat_only, **MODEL)
        assert node.openai is not None and node.openai.url is not None
        async with httpx.AsyncClient(base_url=node.openai.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as http:
            refused = await http.post("/v1/chat/completions", json={**ask, "tools": [tool]})
            plain = await http.post("/v1/chat/completions", json=ask)
            forced = await http.post("/v1/chat/completions", json={**ask, "tools": [tool], "tool_choice": "required"})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "unsupported" and error["param"] == "tools"
    assert error["type"] == "invalid_request_error" and chat_only.name in error["message"]
    assert forced.status_code == 400 and forced.json()["error"]["code"] == "unsupported"
    assert plain.status_code == 200, plain.text  # without tools it answers


async def test_an_ask_of_a_chat_only_model_is_answered_unsupported(tmp_path: Path, chat_only: Path) -> None:
    """`msg ask` between two nodes: the answer letter says unsupported (the CLI then exits 1 with
    it); asked with params tools: false, the model answers. An A2A message takes the same run."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        nodes["home"].models.registry.add("smol", chat_only, **MODEL)
        async with Client(nodes["phone"].home.path) as phone:
            refused = await phone.ask("home", "How much disk space is free?",
                                      params={"ban_bytes": True, "max_steps": 1}, timeout=120)
            plain = await phone.ask("home", "Hello", params={"ban_bytes": True, "max_steps": 1, "tools": False,
                                                             "max_tokens": 8}, timeout=120)
    assert refused.body["ok"] is False and refused.body["error"]["code"] == "unsupported"
    assert chat_only.name in refused.text and "--no-tools" in refused.text
    assert plain.body["ok"] is True and plain.body["tool_calls"] == []


async def test_a_delegated_agent_task_to_a_chat_only_model_is_unsupported(tmp_path: Path, chat_only: Path) -> None:
    async with home_and_phone_daemons(tmp_path, lambda h: _register(h, chat_only, profile="home")) as (home, phone):
        await pair(home.home, phone.home, grant="phone")
        goal = ["agent", "run", "How much disk space is free?", "--delegate", "always", "--ban-bytes",
                "--seed", "1", "--max-steps", "1", "--json"]
        rc, out, err = await _cli(phone.home, *goal)
        assert rc == 1 and "Traceback" not in err, err
        _unsupported(out, chat_only.name)
        rc, out, err = await _cli(phone.home, *goal, "--no-tools")
        assert rc == 0, err
        assert json.loads(out)["where"] == "remote"
        rc, out, err = await _cli(home.home, "model", "ps", "--json")  # loaded now: the runner's own detection
        assert rc == 0, err
        assert [(m["name"], m["loaded"], m["tool_family"]) for m in json.loads(out)] == [("smol", True, "none")]


async def test_eval_reports_every_category_not_run(tmp_path: Path, chat_only: Path) -> None:
    home = tmp_path / "home"
    _register(home, chat_only, profile="home")
    rc, out, err = await _cli(home, "eval", str(REPO / "examples" / "eval_cases.jsonl"), "--model", "smol",
                              "--ban-bytes", "--json")
    assert rc == 1 and "Traceback" not in err, err
    _unsupported(out, chat_only.name)
    not_run = json.loads(out)["error"]["not_run"]
    from psymesh.agent.evaluation.suite import load_cases

    assert set(not_run) == {c.category for c in load_cases(REPO / "examples" / "eval_cases.jsonl")}
    assert all("cannot call tools" in why for why in not_run.values())


async def test_bfcl_reports_the_category_not_run(tmp_path: Path, chat_only: Path) -> None:
    home = tmp_path / "home"
    _register(home, chat_only, profile="home")
    rc, out, err = await _cli(home, "eval", "--bfcl", "--model", "smol", "--category", "simple_python",
                              "--limit", "1", "--ban-bytes", "--json")
    assert rc == 1 and "Traceback" not in err, err
    _unsupported(out, chat_only.name)
    assert list(json.loads(out)["error"]["not_run"]) == ["simple_python"]


async def test_a_run_without_a_named_model_takes_one_that_can_call_tools(tmp_path: Path, chat_only: Path,
                                                                         tiny_model: Path) -> None:
    """SmolLM2 added beside the tool-calling model ("smol" sorts first) does not take the agent's runs."""
    async with run_nodes(tmp_path, "home") as nodes:
        node = nodes["home"]
        node.models.registry.add("smol", chat_only, **MODEL)
        node.models.registry.add("tiny", tiny_model, **MODEL)
        done = await node.agents.run("Show system info.", {"ban_bytes": True, "max_steps": 1, "max_tokens": 16},
                                     peer_id=node.identity.peer_id, deadline=None)
        assert done["stopped"] in ("final", "max_steps")
        plain = await node.agents.run("Hello", {"ban_bytes": True, "max_steps": 1, "tools": False, "max_tokens": 8},
                                      peer_id=node.identity.peer_id, deadline=None)
        assert plain["tool_calls"] == []
