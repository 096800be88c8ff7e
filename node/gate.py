"""The gate: one ordered checklist that every inbound request passes, in one place.

    1. the remote peer id is paired and not revoked          unknown_peer
    2. we issued it a grant (manifest)                        forbidden
    3. the grant is ours, for this peer, signed, in date      forbidden / expired
    4. a capability covers this exact request                 forbidden
    5. the payload is within the grant's limit                too_large
    6. the peer is within its request rate                    rate_limited (retry_after)

The first failure wins; nothing runs for a denied request. Every decision, allowed
or denied, is a row in the audit log. The remote peer id comes from the Noise
session (libp2p), never from the request. Like syncthing's connection checks, the
order is fixed and the list lives here only.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from psymesh.node.audit import AuditLog
from psymesh.node.logs import fields
from psymesh.node.trust import Peer, TrustStore
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.limits import Admission
from psymesh.protocol.manifest import Decision, Operation, check, verify_grant

log = logging.getLogger("psymesh.gate")


class Gate:
    def __init__(self, local_peer_id: str, trust: TrustStore, audit: AuditLog,
                 clock: Callable[[], float] = time.time) -> None:
        self.local_peer_id = local_peer_id
        self.trust = trust
        self.audit = audit
        self.clock = clock
        self.admission = Admission()

    def authorize(self, peer_id: str, protocol: str, operation: Operation | None, *, label: str | None = None) -> Decision:
        """Allow or raise. `operation=None` is a peer-level request (ping, manifest refresh):
        it needs a valid grant but no particular capability."""
        now = self.clock()
        what = label or (operation.required() if operation else protocol.split("/")[2])
        try:
            decision = self._decide(peer_id, operation, now)
            decision.raise_if_denied()
        except PsymeshError as exc:
            self.audit.record(peer_id, protocol, what, False, exc.code.value, exc.message, now=now)
            log.info("denied %s to %s: %s", what, peer_id, exc.message, extra=fields(code=exc.code.value))
            raise
        self.audit.record(peer_id, protocol, what, True, now=now)
        return decision

    def _decide(self, peer_id: str, operation: Operation | None, now: float) -> Decision:
        peer = self.paired(peer_id)
        grant = peer.granted
        if grant is None:
            return Decision(False, ErrorCode.FORBIDDEN, "this node has granted you nothing")
        if operation is None:
            decision = verify_grant(grant, local_peer_id=self.local_peer_id, remote_peer_id=peer_id, now=now)
        else:
            decision = check(grant, operation, local_peer_id=self.local_peer_id, remote_peer_id=peer_id, now=now)
        if not decision.allowed:
            return decision
        rpm = grant.limits.requests_per_minute
        if rpm is not None:
            retry_after = self.admission.rate.acquire(peer_id, now, per_minute=rpm)
            if retry_after is not None:
                raise PsymeshError(f"over {rpm} requests per minute; retry in {retry_after:.1f} s",
                                   code=ErrorCode.RATE_LIMITED, retry_after=retry_after)
        return decision

    def paired(self, peer_id: str) -> Peer:
        peer = self.trust.get(peer_id)
        if peer is None or peer.revoked:
            state = "was revoked" if peer is not None else "is not paired with this node"
            raise PsymeshError(f"peer {peer_id} {state}; pair first (psymesh pair join)",
                               code=ErrorCode.UNKNOWN_PEER)
        return peer

    def refuse_unpaired(self, peer_id: str, protocol: str) -> None:
        """Record and raise for a peer that may only pair (used before any service runs)."""
        try:
            self.paired(peer_id)
        except PsymeshError as exc:
            self.audit.record(peer_id, protocol, protocol.split("/")[2], False, exc.code.value, exc.message)
            raise
