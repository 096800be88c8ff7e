"""Capability manifests: signing, the ordered permission checklist, CLI capability strings."""
from __future__ import annotations

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from psymesh.protocol.errors import ErrorCode, ProtocolError, PsymeshError
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.limits import Limits
from psymesh.protocol.signing import canonical_encode
from psymesh.protocol.manifest import (
    Capability,
    Manifest,
    ManifestRevoke,
    Operation,
    check,
    new_manifest,
    parse_capability,
    preset,
    revocation,
    verify_from_issuer,
    verify_grant,
)
from psymesh.protocol.messages import pack, unpack
from psymesh.protocol.pairing import PairWelcome, PeerInfo

NOW = 1_700_000_000


def identity(seed: int) -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)
    return key, peer_id_from_public_key(key.public_key().public_bytes_raw())


HOME_KEY, HOME = identity(1)
_, PHONE = identity(2)
OTHER_KEY, OTHER = identity(3)


def grant(*caps: str, limits: Limits | None = None, ttl: float | None = None) -> Manifest:
    return new_manifest(HOME, PHONE, caps, now=NOW, ttl=ttl, limits=limits).sign(HOME_KEY)


def decide(manifest: Manifest, op: Operation, now: float = NOW + 1):
    return check(manifest, op, local_peer_id=HOME, remote_peer_id=PHONE, now=now)


# ---------------------------------------------------------------------------- signing


def test_signature_survives_the_wire_and_catches_tampering() -> None:
    manifest = grant("msg.send", "tool:files.*", limits=Limits(requests_per_minute=5))
    assert manifest.signature_valid() and len(manifest.signature) == 64

    welcome = PairWelcome(mac=bytes(32), info=PeerInfo(name="home"), manifest=manifest)
    received = unpack(pack(welcome))
    assert isinstance(received, PairWelcome) and received.manifest == manifest
    assert received.manifest.signature_valid()

    widened = manifest.model_copy(update={"capabilities": (*manifest.capabilities, Capability(name="relay"))})
    assert not widened.signature_valid()
    flipped = manifest.model_copy(update={"signature": bytes([manifest.signature[0] ^ 1]) + manifest.signature[1:]})
    assert not flipped.signature_valid()


def test_a_remembered_verification_holds_for_the_exact_signed_bytes_only() -> None:
    """`check()` runs on every request, so a signature that verified is remembered (keyed by
    issuer, signature and the exact signed bytes). Nothing else may ride on it: a copy with
    the same signature but another body, issuer or date fails, and the dates are still
    checked on every call."""
    manifest = grant("web.fetch:domains=example.org", ttl=60)
    op = Operation(name="web.fetch", domain="example.org")
    for _ in range(3):
        assert manifest.signature_valid() and decide(manifest, op).allowed
    wider = manifest.model_copy(update={"capabilities": (Capability(name="web.fetch"),)})
    longer = manifest.model_copy(update={"expires": manifest.expires + 3600})
    other_issuer = manifest.model_copy(update={"issuer": OTHER})
    for forged in (wider, longer, other_issuer):
        assert forged.signature == manifest.signature and not forged.signature_valid()
    assert decide(wider, Operation(name="web.fetch", domain="evil.example")).code == ErrorCode.FORBIDDEN
    assert decide(manifest, op, now=NOW + 61).code == ErrorCode.EXPIRED


def test_only_the_issuer_key_can_sign() -> None:
    with pytest.raises(ValueError):
        new_manifest(HOME, PHONE, ["msg.send"], now=NOW).sign(OTHER_KEY)


def test_canonical_encoding_ignores_key_order_and_refuses_floats() -> None:
    assert canonical_encode({"b": 1, "a": [{"y": 2, "x": 3}]}) == canonical_encode({"a": [{"x": 3, "y": 2}], "b": 1})
    with pytest.raises(TypeError):
        canonical_encode({"t": 1.5})


