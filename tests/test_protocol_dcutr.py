"""protocol/dcutr.py: DCUtR's rounds, sans-IO, both sides, told the time (`now=`)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from psymesh.protocol.dcutr import ATTEMPTS, Dial, Finish, Initiator, Kind, Responder, Send
from psymesh.protocol.errors import ProtocolError

ADDRS = ("/ip4/192.0.2.1/tcp/4001",)


def test_b_times_the_connect_and_dials_after_half_the_round_trip() -> None:
    b = Initiator()
    assert b.start(now=10.0) == Send(Kind.CONNECT)
    assert b.receive(Kind.CONNECT, ADDRS, now=10.2) == [Send(Kind.SYNC),
                                                       Dial(ADDRS, after_s=pytest.approx(0.1), attempt=1,
                                                            rtt_s=pytest.approx(0.2))]
    assert b.dialed(True, now=10.4) == Finish(True, 1)
    assert b.finished


def test_a_answers_connect_with_its_own_and_dials_when_sync_arrives() -> None:
    a = Responder()
    assert a.receive(Kind.CONNECT, ADDRS, now=0.0) == [Send(Kind.CONNECT)]
    assert a.receive(Kind.SYNC, (), now=0.1) == [Dial(ADDRS, after_s=0.0, attempt=1)]
    assert a.dialed(True, now=0.2) == Finish(True, 1)


# (side, messages in order, what is refused): each message out of its place is a ProtocolError
OUT_OF_ORDER = [
    ("B: SYNC where CONNECT is due", Initiator, [Kind.SYNC]),
    ("A: SYNC before CONNECT", Responder, [Kind.SYNC]),
    ("A: CONNECT twice", Responder, [Kind.CONNECT, Kind.CONNECT]),
    ("A: an unknown type", Responder, [7]),
]


@pytest.mark.parametrize(("case", "side", "kinds"), OUT_OF_ORDER, ids=[c for c, _, _ in OUT_OF_ORDER])
def test_a_message_out_of_its_place_is_refused(case: str, side: type, kinds: list[int]) -> None:
    machine = side()
    if isinstance(machine, Initiator):
        machine.start(now=0.0)
    *fine, wrong = kinds
    for kind in fine:
        machine.receive(kind, ADDRS, now=0.0)
    with pytest.raises(ProtocolError):
        machine.receive(wrong, ADDRS, now=0.0)


def test_b_expects_nothing_while_it_dials() -> None:
    b = Initiator()
    b.start(now=0.0)
    b.receive(Kind.CONNECT, ADDRS, now=0.0)
    with pytest.raises(ProtocolError):
        b.receive(Kind.CONNECT, ADDRS, now=0.0)


@given(attempts=st.integers(1, 6), punched_at=st.one_of(st.none(), st.integers(1, 6)),
       rtts=st.lists(st.floats(0.0, 5.0), min_size=6, max_size=6))
def test_both_sides_agree_round_by_round_and_stop_in_time(attempts: int, punched_at: int | None,
                                                          rtts: list[float]) -> None:
    """Driven against each other: the same rounds on both sides, B waits half its RTT, A none,
    and the exchange ends at the first punched round or after `attempts` rounds."""
    b, a = Initiator(attempts=attempts), Responder(attempts=attempts)
    now = 0.0
    action: Send | Finish = b.start(now)
    rounds = 0
    while isinstance(action, Send):
        assert action == Send(Kind.CONNECT)
        rounds += 1
        assert a.receive(Kind.CONNECT, ("b",), now) == [Send(Kind.CONNECT)]
        now += rtts[rounds - 1]
        sync, b_dial = b.receive(Kind.CONNECT, ("a",), now)
        assert sync == Send(Kind.SYNC) and isinstance(b_dial, Dial)
        assert b_dial.addrs == ("a",) and b_dial.after_s == pytest.approx(rtts[rounds - 1] / 2)
        (a_dial,) = a.receive(Kind.SYNC, (), now)
        assert isinstance(a_dial, Dial) and a_dial.addrs == ("b",) and a_dial.after_s == 0.0
        assert a_dial.attempt == b_dial.attempt == rounds
        punched = punched_at == rounds
        a_end = a.dialed(punched, now)
        action = b.dialed(punched, now)
        assert (a_end is None) == isinstance(action, Send)
    want = min(attempts, punched_at) if punched_at is not None else attempts
    assert rounds == want <= ATTEMPTS * 2
    assert action == Finish(punched_at is not None and punched_at <= attempts, rounds)
    assert a.finished and b.finished
