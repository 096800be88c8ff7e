"""One model split across several homes (issue 35, item 5): real daemons on loopback, each worker
llama.cpp's own RPC server in its child process (node/compute/worker_child.py), the owner's runner
llama.cpp's RPC client, every byte between them on a psymesh stream through the door.

What a user relies on: the split model writes, greedy, exactly what the whole model writes, split
two ways and three, asked locally or by a paired phone's delegated task; `model ps` shows the parts;
a worker that dies mid-generation fails that one job, naming the worker, and the owner serves on
(the next load leaves it out); a revoked worker is left out; and one run across network namespaces.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import anyio
import openai
import pytest

from conftest import pair, run_nodes, serving_openai
from netns import NetnsDaemon, daemons, namespaces  # noqa: F401  (a fixture, used by name)
from waiting import wait_until
from psymesh.agent.runtime.api import ModelCrashed
from psymesh.agent.runtime.testmodel import tiny_model_path
from psymesh.node.control.client import Client
from psymesh.protocol.errors import PsymeshError

pytestmark = pytest.mark.anyio
N = 16
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0.0, "max_tokens": N}
MODEL = {"n_ctx": 512, "n_threads": 1, "keep_alive_s": 0}  # unloaded after each request: each asks its workers again


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny generated model with six layers: enough to split three ways (two each)."""
    return tiny_model_path(tmp_path_factory.getbasetemp() / "models", n_layer=6)


async def lenders(nodes, owner: str, *workers: str, rpc_memory_mb: int = 512) -> list[str]:
    """Each of `workers` lends its compute and grants `owner` compute.rpc; their peer ids."""
    ids = []
    for name in workers:
        worker = nodes[name]
        await worker.worker.start()
        await pair(worker.home.path, nodes[owner].home.path, grant="messaging", grant_back=None)
        async with Client(worker.home.path) as c:
            await c.grant(owner, add=["compute.rpc"], set_limits={"rpc_memory_mb": rpc_memory_mb})
        ids.append(worker.identity.peer_id)
    return ids


async def home_and_laptop(nodes, six_layers: Path):
    """laptop lends to home, which adds `whole` and `two` (split with laptop); and what `whole` writes."""
    home, laptop = nodes["home"], nodes["laptop"]
    [lid] = await lenders(nodes, "home", "laptop")
    home.models.registry.add("whole", six_layers, **MODEL)
    home.models.registry.add("two", six_layers, split=[lid], **MODEL)
    return home, laptop, lid, await greedy(home, "whole")


async def greedy(node, model: str) -> str:
    runner = await node.models.get(model)
    return (await runner.complete(PROMPT, **GREEDY)).text


async def test_a_model_split_two_and_three_ways_writes_what_the_whole_model_writes(tmp_path, six_layers):
    serving_openai(tmp_path / "phone", "phone", "phone")
    async with run_nodes(tmp_path, "home", "laptop", "tablet", "phone", profiles={"phone": "phone"}) as nodes:
        home = nodes["home"]
        laptop, tablet = await lenders(nodes, "home", "laptop", "tablet")
        home.models.registry.add("whole", six_layers, **MODEL)
        home.models.registry.add("two", six_layers, split=[laptop], **MODEL)
        home.models.registry.add("three", six_layers, split=[laptop, tablet], **MODEL)
        whole = await greedy(home, "whole")
        assert len(whole) > 0
        assert await greedy(home, "two") == whole
        assert await greedy(home, "three") == whole
        [three] = [m for m in home.models.ps() if m.name == "three"]
        assert [(s.where, s.layers, s.link) for s in three.shares] == [
            ("this node", 2, "local"), ("laptop", 2, "direct"), ("tablet", 2, "direct")]

        # a paired phone's delegated task runs on the split model like on any other
        await pair(home.home.path, nodes["phone"].home.path, grant="phone")
        async with Client(nodes["phone"].home.path) as phone:
            delegated = {}
            for model in ("whole", "three"):
                task = await phone.delegate("home", infer=[{"role": "user", "content": "Say something."}],
                                            model=model, max_tokens=N, params={"temperature": 0})
                delegated[model] = (await task.result()).text
        assert delegated["three"] == delegated["whole"] != ""
        # and the phone's OpenAI endpoint, streaming home's split model, as an app would
        phone = nodes["phone"]
        assert phone.openai is not None and phone.openai.url is not None
        api = openai.OpenAI(base_url=phone.openai.url + "/v1", api_key=phone.openai.key.value, max_retries=0,
                            timeout=120)
        with anyio.fail_after(120):
            chunks = await anyio.to_thread.run_sync(lambda: list(api.chat.completions.create(
                model="home/three", messages=[{"role": "user", "content": "Say something."}], max_tokens=N,
                temperature=0, stream=True)))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == delegated["whole"]
        async with Client(home.home.path) as c:
            [shown] = [m for m in await c.models_ps() if m.name == "three"]
        assert shown.split == ["laptop", "tablet"] and [s.layers for s in shown.shares] == [2, 2, 2]
        async with Client(nodes["laptop"].home.path) as c:
            status = await c.worker()
        assert status.running and status.isolation == "netns" and status.streams_served >= 2


