"""Shared test fixtures. Async tests run on trio through anyio's pytest plugin
(libp2p is trio-native); SDK tests that must prove asyncio support use pytest-asyncio."""
from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import anyio


@contextlib.asynccontextmanager
async def run_nodes(tmp_path: Path, *names: str, profiles: dict[str, str] | None = None,
                    configs: dict[str, dict] | None = None,
                    fsyncs: dict[str, Callable[[int], None]] | None = None,
                    environs: dict[str, Mapping[str, str]] | None = None) -> AsyncIterator[dict]:
    """Run in-process daemons (one per name) under one task group; cancel them all on exit.
    `configs[name]`: config.toml fields to set on that node (as NodeConfig values);
    `fsyncs[name]`: how that node syncs its WAL before a durable answer (default os.fsync);
    `environs[name]`: the environment that node reads (its PATH: which device commands it finds)."""
    from psymesh.node.core.bridgeconfig import UiServe
    from psymesh.node.daemon import Node
    from psymesh.node.core.home import NodeHome

    profiles = profiles or {}
    nodes = {}
    async with anyio.create_task_group() as tg:
        for name in names:
            home = NodeHome(tmp_path / name)
            home.init(profile=profiles.get(name, "home"), name=name)  # type: ignore[arg-type]
            # port 0: a home's dashboard (on by default) must not fight other tests for 8765
            # device "simulated": a phone's tools never drive the machine running the tests (its nmcli...)
            update = {"listen": ["/ip4/127.0.0.1/tcp/0"], "ui": UiServe(port=0), "device": "simulated",
                      **(configs or {}).get(name, {})}
            config = home.load_config().model_copy(update=update)
            node = Node(home, config, **({"fsync": fsyncs[name]} if fsyncs and name in fsyncs else {}),
                        **({"environ": environs[name]} if environs and name in environs else {}))
            await tg.start(node.run)
            nodes[name] = node
        try:
            yield nodes
        finally:
            tg.cancel_scope.cancel()


from psymesh.node.control.process import pair_homes as pair  # noqa: E402  (tests say `pair(home, phone)`)


def serving_openai(path: Path, name: str, profile: str, key_file: Path | None = None) -> None:
    """A node home whose config.toml turns the OpenAI endpoint on (port 0: any free port), before
    run_nodes starts it; `key_file`: its api_key_file (else the key the node makes in its home)."""
    from psymesh.node.core.home import NodeHome

    home = NodeHome(path)
    home.init(profile=profile, name=name)  # type: ignore[arg-type]
    config = home.load_config()
    openai_cfg = config.serve.openai.model_copy(update={"enabled": True, "port": 0,
                                                        "api_key_file": str(key_file) if key_file else None})
    home.save_config(config.model_copy(update={"serve": config.serve.model_copy(update={"openai": openai_cfg})}))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated GGUF in the BotPsy chat format (psymesh.agent.runtime.testmodel), made once per run."""
    from psymesh.agent.runtime.testmodel import tiny_model_path

    return tiny_model_path(tmp_path_factory.getbasetemp() / "models")


@contextlib.asynccontextmanager
async def home_and_phone_daemons(tmp_path: Path, setup_home: Callable[[Path], None]) -> AsyncIterator[tuple]:
    """A home and a phone daemon process (not paired), each in a process of its own, stopped on
    exit; `setup_home(its folder)` runs before home starts (to register its model, say)."""
    from psymesh.node.control.process import DaemonProcess

    home = DaemonProcess(tmp_path / "home", name="home")
    phone = DaemonProcess(tmp_path / "phone", profile="phone", name="phone")
    setup_home(home.home)
    await home.start()
    await phone.start()
    try:
        yield home, phone
    finally:
        await phone.stop()
        await home.stop()


def register_model(home: Path, path: Path, *, name: str, profile: str = "phone", **settings: int) -> None:
    """`psymesh model add` without the subprocess: straight into the node database of `home`."""
    from psymesh.node.core.db import open_db
    from psymesh.node.core.home import NodeHome
    from psymesh.node.models import ModelRegistry

    NodeHome(home).init(profile=profile, name=home.name)  # type: ignore[arg-type]
    config = NodeHome(home).load_config()  # a phone's tools never drive the machine running the tests
    NodeHome(home).save_config(config.model_copy(update={"device": "simulated"}))
    conn = open_db(NodeHome(home).db_path)
    try:
        ModelRegistry(conn).add(name, path, **settings)  # type: ignore[arg-type]
    finally:
        conn.close()