def test_unknown_fields_are_rejected_not_ignored() -> None:
    body = grant("msg.send").model_dump()
    with pytest.raises(ValidationError):
        Manifest.model_validate({**body, "allow_everything": True})
    welcome = {"v": 1, "type": "pair.welcome", "mac": bytes(32), "info": {"name": "home"},
               "manifest": {**body, "capabilities": [{"name": "msg.send", "note": "x"}]}}
    with pytest.raises(ProtocolError):
        unpack(msgpack.packb(welcome, use_bin_type=True))


# ---------------------------------------------------------------------------- revocation notices


def test_a_revocation_notice_is_signed_survives_the_wire_and_catches_tampering() -> None:
    held = grant("msg.send")
    notice = revocation(HOME, PHONE, held, now=NOW + 0.9).sign(HOME_KEY)
    assert (notice.serial, notice.at) == (held.serial, NOW) and notice.signature_valid()
    received = unpack(pack(notice))
    assert isinstance(received, ManifestRevoke) and received == notice and received.signature_valid()
    for change in ({"serial": held.serial + 1}, {"at": NOW + 1}, {"subject": OTHER}, {"issuer": OTHER}):
        assert not notice.model_copy(update=change).signature_valid(), change
    with pytest.raises(ValueError):
        revocation(HOME, PHONE, held, now=NOW).sign(OTHER_KEY)
    assert revocation(HOME, PHONE, None, now=NOW).serial == 0  # nothing granted yet


def test_a_grant_signature_does_not_make_a_notice_or_the_reverse() -> None:
    """Separate signing contexts: one signed object cannot be passed off as the other."""
    notice = revocation(HOME, PHONE, None, now=NOW)
    manifest_context, revoke_context = b"psymesh/manifest/v1\x00", b"psymesh/revoke/v1\x00"
    body = notice.signing_bytes().removeprefix(revoke_context)
    assert body != notice.signing_bytes() and grant().signing_bytes().startswith(manifest_context)
    as_notice = notice.model_copy(update={"signature": HOME_KEY.sign(manifest_context + body)})
    assert not as_notice.signature_valid()
    assert notice.model_copy(update={"signature": HOME_KEY.sign(revoke_context + body)}).signature_valid()


def test_a_notice_voids_the_grants_up_to_its_serial_only() -> None:
    held = grant("msg.send")
    notice = revocation(HOME, PHONE, held, now=NOW).sign(HOME_KEY)
    assert notice.voids(held) and notice.voids(None)
    older = held.model_copy(update={"serial": held.serial - 1})
    newer = held.model_copy(update={"serial": held.serial + 1})  # granted when the two paired again
    assert notice.voids(older) and not notice.voids(newer)


def test_a_subject_takes_grants_and_notices_only_from_their_issuer_for_itself() -> None:
    notice = revocation(HOME, PHONE, None, now=NOW).sign(HOME_KEY)
    for signed in (grant("msg.send"), notice):
        verify_from_issuer(signed, sender=HOME, local_peer_id=PHONE)
        for sender, local in ((OTHER, PHONE), (HOME, OTHER)):
            with pytest.raises(PsymeshError) as err:
                verify_from_issuer(signed, sender=sender, local_peer_id=local)
            assert err.value.code is ErrorCode.FORBIDDEN
    forged = notice.model_copy(update={"signature": OTHER_KEY.sign(notice.signing_bytes())})
    with pytest.raises(PsymeshError) as err:
        verify_from_issuer(forged, sender=HOME, local_peer_id=PHONE)
    assert err.value.code is ErrorCode.FORBIDDEN and "revocation" in err.value.message
    with pytest.raises(ProtocolError):  # a peer id must carry a key
        unpack(pack(notice).replace(HOME.encode(), b"x" * len(HOME)))


# ---------------------------------------------------------------------------- the checklist, in order


def test_grant_from_another_issuer_is_refused() -> None:
    foreign = new_manifest(OTHER, PHONE, ["msg.send"], now=NOW).sign(OTHER_KEY)
    decision = decide(foreign, Operation(name="msg.send"))
    assert (decision.allowed, decision.code) == (False, ErrorCode.FORBIDDEN)
    assert "not issued by this node" in decision.reason


