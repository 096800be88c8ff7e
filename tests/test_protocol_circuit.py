"""protocol/circuit.py: a relay's HOP answers and a relay status's meaning, sans-IO, told the time."""
from __future__ import annotations

import pytest

from psymesh.protocol.circuit import (
    Answer,
    Hop,
    HopKind,
    OpenCircuit,
    Reserved,
    Status,
    StopKind,
    refusal,
    status_for,
    stop_answer,
)
from psymesh.protocol.errors import ConnectError, ErrorCode, PsymeshError
from psymesh.protocol.relay import CONNECT, RESERVE, RelayBook, RelaySettings

GRANTED = {"phone", "home"}  # peers the gate lets use the relay


def admit(peer: str, what: str) -> None:
    assert what in (RESERVE, CONNECT)
    if peer not in GRANTED:
        raise PsymeshError(f"{peer} has no `relay`", code=ErrorCode.FORBIDDEN)


def hop(settings: RelaySettings = RelaySettings(), connected: frozenset[str] = frozenset({"home", "phone"})) -> Hop:
    return Hop(RelayBook(settings), admit, lambda peer: peer in connected)


# (case, source, kind, destination, relayed, home reserved first?, expected action's type, status)
CASES = [
    ("reserve", "home", HopKind.RESERVE, None, False, False, Reserved, None),
    ("reserve without the grant", "stranger", HopKind.RESERVE, None, False, False, Answer, Status.PERMISSION_DENIED),
    ("reserve over a circuit", "home", HopKind.RESERVE, None, True, False, Answer, Status.PERMISSION_DENIED),
    ("connect to a reserved peer", "phone", HopKind.CONNECT, "home", False, True, OpenCircuit, None),
    ("connect to an unreserved peer", "phone", HopKind.CONNECT, "home", False, False, Answer, Status.NO_RESERVATION),
    ("connect naming nobody", "phone", HopKind.CONNECT, None, False, True, Answer, Status.MALFORMED_MESSAGE),
    ("connect without the grant", "stranger", HopKind.CONNECT, "home", False, True, Answer,
     Status.PERMISSION_DENIED),
    ("a STATUS asked of the relay", "phone", HopKind.STATUS, None, False, True, Answer, Status.UNEXPECTED_MESSAGE),
]


@pytest.mark.parametrize(("case", "source", "kind", "destination", "relayed", "reserved", "action", "status"),
                         CASES, ids=[c[0] for c in CASES])
def test_a_hop_request_is_answered_by_the_table(case: str, source: str, kind: HopKind, destination: str | None,
                                                relayed: bool, reserved: bool, action: type,
                                                status: Status | None) -> None:
    relay = hop()
    if reserved:
        assert isinstance(relay.receive("home", HopKind.RESERVE, None, relayed=False, now=0.0), Reserved)
    got = relay.receive(source, kind, destination, relayed=relayed, now=1.0)
    assert type(got) is action, (case, got)
    if status is not None:
        assert isinstance(got, Answer) and got.status is status


def test_a_circuit_is_counted_until_closed_and_the_shares_hold() -> None:
    relay = hop(RelaySettings(max_circuits_per_pair=1))
    relay.receive("home", HopKind.RESERVE, None, relayed=False, now=0.0)
    assert relay.receive("phone", HopKind.CONNECT, "home", relayed=False, now=1.0) == OpenCircuit("phone", "home")
    second = relay.receive("phone", HopKind.CONNECT, "home", relayed=False, now=1.0)
    assert isinstance(second, Answer) and second.status is Status.RESOURCE_LIMIT_EXCEEDED
    relay.closed("phone", "home")
    assert relay.book.circuits == {}
    assert isinstance(relay.receive("phone", HopKind.CONNECT, "home", relayed=False, now=2.0), OpenCircuit)


def test_reservations_lapse_in_time_and_with_their_peers_connection() -> None:
    relay = hop(connected=frozenset({"phone"}))
    reserved = relay.receive("home", HopKind.RESERVE, None, relayed=False, now=0.0)
    assert reserved == Reserved(RelaySettings().reservation_ttl_s)
    relay.receive("phone", HopKind.RESERVE, None, relayed=False, now=1.0)  # home is not connected: dropped
    assert set(relay.book.reservations) == {"phone"}
    late = relay.receive("home", HopKind.CONNECT, "phone", relayed=False, now=RelaySettings().reservation_ttl_s + 2)
    assert isinstance(late, Answer) and late.status is Status.NO_RESERVATION


@pytest.mark.parametrize(("code", "status"), [
    (ErrorCode.UNKNOWN_PEER, Status.PERMISSION_DENIED), (ErrorCode.FORBIDDEN, Status.PERMISSION_DENIED),
    (ErrorCode.EXPIRED, Status.PERMISSION_DENIED), (ErrorCode.BUSY, Status.RESOURCE_LIMIT_EXCEEDED),
    (ErrorCode.NOT_FOUND, Status.NO_RESERVATION), (ErrorCode.INTERNAL, Status.CONNECTION_FAILED)])
def test_a_refusal_is_the_specs_status(code: ErrorCode, status: Status) -> None:
    assert status_for(PsymeshError("no", code=code)) is status


@pytest.mark.parametrize(("status", "code"), [
    (Status.PERMISSION_DENIED, ErrorCode.FORBIDDEN), (Status.RESOURCE_LIMIT_EXCEEDED, ErrorCode.BUSY),
    (Status.RESERVATION_REFUSED, ErrorCode.BUSY), (Status.NO_RESERVATION, None), (999, None)])
def test_a_relays_status_is_the_error_its_asker_sees(status: int, code: ErrorCode | None) -> None:
    error = refusal(status, "relay r refused")
    if code is None:
        assert isinstance(error, ConnectError)
    else:
        assert error.code is code


def test_a_target_answers_only_connect_on_stop() -> None:
    assert stop_answer(StopKind.CONNECT) is Status.OK
    assert stop_answer(StopKind.STATUS) is Status.UNEXPECTED_MESSAGE
