"""Hole punching (DCUtR, libp2p/specs relay/DCUtR.md) rounds, sans-IO: which message goes out when,
how the round trip is timed, when each side dials, and when the exchange ends.

Two peers joined by a circuit agree, over it, to dial each other at once. `B` (the side the
circuit reached: `Initiator`) sends CONNECT with its addresses, times the answer (the relayed
RTT), sends SYNC, waits half the RTT and dials; `A` (the side that dialed the circuit:
`Responder`) answers each CONNECT with its own addresses and dials the moment SYNC arrives. A
round that made no direct connection is followed by another, up to `attempts`, on the same
stream. Each machine is told what arrived (`receive(kind, addrs, now)`) and how a round's dials
went (`dialed(punched)`), and returns what to do: `Send`, `Dial`, or `Finish`. The driving loop
(node/net/dcutr.py) does the IO: the protobufs, the stream, the dials, the step timeouts.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .errors import ProtocolError

ATTEMPTS = 3  # rounds per exchange (the spec's suggestion)


class Kind(IntEnum):
    """The spec's `HolePunch.Type` values."""

    CONNECT = 100
    SYNC = 300


@dataclass(frozen=True)
class Send:
    """Send a `kind` message (the driver puts our current addresses in a CONNECT; a SYNC has none)."""

    kind: Kind


@dataclass(frozen=True)
class Dial:
    """Wait `after_s` seconds, then dial the peer at `addrs` (all at once) and report with `dialed()`."""

    addrs: tuple[str, ...]
    after_s: float
    attempt: int
    rtt_s: float | None = None  # the relayed round trip `B` measured (for the log)


@dataclass(frozen=True)
class Finish:
    """The exchange is over: `punched` if a round made a direct connection."""

    punched: bool
    attempt: int


Action = Send | Dial | Finish


class Initiator:
    """DCUtR's `B`: starts each round. `start(now)`, then `receive()` the peer's CONNECT, then
    `dialed()`, which starts the next round or finishes."""

    def __init__(self, *, attempts: int = ATTEMPTS) -> None:
        if attempts < 1:
            raise ValueError("at least one attempt")
        self.attempts = attempts
        self.attempt = 0
        self._sent_at: float | None = None  # set while our CONNECT awaits its answer
        self._dialing = False
        self.finished = False

    def start(self, now: float) -> Send:
        """The first round's CONNECT."""
        if self.attempt:
            raise RuntimeError("already started")
        return self._connect(now)

    def receive(self, kind: Kind | int, addrs: tuple[str, ...], now: float) -> list[Action]:
        """The peer's message: its CONNECT answers ours (SYNC, then dial after half the RTT)."""
        if self._sent_at is None:
            raise ProtocolError(f"DCUtR: a message (type {int(kind)}) while none was expected")
        if kind != Kind.CONNECT:
            raise ProtocolError(f"expected DCUtR CONNECT, got type {int(kind)}")
        rtt = max(0.0, now - self._sent_at)
        self._sent_at, self._dialing = None, True
        return [Send(Kind.SYNC), Dial(addrs, after_s=rtt / 2, attempt=self.attempt, rtt_s=rtt)]

    def dialed(self, punched: bool, now: float) -> Send | Finish:
        """How this round's dials went: finish, or the next round's CONNECT."""
        if not self._dialing:
            raise RuntimeError("no round is dialing")
        self._dialing = False
        if punched or self.attempt >= self.attempts:
            self.finished = True
            return Finish(punched, self.attempt)
        return self._connect(now)

    def _connect(self, now: float) -> Send:
        self.attempt += 1
        self._sent_at = now
        return Send(Kind.CONNECT)


class Responder:
    """DCUtR's `A`: answers each round. `receive()` CONNECT (answered with ours), then SYNC
    (dial at once), then `dialed()`, which finishes or waits for the next round's CONNECT."""

    def __init__(self, *, attempts: int = ATTEMPTS) -> None:
        if attempts < 1:
            raise ValueError("at least one attempt")
        self.attempts = attempts
        self.attempt = 0
        self._expect: Kind | None = Kind.CONNECT
        self._theirs: tuple[str, ...] = ()
        self.finished = False

    def receive(self, kind: Kind | int, addrs: tuple[str, ...], now: float) -> list[Action]:
        if self._expect is None:
            raise ProtocolError(f"DCUtR: a message (type {int(kind)}) while none was expected")
        if kind != self._expect:
            raise ProtocolError(f"expected DCUtR {self._expect.name}, got type {int(kind)}")
        if kind == Kind.CONNECT:
            self.attempt += 1
            self._theirs, self._expect = addrs, Kind.SYNC
            return [Send(Kind.CONNECT)]
        self._expect = None
        return [Dial(self._theirs, after_s=0.0, attempt=self.attempt)]

    def dialed(self, punched: bool, now: float) -> Finish | None:
        """How this round's dials went: finish, or None (wait for the peer's next CONNECT)."""
        if self._expect is not None:
            raise RuntimeError("no round is dialing")
        if punched or self.attempt >= self.attempts:
            self.finished = True
            return Finish(punched, self.attempt)
        self._expect = Kind.CONNECT
        return None