async def test_a_worker_killed_mid_generation_fails_that_job_naming_it_and_the_owner_serves_on(tmp_path, six_layers):
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop, _, whole = await home_and_laptop(nodes, six_layers)
        runner = await home.models.get("two")
        pieces: list[str] = []
        with pytest.raises(ModelCrashed) as crashed:
            async for piece in runner.generate(PROMPT, temperature=0.0, max_tokens=4000,
                                               logit_bias={t: -100.0 for t in runner.info.eog_token_ids}):
                pieces.append(piece)
                if len(pieces) == 3:
                    os.kill(laptop.worker.view().pid, signal.SIGKILL)  # the worker's RPC server dies
        assert "laptop" in crashed.value.message and crashed.value.details.get("worker")
        assert len(pieces) >= 3  # it was generating
        # the owner serves on: the next load leaves the dead worker out (or it is back: restarted on demand)
        assert await greedy(home, "two") == whole
        assert laptop.worker.view().error or laptop.worker.view().running


async def test_a_revoked_worker_is_left_out_and_wait_makes_the_load_fail_naming_it(tmp_path, six_layers):
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop, lid, whole = await home_and_laptop(nodes, six_layers)
        home.models.registry.add("waits", six_layers, split=[lid], on_worker_loss="wait", **MODEL)
        async with Client(laptop.home.path) as c:
            await c.grant("home", remove=["compute.rpc"])
        assert await greedy(home, "two") == whole  # loaded here alone
        [two] = [m for m in home.models.ps() if m.name == "two"]
        assert [(s.where, s.layers) for s in two.shares] == [("this node", 6), ("laptop", 0)]
        assert two.shares[1].link.startswith("left out:") and "compute.rpc" in two.shares[1].link
        with pytest.raises(PsymeshError) as waits:
            await greedy(home, "waits")
        assert waits.value.code.value == "unavailable" and "laptop" in waits.value.message


async def test_a_model_split_across_network_namespaces_writes_what_the_whole_model_writes(tmp_path, six_layers,
                                                                                        namespaces):
    """The owner (and a phone beside it) in one namespace, the worker in another, joined by a veth
    pair only: the worker's stream crosses a real link, the owner's runner dials its own loopback."""
    here, there = namespaces.add("own"), namespaces.add("lend")
    namespaces.link(here, "10.77.1.1", there, "10.77.1.2")
    owner, phone = NetnsDaemon(here, tmp_path / "owner", "owner"), NetnsDaemon(here, tmp_path / "phone", "phone",
                                                                                 profile="phone")
    worker = NetnsDaemon(there, tmp_path / "worker", "worker")
    async with daemons(owner, phone, worker), worker.client() as w, phone.client() as p:
        assert (await w.worker("start")).running
        await pair(worker.home, owner.home, grant="messaging", grant_back=None)
        await w.grant("owner", add=["compute.rpc"], set_limits={"rpc_memory_mb": 512})
        await pair(owner.home, phone.home, grant="phone")
        for name, split in (("whole", []), ("two", ["--split", "worker"])):
            await anyio.run_process([sys.executable, "-m", "psymesh", "model", "add", name, str(six_layers), "--ctx",
                                     "512", "--home", str(owner.home), *split])
        said = {}
        for model in ("whole", "two"):
            task = await p.delegate("owner", infer=[{"role": "user", "content": "Say something."}], model=model,
                                    max_tokens=N, params={"temperature": 0})
            said[model] = (await task.result()).text
        assert said["two"] == said["whole"] != ""
        async with owner.client() as o:
            [two] = [m for m in await o.models_ps() if m.name == "two"]
        assert [(s.where, s.layers, s.link) for s in two.shares] == [("this node", 3, "local"),
                                                                     ("worker", 3, "direct")]
        status = await w.worker()
        assert status.isolation == "netns" and status.streams_served >= 2
