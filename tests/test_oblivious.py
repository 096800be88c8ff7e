"""Two-hop web sealing (protocol/oblivious.py), sans-IO: requests and answers round-trip
and reveal only their padding bucket; altered bytes, another exit's key, replays, stale
and future-dated requests are refused with their codes; the replay memory says BUSY
rather than forget; the exit key's signature binds every field. Two independent HPKE
implementations (pyhpke, which we seal with, and `cryptography`'s) open each other's
requests, and RFC 9458's Appendix A example checks the response key schedule."""
from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite
from hypothesis import given, settings, strategies as st
from pyhpke import AEADId, CipherSuite, KDFId, KEMId, KEMKeyPair

from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.oblivious import (
    consistent_key,
    AEAD_ID,
    BUCKETS,
    KDF_ID,
    KEM_ID,
    MAX_REQUEST_BODY,
    MAX_RESPONSE_BODY,
    REQUEST_LABEL,
    REQUEST_OVERHEAD,
    RESPONSE_OVERHEAD,
    ExitKey,
    ExitSecret,
    Gateway,
    _response_key_nonce,
    seal_request,
    verify_exit_key,
)
from psymesh.protocol.web import MAX_SEALED_BYTES, WebRelay, WebSealedReply

T0 = 1_750_000_000.0
WINDOW = 60.0
ExitSetup = tuple[ExitSecret, ExitKey, Gateway]


def new_identity() -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.generate()
    return key, peer_id_from_public_key(key.public_key().public_bytes_raw())


@pytest.fixture
def exit_setup() -> ExitSetup:
    identity, exit_id = new_identity()
    secret = ExitSecret.generate(7)
    key = secret.public(identity, exit_id, T0, 86_400.0)
    return secret, key, Gateway({7: secret}, window_s=WINDOW)


def refused(code: ErrorCode, call: Callable[..., object], *args: object, **kwargs: object) -> PsymeshError:
    with pytest.raises(PsymeshError) as info:
        call(*args, **kwargs)
    assert info.value.code == code, info.value
    assert info.value.message
    return info.value


# ---------------------------------------------------------------------------- round trips


def test_request_and_response_round_trip(exit_setup: ExitSetup) -> None:
    _, key, gateway = exit_setup
    verify_exit_key(key, exit=key.exit, now=T0)
    sealed, pending = seal_request(key, b'{"type": "web.search", "query": "tides"}', now=T0)
    body, sealer = gateway.open(sealed, now=T0 + 1)
    assert body == b'{"type": "web.search", "query": "tides"}'
    assert pending.open(sealer.seal(b"the answer")) == b"the answer"
    assert gateway.remembered == 1


@settings(max_examples=60, deadline=None)
@given(request=st.binary(max_size=5000), answer=st.binary(max_size=5000))
def test_any_body_round_trips_through_the_padding(request: bytes, answer: bytes) -> None:
    secret = ExitSecret.generate(1)
    _, exit_id = new_identity()
    key = ExitKey(exit=exit_id, key_id=1, kem_id=KEM_ID, kdf_id=KDF_ID, aead_id=AEAD_ID,
                  public_key=secret.private_key.public_key().public_bytes_raw(), not_after=int(T0) + 60)
    sealed, pending = seal_request(key, request, now=T0)
    body, sealer = Gateway({1: secret}).open(sealed, now=T0)
    assert body == request
    assert pending.open(sealer.seal(answer)) == answer