def test_forged_signature_claiming_our_issuer_is_refused() -> None:
    unsigned = new_manifest(HOME, PHONE, ["msg.send"], now=NOW)
    forged = unsigned.model_copy(update={"signature": OTHER_KEY.sign(unsigned.signing_bytes())})
    decision = decide(forged, Operation(name="msg.send"))
    assert decision.code is ErrorCode.FORBIDDEN and "signature" in decision.reason
    assert decide(unsigned, Operation(name="msg.send")).code is ErrorCode.FORBIDDEN


def test_grant_for_another_peer_is_refused() -> None:
    decision = check(grant("msg.send"), Operation(name="msg.send"), local_peer_id=HOME, remote_peer_id=OTHER, now=NOW)
    assert decision.code is ErrorCode.FORBIDDEN and "another peer" in decision.reason


def test_validity_window() -> None:
    manifest = grant("msg.send", ttl=3600)
    op = Operation(name="msg.send")
    assert decide(manifest, op, now=NOW - 1).code is ErrorCode.EXPIRED  # not yet valid
    assert decide(manifest, op, now=NOW).allowed
    assert decide(manifest, op, now=NOW + 3599.9).allowed
    assert decide(manifest, op, now=NOW + 3600).code is ErrorCode.EXPIRED
    assert decide(grant("msg.send"), op, now=NOW + 10**9).allowed  # no ttl: valid until revoked


def test_verify_grant_checks_the_grant_but_no_capability() -> None:
    manifest = grant(ttl=10)  # grants nothing, but is a valid grant
    kw = {"local_peer_id": HOME, "remote_peer_id": PHONE}
    assert verify_grant(manifest, now=NOW + 1, **kw).allowed
    assert verify_grant(manifest, now=NOW + 10, **kw).code is ErrorCode.EXPIRED
    assert verify_grant(manifest, now=NOW + 1, local_peer_id=HOME, remote_peer_id=OTHER).code is ErrorCode.FORBIDDEN


def test_checks_run_in_order_first_failure_wins() -> None:
    manifest = grant("msg.send", ttl=10, limits=Limits(max_payload_bytes=10))
    big_and_forbidden = Operation.tool_call("files.read", payload_bytes=11)
    assert decide(manifest, big_and_forbidden, now=NOW + 20).code is ErrorCode.EXPIRED
    assert decide(manifest, big_and_forbidden).code is ErrorCode.FORBIDDEN
    assert decide(manifest, Operation(name="msg.send", payload_bytes=11)).code is ErrorCode.TOO_LARGE
    assert decide(manifest, Operation(name="msg.send", payload_bytes=10)).allowed


def test_a_denial_names_the_missing_capability_and_raises_a_typed_error() -> None:
    decision = decide(grant("task.infer:models=botpsy*"), Operation.infer("llama-3-8b"))
    assert decision.details == {"missing": "task.infer:models=llama-3-8b", "granted": ["task.infer:models=botpsy*"]}
    assert "task.infer:models=llama-3-8b" in decision.reason
    with pytest.raises(PsymeshError) as info:
        decision.raise_if_denied()
    assert info.value.code is ErrorCode.FORBIDDEN and info.value.details["missing"] == "task.infer:models=llama-3-8b"


# ---------------------------------------------------------------------------- the permission matrix


ALLOW, DENY = True, False


