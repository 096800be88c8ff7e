"""docs/protocol.md's worked examples, read from the document itself: each message is built
from the spec's own words (field names, defaults, the canonical encoding it describes) and
must give the example's bytes, and the node's decoder (and, for the session, a running
pair of daemons) must accept it. A spec edit that breaks an example, or a code change that
drifts from the spec, fails here."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from spake2 import SPAKE2_A, SPAKE2_B
from spake2.parameters.ed25519 import ParamsEd25519

from conftest import pair, run_nodes
from p2p_helpers import raw_answers
from psymesh.protocol import wordlist
from psymesh.protocol.common import Ping, Pong
from psymesh.protocol.compute import RpcAccept, RpcOffer
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.messages import decode_map, from_map, pack, unpack
from psymesh.protocol.messaging import Letter, MsgSend, check_letter
from psymesh.protocol.pairing import PairingCode, parse_code
from psymesh.protocol.session import Reply, Request, SessionClient, SessionServer
from psymesh.protocol.signing import canonical_encode
from psymesh.protocol.tasks import EventKind, TaskEvent, TaskState
from psymesh.protocol.manifest import ManifestOk
from psymesh.protocol.web import WebKeyOk, WebPage

SPEC = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()


def block_after(marker: str) -> list[str]:
    """The lines of the first fenced block after `marker` in the spec."""
    start = SPEC.index(marker)
    fence = SPEC.index("```\n", start) + 4
    return SPEC[fence:SPEC.index("```", fence)].splitlines()


def spec_bytes(lines: list[str]) -> bytes:
    """Hex bytes and quoted ASCII strings (their bytes), ignoring `(32 bytes)` notes and the
    labels before a colon (`client:`)."""
    out = bytearray()
    for line in lines:
        line = re.sub(r"\([^)]*\)", "", re.sub(r"^\s*\w+:", "", line))
        for token in re.findall(r'"[^"]*"|\b[0-9a-f]{2}\b', line):
            out += token[1:-1].encode() if token.startswith('"') else bytes.fromhex(token)
    return bytes(out)


def until_equals(lines: list[str]) -> list[str]:
    """The lines before the first `= {...}` gloss."""
    end = next((i for i, line in enumerate(lines) if line.strip().startswith("= {")), len(lines))
    return lines[:end]


def spec_hex(name: str, after: str) -> str:
    """A hex value the spec gives in prose as `name` ... `<hex>`."""
    match = re.search(re.escape(name) + r"[^`]*?`?([0-9a-f]{32,})`", SPEC[SPEC.index(after):])
    assert match, name
    return match.group(1)


# -- §3 and §5.1: frames and the session envelope ------------------------------------------
def test_the_ping_frame_of_section_3() -> None:
    lines = block_after("`ping` with `seq = 1` and a 3-byte payload `abc`:")
    body = spec_bytes([lines[1].split("=", 1)[1], lines[2]])
    frame = spec_bytes([lines[3].split("=", 1)[1].split("+")[0]])
    from_words = msgpack.packb({"seq": 1, "payload": b"abc", "v": 1, "type": "ping"}, use_bin_type=True)
    assert body == from_words and len(body) == 32 and frame == len(body).to_bytes(4, "big")
    assert unpack(body) == Ping(seq=1, payload=b"abc") and pack(Ping(seq=1, payload=b"abc")) == body


def test_the_session_ping_of_section_5_1_against_the_sans_io_ends() -> None:
    lines = block_after("Worked example, `ping {seq: 1, payload: b\"abc\"}` as request 1")
    client_frame = spec_bytes(until_equals(lines[:3]))
    server_frame = spec_bytes(until_equals(lines[3:]))
    request = {"seq": 1, "payload": b"abc", "rid": 1, "v": 1, "type": "ping"}
    answer = {"seq": 1, "payload": b"abc", "rid": 1, "end": True, "v": 1, "type": "pong"}
    assert client_frame == frame_of(request) and server_frame == frame_of(answer)

    server, client = SessionServer(), SessionClient()
    server.receive_data(client_frame)
    assert server.next_event() == Request(1, Ping(seq=1, payload=b"abc"))
    rid, ours = client.request(Ping(seq=1, payload=b"abc"))
    assert rid == 1 and ours == client_frame  # the node writes exactly the spec's request
    client.receive_data(server_frame)
    assert client.next_reply() == Reply(1, Pong(seq=1, payload=b"abc"), True)


def frame_of(obj: dict) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


# -- §3: canonical msgpack -------------------------------------------------------------------
def test_the_canonical_encoding_example() -> None:
    lines = block_after("Worked example, the canonical encoding of")
    assert canonical_encode({"b": 1, "a": [{"y": 2, "x": 3}], "n": -1, "big": 300, "s": b"\x01"}) == spec_bytes(lines[:1])


# -- §5.2: words and SPAKE2 --------------------------------------------------------------------
def appendix_words(title: str) -> tuple[str, ...]:
    lines = block_after(title)
    words: list[str] = []
    for i, line in enumerate(lines):
        offset, *row = line.split()
        assert int(offset, 16) == 8 * i and len(row) == 8
        words += row
    return tuple(words)


def test_the_word_list_of_appendix_a_is_the_codes_list_byte_for_byte() -> None:
    even, odd = appendix_words("Even words (bytes 00 to ff):"), appendix_words("Odd words (bytes 00 to ff):")
    assert even == wordlist.EVEN and odd == wordlist.ODD and len(set(even) | set(odd)) == 512
    appendix = SPEC[SPEC.index("## Appendix A"):]
    assert hashlib.sha256("\n".join(even).encode()).hexdigest() == spec_hex("the even list's SHA-256 is", "## Appendix A")
    assert hashlib.sha256("\n".join(odd).encode()).hexdigest() in appendix
    assert "`" + "-".join(wordlist.words_for(bytes([0x2F, 0x8A]))) + "`" in appendix
    assert all(w == w.lower() and w.isascii() for w in even + odd)
    # the password is the lowercase code, whatever case a person typed
    assert parse_code("4817 Chisel Molecule").password == b"4817-chisel-molecule"
    assert PairingCode(nameplate=4817, words=("chisel", "molecule")).secret_bytes == bytes(
        [even.index("chisel"), odd.index("molecule")])


def test_the_spake2_example_from_the_spec_s_formulas() -> None:
    after = "**SPAKE2, byte by byte**"
    assert ParamsEd25519.M.to_bytes().hex() == spec_hex("`M = ", after)
    assert ParamsEd25519.N.to_bytes().hex() == spec_hex("`N = ", after)
    pw = b"4817-chisel-molecule"
    w = int.from_bytes(hkdf_sha256(pw, b"SPAKE2 pw", 48), "big") % (2**252 + 27742317777372353535851937790883648493)
    assert w.to_bytes(32, "little").hex() == spec_hex("`w` (as 32 bytes little-endian) is", after)
    x = int.from_bytes(bytes.fromhex(spec_hex("with `x` =", after)), "little")
    joiner = SPAKE2_A(pw, idA=b"J", idB=b"I", entropy_f=fixed_scalar(x))
    X = joiner.start()
    assert X.hex() == spec_hex("the joiner's\n`pake` is", after) and X[0:1] == b"A" and len(X) == 33
    Y = bytes.fromhex(spec_hex("the inviter's `pake`", after))
    assert Y[0:1] == b"B"
    assert joiner.finish(Y).hex() == spec_hex("both sides get `K = ", after)


def hkdf_sha256(ikm: bytes, info: bytes, length: int) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"", info=info).derive(ikm)


def fixed_scalar(x: int):  # noqa: ANN201
    """spake2's entropy function that makes it draw exactly `x` (Ed25519's random_scalar reads
    64 bytes, big-endian, mod L: given x itself, below L, it draws x)."""
    def entropy(n: int) -> bytes:
        return x.to_bytes(n, "big")
    return entropy


# -- §5.4: a task event ------------------------------------------------------------------------
def test_the_task_event_example() -> None:
    lines = block_after("Worked example, a `token` event as the second frame answering")
    body = spec_bytes(until_equals(lines))
    assert len(body) == 98
    from_words = {"task_id": "t1", "seq": 2, "kind": "token", "state": "working", "at": 1800000000.5,
                  "data": {"text": "Hel"}, "rid": 3, "end": False, "v": 1, "type": "task.event"}
    assert body == msgpack.packb(from_words, use_bin_type=True)
    obj = decode_map(body)
    assert (obj.pop("rid"), obj.pop("end")) == (3, False)
    event = from_map(obj)
    assert event == TaskEvent(task_id="t1", seq=2, kind=EventKind.TOKEN, state=TaskState.WORKING,
                              at=1800000000.5, data={"text": "Hel"})


# -- §5.7: a letter's signature ------------------------------------------------------------------
SEED = bytes(range(32))


def letter_as_the_spec_says(sent: dict, key: Ed25519PrivateKey) -> dict:
    """Sign a letter as §5.7 says: the sent fields plus every default, nils left out, canonical."""
    defaults = {"thread": "main", "kind": "send", "text": "", "body": {}, "withdrawn": False}
    signed = {k: v for k, v in {**defaults, **sent}.items() if v is not None}
    return {**sent, "signature": key.sign(b"psymesh/letter/v1\x00" + canonical_encode(signed, floats=True))}


def test_the_partial_web_page_example_and_an_older_exits_page() -> None:
    """§5.10's partial page parses as this node reads it; an older exit's page, without the
    optional fields, still does, and reads as partial for a reason not named."""
    example = re.search(r'shown as JSON; a session reply adds `rid`\s+and `end`\): `(\{.*?\})`', SPEC, re.S)
    assert example is not None
    page = from_map(json.loads(example.group(1)))
    assert isinstance(page, WebPage) and page.truncated_reasons == ("too_large", "max_chars")
    assert "first 1048576 of the page's 2092863 bytes" in (page.partial() or "")
    older = unpack(msgpack.packb({"v": 1, "type": "web.page", "url": "u", "final_url": "u", "status": 200,
                                  "content_type": "text/html", "text": "t", "truncated": True}))
    assert isinstance(older, WebPage) and older.truncated_reasons == () and older.body_bytes is None
    assert older.partial() == "partial: the exit cut the text"
    newer = unpack(msgpack.packb({"v": 1, "type": "web.page", "url": "u", "final_url": "u", "status": 200,
                                  "content_type": "text/html", "truncated": True, "truncated_reasons": ["too_odd"]}))
    assert newer.partial() == "partial: the exit cut the text (too_odd)"  # type: ignore[union-attr]


def test_the_letter_example_signs_the_defaults_too() -> None:
    key = Ed25519PrivateKey.from_private_bytes(SEED)
    sender = peer_id_from_public_key(key.public_key().public_bytes_raw())
    assert sender in SPEC[SPEC.index("**What a letter's signature covers.**"):]
    recipient = "12D3KooWCd3eX8r5ihRvzK7P1yPq5aakaBJhG5GNj18YTztPhoCa"
    sent = {"id": "l1", "sender": sender, "recipient": recipient, "tseq": 1, "text": "hi", "at": 1800000000000}
    signing = spec_bytes(block_after("It signs these 215 bytes:"))
    assert len(signing) == 215
    assert signing == b"psymesh/letter/v1\x00" + canonical_encode({"thread": "main", "kind": "send", "body": {},
                                                                    "withdrawn": False, **sent})
    letter = letter_as_the_spec_says(sent, key)
    assert letter["signature"].hex() == spec_hex("and its `signature` is", "It signs these 215 bytes:")
    # the node takes the letter with only the keys sent, and its signature holds
    message = unpack(pack_raw({"letter": letter, "v": 1, "type": "msg.send"}))
    assert isinstance(message, MsgSend) and message.letter.signing_bytes() == signing
    check_letter(message.letter, sender=sender, local_peer_id=recipient)
    # signed over exactly the keys sent (no body, no withdrawn...): refused
    bare = {**sent, "signature": key.sign(b"psymesh/letter/v1\x00" + canonical_encode(sent))}
    assert not Letter.model_validate(bare).signature_valid()


def pack_raw(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# -- the same messages to a running node ------------------------------------------------------------
@pytest.mark.anyio
async def test_a_running_node_answers_the_spec_s_session_ping_and_takes_its_letter(tmp_path: Path) -> None:
    """A paired phone writes §5.1's request bytes and a letter signed as §5.7 says on a raw
    session stream to its home: the home answers the ping as the example shows (plus `time`,
    which the example leaves out) and stores the letter."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone")
        stream = await phone.p2p.open_stream(home.identity.peer_id, "/psymesh/session/1.0.0")
        lines = block_after("Worked example, `ping {seq: 1, payload: b\"abc\"}` as request 1")
        key = Ed25519PrivateKey.from_private_bytes(phone.identity.seed)
        sent = {"id": "spec-1", "sender": phone.identity.peer_id, "recipient": home.identity.peer_id,
                "tseq": 1, "text": "hi", "at": 1800000000000}
        letter = frame_of({"letter": letter_as_the_spec_says(sent, key), "rid": 2, "v": 1, "type": "msg.send"})
        await stream.send_all(spec_bytes(until_equals(lines[:3])) + letter)
        answers = await raw_answers(stream, 2)
        await stream.aclose()
        pong = answers[1]
        assert isinstance(pong.pop("time"), float)
        assert frame_of(pong) == spec_bytes(until_equals(lines[3:]))
        assert {"rid": 2, "end": True, "type": "msg.receipt", "id": "spec-1", "status": "stored"}.items() <= answers[2].items()


