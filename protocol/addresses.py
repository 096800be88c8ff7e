"""Addresses that follow the peer: a node tells its paired peers where it can be reached now.

A home PC's addresses change: a new DHCP lease, a second network, a reservation at a
relay gained or lost. Each node hands every paired peer it is connected to a signed
`AddrRecord` of its current addresses whenever they change (`addrs.push`, on the session,
admitted by the door like any request: its `issuer` rule, the record being the sender's
own). The receiver keeps them in its trust store in place of what it held (the peer knows
its own addresses best; a `seq` older than the one held is ignored), and dials a peer it
reaches only through a relay at the new direct addresses at once.

The record is signed by the node's identity key although the session already
authenticates the sender: a signed record stays the node's word wherever it is kept or
passed on (an invite, a relay), as libp2p's signed peer records are.
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import ErrorCode, PsymeshError
from .identity import PeerId
from .signing import Signed
from .messages import Message

MAX_ADDRS = 16  # as many as an invite carries


class AddrRecord(Signed, BaseModel):
    """`peer_id`'s addresses (multiaddrs ending /p2p/<peer_id>; through a relay too), as of
    `seq` (its issue time in milliseconds: a larger one replaces a smaller), signed by it."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    signing_context: ClassVar[bytes] = b"psymesh/addrs/v1\x00"
    signer_field: ClassVar[str] = "peer_id"
    signer_role: ClassVar[str] = "record's peer"

    peer_id: PeerId
    addrs: tuple[str, ...] = Field(max_length=MAX_ADDRS)
    seq: int = Field(ge=0, lt=2**63)
    signature: bytes = Field(default=b"", max_length=64)


    @field_validator("addrs")
    @classmethod
    def _addrs(cls, addrs: tuple[str, ...]) -> tuple[str, ...]:
        for addr in addrs:
            if not addr.startswith("/") or len(addr) > 256 or not addr.isprintable() or " " in addr:
                raise ValueError(f"not a multiaddr: {addr[:80]!r}")
        return addrs

    def verify(self, *, sender: str) -> None:
        """FORBIDDEN unless this is `sender`'s own record, validly signed, naming only it."""
        if not self.signature_valid():
            raise PsymeshError("an address record must be validly signed", code=ErrorCode.FORBIDDEN)
        if self.peer_id != sender:
            raise PsymeshError("an address record must be the sender's own", code=ErrorCode.FORBIDDEN)
        if any(not addr.endswith(f"/p2p/{sender}") for addr in self.addrs):
            raise PsymeshError("every address in a record must end in /p2p/<its peer id>",
                               code=ErrorCode.BAD_REQUEST)


class AddrsPush(Message):
    """A node hands a paired peer its current addresses (when they change, and once per
    connection otherwise)."""

    type = "addrs.push"
    record: AddrRecord


class AddrsOk(Message):
    type = "addrs.ok"
    seq: int  # the seq of the record now held for the sender (a newer one may be held already)


# ---------------------------------------------------------------- where to dial a paired peer


def _ip_of(addr: str) -> str | None:
    parts = addr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None


def is_loopback_addr(addr: str) -> bool:
    ip = _ip_of(addr)
    return ip is not None and (ip.startswith("127.") or ip == "::1")


def dial_addresses(peer_id: str, stored: list[str], relays: list[tuple[str, list[str]]],
                   local_ips: frozenset[str]) -> list[str]:
    """Where to look for `peer_id`: its stored addresses, then a circuit through each relay
    this node is paired with (`relays`: each relay's id and its direct addresses), for the
    peer that took a reservation there after we last heard from it (a circuit address needs
    only the relay's and the peer's ids). A loopback address names the peer only when the
    peer is this host: it is kept when the peer lists nothing else, or lists an address of
    this machine (`local_ips`); otherwise it would reach our own listener."""
    others = [a for a in stored if not is_loopback_addr(a) and "/p2p-circuit" not in a]
    here = not others or any(_ip_of(a) in local_ips for a in others)
    out = [a for a in stored if here or not is_loopback_addr(a)]
    via = {a.partition("/p2p-circuit")[0] for a in out if "/p2p-circuit" in a}
    for relay_id, relay_addrs in relays:
        if relay_id == peer_id:
            continue
        for addr in relay_addrs:
            if "/p2p-circuit" in addr:
                continue
            base = addr if f"/p2p/{relay_id}" in addr else f"{addr}/p2p/{relay_id}"
            if base not in via:
                out.append(f"{base}/p2p-circuit/p2p/{peer_id}")
                via.add(base)
    return out