@pytest.mark.parametrize(
    ("capability", "operation", "allowed"),
    [
        # task.infer: model globs and the token ceiling
        ("task.infer", Operation.infer("anything"), ALLOW),
        ("task.infer", Operation.infer(None), ALLOW),
        ("task.infer:models=botpsy*", Operation.infer("botpsy-0.8b-q4"), ALLOW),
        ("task.infer:models=botpsy*", Operation.infer("qwen3-8b"), DENY),
        ("task.infer:models=botpsy*", Operation.infer(None), DENY),
        ("task.infer:models=botpsy*,qwen3-?b", Operation.infer("qwen3-8b"), ALLOW),
        ("task.infer:models=botpsy*", Operation.infer("BotPsy-0.8b"), DENY),  # case-sensitive, like file names
        ("task.infer:max_tokens=2048", Operation.infer("m", max_tokens=2048), ALLOW),
        ("task.infer:max_tokens=2048", Operation.infer("m", max_tokens=2049), DENY),
        # tools: exact names and globs
        ("tool:system.info", Operation.tool_call("system.info"), ALLOW),
        ("tool:system.info", Operation.tool_call("system.infox"), DENY),
        ("tool:files.*", Operation.tool_call("files.read"), ALLOW),
        ("tool:files.*", Operation.tool_call("files.write"), ALLOW),
        ("tool:files.*", Operation.tool_call("filesystem.read"), DENY),
        ("tool:files.*", Operation.tool_call("system.info"), DENY),
        ("tool:*", Operation.tool_call("shell.exec"), ALLOW),
        ("tool:files.*", Operation(name="task.agent"), DENY),
        # web.fetch: domain rules
        ("web.fetch", Operation.fetch("https://anything.example/x"), ALLOW),
        ("web.fetch:domains=*", Operation.fetch("http://10.0.0.1/"), ALLOW),
        ("web.fetch:domains=example.com", Operation.fetch("https://example.com/a?b"), ALLOW),
        ("web.fetch:domains=example.com", Operation.fetch("https://EXAMPLE.com./"), ALLOW),
        ("web.fetch:domains=example.com", Operation.fetch("https://www.example.com/"), DENY),
        ("web.fetch:domains=example.com", Operation.fetch("https://notexample.com/"), DENY),
        ("web.fetch:domains=example.com", Operation.fetch("https://example.com.evil.net/"), DENY),
        ("web.fetch:domains=*.wikipedia.org", Operation.fetch("https://en.wikipedia.org/wiki/X"), ALLOW),
        ("web.fetch:domains=*.wikipedia.org", Operation.fetch("https://en.m.wikipedia.org/"), ALLOW),
        ("web.fetch:domains=*.wikipedia.org", Operation.fetch("https://wikipedia.org/"), DENY),
        ("web.fetch:domains=*.wikipedia.org", Operation.fetch("https://evilwikipedia.org/"), DENY),
        ("web.fetch:domains=example.com,*.wikipedia.org", Operation.fetch("https://de.wikipedia.org/"), ALLOW),
        ("web.fetch:domains=bücher.de", Operation.fetch("https://xn--bcher-kva.de/"), ALLOW),
        ("web.fetch:domains=192.168.1.5", Operation.fetch("http://192.168.1.5:8080/"), ALLOW),
        ("web.fetch:domains=192.168.1.5", Operation.fetch("http://192.168.1.6/"), DENY),
        ("web.fetch:domains=example.com", Operation(name="web.search"), DENY),
        # the plain kinds: each covers itself only
        ("web.search", Operation(name="web.search"), ALLOW),
        ("task.agent", Operation(name="task.agent"), ALLOW),
        ("task.agent", Operation.infer("botpsy"), DENY),
        ("msg.send", Operation(name="msg.send"), ALLOW),
        ("msg.send", Operation(name="msg.ask"), DENY),
        ("msg.ask", Operation(name="msg.ask"), ALLOW),
        ("relay", Operation(name="relay"), ALLOW),
        ("relay", Operation(name="msg.send"), DENY),
    ],
)
def test_permission_matrix(capability: str, operation: Operation, allowed: bool) -> None:
    decision = decide(grant(capability), operation)
    assert decision.allowed is allowed, decision.reason
    if not allowed:
        assert decision.code is ErrorCode.FORBIDDEN


def test_default_deny() -> None:
    empty = grant()
    for op in (Operation(name="msg.send"), Operation.infer("m"), Operation.tool_call("system.info")):
        assert decide(empty, op).code is ErrorCode.FORBIDDEN


