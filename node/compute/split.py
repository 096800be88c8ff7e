"""Where a split model's layers go, decided each time its runner starts.

A model added with `--split PEER[,PEER...]` runs its first layers on this node's CPU and the
rest on the workers, evenly (llama.cpp offloads the *last* `n_gpu_layers` layers to its RPC
devices, split among them by `tensor_split`). Before each load (the first request, after a
keep-alive exit, after a crash) every worker is asked, all at once, whether it serves us and
with what budget (`rpc.offer` with `probe`). A worker that does not answer, refuses or whose
share would not fit its budget is, by the model's `on_worker_loss`:

    reload   left out: the model loads on the workers that answered (and this node)   default
    wait     the load fails `unavailable`, naming the worker (the owner retries later)

When a runner dies while a worker's link failed, its error names that worker (`blame`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import anyio

from ..models.ggufheader import read_gguf_header
from ..models.runner import Share
from .link import RpcLinks
from ...agent.runtime.api import ModelSettings
from ...protocol.compute import RpcAccept
from ...protocol.errors import ErrorCode, PsymeshError

OnWorkerLoss = Literal["reload", "wait"]
PROBE_TIMEOUT_S = 10.0


def split_layers(n_layers: int, parts: int) -> tuple[int, tuple[float, ...]]:
    """Even shares of `n_layers` over this node and `parts - 1` workers: (layers offloaded to
    the workers, llama.cpp's `tensor_split` among them). This node keeps the remainder."""
    if parts < 2 or n_layers < parts:
        return 0, ()
    each = n_layers // parts
    return each * (parts - 1), tuple(1.0 for _ in range(parts - 1))


def block_count(path: Path) -> int:
    header = read_gguf_header(path)
    count = header.int(f"{header.architecture}.block_count")
    if not count:
        raise PsymeshError(f"{path.name} does not say how many layers it has ({header.architecture}.block_count)",
                           code=ErrorCode.BAD_REQUEST)
    return count


class SplitPlacement:
    """The `Placement` of one split model (node/models/runner.py calls it before each load)."""

    def __init__(self, links: RpcLinks, peers: Sequence[str], *, on_worker_loss: OnWorkerLoss = "reload",
                 label: Callable[[str], str], relayed: Callable[[str], bool | None],
                 clock: Callable[[], float] = time.time) -> None:
        self.links = links
        self.peers = tuple(peers)
        self.on_worker_loss = on_worker_loss
        self.label = label
        self.relayed = relayed
        self.clock = clock
        self._loaded_at = 0.0
        self._shares: tuple[Share, ...] = ()

    async def settings(self, base: ModelSettings) -> ModelSettings:
        answers: dict[str, RpcAccept | PsymeshError] = {}

        async def ask(peer_id: str) -> None:
            try:
                with anyio.fail_after(PROBE_TIMEOUT_S):
                    answers[peer_id] = await self.links.probe(peer_id)
            except TimeoutError:
                answers[peer_id] = PsymeshError(f"{self.label(peer_id)} did not answer within {PROBE_TIMEOUT_S:.0f} s",
                                                code=ErrorCode.UNAVAILABLE)
            except PsymeshError as exc:
                answers[peer_id] = exc

        async with anyio.create_task_group() as tg:
            for peer_id in self.peers:
                tg.start_soon(ask, peer_id)
        n_layers = await anyio.to_thread.run_sync(block_count, base.path)
        size_mb = base.path.stat().st_size / 2**20
        left_out: dict[str, str] = {}
        while True:
            kept = [p for p in self.peers if isinstance(answers[p], RpcAccept) and p not in left_out]
            offloaded, tensor_split = split_layers(n_layers, len(kept) + 1)
            each = offloaded // len(kept) if kept else 0
            too_small = [p for p in kept if (b := answers[p].memory_mb) is not None  # type: ignore[union-attr]
                         and size_mb * each / n_layers > b]
            if not too_small:
                break
            for p in too_small:
                left_out[p] = (f"its budget ({answers[p].memory_mb} MB) is less than its share of "  # type: ignore[union-attr]
                               f"{base.path.name} (about {size_mb * each / n_layers:.0f} MB)")
        for p in self.peers:
            answer = answers[p]
            if isinstance(answer, PsymeshError):
                left_out.setdefault(p, answer.message)
        if left_out and self.on_worker_loss == "wait":
            p, why = next(iter(left_out.items()))
            raise PsymeshError(f"worker {self.label(p)} of split model {base.path.name} is unavailable: {why}",
                               code=ErrorCode.UNAVAILABLE, details={"worker": p})
        endpoints = [await self.links.endpoint(p) for p in kept]
        self._loaded_at = self.clock()
        local = n_layers - offloaded
        shares = [Share("this node", None, local, None, "local")]
        for p in self.peers:
            if p in kept:
                answer = answers[p]
                assert isinstance(answer, RpcAccept)
                how = self.relayed(p)
                shares.append(Share(self.label(p), p, each, answer.memory_mb,
                                    "relayed" if how else "direct" if how is not None else "connected"))
            else:
                shares.append(Share(self.label(p), p, 0, None, f"left out: {left_out[p]}"))
        self._shares = tuple(shares)
        return base.model_copy(update={"rpc_servers": tuple(endpoints), "n_gpu_layers": offloaded,
                                       "tensor_split": tensor_split})

    def blame(self) -> str | None:
        return self.links.blame(self.peers, since=self._loaded_at)

    def shares(self) -> tuple[Share, ...]:
        return self._shares
