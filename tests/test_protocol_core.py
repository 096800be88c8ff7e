"""The sans-IO core: frames, envelopes, typed errors. Bad bytes only ever raise ProtocolError."""
from __future__ import annotations

import ast
import struct
import tracemalloc
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from psymesh.protocol import Channel, ErrorCode, FrameDecoder, ProtocolError, encode_frame, pack, unpack
from psymesh.protocol.common import Error, Ping, Pong
from psymesh.protocol.common import expect
from psymesh.protocol.errors import RemoteError

ROOT = Path(__file__).resolve().parents[1]


def test_roundtrip_ping() -> None:
    ch = Channel()
    wire = ch.send(Ping(seq=7, payload=b"x" * 32))
    ch.receive_data(wire)
    assert ch.next_message() == Ping(seq=7, payload=b"x" * 32)
    assert ch.next_message() is None


def test_byte_by_byte_delivery_reassembles() -> None:
    ch = Channel()
    wire = ch.send(Pong(seq=1, payload=b"abc")) + ch.send(Pong(seq=2))
    got = []
    for i in range(len(wire)):
        ch.receive_data(wire[i:i + 1])
        while (m := ch.next_message()) is not None:
            got.append(m.seq)
    assert got == [1, 2]


def test_unknown_keys_are_ignored() -> None:
    body = msgpack.packb({"v": 1, "type": "ping", "seq": 3, "from_the_future": [1, 2]})
    assert unpack(body) == Ping(seq=3)


@pytest.mark.parametrize(
    "body, code",
    [
        (msgpack.packb({"v": 2, "type": "ping", "seq": 1}), ErrorCode.UNSUPPORTED_VERSION),
        (msgpack.packb({"type": "ping", "seq": 1}), ErrorCode.BAD_FRAME),
        (msgpack.packb({"v": 1, "type": "nope"}), ErrorCode.BAD_FRAME),
        (msgpack.packb({"v": 1, "type": "ping", "seq": "one"}), ErrorCode.BAD_FRAME),
        (msgpack.packb({"v": 1, "type": "ping", "seq": -1}), ErrorCode.BAD_FRAME),
        (msgpack.packb([1, 2, 3]), ErrorCode.BAD_FRAME),
        (b"\xc1", ErrorCode.BAD_FRAME),
        (msgpack.packb({"v": 1, "type": "ping"}) + b"\x00", ErrorCode.BAD_FRAME),
    ],
)
def test_bad_bodies_give_typed_errors(body: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        unpack(body)
    assert info.value.code == code
    assert info.value.message


def test_oversized_length_prefix_is_refused_before_the_body_arrives() -> None:
    dec = FrameDecoder(max_frame_size=1024)
    dec.feed(struct.pack(">I", 1025))
    with pytest.raises(ProtocolError) as info:
        dec.next_frame()
    assert info.value.code == ErrorCode.TOO_LARGE


def test_huge_claimed_size_allocates_nothing() -> None:
    dec = FrameDecoder()  # 4 MiB limit; claim 4 GiB - 1
    tracemalloc.start()
    dec.feed(b"\xff\xff\xff\xff" + b"x" * 100)
    with pytest.raises(ProtocolError):
        dec.next_frame()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024


def test_partial_frame_waits_without_allocating_claimed_size() -> None:
    dec = FrameDecoder()
    tracemalloc.start()
    dec.feed(struct.pack(">I", 4 * 1024 * 1024) + b"x" * 10)
    assert dec.next_frame() is None
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024


def test_encoder_refuses_what_the_peer_would_refuse() -> None:
    with pytest.raises(ProtocolError) as info:
        encode_frame(b"x" * 2000, max_frame_size=1000)
    assert info.value.code == ErrorCode.TOO_LARGE


def test_channel_is_broken_for_good_after_an_error() -> None:
    ch = Channel()
    ch.receive_data(encode_frame(b"\xc1"))
    with pytest.raises(ProtocolError):
        ch.next_message()
    assert ch.broken
    with pytest.raises(ProtocolError):
        ch.receive_data(Channel().send(Ping(seq=1)))


def test_truncated_stream_at_eof_is_an_error() -> None:
    ch = Channel()
    wire = ch.send(Ping(seq=1, payload=b"abc"))
    ch.receive_data(wire[:-2])
    ch.receive_data(b"")
    with pytest.raises(ProtocolError):
        ch.next_message()


def test_error_reply_becomes_remote_error_with_code() -> None:
    err = Error.of(ErrorCode.BUSY, "queue full", retry_after=2.5)
    decoded = unpack(pack(err))
    with pytest.raises(RemoteError) as info:
        expect(decoded, Pong)
    assert info.value.code == ErrorCode.BUSY and info.value.retry_after == 2.5


def test_unknown_error_code_from_newer_peer_stays_readable() -> None:
    exc = Error(code="brand_new_code", message="hi").to_exception()
    assert exc.code == ErrorCode.INTERNAL and "brand_new_code" in exc.message


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_only_raise_protocol_error(data: bytes) -> None:
    ch = Channel(max_frame_size=4096)
    try:
        ch.receive_data(data)
        while ch.next_message() is not None:
            pass
        ch.receive_data(b"")
        ch.next_message()
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10), max_size=6), st.sampled_from(["ping", "pong", "error", "control.ping", "x"]))
def test_arbitrary_maps_only_raise_protocol_error(fields: dict, kind: str) -> None:
    fields = {**fields, "v": 1, "type": kind}
    try:
        unpack(msgpack.packb(fields, use_bin_type=True))
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1), st.binary(max_size=64))
def test_any_length_prefix_is_handled(length: int, tail: bytes) -> None:
    dec = FrameDecoder(max_frame_size=1024)
    dec.feed(struct.pack(">I", length) + tail)
    try:
        frame = dec.next_frame()
    except ProtocolError as exc:
        assert exc.code == ErrorCode.TOO_LARGE and length > 1024
    else:
        assert frame is None or len(frame) == length


def test_protocol_package_imports_nothing_of_ours_and_no_io() -> None:
    forbidden = ("psymesh.node", "psymesh.agent", "psymesh.discovery", "trio", "anyio", "libp2p",
                 "sqlite3", "socket", "asyncio", "httpx")
    for path in (ROOT / "protocol").rglob("*.py"):  # control/ too
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(forbidden), f"{path.name} imports {name}"