def test_sizes_reveal_only_the_bucket(exit_setup: ExitSetup) -> None:
    _, key, gateway = exit_setup
    request_room = 1 + 8 + 4    # version, sent_at_ms, length
    response_room = 1 + 4       # version, length
    for i, bucket in enumerate(BUCKETS):
        smallest = BUCKETS[i - 1] - request_room + 1 if i else 0
        sizes = {len(seal_request(key, bytes(n), now=T0)[0]) for n in (smallest, bucket - request_room)}
        assert sizes == {bucket + REQUEST_OVERHEAD}
    assert len(seal_request(key, b"a", now=T0)[0]) != len(seal_request(key, bytes(1024), now=T0)[0])
    refused(ErrorCode.TOO_LARGE, seal_request, key, bytes(MAX_REQUEST_BODY + 1), now=T0)

    sealed, _ = seal_request(key, b"q", now=T0)
    _, sealer = gateway.open(sealed, now=T0)
    for i, bucket in enumerate(BUCKETS):
        smallest = BUCKETS[i - 1] - response_room + 1 if i else 0
        sizes = {len(sealer.seal(bytes(n))) for n in (smallest, bucket - response_room)}
        assert sizes == {bucket + RESPONSE_OVERHEAD}
    refused(ErrorCode.TOO_LARGE, sealer.seal, bytes(MAX_RESPONSE_BODY + 1))


def test_the_largest_bodies_fit_the_wire_messages(exit_setup: ExitSetup) -> None:
    _, key, gateway = exit_setup
    sealed, pending = seal_request(key, b"\x01" * MAX_REQUEST_BODY, now=T0)
    assert len(sealed) <= MAX_SEALED_BYTES
    WebRelay(exit=key.exit, sealed=sealed)
    body, sealer = gateway.open(sealed, now=T0)
    assert body == b"\x01" * MAX_REQUEST_BODY
    reply = sealer.seal(b"\x02" * MAX_RESPONSE_BODY)
    WebSealedReply(sealed=reply)
    assert pending.open(reply) == b"\x02" * MAX_RESPONSE_BODY


# ---------------------------------------------------------------------------- refusals


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


def test_altered_requests_are_refused(exit_setup: ExitSetup) -> None:
    _, key, gateway = exit_setup
    sealed, _ = seal_request(key, b"query", now=T0)
    refused(ErrorCode.BAD_REQUEST, gateway.open, flip(sealed, 0), now=T0)        # key_id
    refused(ErrorCode.BAD_REQUEST, gateway.open, flip(sealed, 6), now=T0)        # aead_id
    refused(ErrorCode.BAD_FRAME, gateway.open, flip(sealed, 7), now=T0)          # enc
    refused(ErrorCode.BAD_FRAME, gateway.open, flip(sealed, 50), now=T0)         # ciphertext
    refused(ErrorCode.BAD_FRAME, gateway.open, flip(sealed, len(sealed) - 1), now=T0)   # tag
    refused(ErrorCode.BAD_FRAME, gateway.open, sealed[:-1], now=T0)
    refused(ErrorCode.BAD_FRAME, gateway.open, sealed + b"\x00", now=T0)
    refused(ErrorCode.BAD_FRAME, gateway.open, sealed[:20], now=T0)
    refused(ErrorCode.BAD_FRAME, gateway.open, b"", now=T0)
    assert gateway.remembered == 0
    assert gateway.open(sealed, now=T0)[0] == b"query"   # the refusals burned nothing


def test_altered_or_foreign_responses_are_refused(exit_setup: ExitSetup) -> None:
    _, key, gateway = exit_setup
    sealed, pending = seal_request(key, b"one", now=T0)
    other, _ = seal_request(key, b"two", now=T0)
    _, sealer = gateway.open(sealed, now=T0)
    _, other_sealer = gateway.open(other, now=T0)
    reply = sealer.seal(b"answer")
    refused(ErrorCode.FORBIDDEN, pending.open, flip(reply, 0))                  # response nonce
    refused(ErrorCode.FORBIDDEN, pending.open, flip(reply, 40))                 # ciphertext
    refused(ErrorCode.FORBIDDEN, pending.open, other_sealer.seal(b"answer"))    # another request's answer
    refused(ErrorCode.BAD_FRAME, pending.open, reply[:-1])
    refused(ErrorCode.BAD_FRAME, pending.open, reply[:31])
    assert pending.open(reply) == b"answer"


def test_another_exits_key_cannot_open(exit_setup: ExitSetup) -> None:
    _, key, _ = exit_setup
    sealed, _ = seal_request(key, b"query", now=T0)
    impostor = Gateway({7: ExitSecret.generate(7)})
    refused(ErrorCode.BAD_FRAME, impostor.open, sealed, now=T0)


