"""Messages of the local control API (Unix socket in the node home; same frames as the wire).

The control API is how the CLI and scripts drive their own daemon. Every request
gets exactly one reply (or an `error`), except streaming requests, which say so.
"""
from __future__ import annotations

from pydantic import Field

from psymesh.protocol.messages import Message


class StatusRequest(Message):
    type = "control.status"


class ConnectedPeer(Message):
    type = "control.connected_peer"
    peer_id: str
    addrs: list[str] = Field(default_factory=list)
    name: str | None = None


class StatusReply(Message):
    type = "control.status_reply"
    peer_id: str
    fingerprint: str
    name: str
    profile: str
    version: str
    addrs: list[str]
    uptime_s: float
    connected_peers: list[ConnectedPeer] = Field(default_factory=list)


class PingRequest(Message):
    """Ping a peer over the encrypted channel. `peer` is a multiaddr ending /p2p/<id>, or a known peer id/name."""

    type = "control.ping"
    peer: str = Field(min_length=1, max_length=1024)
    count: int = Field(default=4, ge=1, le=1000)
    payload_size: int = Field(default=32, ge=0, le=65536)


class PingReply(Message):
    type = "control.ping_reply"
    peer_id: str
    rtts_ms: list[float]
    connect_ms: float
    min_ms: float
    median_ms: float
    max_ms: float


class ShutdownRequest(Message):
    """Ask the daemon to stop cleanly (same as SIGTERM)."""

    type = "control.shutdown"


class Ok(Message):
    type = "control.ok"
