"""Lending this node's compute: llama.cpp's RPC server, reached only through the door.

    psymesh worker start           the RPC server's child process starts (or [worker] enabled)
    owner ── /psymesh/rpc/1.0.0 ──► Gate.admit_rpc (compute.rpc, one audit row) ─► rpc.accept
          ◄──── llama.cpp RPC bytes, held to the budget by protocol/compute.py's RpcGate ────►
                                     the child's Unix socket ─► its private loopback ─► ggml-rpc

The server is llama.cpp's own (`ggml_backend_rpc_start_server`), in a child process
(node/compute/worker_child.py) that nothing can reach but its Unix socket, in a directory
only this user may enter; the child runs the server in a network namespace of its own, so
not even this machine's other users reach its port. The node forwards to that socket the
streams the door admitted, one owner at a time (llama.cpp's server is sequential).

Whenever a grant changes (the trust store tells), each open stream is asked again
(`Gate.holds_rpc`): one whose peer lost `compute.rpc`, or was revoked, is cut at once, with
an audit row; a stream also ends when the grant that admitted it expires. A stream whose owner passes its budget is cut before the command reaches the
server. A child that dies is restarted on the next stream (its crash ends the stream it
served, nothing else).
"""
from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
from anyio.abc import Process

from ..core.home import WorkerSettings
from ..door.gate import Gate
from ..door.trust import TrustStore
from ..net.framed import AnyioByteStream, FramedStream
from ..net.pipe import Traffic, splice
from .worker_child import HANDOVER_GRACE_S  # the child waits as long for its previous connection
from ...protocol.compute import RpcAccept, RpcGate, RpcOffer, Version, check_versions, version_text
from ...protocol.errors import ErrorCode, PsymeshError

log = logging.getLogger("psymesh.worker")

OFFER_TIMEOUT_S = 10.0   # an opened stream must say what it wants within this
READY_TIMEOUT_S = 60.0   # the child's ready line (it imports llama.cpp and enters its namespace)
LOAD_CHAIN = 32          # at most this many streams in a row count as one load (one rate unit)


@dataclass(frozen=True)
class ChildReady:
    """The worker child's ready line (node/compute/worker_child.py)."""

    rpc: tuple[int, int, int]
    build: str
    isolation: str            # "netns": its own network namespace; "shared-loopback": the machine's
    memory_mb: int | None
    threads: int


@dataclass
class Serving:
    """One owner's stream being served."""

    peer_id: str
    since: float
    budget_mb: int | None
    traffic: Traffic = field(default_factory=Traffic)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    cut: PsymeshError | None = None
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(frozen=True)
class WorkerView:
    """`psymesh worker status`."""

    running: bool
    pid: int | None
    isolation: str | None
    rpc: str | None
    build: str | None
    memory_mb: int | None
    threads: int | None
    serving: str | None           # the owner served now (its name), if any
    serving_since: float | None
    bytes_in: int
    bytes_out: int
    streams_served: int
    last_end: str                 # how the last stream ended
    error: str                    # why the child is not running, if it tried


