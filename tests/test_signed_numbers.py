"""A letter's signed bytes are built from the values, never from the widths its sender's
msgpack library wrote (docs/protocol.md §3, "numbers are signed by their value"): a
letter packed by hand the way another library would (whole numbers as float64, small ints
as int64, exact floats as float32, map16 headers, keys in another order) and signed over
bytes this test builds by the spec's rule alone, is stored whole by a running node, never
refused nor left as a withdrawn stub; and a letter the node signs verifies under that rule."""
from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from conftest import pair, run_nodes
from letters import inbox
from p2p_helpers import raw_answers
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.messages import unpack
from psymesh.protocol.messaging import Letter, MsgSend, check_letter
from psymesh.protocol.signing import canonical_encode, legacy_encode

SPEC = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
CONTEXT = b"psymesh/letter/v1\x00"
BODY = {"t": 2.0, "9": 0.5, "10": 1, "big": 2**64 - 1, "neg": -5000000000.0, "huge": 1e20, "z": -0.0}


# -- the spec's rule, written from its words (not the node's encoder) --------------------------
def spec_canonical(value: object) -> bytes:
    """§3's canonical msgpack: keys sorted by their bytes, shortest forms, numbers by value."""
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: kv[0].encode())
        return _header(len(items), 0x80, 0xDE) + b"".join(spec_canonical(k) + spec_canonical(v) for k, v in items)
    if isinstance(value, list):
        return _header(len(value), 0x90, 0xDC) + b"".join(spec_canonical(v) for v in value)
    if value is None or isinstance(value, bool):
        return {None: b"\xc0", False: b"\xc2", True: b"\xc3"}[value]
    if isinstance(value, float) and value.is_integer() and -(2**63) <= value < 2**64:
        value = int(value)
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, bytes):
        return b"\xc4" + bytes([len(value)]) + value if len(value) < 256 else b"\xc5" + struct.pack(">H", len(value)) + value
    assert isinstance(value, str)
    raw = value.encode()
    if len(raw) < 32:
        return bytes([0xA0 | len(raw)]) + raw
    return (b"\xd9" + bytes([len(raw)]) if len(raw) < 256 else b"\xda" + struct.pack(">H", len(raw))) + raw


def _header(n: int, fix: int, wide: int) -> bytes:
    return bytes([fix | n]) if n < 16 else bytes([wide]) + struct.pack(">H", n)


def _int(n: int) -> bytes:
    if 0 <= n < 128:
        return bytes([n])
    if -32 <= n < 0:
        return struct.pack(">b", n)
    if n >= 0:
        for tag, fmt, top in ((0xCC, ">B", 2**8), (0xCD, ">H", 2**16), (0xCE, ">I", 2**32), (0xCF, ">Q", 2**64)):
            if n < top:
                return bytes([tag]) + struct.pack(fmt, n)
    for tag, fmt, low in ((0xD0, ">b", -(2**7)), (0xD1, ">h", -(2**15)), (0xD2, ">i", -(2**31)), (0xD3, ">q", -(2**63))):
        if n >= low:
            return bytes([tag]) + struct.pack(fmt, n)
    raise ValueError(n)


# -- another library's frame: what a JavaScript encoder might write ---------------------------
def foreign_pack(value: object) -> bytes:
    """msgpack as another library writes it: maps always map16 in the order given, every
    integer int64/uint64, every float float64 unless float32 holds it exactly, strings str8."""
    if isinstance(value, dict):
        return b"\xde" + struct.pack(">H", len(value)) + b"".join(foreign_pack(k) + foreign_pack(v) for k, v in value.items())
    if isinstance(value, list):
        return b"\xdc" + struct.pack(">H", len(value)) + b"".join(foreign_pack(v) for v in value)
    if value is None or isinstance(value, bool):
        return {None: b"\xc0", False: b"\xc2", True: b"\xc3"}[value]
    if isinstance(value, int):
        return b"\xcf" + struct.pack(">Q", value) if value >= 2**63 else b"\xd3" + struct.pack(">q", value)
    if isinstance(value, float):
        if not value.is_integer() and struct.unpack(">f", struct.pack(">f", value))[0] == value:
            return b"\xca" + struct.pack(">f", value)
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, bytes):
        return b"\xc5" + struct.pack(">H", len(value)) + value
    raw = str(value).encode()
    return b"\xd9" + bytes([len(raw)]) + raw