def test_the_token_ceiling_comes_with_the_decision() -> None:
    assert decide(grant("task.infer:max_tokens=512"), Operation.infer("m")).max_tokens == 512
    both = grant("task.infer:models=botpsy*,max_tokens=512", "task.infer:models=botpsy*,max_tokens=4096")
    assert decide(both, Operation.infer("botpsy")).max_tokens == 4096  # the most generous covering grant
    assert decide(grant("task.infer"), Operation.infer("m", max_tokens=10**6)).max_tokens is None


@pytest.mark.parametrize(
    ("name", "allowed", "denied"),
    [
        ("phone", [Operation.infer("qwen3-8b"), Operation(name="task.agent"), Operation.tool_call("system.info"),
                   Operation.tool_call("files.list"), Operation.fetch("https://example.org/"),
                   Operation(name="web.search"), Operation(name="msg.send"), Operation(name="msg.ask")],
         [Operation.tool_call("shell.exec"), Operation(name="relay")]),
        ("messaging", [Operation(name="msg.send"), Operation(name="msg.ask")],
         [Operation.infer("botpsy"), Operation(name="task.agent"), Operation.tool_call("files.read"),
          Operation.fetch("https://example.org/"), Operation(name="web.search"), Operation(name="relay")]),
    ],
)
def test_presets(name: str, allowed: list[Operation], denied: list[Operation]) -> None:
    manifest = preset(name, HOME, PHONE, NOW, ttl=86400).sign(HOME_KEY)
    assert manifest.expires == NOW + 86400 and manifest.limits.requests_per_minute
    for op in allowed:
        assert decide(manifest, op).allowed, op
    for op in denied:
        assert decide(manifest, op).code is ErrorCode.FORBIDDEN, op


def test_unknown_preset() -> None:
    with pytest.raises(PsymeshError) as info:
        preset("admin", HOME, PHONE, NOW)
    assert info.value.code is ErrorCode.BAD_REQUEST and "phone" in info.value.message


# ---------------------------------------------------------------------------- CLI capability strings


@pytest.mark.parametrize(
    "text",
    ["task.infer:models=botpsy*,max_tokens=2048", "task.infer:models=botpsy*,qwen*", "tool:files.*",
     "web.fetch:domains=example.com,*.wikipedia.org", "msg.send", "task.agent", "relay", "web.fetch"],
)
def test_capability_strings_round_trip(text: str) -> None:
    assert str(parse_capability(text)) == text


def test_capability_string_parses_lists_and_numbers() -> None:
    cap = parse_capability(" task.infer:models=botpsy*, qwen*, max_tokens=2048 ")
    assert (cap.models, cap.max_tokens) == (("botpsy*", "qwen*"), 2048)
    assert parse_capability("web.fetch:domains=Example.COM.").domains == ("example.com",)


@pytest.mark.parametrize(
    "text",
    ["fs.write", "tool:", "tool:files/*", "tool", "msg.send:models=x", "task.infer:max_tokens=lots",
     "task.infer:max_tokens=1,2", "task.infer:models=a,models=b", "task.infer:botpsy*", "task.infer:models=",
     "task.infer:color=red", "web.fetch:domains=ex*ample.com", "web.fetch:domains=*.10.0.0.1",
     "web.fetch:domains=exa mple.com", "", ":"],
)
def test_bad_capability_strings_are_refused_with_a_reason(text: str) -> None:
    with pytest.raises(PsymeshError) as info:
        parse_capability(text)
    assert info.value.code is ErrorCode.BAD_REQUEST and info.value.message


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_any_capability_string_parses_or_raises_a_typed_error(text: str) -> None:
    try:
        cap = parse_capability(text)
    except PsymeshError:
        return
    assert parse_capability(str(cap)) == cap


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_any_url_becomes_a_fetch_operation_or_a_typed_error(url: str) -> None:
    try:
        op = Operation.fetch(url)
    except PsymeshError:
        return
    decide(grant("web.fetch:domains=*.example.com"), op)  # and judging it never raises