def test_a_replay_stays_refused_until_its_timestamp_refuses_it(exit_setup: ExitSetup) -> None:
    _, key, gateway = exit_setup
    sealed, _ = seal_request(key, b"query", now=T0)
    gateway.open(sealed, now=T0)
    refused(ErrorCode.CONFLICT, gateway.open, sealed, now=T0)
    refused(ErrorCode.CONFLICT, gateway.open, sealed, now=T0 + 30)
    refused(ErrorCode.CONFLICT, gateway.open, sealed, now=T0 + WINDOW)      # last instant of its window
    error = refused(ErrorCode.EXPIRED, gateway.open, sealed, now=T0 + WINDOW + 0.5)
    assert error.message == "stale or future-dated request"
    assert gateway.remembered == 0                                          # forgotten once useless


def test_stale_and_future_dated_requests_are_refused(exit_setup: ExitSetup) -> None:
    _, key, gateway = exit_setup
    stale, _ = seal_request(key, b"old", now=T0 - WINDOW - 1)
    future, _ = seal_request(key, b"new", now=T0 + WINDOW + 1)
    for sealed in (stale, future):
        error = refused(ErrorCode.EXPIRED, gateway.open, sealed, now=T0)
        assert error.message == "stale or future-dated request"
    edge, _ = seal_request(key, b"edge", now=T0 - WINDOW)
    assert gateway.open(edge, now=T0)[0] == b"edge"


def test_a_full_replay_memory_says_busy_rather_than_forget(exit_setup: ExitSetup) -> None:
    secret, key, _ = exit_setup
    gateway = Gateway({7: secret}, window_s=WINDOW, max_remembered=2)
    first, _ = seal_request(key, b"1", now=T0)
    gateway.open(first, now=T0)
    gateway.open(seal_request(key, b"2", now=T0 + 10)[0], now=T0 + 10)
    error = refused(ErrorCode.BUSY, gateway.open, seal_request(key, b"3", now=T0 + 20)[0], now=T0 + 20)
    assert error.retry_after == pytest.approx(WINDOW - 20)
    refused(ErrorCode.CONFLICT, gateway.open, first, now=T0 + 20)            # still guarded
    later = T0 + WINDOW + 1                                                   # the first is forgotten
    assert gateway.open(seal_request(key, b"4", now=later)[0], now=later)[0] == b"4"
    assert gateway.remembered == 2


def test_rotating_secrets_keeps_the_replay_memory(exit_setup: ExitSetup) -> None:
    secret, key, gateway = exit_setup
    sealed, _ = seal_request(key, b"query", now=T0)
    gateway.open(sealed, now=T0)
    gateway.set_secrets({7: secret, 8: ExitSecret.generate(8)})
    refused(ErrorCode.CONFLICT, gateway.open, sealed, now=T0 + 1)
    gateway.set_secrets({8: ExitSecret.generate(8)})
    refused(ErrorCode.BAD_REQUEST, gateway.open, seal_request(key, b"q", now=T0)[0], now=T0)
    with pytest.raises(ValueError):
        gateway.set_secrets({9: secret})


# ---------------------------------------------------------------------------- exit keys


def test_a_signed_exit_key_verifies_and_binds_every_field(exit_setup: ExitSetup) -> None:
    _, key, _ = exit_setup
    verify_exit_key(key, exit=key.exit, now=T0)
    assert key.not_after == int(T0 + 86_400)
    for change in ({"key_id": 8}, {"public_key": bytes(32)}, {"not_after": key.not_after + 1},
                   {"kem_id": 0x21}, {"signature": b"\x00" * 64}):
        refused(ErrorCode.FORBIDDEN, verify_exit_key, key.model_copy(update=change), exit=key.exit, now=T0)
    _, other_peer = new_identity()
    refused(ErrorCode.FORBIDDEN, verify_exit_key, key, exit=other_peer, now=T0)
    refused(ErrorCode.EXPIRED, verify_exit_key, key, exit=key.exit, now=key.not_after + 1)