def test_the_task_id_grammar_of_section_5_4_is_the_node_s() -> None:
    """Issue 34 item 5: §5.4 states the task-id grammar as a regular expression; the node's
    TaskId takes exactly the ids it matches (the spec's own examples, and edge cases)."""
    from pydantic import TypeAdapter, ValidationError

    from psymesh.protocol.tasks import TaskId

    grammar = re.search(r"A task id is .*?`(\^[^`]+\$)`", SPEC, re.S)
    assert grammar is not None, "§5.4 must state the task-id grammar as a regular expression"
    spec_re = re.compile(grammar.group(1))
    section = SPEC[SPEC.index("### 5.4"):SPEC.index("### 5.5")]
    said_ok = re.search(r"Examples:\s*(.*?) are task ids", section, re.S)
    said_bad = re.search(r"task ids; (.*?) are not", section, re.S)
    assert said_ok and said_bad
    ok = re.findall(r"`([^`]+)`", said_ok.group(1))
    bad = re.findall(r"`([^`]+)`", said_bad.group(1)) + ["x" * 65]
    adapter = TypeAdapter(TaskId)

    def node_takes(task_id: str) -> bool:
        try:
            adapter.validate_python(task_id)
        except ValidationError:
            return False
        return True

    for task_id in ok + bad + ["a", "9", "x" * 64, "a_b", "a\n", "_a", ":a", "a b", "A.-:_9"]:
        assert node_takes(task_id) is bool(spec_re.fullmatch(task_id)), task_id
    assert all(node_takes(t) for t in ok) and not any(node_takes(t) for t in bad)


