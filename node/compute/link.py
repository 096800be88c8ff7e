"""The owner's side of a split model: each worker as a loopback port its runner can dial.

llama.cpp's RPC client (in the owner's model runner) connects to `host:port`; psymesh gives it
one port per worker, `127.0.0.1:P`, held by this node. Each connection made there is served
only if its socket is this user's (node/net/localpeer.py), then carried on a stream of
`/psymesh/rpc/1.0.0` to the worker, opened through the node's usual dialing (direct, or
through a relay), after the worker's door took the offer:

    runner (llama.cpp) ─TCP─► 127.0.0.1:P ─► rpc.offer / rpc.accept ─► worker node ─► its RPC server

The owner reads its own bytes with the worker's budget (protocol/compute.py `RpcGate`) as the
worker does, so a share too big for the worker fails here, saying so, rather than as a cut
stream. How each link last ended is kept, so a runner that dies can name the worker that went
away (`blame`).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from ..net.framed import AnyioByteStream, ByteStream, FramedStream
from ..net.localpeer import loopback_peer_uid
from ..net.pipe import Traffic, splice
from ...protocol import ids
from ...protocol.compute import RPC_MAX_FRAME, RpcAccept, RpcGate, RpcOffer, Version, check_versions
from ...protocol.errors import ErrorCode, PsymeshError

log = logging.getLogger("psymesh.split")

OFFER_TIMEOUT_S = 15.0    # the worker's answer to an offer (a dial, then its door)

OpenStream = Callable[[str, str], Awaitable[ByteStream]]


@dataclass
class LinkState:
    """One worker as the owner sees it."""

    peer_id: str
    port: int
    accept: RpcAccept | None = None     # its last answer
    traffic: Traffic | None = None      # the stream carried now
    since: float | None = None
    ended_at: float | None = None
    failure: str = ""                   # how the last stream failed, or why it was refused
    failed_at: float | None = None
    streams: int = 0
    listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = field(default=None, repr=False)


class RpcLinks:
    def __init__(self, open_stream: OpenStream, label: Callable[[str], str], *,
                 engine: Callable[[], tuple[Version, str]], clock: Callable[[], float] = time.time) -> None:
        self.open_stream = open_stream
        self.label = label
        self.engine = engine  # this node's llama.cpp RPC version and build (agent/runtime/rpc.py)
        self.clock = clock
        self._links: dict[str, LinkState] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._lock = anyio.Lock()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:  # the listeners' serving tasks have ended: closing them now wakes none
            self._tg = None
            for link in self._links.values():
                if link.listener is not None:
                    with anyio.CancelScope(shield=True):
                        await link.listener.aclose()

    async def endpoint(self, peer_id: str) -> str:
        """`127.0.0.1:P`, where this node's runner reaches worker `peer_id` (opened on first use)."""
        async with self._lock:
            link = self._links.get(peer_id)
            if link is None:
                if self._tg is None:
                    raise PsymeshError("the node is stopping", code=ErrorCode.UNAVAILABLE)
                listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
                port = listener.extra(SocketAttribute.local_port)
                link = self._links[peer_id] = LinkState(peer_id, port, listener=listener)
                self._tg.start_soon(listener.serve, lambda conn, link=link: self._carry(link, conn))
            return f"127.0.0.1:{link.port}"

    async def offer(self, peer_id: str, *, probe: bool) -> tuple[FramedStream, RpcAccept]:
        """Open a stream to `peer_id` and make the offer; its answer (raises the refusal)."""
        version, build = self.engine()
        stream = await self.open_stream(peer_id, ids.RPC)
        framed = FramedStream(stream, RPC_MAX_FRAME)
        try:
            with anyio.fail_after(OFFER_TIMEOUT_S):
                accept = await framed.request(RpcOffer(rpc=version, build=build, probe=probe), RpcAccept)
            check_versions(version, accept.rpc, ours_build=build, theirs_build=accept.build, who=self.label(peer_id))
        except TimeoutError:
            await framed.aclose()
            raise PsymeshError(f"{self.label(peer_id)} did not answer the offer within {OFFER_TIMEOUT_S:.0f} s",
                               code=ErrorCode.TIMEOUT) from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await framed.aclose()
            raise
        return framed, accept

    async def probe(self, peer_id: str) -> RpcAccept:
        """Ask `peer_id` whether it would serve us, and with what budget (it answers, then closes)."""
        try:
            framed, accept = await self.offer(peer_id, probe=True)
        except PsymeshError as exc:
            self._failed(peer_id, exc.message)
            raise
        await framed.aclose()
        link = self._links.get(peer_id)
        if link is not None:
            link.accept = accept
        return accept

    async def _carry(self, link: LinkState, conn: anyio.abc.SocketStream) -> None:
        ours = conn.extra(SocketAttribute.local_address)
        theirs = conn.extra(SocketAttribute.remote_address)
        uid = loopback_peer_uid(ours, theirs)  # type: ignore[arg-type]
        if uid != os.getuid():
            log.warning("refused a connection to the port of worker %s: %s", self.label(link.peer_id),
                        "its socket is another user's" if uid is not None else "whose socket it is cannot be read")
            await conn.aclose()
            return
        try:
            framed, accept = await self.offer(link.peer_id, probe=False)
        except PsymeshError as exc:
            self._failed(link.peer_id, exc.message)
            log.warning("worker %s refused: %s", self.label(link.peer_id), exc.message)
            await conn.aclose()
            return
        link.accept, link.since, link.streams = accept, self.clock(), link.streams + 1
        link.traffic = traffic = Traffic()
        guard = RpcGate(None if accept.memory_mb is None else accept.memory_mb * 2**20)
        try:
            await splice(AnyioByteStream(conn), framed.stream, first=framed.channel.detach(), watch=guard.feed,
                         traffic=traffic)
        finally:
            link.traffic, link.ended_at = None, self.clock()
            if traffic.refused is not None:
                self._failed(link.peer_id, f"over its budget: {traffic.refused.message}")
            elif traffic.ended != "the owner closed it":
                self._failed(link.peer_id, traffic.ended or "the stream ended")

    def _failed(self, peer_id: str, why: str) -> None:
        link = self._links.get(peer_id)
        if link is not None:
            link.failure, link.failed_at = why, self.clock()

    def blame(self, peers: Sequence[str], *, since: float) -> str | None:
        """The worker among `peers` whose link failed at or after `since`, in words, or None."""
        failed = [(link.failed_at, link) for p in peers if (link := self._links.get(p)) is not None
                  and link.failed_at is not None and link.failed_at >= since]
        if not failed:
            return None
        _, link = max(failed, key=lambda pair: pair[0])
        return f"worker {self.label(link.peer_id)}: {link.failure}"

    def state(self, peer_id: str) -> LinkState | None:
        return self._links.get(peer_id)