def js_ordered(body: dict) -> dict:
    """A JavaScript object's key order: integer-like keys first, ascending; then the rest as added."""
    ints = sorted((k for k in body if re.fullmatch(r"0|[1-9][0-9]*", k)), key=int)
    return {**{k: body[k] for k in ints}, **{k: v for k, v in body.items() if k not in ints}}


def foreign_letter(key: Ed25519PrivateKey, recipient: str, lid: str, tseq: int, body: dict) -> dict:
    """A letter signed by the spec's rule alone, its fields in an order of its own."""
    sender = peer_id_from_public_key(key.public_key().public_bytes_raw())
    fields = {"withdrawn": False, "tseq": tseq, "text": "numbers", "kind": "send", "body": js_ordered(body),
              "at": 1800000000000, "thread": "main", "recipient": recipient, "sender": sender, "id": lid}
    return {**fields, "signature": key.sign(CONTEXT + spec_canonical(fields))}


def whole_as_int(value: object) -> object:
    if isinstance(value, dict):
        return {k: whole_as_int(v) for k, v in value.items()}
    if isinstance(value, list):
        return [whole_as_int(v) for v in value]
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**63 else value


def spec_block_bytes(marker: str) -> bytes:
    start = SPEC.index(marker)
    fence = SPEC.index("```\n", start) + 4
    block = SPEC[fence:SPEC.index("```", fence)]
    return bytes.fromhex(" ".join(line for i, line in enumerate(block.splitlines()) if i % 2 == 0))


# -- the spec's example -----------------------------------------------------------------------------
def test_the_spec_s_number_example_is_what_the_node_and_the_rule_sign() -> None:
    example = spec_block_bytes("Worked example, the canonical encoding of a `body`")
    assert len(example) == 62
    assert canonical_encode(BODY, floats=True) == spec_canonical(BODY) == example
    # the same body as the spec says a JavaScript library might send it: the same canonical bytes
    received = bytes.fromhex("de 00 07 a1 7a cb 80 00 00 00 00 00 00 00 a1 74 cb 40 00 00 00 00 00 00 00"
                             " a1 39 ca 3f 00 00 00 a2 31 30 d3 00 00 00 00 00 00 00 01"
                             " a3 6e 65 67 cb c1 f2 a0 5f 20 00 00 00 a4 68 75 67 65 cb 44 15 af 1d 78 b5 8c 40"
                             " a3 62 69 67 cf ff ff ff ff ff ff ff ff")
    for piece in ("cb 80 00 00 00 00 00 00 00", "ca 3f 00 00 00", "d3 00 00 00 00 00 00 00 01",
                  "cb c1 f2 a0 5f\n20 00 00 00", "`de 00 07`"):
        assert piece in SPEC
    decoded = msgpack.unpackb(received)
    assert list(decoded) == ["z", "t", "9", "10", "neg", "huge", "big"]
    assert canonical_encode(decoded, floats=True) == example


def test_a_letter_the_node_signs_verifies_by_the_spec_s_rule() -> None:
    """A verifier with one number type (it reads 2.0 as 2) checks the node's signature."""
    key = Ed25519PrivateKey.generate()
    me = peer_id_from_public_key(key.public_key().public_bytes_raw())
    letter = Letter(id="n1", sender=me, recipient=me, tseq=1, at=1, body={"x": 2.0, "y": [1.5, 3.0e10]}).sign(key)
    as_js_reads_it = {k: v for k, v in letter.model_dump(exclude={"signature"}, exclude_none=True).items()}
    as_js_reads_it["body"] = {"x": 2, "y": [1.5, 30000000000]}
    key.public_key().verify(letter.signature, CONTEXT + spec_canonical(as_js_reads_it))