def test_the_mistyped_ping_of_section_3_is_bad_frame_for_its_rid_alone() -> None:
    """Issue 34 item 5: §3's example frame, `ping {seq: "1"}`, is refused `bad_frame` with the
    spec's message; it is not answered as `seq: 1`, and the session goes on."""
    from psymesh.protocol.session import Refused

    lines = block_after("So `ping {seq: \"1\"}` is answered")
    frame = spec_bytes(until_equals(lines[:1]))
    assert frame == frame_of({"seq": "1", "rid": 1, "v": 1, "type": "ping"})
    server = SessionServer()
    server.receive_data(frame)
    event = server.next_event()
    assert isinstance(event, Refused) and event.error.code.value == "bad_frame"
    said = re.search(r'message: "([^"]+)"', "\n".join(lines))
    assert said is not None and event.error.message == said.group(1)
    assert not server.broken


# -- §5.11: re-sync answers --------------------------------------------------------------
def test_the_re_sync_answers_of_section_5_11() -> None:
    lines = block_after("The answers to requests 2 and 3 on the wire")
    grant, key = spec_bytes(until_equals(lines[:3])), spec_bytes(until_equals(lines[3:]))
    assert grant == frame_of({"serial": 7, "rid": 2, "end": True, "v": 1, "type": "manifest.ok"}) and len(grant) == 43
    assert key == frame_of({"rid": 3, "end": True, "v": 1, "type": "web.key_ok"}) and len(key) == 34
    client = SessionClient()
    client.request(Ping(seq=1))
    client.request(Ping(seq=2))
    client.request(Ping(seq=3))
    client.receive_data(grant + key)
    assert client.next_reply() == Reply(2, ManifestOk(serial=7), True)
    assert client.next_reply() == Reply(3, WebKeyOk(), True)


