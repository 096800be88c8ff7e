"""Circuit relay v2's conversations, sans-IO: what a relay answers on HOP, what a target answers
on STOP, and what a relay's status means to the peer that asked.

`Hop` is the relay's side of one HOP request (libp2p/specs relay/circuit-v2.md): told who asked
(the peer Noise proved, never the message's own `peer` field: defect 21 of node/net/patches.py),
what it asked, whether the request came over a circuit, and the time (`now`), it returns what to
do: `Answer` a refusal's status, `Reserved` (answer OK with the reservation), or `OpenCircuit`
(open STOP to the destination, answer OK, splice; then `closed()`). The gate decides and audits
who may (`admit`, protocol/relay.py's RESERVE or CONNECT), the book (`RelayBook`) how many.
The driving loop is node/net/circuit.py: the protobufs, the streams, the splice.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from .errors import ConnectError, ErrorCode, PsymeshError
from .relay import CONNECT, RESERVE, RelayBook


class Status(IntEnum):
    """The spec's `Status` values."""

    UNUSED = 0
    OK = 100
    RESERVATION_REFUSED = 200
    RESOURCE_LIMIT_EXCEEDED = 201
    PERMISSION_DENIED = 202
    CONNECTION_FAILED = 203
    NO_RESERVATION = 204
    MALFORMED_MESSAGE = 400
    UNEXPECTED_MESSAGE = 401


class HopKind(IntEnum):
    """The spec's `HopMessage.Type` values."""

    RESERVE = 0
    CONNECT = 1
    STATUS = 2


class StopKind(IntEnum):
    """The spec's `StopMessage.Type` values."""

    CONNECT = 0
    STATUS = 1


@dataclass(frozen=True)
class Answer:
    """Answer STATUS `status` and close; `reason` says why, for the log (None: nothing to say)."""

    status: Status
    reason: str | None = None


@dataclass(frozen=True)
class Reserved:
    """Answer OK with a reservation until `expires` (wall time)."""

    expires: float


@dataclass(frozen=True)
class OpenCircuit:
    """Open STOP to `destination` for `source`; OK to the source once it said OK, else
    CONNECTION_FAILED. Counted in the book until `Hop.closed(source, destination)`."""

    source: str
    destination: str


HopAction = Answer | Reserved | OpenCircuit
Admit = Callable[[str, str], None]  # (peer id, RESERVE or CONNECT): returns, or raises why not
Connected = Callable[[str], bool]   # is this peer directly connected to the relay now?
Label = Callable[[str], str]        # a peer id as a message names it (the node's: a paired peer's name too)


@dataclass
class Hop:
    """A relay's HOP side: its book, its gate, whom it is connected to, and how its refusals
    name peers."""

    book: RelayBook
    admit: Admit
    connected: Connected
    label: Label = str

    def receive(self, source: str, kind: int, destination: str | None, *, relayed: bool, now: float) -> HopAction:
        """One HOP request from `source` (`destination`: the CONNECT's target, None if it named
        none readable), which came over a circuit if `relayed`."""
        if relayed:  # the spec: never reserve or connect over a circuit
            return Answer(Status.PERMISSION_DENIED)
        if kind == HopKind.RESERVE:
            try:
                self.admit(source, RESERVE)
                for other in [p for p in self.book.reservations if not self.connected(p)]:
                    self.book.drop(other)  # a reservation lasts only while its peer stays connected
                return Reserved(self.book.reserve(source, now))
            except PsymeshError as exc:
                return Answer(status_for(exc), f"refused a reservation to {self.label(source)}: {exc.message}")
        if kind == HopKind.CONNECT:
            if destination is None:
                return Answer(Status.MALFORMED_MESSAGE)
            try:
                self.admit(source, CONNECT)
                if not self.connected(destination):
                    self.book.drop(destination)
                self.book.open_circuit(source, destination, now)
            except PsymeshError as exc:
                return Answer(status_for(exc), f"refused a circuit from {self.label(source)} to {self.label(destination)}: "
                                                  f"{exc.message}")
            return OpenCircuit(source, destination)
        return Answer(Status.UNEXPECTED_MESSAGE)

    def closed(self, source: str, destination: str) -> None:
        """The circuit `OpenCircuit` started has ended (or never opened)."""
        self.book.close_circuit(source, destination)


def status_for(exc: PsymeshError) -> Status:
    """A refusal of our relay (the gate's, or its book's) as the spec's status."""
    if exc.code in (ErrorCode.UNKNOWN_PEER, ErrorCode.FORBIDDEN, ErrorCode.EXPIRED):
        return Status.PERMISSION_DENIED
    if exc.code is ErrorCode.BUSY:
        return Status.RESOURCE_LIMIT_EXCEEDED
    if exc.code is ErrorCode.NOT_FOUND:
        return Status.NO_RESERVATION
    return Status.CONNECTION_FAILED


def status_name(status: int) -> str:
    try:
        return Status(status).name.lower()
    except ValueError:
        return f"status {status}"


def refusal(status: int, what: str) -> PsymeshError:
    """A relay's status other than OK as the PsymeshError for it."""
    reason = f"{what}: {status_name(status)}"
    if status == Status.PERMISSION_DENIED:
        return PsymeshError(f"{reason} (it has not granted this node `relay`)", code=ErrorCode.FORBIDDEN)
    if status in (Status.RESOURCE_LIMIT_EXCEEDED, Status.RESERVATION_REFUSED):
        return PsymeshError(reason, code=ErrorCode.BUSY)
    return ConnectError(reason)


def stop_answer(kind: int) -> Status:
    """A target's answer to a relay's STOP message (once the door let the relay bring it):
    OK to CONNECT, else the exchange is broken."""
    return Status.OK if kind == StopKind.CONNECT else Status.UNEXPECTED_MESSAGE
