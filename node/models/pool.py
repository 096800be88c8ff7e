"""ModelPool: the node's models by name, each a ModelRunner (its own process), made on
first use and stopped with the node.

The pool holds the handles; each handle starts its process when a request needs it and
the process leaves after its keep-alive, so a model that nobody uses costs the node
nothing but this entry. `ps()` is what `psymesh model ps` shows.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio

from ...protocol.errors import ErrorCode, PsymeshError

from .registry import ModelRegistry, ModelSettings
from .runner import ModelRunner, Placement, RunnerStatus

PlacementFor = Callable[[str, tuple[str, ...], str], Placement]  # (model, its workers, on_worker_loss)


class ModelPool:
    def __init__(self, registry: ModelRegistry, *, keep_alive_s: float | None = 300.0,
                 memory_limit_mb: int | None = None, log_dir: Path | None = None,
                 placement_for: PlacementFor | None = None,
                 split_of: Callable[[str], tuple[tuple[str, ...], str]] | None = None) -> None:
        self.registry = registry
        # a model's workers and on_worker_loss: config.toml's [models.NAME] over the registry's (the daemon's)
        self.split_of = split_of or registry.split_of
        self.placement_for = placement_for  # a split model's workers (node/compute/split.py, from the daemon)
        self._splits: dict[str, tuple[tuple[str, ...], str]] = {}
        self.keep_alive_s = keep_alive_s
        self.memory_limit_mb = memory_limit_mb
        self.log_dir = log_dir
        self._runners: dict[str, ModelRunner] = {}
        self._lock = anyio.Lock()

    def settings(self, name: str) -> ModelSettings:
        """How `name` loads here: its registry entry with this node's keep-alive and memory cap."""
        return self.registry.settings(name, keep_alive_s=self.keep_alive_s, memory_limit_mb=self.memory_limit_mb)

    async def get(self, name: str) -> ModelRunner:
        """The runner of `name`, loaded (ModelLoadError / ModelCrashed if it cannot be)."""
        async with self._lock:  # two first requests must not make two handles for one model
            settings = self.settings(name)
            split = self.split_of(name)
            runner = self._runners.get(name)
            if runner is not None and (runner.settings != settings or self._splits.get(name) != split):
                del self._runners[name]  # the registry entry changed: reload
                await runner.aclose()
                runner = None
            if runner is None:
                log = self.log_dir / f"model-{name}.log" if self.log_dir is not None else None
                workers, on_loss = split
                if workers and self.placement_for is None:
                    raise PsymeshError(f"model {name} is split across other nodes; this process cannot reach them",
                                       code=ErrorCode.UNAVAILABLE)
                placement = self.placement_for(name, workers, on_loss) if workers and self.placement_for else None
                runner = self._runners[name] = ModelRunner(settings, name=name, log_path=log, placement=placement)
                self._splits[name] = split
        await runner.start()  # outside the pool's lock: loading one model does not hold up another
        return runner

    def ps(self) -> list[RunnerStatus]:
        return [r.status() for _, r in sorted(self._runners.items())]

    async def aclose(self) -> None:
        runners, self._runners = list(self._runners.values()), {}
        for r in runners:
            await r.aclose()