def test_an_older_release_s_letter_still_verifies_and_nan_is_refused() -> None:
    key = Ed25519PrivateKey.generate()
    me = peer_id_from_public_key(key.public_key().public_bytes_raw())
    fields = {"id": "o1", "sender": me, "recipient": me, "tseq": 1, "at": 1, "thread": "main", "kind": "send",
              "text": "", "body": {"x": 2.0}, "withdrawn": False}
    old = Letter.model_validate({**fields, "signature": key.sign(CONTEXT + legacy_encode(fields))})
    assert old.signing_bytes() != CONTEXT + legacy_encode(fields) and old.signature_valid()
    for bad in (math.nan, math.inf):
        with pytest.raises(ValidationError, match="NaN and infinities"):
            Letter.model_validate({**fields, "body": {"x": [bad]}})
        # an app asking its node to send one hears why, bad_frame, not `internal` at signing
        for kind in ("control.msg_send", "control.group_send"):
            with pytest.raises(PsymeshError, match="NaN and infinities") as refused:
                unpack(msgpack.packb({"v": 1, "type": kind, "to": "home", "name": "g", "body": {"x": bad}}))
            assert refused.value.code == ErrorCode.BAD_FRAME


def test_a_foreign_frame_decodes_and_its_signature_holds() -> None:
    key = Ed25519PrivateKey.generate()
    letter = foreign_letter(key, "12D3KooWCd3eX8r5ihRvzK7P1yPq5aakaBJhG5GNj18YTztPhoCa", "f1", 1, BODY)
    message = unpack(foreign_pack({"type": "msg.send", "letter": letter, "v": 1}))
    assert isinstance(message, MsgSend)
    check_letter(message.letter, sender=letter["sender"], local_peer_id=letter["recipient"])


# -- to a running node ---------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_a_running_node_stores_letters_another_library_packed(tmp_path: Path) -> None:
    """Letters from a peer whose library writes other widths and orders (whole numbers as
    float64, big and small integers as 64-bit, floats as float32) are stored whole by the
    home: `stored`, released with their bodies, none withdrawn; the same letter sent again
    with its numbers written another way is the same letter (`stored`, not `conflict`)."""
    bodies = [BODY, {"n": 3.0, "list": [1.0, 2.25, -7.0], "deep": {"b": 2**53 + 1, "a": 0.1}},
              {"count": 2**40, "ratio": 0.75, "nested": [{"10": 1.0, "2": "two", "1": None}]}]
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone")
        key = Ed25519PrivateKey.from_private_bytes(phone.identity.seed)
        stream = await phone.p2p.open_stream(home.identity.peer_id, "/psymesh/session/1.0.0")
        wire = b""
        for i, body in enumerate(bodies, start=1):
            letter = foreign_letter(key, home.identity.peer_id, f"js-{i}", i, body)
            frame = foreign_pack({"type": "msg.send", "v": 1, "rid": i, "letter": letter})
            wire += len(frame).to_bytes(4, "big") + frame
        # the first letter again, as a library with one number type writes it (2.0 as 02): the same letter
        again = foreign_letter(key, home.identity.peer_id, "js-1", 1, BODY)
        frame = msgpack.packb({"type": "msg.send", "v": 1, "rid": 4, "letter": {**again, "body": whole_as_int(BODY)}})
        wire += len(frame).to_bytes(4, "big") + frame
        await stream.send_all(wire)
        answers = await raw_answers(stream, len(bodies) + 1)
        await stream.aclose()
        for rid in range(1, len(bodies) + 2):
            assert (answers[rid]["type"], answers[rid].get("status")) == ("msg.receipt", "stored"), answers[rid]
        got = await inbox(home, len(bodies))
        assert [g.id for g in got] == ["js-1", "js-2", "js-3"]
        assert not any(g.withdrawn for g in got)
        for g, body in zip(got, bodies, strict=True):
            assert g.text == "numbers" and g.body == body
