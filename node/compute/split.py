"""Where a split model's layers go, decided each time its runner starts.

A model added with `--split PEER[,PEER...]` runs its first layers on this node's CPU and the
rest on the workers, evenly (llama.cpp offloads the *last* `n_gpu_layers` layers to its RPC
devices, split among them by `tensor_split`; agent/runtime/rpc.py's `split_layers` computes both
and keeps the output layer, and so the logits, here). Before each load (the first request, after a
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
from ...agent.runtime.rpc import layer_counts, split_layers
from ...protocol.compute import RpcAccept
from ...protocol.errors import ErrorCode, PsymeshError

OnWorkerLoss = Literal["reload", "wait"]
PROBE_TIMEOUT_S = 10.0


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
            if len(kept) >= n_layers:  # every part holds a layer at least: the last ones wait
                for p in kept[n_layers - 1:]:
                    left_out[p] = f"{base.path.name} has only {n_layers} layers"
                continue
            counts = layer_counts(n_layers, [1.0] * (len(kept) + 1))
            held = dict(zip(kept, counts[1:]))
            too_small = {p: size_mb * held[p] / n_layers for p in kept
                         if (b := answers[p].memory_mb) is not None  # type: ignore[union-attr]
                         and size_mb * held[p] / n_layers > b}
            if not too_small:
                break
            for p, mb in too_small.items():
                left_out[p] = (f"its budget ({answers[p].memory_mb} MB) is less than its share of "  # type: ignore[union-attr]
                               f"{base.path.name} (about {mb:.0f} MB)")
        offloaded, tensor_split = split_layers(n_layers, [1.0] * (len(kept) + 1))
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
        def part(layers: int) -> int:
            return round(size_mb * layers / n_layers)

        shares = [Share("this node", None, counts[0], None, "local", part(counts[0]))]
        for p in self.peers:
            if p in kept:
                answer = answers[p]
                assert isinstance(answer, RpcAccept)
                how = self.relayed(p)
                shares.append(Share(self.label(p), p, held[p], answer.memory_mb,
                                    "relayed" if how else "direct" if how is not None else "connected",
                                    part(held[p])))
            else:
                shares.append(Share(self.label(p), p, 0, None, f"left out: {left_out[p]}"))
        self._shares = tuple(shares)
        return base.model_copy(update={"rpc_servers": tuple(endpoints), "n_gpu_layers": offloaded,
                                       "tensor_split": tensor_split})

    def blame(self) -> str | None:
        return self.links.blame(self.peers, since=self._loaded_at)

    def shares(self) -> tuple[Share, ...]:
        return self._shares