class WorkerService:
    def __init__(self, settings: WorkerSettings, socket_path: Path, gate: Gate, trust: TrustStore, *,
                 name: str, log_path: Path | None = None, command: list[str] | None = None) -> None:
        self.settings = settings
        self.socket_path = socket_path
        self.gate = gate
        self.trust = trust
        self.name = name
        self.log_path = log_path
        self.command = command or [sys.executable, "-m", "psymesh.node.compute.worker_child"]  # tests: a stand-in
        self._proc: Process | None = None
        self._ready: ChildReady | None = None
        self._wanted = settings.enabled
        self._serving: Serving | None = None
        self._served = 0
        self._last_stream: tuple[str, float] | None = None  # who ended the last stream, when (monotonic)
        self._chain = 0                                       # streams in a row that continued a load
        self._last_end = ""
        self._error = ""
        self._lock = anyio.Lock()
        trust.on_change(self.recheck)

    # -- the child ------------------------------------------------------------------
    async def start(self) -> ChildReady:
        """Start the RPC server's child now (idempotent); what it said when ready."""
        async with self._lock:
            self._wanted = True
            if self._proc is not None and self._proc.returncode is None and self._ready is not None:
                return self._ready
            return await self._spawn()

    async def stop(self) -> None:
        """Stop lending: the stream served now is cut, the child ends."""
        async with self._lock:
            self._wanted = False
            if self._serving is not None:
                self._serving.scope.cancel()
            await self._reap()

    async def _spawn(self) -> ChildReady:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        args = [*self.command, "--socket", str(self.socket_path)]
        if self.settings.memory_mb is not None:
            args += ["--memory-mb", str(self.settings.memory_mb)]
        if self.settings.threads is not None:
            args += ["--threads", str(self.settings.threads)]
        if self.settings.allow_shared_loopback:
            args.append("--allow-shared-loopback")
        if self.log_path is not None:
            self.log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        stderr = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        try:
            proc = await anyio.open_process(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                            start_new_session=True)
        finally:
            if stderr is not subprocess.DEVNULL:
                stderr.close()
        line = b""
        assert proc.stdout is not None
        with anyio.move_on_after(READY_TIMEOUT_S):
            while not line.endswith(b"\n"):
                try:
                    chunk = await proc.stdout.receive(4096)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
                line += chunk
        try:
            said = json.loads(line.decode() or "null")
            ready = ChildReady(rpc=tuple(said["rpc"]), build=str(said.get("build", "")),  # type: ignore[arg-type]
                               isolation=str(said["isolation"]), memory_mb=said.get("memory_mb"),
                               threads=int(said.get("threads") or 1))
        except (ValueError, KeyError, TypeError):
            self._proc = proc
            await self._reap()
            self._error = self._log_tail() or "the worker's child ended before it was ready"
            raise PsymeshError(f"the worker could not start: {self._error}", code=ErrorCode.UNAVAILABLE) from None
        self._proc, self._ready, self._error = proc, ready, ""
        log.info("lending compute: llama.cpp RPC %s (%s), %s, memory %s", version_text(ready.rpc), ready.build,
                 ready.isolation, f"{ready.memory_mb} MB" if ready.memory_mb else "uncapped")
        return ready

    async def _reap(self) -> None:
        proc, self._proc, self._ready = self._proc, None, None
        if proc is None:
            return
        with anyio.CancelScope(shield=True):
            if proc.stdin is not None:
                with contextlib.suppress(Exception):
                    await proc.stdin.aclose()
            with anyio.move_on_after(2.0):
                await proc.wait()
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            if proc.stdout is not None:
                with contextlib.suppress(Exception):
                    await proc.stdout.aclose()

    def _log_tail(self) -> str:
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError):
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines()[-20:] if ln.strip()]
            return lines[-1][:300] if lines else ""
        return ""

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """With the node: the child when [worker] enabled; stopped with the node."""
        try:
            if self._wanted:
                try:
                    await self.start()
                except PsymeshError as exc:
                    log.warning("%s", exc.message)
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await self._reap()
                with contextlib.suppress(FileNotFoundError):
                    self.socket_path.unlink()

    # -- the door's streams -----------------------------------------------------------
    async def serve(self, framed: FramedStream, peer_id: str) -> None:
        """One `/psymesh/rpc/1.0.0` stream (the door let a paired peer open it): its offer,
        the grant's decision, then llama.cpp's bytes to the child and back."""
        with anyio.fail_after(OFFER_TIMEOUT_S):
            offer = await framed.receive_required()
        if not isinstance(offer, RpcOffer):
            raise PsymeshError(f"expected rpc.offer, got {offer.type}", code=ErrorCode.BAD_REQUEST)
        grant = self.gate.admit_rpc(peer_id, probe=offer.probe, continues=not offer.probe and self._continues(peer_id))
        try:  # admitted: what still refuses it is audited after the door's row (as Gate.undo's)
            ready = await self._ready_child()
            check_versions(ready.rpc, offer.rpc, ours_build=ready.build, theirs_build=offer.build,
                           who=self.trust.label(peer_id))
            if not offer.probe:
                await self._handover(peer_id)
            if self._serving is not None and (not offer.probe or self._serving.peer_id != peer_id):
                raise PsymeshError(f"{self.name} lends its compute to {self.trust.label(self._serving.peer_id)} now; "
                                   "it serves one split model at a time", code=ErrorCode.BUSY, retry_after=5.0)
        except PsymeshError as exc:
            self.gate.rpc_closed(peer_id, exc)
            raise
        budgets = [b for b in (grant.limits.rpc_memory_mb, ready.memory_mb) if b is not None]
        budget = min(budgets) if budgets else None
        accept = RpcAccept(rpc=ready.rpc, build=ready.build, memory_mb=budget, threads=ready.threads)
        if offer.probe:
            await framed.send(accept)
            return
        serving = self._serving = Serving(peer_id, time.time(), budget)
        if grant.expires is not None:  # the grant's end ends the stream (a wall-clock date, on trio's clock)
            serving.scope.deadline = anyio.current_time() + max(0.0, grant.expires - self.gate.clock())
        try:
            with serving.scope:
                sock = await anyio.connect_unix(self.socket_path)
                await framed.send(accept)
                guard = RpcGate(None if budget is None else budget * 2**20)
                await splice(framed.stream, AnyioByteStream(sock), first=framed.channel.detach(), watch=guard.feed,
                             traffic=serving.traffic)
        except OSError as exc:
            serving.cut = PsymeshError(f"{self.name}'s worker is not answering ({exc.strerror}); it restarts on the "
                                       "next stream", code=ErrorCode.UNAVAILABLE)
            raise serving.cut from None
        finally:
            if serving.cut is None and serving.scope.cancelled_caught and anyio.current_time() >= serving.scope.deadline:
                serving.cut = PsymeshError("closed: the grant has expired", code=ErrorCode.EXPIRED)
            self._serving = None
            self._served += 1
            self._last_stream = (peer_id, time.monotonic())
            serving.done.set()
            self._finish(serving)

    def _continues(self, peer_id: str) -> bool:
        """Does a stream of `peer_id` opened now go on with the load its previous one began? Its
        previous stream is still open, or ended less than HANDOVER_GRACE_S ago, and the chain is
        shorter than LOAD_CHAIN: then the grant's rate is not charged for it again."""
        serving = self._serving
        if serving is not None and serving.peer_id == peer_id:
            chained = True
        else:
            last = self._last_stream
            chained = last is not None and last[0] == peer_id and time.monotonic() - last[1] < HANDOVER_GRACE_S
        self._chain = self._chain + 1 if chained else 0
        return chained and self._chain < LOAD_CHAIN

    async def _handover(self, peer_id: str) -> None:
        """llama.cpp's client opens consecutive connections while it loads a model (a device
        count, the model's buffers), each closed just before the next opens; through the owner's
        link the previous stream's end may reach us after the next one's start. A stream from
        the owner served now waits up to HANDOVER_GRACE_S for the previous one to end; another
        peer's is refused busy at once."""
        with anyio.move_on_after(HANDOVER_GRACE_S):
            while (serving := self._serving) is not None and serving.peer_id == peer_id:
                await serving.done.wait()

    def _finish(self, serving: Serving) -> None:
        t = serving.traffic
        reason = serving.cut or t.refused
        if reason is not None:
            self.gate.rpc_closed(serving.peer_id, reason)
            self._last_end = f"cut: {reason.message}"
        else:
            self._last_end = t.ended or "ended"
        log.info("compute.rpc stream of %s ended after %d B in, %d B out: %s", self.trust.label(serving.peer_id),
                 t.a_to_b, t.b_to_a, self._last_end)
        if self._proc is not None and self._proc.returncode is not None:
            self._error = self._log_tail() or f"the worker's child ended ({self._proc.returncode})"

    async def _ready_child(self) -> ChildReady:
        if not self._wanted:
            raise PsymeshError(f"{self.name} lends no compute now (its owner can turn it on: psymesh worker start)",
                               code=ErrorCode.UNAVAILABLE)
        ready = self._ready
        if ready is not None and self._proc is not None and self._proc.returncode is None:
            return ready
        async with self._lock:  # it died (a peer's command may have crashed it): a fresh one
            await self._reap()
            return await self._spawn()

    def recheck(self) -> None:
        """The trust store changed: a stream whose peer no longer holds `compute.rpc` is cut now."""
        serving = self._serving
        if serving is None or serving.cut is not None:
            return
        why = self.gate.holds_rpc(serving.peer_id)
        if why is not None:
            serving.cut = PsymeshError(f"closed: {why.message}", code=why.code)
            serving.scope.cancel()

    def view(self) -> WorkerView:
        ready, proc, serving = self._ready, self._proc, self._serving
        running = proc is not None and proc.returncode is None and ready is not None
        return WorkerView(
            running=running, pid=proc.pid if running and proc is not None else None,
            isolation=ready.isolation if ready else None, rpc=version_text(ready.rpc) if ready else None,
            build=ready.build if ready else None, memory_mb=ready.memory_mb if ready else None,
            threads=ready.threads if ready else None,
            serving=self.trust.label(serving.peer_id) if serving else None,
            serving_since=serving.since if serving else None,
            bytes_in=serving.traffic.a_to_b if serving else 0, bytes_out=serving.traffic.b_to_a if serving else 0,
            streams_served=self._served, last_end=self._last_end, error=self._error)


def worker_log(logs_dir: Path) -> Path:
    """Where the worker child's own output goes (llama.cpp's server prints there)."""
    return logs_dir / "worker.log"


def rpc_engine() -> tuple[Version, str]:
    """This node's llama.cpp RPC protocol version and engine build, as offers and answers carry
    them (read from the installed llama-cpp-python, without loading a model)."""
    from ...agent.runtime.rpc import engine_build, rpc_version

    return rpc_version(), engine_build()