def test_an_exit_key_in_another_suite_is_refused() -> None:
    identity, exit_id = new_identity()
    secret = ExitSecret.generate(1)
    aes = ExitKey(exit=exit_id, key_id=1, kem_id=KEM_ID, kdf_id=KDF_ID, aead_id=0x0001,
                  public_key=secret.private_key.public_key().public_bytes_raw(), not_after=int(T0) + 60).sign(identity)
    refused(ErrorCode.BAD_REQUEST, verify_exit_key, aes, exit=exit_id, now=T0)
    refused(ErrorCode.BAD_REQUEST, seal_request, aes, b"q", now=T0)


def test_an_exit_key_is_signed_only_by_its_exit() -> None:
    identity, _ = new_identity()
    _, someone_else = new_identity()
    with pytest.raises(ValueError):
        ExitSecret.generate(1).public(identity, someone_else, T0, 60.0)


def test_an_exit_secret_survives_its_file_format(exit_setup: ExitSetup) -> None:
    secret, key, _ = exit_setup
    again = ExitSecret.from_bytes(secret.to_bytes())
    assert again.key_id == 7
    assert "private_key" not in repr(again)
    sealed, _ = seal_request(key, b"query", now=T0)
    assert Gateway({7: again}).open(sealed, now=T0)[0] == b"query"
    for bad in (b"", secret.to_bytes()[:-1], b"x" + secret.to_bytes()[1:]):
        refused(ErrorCode.BAD_REQUEST, ExitSecret.from_bytes, bad)


# ---------------------------------------------------------------------------- independent implementations


def test_cryptography_hpke_and_pyhpke_open_each_others_requests(exit_setup: ExitSetup) -> None:
    """`cryptography`'s single-shot HPKE (base mode, aad b"", enc || ct) with the same
    suite and info opens what we seal, and seals what the gateway opens, laid out by hand
    from the module docstring."""
    secret, key, gateway = exit_setup
    suite = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.CHACHA20_POLY1305)
    hdr = struct.pack(">BHHH", 7, 0x0020, 0x0001, 0x0003)
    info = b"psymesh web request\x00" + hdr

    sealed, _ = seal_request(key, b"ours", now=T0)
    assert sealed[:7] == hdr
    plaintext = suite.decrypt(sealed[7:], secret.private_key, info=info)
    assert len(plaintext) == 1024
    assert plaintext[:13] == b"\x01" + struct.pack(">QI", int(T0 * 1000), 4)
    assert plaintext[13:17] == b"ours" and plaintext[17:] == bytes(1024 - 17)

    theirs = b"\x01" + struct.pack(">QI", int(T0 * 1000), 6) + b"theirs"
    theirs += bytes(1024 - len(theirs))
    body, _ = gateway.open(hdr + suite.encrypt(theirs, secret.private_key.public_key(), info=info), now=T0)
    assert body == b"theirs"


@pytest.mark.parametrize("plaintext, code", [
    (b"\x01" + struct.pack(">QI", int(T0 * 1000), 1) + b"x" + b"\x00" * 1010 + b"\x01", ErrorCode.BAD_FRAME),
    (b"\x01" + struct.pack(">QI", int(T0 * 1000), 1012) + bytes(1011), ErrorCode.BAD_FRAME),
    (b"\x01" + struct.pack(">QI", int(T0 * 1000), 1) + b"x" + bytes(986), ErrorCode.BAD_FRAME),
    (b"\x02" + struct.pack(">QI", int(T0 * 1000), 1) + b"x" + bytes(1010), ErrorCode.UNSUPPORTED_VERSION),
], ids=["padding not zero", "length overruns", "not a bucket", "version 2"])
def test_validly_sealed_but_malformed_frames_are_refused(exit_setup: ExitSetup, plaintext: bytes, code: ErrorCode) -> None:
    secret, _, gateway = exit_setup
    suite = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.CHACHA20_POLY1305)
    hdr = struct.pack(">BHHH", 7, 0x0020, 0x0001, 0x0003)
    sealed = hdr + suite.encrypt(plaintext, secret.private_key.public_key(), info=b"psymesh web request\x00" + hdr)
    refused(code, gateway.open, sealed, now=T0)
    assert gateway.remembered == 0


