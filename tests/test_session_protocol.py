"""The sans-IO session (`/psymesh/session/1.0.0`): request ids, interleaved answers, cancel,
and what a broken or hostile peer can and cannot do to it."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psymesh.protocol.common import Error, Ping, Pong
from psymesh.protocol.errors import ErrorCode, ProtocolError, PsymeshError
from psymesh.protocol.framing import encode_frame
from psymesh.protocol.session import (
    Cancel,
    Refused,
    Reply,
    Request,
    SessionCancel,
    SessionClient,
    SessionEnd,
    SessionServer,
)


def pump_to_server(server: SessionServer, data: bytes) -> list:
    server.receive_data(data)
    out = []
    while (ev := server.next_event()) is not None:
        out.append(ev)
    return out


def pump_to_client(client: SessionClient, data: bytes) -> list[Reply]:
    client.receive_data(data)
    out = []
    while (r := client.next_reply()) is not None:
        out.append(r)
    return out


def raw(obj: dict) -> bytes:
    return encode_frame(msgpack.packb(obj, use_bin_type=True))


def test_requests_are_numbered_and_answers_interleave() -> None:
    client, server = SessionClient(), SessionServer()
    rid1, d1 = client.request(Ping(seq=1))
    rid2, d2 = client.request(Ping(seq=2))
    assert (rid1, rid2) == (1, 2)
    assert pump_to_server(server, d1 + d2) == [Request(1, Ping(seq=1)), Request(2, Ping(seq=2))]
    # answered out of order, one of them in several frames
    wire = server.reply(2, Pong(seq=2)) + server.reply(1, Pong(seq=10), end=False) + server.reply(1, Pong(seq=11))
    replies = pump_to_client(client, wire)
    assert replies == [Reply(2, Pong(seq=2), True), Reply(1, Pong(seq=10), False), Reply(1, Pong(seq=11), True)]
    assert client.open_requests == server.open_requests == frozenset()


def test_an_error_always_ends_its_request() -> None:
    client, server = SessionClient(), SessionServer()
    rid, data = client.request(Ping(seq=1))
    pump_to_server(server, data)
    wire = server.reply(rid, Error.of(ErrorCode.FORBIDDEN, "no"), end=False)  # the server closes it anyway
    [reply] = pump_to_client(client, wire)
    assert reply.end and isinstance(reply.message, Error)
    # a peer that sends a non-final error breaks the session
    client2 = SessionClient()
    client2.request(Ping(seq=1))
    bad = raw({"v": 1, "type": "error", "code": "forbidden", "rid": 1, "end": False})
    with pytest.raises(ProtocolError, match="must end"):
        pump_to_client(client2, bad)
    assert client2.broken


def test_cancel_reaches_the_server_once_and_is_ignored_after_the_end() -> None:
    client, server = SessionClient(), SessionServer()
    rid, data = client.request(Ping(seq=1))
    pump_to_server(server, data)
    assert pump_to_server(server, client.cancel(rid)) == [Cancel(rid)]
    pump_to_client(client, server.reply(rid, Error.of(ErrorCode.CANCELED, "canceled")))
    assert client.cancel(rid) == b""  # already over: nothing to send
    # a cancel that crosses the final frame on the wire is harmless
    rid2, data2 = client.request(Ping(seq=2))
    pump_to_server(server, data2)
    late_cancel = client.cancel(rid2)
    server.reply(rid2, Pong(seq=2))
    assert pump_to_server(server, late_cancel) == []


def test_a_cancel_of_a_rid_never_sent_is_ignored_and_the_session_goes_on() -> None:
    """Issue 34 item 5: `session.cancel` carries only the `rid` of the request to stop. A
    client that gives its cancel a fresh rid of its own (as if it were a request) cancels
    nothing, gets no answer, and keeps its session; the open request and that rid are
    unaffected."""
    server = SessionServer()
    assert pump_to_server(server, raw({"v": 1, "type": "ping", "seq": 1, "rid": 1})) == [Request(1, Ping(seq=1))]
    assert pump_to_server(server, raw({"v": 1, "type": "session.cancel", "rid": 2, "task_id": "t"})) == []
    assert not server.broken and server.open_requests == frozenset({1})
    assert pump_to_server(server, raw({"v": 1, "type": "ping", "seq": 2, "rid": 2})) == [Request(2, Ping(seq=2))]
    assert pump_to_server(server, raw({"v": 1, "type": "session.cancel", "rid": 1})) == [Cancel(1)]


@pytest.mark.parametrize("fields, where", [
    ({"seq": "1"}, "seq: must be an integer, not str"),
    ({"seq": 1.0}, "seq: must be an integer, not float"),
    ({"seq": True}, "seq: must be an integer, not bool"),
    ({"seq": 1, "payload": "abc"}, "payload: must be bin (bytes), not str"),
])
def test_a_field_of_another_msgpack_type_is_bad_frame_not_coerced(fields: dict, where: str) -> None:
    """Issue 34 item 5: fields are validated as the spec types them (protocol.md §3): a ping
    with `seq: "1"` is refused `bad_frame` for its rid alone, never answered as `seq: 1`."""
    server = SessionServer()
    [event] = pump_to_server(server, raw({"v": 1, "type": "ping", "rid": 1, **fields}))
    assert isinstance(event, Refused) and event.error.code is ErrorCode.BAD_FRAME
    assert where in event.error.message and not server.broken


def test_a_bad_request_is_refused_alone_and_the_session_goes_on() -> None:
    server = SessionServer()
    events = pump_to_server(server, raw({"v": 1, "type": "no.such", "rid": 1})
                            + raw({"v": 1, "type": "ping", "seq": -5, "rid": 2})
                            + raw({"v": 1, "type": "ping", "seq": 3, "rid": 3}))
    assert [type(e) for e in events] == [Refused, Refused, Request]
    assert events[0].error.code is ErrorCode.BAD_FRAME
    data = server.reply(1, Error.from_exception(events[0].error))
    assert data and not server.broken


@pytest.mark.parametrize("frame, why", [
    ({"v": 1, "type": "ping", "seq": 1}, "integer 'rid'"),
    ({"v": 1, "type": "ping", "seq": 1, "rid": True}, "integer 'rid'"),
    ({"v": 1, "type": "ping", "seq": 1, "rid": 0}, "integer 'rid'"),
])
def test_malformed_frames_break_the_session(frame: dict, why: str) -> None:
    server = SessionServer()
    with pytest.raises(ProtocolError, match=why):
        pump_to_server(server, raw(frame))
    assert server.broken
    with pytest.raises(ProtocolError):
        server.receive_data(b"more")


def test_request_ids_must_increase() -> None:
    server = SessionServer()
    pump_to_server(server, raw({"v": 1, "type": "ping", "seq": 1, "rid": 5}))
    with pytest.raises(ProtocolError, match="does not follow"):
        pump_to_server(server, raw({"v": 1, "type": "ping", "seq": 1, "rid": 5}))


def test_a_broken_session_says_why_in_one_error_frame_without_rid() -> None:
    """§2: after the frame that breaks a session (here a reused `rid`) the server sends one
    `error` frame, with no `rid`, before it closes; the client fails every request with it."""
    server, client = SessionServer(), SessionClient()
    assert server.farewell() == b""  # nothing to say while the session is sound
    _, first = client.request(Ping(seq=1))
    pump_to_server(server, first)
    with pytest.raises(ProtocolError, match="does not follow"):
        pump_to_server(server, first)  # the same rid again
    farewell = server.farewell()
    assert msgpack.unpackb(farewell[4:]) == {"code": "bad_frame", "message": "request id 1 does not follow 1",
                                             "retry_after": None, "details": {}, "v": 1, "type": "error"}
    assert server.farewell() == b""  # said once
    with pytest.raises(PsymeshError) as info:
        pump_to_client(client, farewell)
    assert info.value.code is ErrorCode.BAD_FRAME and "does not follow" in info.value.message


def test_open_requests_are_bounded_on_both_ends() -> None:
    client = SessionClient(max_open=2)
    client.request(Ping(seq=1))
    client.request(Ping(seq=2))
    with pytest.raises(PsymeshError) as info:
        client.request(Ping(seq=3))
    assert info.value.code is ErrorCode.BUSY
    server = SessionServer(max_open=2)
    events = pump_to_server(server, b"".join(raw({"v": 1, "type": "ping", "seq": i, "rid": i}) for i in (1, 2, 3)))
    assert isinstance(events[2], Refused) and events[2].error.code is ErrorCode.BUSY
    server.reply(3, Error.from_exception(events[2].error))
    assert server.open_requests == {1, 2}


def test_replies_for_requests_never_made_break_the_client() -> None:
    client = SessionClient()
    with pytest.raises(ProtocolError, match="not open"):
        pump_to_client(client, raw({"v": 1, "type": "pong", "seq": 1, "rid": 1, "end": True}))


def test_only_requests_can_be_requested() -> None:
    client = SessionClient()
    for message in (SessionCancel(), SessionEnd(), Error.of(ErrorCode.INTERNAL, "x")):
        with pytest.raises(ProtocolError):
            client.request(message)
    assert client.open_requests == frozenset()


def test_end_of_stream_inside_a_frame_is_an_error() -> None:
    client = SessionClient()
    client.request(Ping(seq=1))
    client.receive_data(raw({"v": 1, "type": "pong", "seq": 1, "rid": 1, "end": True})[:-2])
    client.receive_data(b"")
    with pytest.raises(ProtocolError, match="middle of a frame"):
        client.next_reply()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_arbitrary_bytes_only_ever_raise_protocol_errors(chunks: list[bytes]) -> None:
    server, client = SessionServer(max_frame_size=1024), SessionClient(max_frame_size=1024)
    client.request(Ping(seq=1))
    for side, pull in ((server, server.next_event), (client, client.next_reply)):
        try:
            for chunk in chunks:
                side.receive_data(chunk)
                while pull() is not None:
                    pass
        except ProtocolError:
            assert side.broken