# -- §5.12: a share of a split model -----------------------------------------------------------
def test_the_rpc_offer_of_section_5_12_and_its_accept() -> None:
    lines = block_after("Worked example, the offer of `llama-cpp-python 0.3.36` speaking RPC 7.0.0")
    frame = spec_bytes(until_equals(lines))
    offer = {"rpc": [7, 0, 0], "build": "llama-cpp-python 0.3.36", "probe": False, "v": 1, "type": "rpc.offer"}
    assert frame == frame_of(offer) and len(frame) == 68
    assert unpack(frame[4:]) == RpcOffer(rpc=(7, 0, 0), build="llama-cpp-python 0.3.36")
    assert pack(RpcOffer(rpc=(7, 0, 0), build="llama-cpp-python 0.3.36")) == frame[4:]

    accept = pack(RpcAccept(rpc=(7, 0, 0), build="llama-cpp-python 0.3.36", memory_mb=2048, threads=3))
    said = SPEC[SPEC.index("`rpc.accept {rpc: [7, 0, 0], build:"):]
    assert f"({len(accept) + 4} bytes:" in said[:200]
    head, tail = re.search(r"`([0-9a-f ]+) \.\.\. ([0-9a-f \n]+) \.\.\.`", said).groups()
    framed = (len(accept).to_bytes(4, "big") + accept)
    assert framed.startswith(bytes.fromhex(head)) and bytes.fromhex(tail.replace("\n", " ")) in framed
    hello = re.search(r"`HELLO` \(command 14, size 0: `([0-9a-f \n]+)`\)", said).group(1)
    assert bytes.fromhex(hello.replace("\n", " ")) == bytes([14]) + (0).to_bytes(8, "little")
