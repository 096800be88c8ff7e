"""The node daemon: one root task group that owns every service.

    Node.run()
      ├── P2PNode.run        libp2p host (Noise + yamux over TCP), our protocol handlers
      ├── ControlServer.serve  local Unix socket for the CLI and scripts
      └── signal watcher     SIGINT/SIGTERM -> cancel the root scope -> clean shutdown

Every service starts with `await tg.start(...)`, so `run()` reports ready only when
the node really listens; nothing is spawned and forgotten.
"""
from __future__ import annotations

import logging
import signal
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

import psymesh
from psymesh.node.control import ControlServer
from psymesh.node.db import open_db
from psymesh.node.framed import FramedStream
from psymesh.node.home import NodeConfig, NodeHome
from psymesh.node.logs import fields
from psymesh.node.p2p import P2PNode, P2PStream
from psymesh.node.ping import measure_ping, serve_ping
from psymesh.protocol import control as c
from psymesh.protocol import ids
from psymesh.protocol.errors import ErrorCode, ProtocolError, PsymeshError

log = logging.getLogger("psymesh.node")

InboundHandler = Callable[[FramedStream, str], Awaitable[None]]


class Node:
    def __init__(self, home: NodeHome, config: NodeConfig | None = None) -> None:
        self.home = home
        self.identity = home.init()
        self.config = config or home.load_config()
        self.db = open_db(home.db_path)
        self.started_at = time.monotonic()
        self.p2p = P2PNode(self.identity.seed, self.config.listen)
        self.control = ControlServer(home.socket_path, self.config.max_frame_size)
        self._root: anyio.CancelScope | None = None
        self._register_services()

    # -- wiring ---------------------------------------------------------------
    def _register_services(self) -> None:
        self.inbound(ids.PING, lambda framed, peer: serve_ping(framed))
        self.control.route(c.StatusRequest, self._status)
        self.control.route(c.PingRequest, self._ping)
        self.control.route(c.ShutdownRequest, self._shutdown)

    def inbound(self, protocol: str, handler: InboundHandler) -> None:
        """Serve `protocol` on the p2p host with framing and typed error replies."""

        async def on_stream(stream: P2PStream) -> None:
            framed = FramedStream(stream, self.config.max_frame_size)
            try:
                await handler(framed, stream.remote_peer_id)
            except PsymeshError as exc:
                log.info("refused %s from %s: %s", protocol, stream.remote_peer_id, exc,
                         extra=fields(code=exc.code.value))
                await framed.send_error(exc)
            finally:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

        self.p2p.set_handler(protocol, on_stream)

    # -- lifecycle ------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._root = tg.cancel_scope
                await tg.start(self.p2p.run)
                await tg.start(self.control.serve)
                tg.start_soon(self._watch_signals, tg.cancel_scope)
                log.info("node %s (%s) listening on %s", self.identity.peer_id, self.config.profile,
                         " ".join(self.p2p.addrs()))
                task_status.started()
        finally:
            self.db.close()
            log.info("node stopped")

    def stop(self) -> None:
        if self._root is not None:
            self._root.cancel()

    async def _watch_signals(self, scope: anyio.CancelScope) -> None:
        try:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    scope.cancel()
                    return
        except (ValueError, RuntimeError, NotImplementedError):
            # not the main thread (e.g. a node embedded in tests): the owner stops us
            await anyio.sleep_forever()

    # -- control handlers ------------------------------------------------------
    async def _status(self, req: c.StatusRequest, _: FramedStream) -> c.StatusReply:
        return c.StatusReply(
            peer_id=self.identity.peer_id,
            fingerprint=self.identity.fingerprint,
            name=self.config.name,
            profile=self.config.profile,
            version=psymesh.__version__,
            addrs=self.p2p.addrs(),
            uptime_s=round(time.monotonic() - self.started_at, 3),
            connected_peers=[c.ConnectedPeer(peer_id=p["peer_id"], addrs=p.get("addrs", []))
                             for p in self.p2p.connected_peers()],
        )

    async def resolve_peer(self, peer: str) -> str:
        """A multiaddr, a peer id, or (later) a paired peer's name -> something open_stream takes."""
        return peer

    async def _ping(self, req: c.PingRequest, _: FramedStream) -> c.PingReply:
        target = await self.resolve_peer(req.peer)
        start = time.perf_counter()
        stream = await self.p2p.open_stream(target, ids.PING)
        connect_ms = (time.perf_counter() - start) * 1000
        framed = FramedStream(stream, self.config.max_frame_size)
        try:
            with anyio.fail_after(30):
                return await measure_ping(framed, stream.remote_peer_id, req.count, req.payload_size, connect_ms)
        except TimeoutError:
            raise ProtocolError(f"ping to {stream.remote_peer_id} timed out", code=ErrorCode.TIMEOUT) from None
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _shutdown(self, req: c.ShutdownRequest, framed: FramedStream) -> None:
        log.info("shutdown requested over the control socket")
        await framed.send(c.Ok())  # answer first: cancelling the root scope ends this connection too
        self.stop()
