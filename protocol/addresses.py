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

from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.identity import PeerId
from psymesh.protocol.signing import Signed
from psymesh.protocol.messages import Message

MAX_ADDRS = 16  # as many as an invite carries


class AddrRecord(Signed, BaseModel):
    """`peer_id`'s addresses (multiaddrs ending /p2p/<peer_id>; through a relay too), as of
    `seq` (its issue time in milliseconds: a larger one replaces a smaller), signed by it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
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