def test_rfc9458_appendix_a_example() -> None:
    """RFC 9458's worked example (X25519, HKDF-SHA256, AES-128-GCM, its own labels):
    pyhpke reproduces the encapsulated request and the exported secret, and our section
    4.4 key schedule reproduces the response key, nonce and encapsulated response."""
    hx = bytes.fromhex
    sk_r = hx("3c168975674b2fa8e465970b79c8dcf09f1c741626480bd4c6162fc5b6a98e1a")
    sk_e = hx("bc51d5e930bda26589890ac7032f70ad12e4ecb37abb1b65b1256c9c48999c73")
    request = hx("00034745540568747470730b6578616d706c652e636f6d012f")
    enc_request = hx("010020000100014b28f881333e7c164ffc499ad9796f877f4e1051ee6d31bad19dec96c208b472"
                     "6374e469135906992e1268c594d2a10c695d858c40a026e7965e7d86b83dd440b2c0185204b4d63525")
    response_nonce = hx("c789e7151fcba46158ca84b04464910d")
    enc_response = hx("c789e7151fcba46158ca84b04464910d86f9013e404feea014e7be4a441f234f857fbd")

    suite = CipherSuite.new(KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES128_GCM)
    pk_r = X25519PrivateKey.from_private_bytes(sk_r).public_key().public_bytes_raw()
    pk_e = X25519PrivateKey.from_private_bytes(sk_e).public_key().public_bytes_raw()
    ephemeral = KEMKeyPair(suite.kem.deserialize_private_key(sk_e), suite.kem.deserialize_public_key(pk_e))
    hdr = struct.pack(">BHHH", 1, 0x0020, 0x0001, 0x0001)
    enc, context = suite.create_sender_context(suite.kem.deserialize_public_key(pk_r),
                                               info=b"message/bhttp request\x00" + hdr, eks=ephemeral)
    assert hdr + enc + context.seal(request) == enc_request

    secret = context.export(b"message/bhttp response", 16)    # max(Nn, Nk) for AES-128-GCM
    assert secret == hx("62d87a6ba569ee81014c2641f52bea36")
    key, nonce = _response_key_nonce(secret, enc, response_nonce, nk=16, nn=12)
    assert key == hx("5d0172a080e428b16d298c4ea0db620d")
    assert nonce == hx("f6bf1aeb88d6df87007fa263")
    assert response_nonce + AESGCM(key).encrypt(nonce, hx("0140c8"), b"") == enc_response
    assert REQUEST_LABEL != b"message/bhttp request"    # ours is domain-separated from HTTP's


def test_the_phone_seals_to_the_relays_view_and_refuses_an_exit_that_keeps_a_key_per_asker() -> None:
    identity = Ed25519PrivateKey.generate()
    exit_id = peer_id_from_public_key(identity.public_key().public_bytes_raw())
    view = ExitSecret.generate(3).public(identity, exit_id, now=T0, ttl_s=3600)
    assert consistent_key(view, view, exit=exit_id, now=T0) == view
    mine_alone = ExitSecret.generate(3).public(identity, exit_id, now=T0, ttl_s=3600)   # same id, other key
    with pytest.raises(PsymeshError) as refused:
        consistent_key(mine_alone, view, exit=exit_id, now=T0)
    assert refused.value.code is ErrorCode.CONFLICT
    other_id = ExitSecret.generate(4).public(identity, exit_id, now=T0, ttl_s=3600)    # a rotation, or a tag
    assert consistent_key(other_id, view, exit=exit_id, now=T0) == view
    # the view itself is checked: the exit's own, signed, in date
    with pytest.raises(PsymeshError) as stale:
        consistent_key(view, view, exit=exit_id, now=T0 + 3601)
    assert stale.value.code is ErrorCode.EXPIRED
    forged = view.model_copy(update={"public_key": bytes(32)})
    with pytest.raises(PsymeshError) as bad:
        consistent_key(view, forged, exit=exit_id, now=T0)
    assert bad.value.code is ErrorCode.FORBIDDEN
