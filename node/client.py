"""The Python SDK: drive your own node daemon from a script.

    async with psymesh.Client(home="~/psy-home") as node:
        status = await node.status()
        result = await node.ping("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...")

Talks to the daemon's control socket with anyio, so it runs under asyncio and trio
alike (libp2p itself lives only inside the daemon). One request at a time per
connection; streaming calls open a connection of their own.
"""
from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable
from typing import TypeVar

import anyio

from psymesh.node.framed import AnyioByteStream, FramedStream
from psymesh.node.home import NodeHome
from psymesh.protocol import control as c
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.framing import DEFAULT_MAX_FRAME_SIZE
from psymesh.protocol.messages import Message, expect

R = TypeVar("R", bound=Message)


class DaemonNotRunning(PsymeshError):
    default_code = ErrorCode.UNAVAILABLE


class Client:
    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        *,
        socket_path: str | os.PathLike[str] | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        self.home = NodeHome(home)
        self.socket_path = Path(socket_path) if socket_path else self.home.socket_path
        self.max_frame_size = max_frame_size
        self._framed: FramedStream | None = None
        self._lock = anyio.Lock()

    async def _open(self) -> FramedStream:
        try:
            raw = await anyio.connect_unix(self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise DaemonNotRunning(
                f"no psymesh daemon is listening at {self.socket_path} ({exc.strerror}); "
                f"start one with: psymesh node start --home {self.home.path}"
            ) from None
        return FramedStream(AnyioByteStream(raw), self.max_frame_size)

    async def __aenter__(self) -> "Client":
        self._framed = await self._open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._framed is not None:
            framed, self._framed = self._framed, None
            await framed.aclose()

    async def request(self, message: Message, reply_type: type[R]) -> R:
        """Send one control request and return its reply; `error` replies raise RemoteError."""
        if self._framed is None:
            raise PsymeshError("use `async with Client(...)` (or await client.__aenter__()) first")
        async with self._lock:
            return await self._framed.request(message, reply_type)

    # -- node ---------------------------------------------------------------
    async def status(self) -> c.StatusReply:
        return await self.request(c.StatusRequest(), c.StatusReply)

    async def ping(self, peer: str, count: int = 4, payload_size: int = 32) -> c.PingReply:
        """Round trips over the encrypted channel to `peer` (multiaddr with /p2p/, or a paired peer's id or name)."""
        return await self.request(c.PingRequest(peer=peer, count=count, payload_size=payload_size), c.PingReply)

    async def shutdown(self) -> None:
        await self.request(c.ShutdownRequest(), c.Ok)

    # -- pairing and trust -----------------------------------------------------
    async def pair_invite(self, *, name: str | None = None, grant: str = "phone", ttl_s: float = 600.0,
                          grant_ttl_s: float | None = None) -> c.PairInviteReply:
        """Make a one-time invite; give its `code` (or `invite` string) to the joining device."""
        return await self.request(c.PairInviteRequest(name=name, grant=grant, ttl_s=ttl_s, grant_ttl_s=grant_ttl_s),
                                  c.PairInviteReply)

    async def pair_invite_and_wait(self, on_invite: Callable[[c.PairInviteReply], object], *,
                                   name: str | None = None, grant: str = "phone", ttl_s: float = 600.0,
                                   grant_ttl_s: float | None = None) -> c.PairedReply:
        """Make an invite, hand it to `on_invite` (to show it), then wait until a device pairs
        with it (-> the pairing, with verification words) or it dies (-> RemoteError)."""
        framed = await self._open()  # a connection of its own: the wait may be long
        try:
            invite = await framed.request(c.PairInviteRequest(name=name, grant=grant, ttl_s=ttl_s,
                                                              grant_ttl_s=grant_ttl_s, wait=True), c.PairInviteReply)
            on_invite(invite)
            return expect(await framed.receive_required(), c.PairedReply)
        finally:
            await framed.aclose()

    async def pair_join(self, invite: str, *, address: str | None = None, grant: str | None = None) -> c.PairedReply:
        """Pair with the node that made `invite` (an invite string, or a code plus `address`).
        `grant` optionally gives the inviter a preset (e.g. "messaging") in return."""
        return await self.request(c.PairJoinRequest(invite=invite, address=address, grant=grant), c.PairedReply)

    async def peers(self, *, include_revoked: bool = True) -> list[dict]:
        return (await self.request(c.PeersRequest(include_revoked=include_revoked), c.PeersReply)).peers

    async def grant(self, peer: str, capabilities: list[str], *, expires_s: float | None = None,
                    preset_limits: str | None = None) -> dict:
        """Replace what `peer` may ask of this node (capabilities in CLI spelling, e.g. "tool:files.*")."""
        req = c.GrantRequest(peer=peer, capabilities=capabilities, expires_s=expires_s, preset_limits=preset_limits)
        return (await self.request(req, c.PeerReply)).peer

    async def revoke(self, peer: str) -> dict:
        return (await self.request(c.RevokeRequest(peer=peer), c.PeerReply)).peer

    async def audit(self, *, peer: str | None = None, limit: int = 100, denied_only: bool = False) -> list[dict]:
        return (await self.request(c.AuditRequest(peer=peer, limit=limit, denied_only=denied_only), c.AuditReply)).rows
