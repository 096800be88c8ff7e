"""ModelPool: the node's models by name, each a ModelRunner (its own process), made on
first use and stopped with the node.

The pool holds the handles; each handle starts its process when a request needs it and
the process leaves after its keep-alive, so a model that nobody uses costs the node
nothing but this entry. `ps()` is what `psymesh model ps` shows.
"""
from __future__ import annotations

from pathlib import Path

import anyio

from .registry import ModelRegistry, ModelSettings
from .runner import ModelRunner, RunnerStatus


class ModelPool:
    def __init__(self, registry: ModelRegistry, *, keep_alive_s: float | None = 300.0,
                 memory_limit_mb: int | None = None, log_dir: Path | None = None) -> None:
        self.registry = registry
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
            runner = self._runners.get(name)
            if runner is not None and runner.settings != settings:  # the registry entry changed: reload
                del self._runners[name]
                await runner.aclose()
                runner = None
            if runner is None:
                log = self.log_dir / f"model-{name}.log" if self.log_dir is not None else None
                runner = self._runners[name] = ModelRunner(settings, name=name, log_path=log)
        await runner.start()  # outside the pool's lock: loading one model does not hold up another
        return runner

    def ps(self) -> list[RunnerStatus]:
        return [r.status() for _, r in sorted(self._runners.items())]

    async def aclose(self) -> None:
        runners, self._runners = list(self._runners.values()), {}
        for r in runners:
            await r.aclose()
