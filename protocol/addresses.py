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

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, field_validator

from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.identity import PeerId, peer_id_from_public_key, public_key_from_peer_id
from psymesh.protocol.manifest import canonical_encode
from psymesh.protocol.messages import Message

MAX_ADDRS = 16  # as many as an invite carries
_CONTEXT = b"psymesh/addrs/v1\x00"


class AddrRecord(BaseModel):
    """`peer_id`'s addresses (multiaddrs ending /p2p/<peer_id>; through a relay too), as of
    `seq` (its issue time in milliseconds: a larger one replaces a smaller), signed by it."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

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

    def signing_bytes(self) -> bytes:
        return _CONTEXT + canonical_encode({"peer_id": self.peer_id, "addrs": list(self.addrs), "seq": self.seq})

    def sign(self, key: Ed25519PrivateKey) -> AddrRecord:
        if peer_id_from_public_key(key.public_key().public_bytes_raw()) != self.peer_id:
            raise ValueError("the signing key is not the record's peer's key")
        return self.model_copy(update={"signature": key.sign(self.signing_bytes())})

    def verify(self, *, sender: str) -> None:
        """FORBIDDEN unless this is `sender`'s own record, validly signed, naming only it."""
        key = Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(self.peer_id))
        try:
            key.verify(self.signature, self.signing_bytes())
        except InvalidSignature:
            raise PsymeshError("an address record must be validly signed", code=ErrorCode.FORBIDDEN) from None
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
