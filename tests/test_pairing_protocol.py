"""Pairing, sans-IO: two state machines in memory, every message through the real wire encoding."""
from __future__ import annotations

import base64
import random
from collections.abc import Callable

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psymesh.protocol import Channel
from psymesh.protocol.common import Error
from psymesh.protocol.errors import ErrorCode, ProtocolError, PsymeshError, RemoteError
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.manifest import PRESETS, Operation, check, preset
from psymesh.protocol.messages import Message, pack, unpack
from psymesh.protocol.pairing import (
    MAX_ATTEMPTS,
    MAX_NAMEPLATE,
    PAIR_MAX_FRAME,
    WRONG_CODE,
    Invite,
    InviteState,
    PairConfirm,
    PairHello,
    PairingCode,
    PairingInviter,
    PairingJoiner,
    PairPake,
    PairState,
    PairWelcome,
    PeerInfo,
    encode_invite,
    new_invite,
    parse_code,
    parse_invite,
)
from psymesh.protocol.strangers import PairingGuard, StrangerLimits
from psymesh.protocol.wordlist import EVEN, ODD

NOW = 1_700_000_000.0


def identity(seed: int) -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)
    return key, peer_id_from_public_key(key.public_key().public_bytes_raw())


HOME_KEY, HOME = identity(1)
_, PHONE = identity(2)
_, RELAY = identity(3)
HOME_INFO = PeerInfo(name="home-pc", role="home", addrs=("/ip4/192.168.1.23/tcp/4001",))
PHONE_INFO = PeerInfo(name="pixel", role="phone", addrs=())


def fixed_entropy(seed: int) -> Callable[[int], bytes]:
    rng = random.Random(seed)
    return lambda n: rng.randbytes(n)


class Invites:
    """The inviter's invite store, as the node would keep it (keyed by nameplate)."""

    def __init__(self, *invites: Invite) -> None:
        self.by_nameplate = {i.nameplate: i for i in invites}

    def find(self, nameplate: int) -> Invite | None:
        return self.by_nameplate.get(nameplate)


class Wire:
    """Carries messages between the two machines as framed bytes, records every byte,
    and answers a local PsymeshError with an `error` reply, as the node does."""

    def __init__(self) -> None:
        self.bytes_seen = b""
        self._tx, self._rx = Channel(), Channel()

    def carry(self, message: Message) -> Message:
        data = self._tx.send(message)
        self.bytes_seen += data
        self._rx.receive_data(data)
        received = self._rx.next_message()
        assert received is not None
        return received


def converse(joiner: PairingJoiner, inviter: PairingInviter, now: float = NOW,
             relay: Callable[[Message], Message] = lambda m: m) -> tuple[PsymeshError | None, PsymeshError | None]:
    """Run a whole pairing; return (joiner's error, inviter's error)."""
    wire = Wire()
    to_inviter: list[Message] = [joiner.start()]
    to_joiner: list[Message] = []
    errors: dict[str, PsymeshError] = {}
    for _ in range(10):  # the protocol needs 2 round trips; a loop means a bug
        if not to_inviter and not to_joiner:
            break
        for msg in to_inviter:
            try:
                to_joiner += inviter.receive(wire.carry(relay(msg)), now)
            except PsymeshError as exc:
                errors["inviter"] = exc
                if not isinstance(exc, RemoteError):
                    to_joiner.append(Error.from_exception(exc))
        to_inviter = []
        for msg in to_joiner:
            try:
                to_inviter += joiner.receive(wire.carry(relay(msg)))
            except PsymeshError as exc:
                errors["joiner"] = exc
                if not isinstance(exc, RemoteError):
                    to_inviter.append(Error.from_exception(exc))
        to_joiner = []
    else:
        pytest.fail("pairing did not settle")
    converse.last_wire = wire  # type: ignore[attr-defined]
    return errors.get("joiner"), errors.get("inviter")


def make_invite(**kw) -> Invite:
    kw.setdefault("rng", random.Random(7))
    return new_invite(NOW, name="phone", **kw)


def joiner_for(code: PairingCode | str, *, me: str = PHONE, them: str = HOME, seed: int = 11) -> PairingJoiner:
    return PairingJoiner(code, local_peer_id=me, remote_peer_id=them, info=PHONE_INFO, entropy=fixed_entropy(seed))


def inviter_for(store: Invites, *, me: str = HOME, them: str = PHONE, seed: int = 12) -> PairingInviter:
    return PairingInviter(local_peer_id=me, remote_peer_id=them, info=HOME_INFO, signing_key=HOME_KEY,
                          find_invite=store.find, entropy=fixed_entropy(seed))


def wrong_code(code: PairingCode) -> PairingCode:
    secret = code.secret_bytes
    return PairingCode.from_bytes(code.nameplate, bytes([secret[0] ^ 1, secret[1]]))


# ---------------------------------------------------------------------------- the happy path


def test_full_pairing_gives_both_sides_the_same_key_words_and_grant() -> None:
    invite = make_invite(grant="phone")
    store = Invites(invite)
    joiner, inviter = joiner_for(str(invite.code)), inviter_for(store)

    assert converse(joiner, inviter) == (None, None)

    assert joiner.state is PairState.DONE and inviter.state is PairState.DONE
    j, i = joiner.result, inviter.result
    assert j is not None and i is not None
    assert (j.peer_id, j.name, j.role, j.addrs) == (HOME, "home-pc", "home", HOME_INFO.addrs)
    assert (i.peer_id, i.name, i.role) == (PHONE, "phone", "phone")  # the inviter's --name wins
    assert j.session_key == i.session_key and len(j.session_key) == 32
    assert j.verification_words == i.verification_words
    assert [w in (ODD if n % 2 else EVEN) for n, w in enumerate(j.verification_words)] == [True] * 4

    # the phone holds the grant its home PC will enforce, and it works there
    assert j.manifest == i.manifest
    assert (j.manifest.issuer, j.manifest.subject) == (HOME, PHONE)
    assert j.manifest.grants() == list(PRESETS["phone"][0])
    assert check(j.manifest, Operation.tool_call("files.read"), local_peer_id=HOME, remote_peer_id=PHONE,
                 now=NOW + 1).allowed

    assert invite.used and invite.state(NOW) is InviteState.USED


def test_the_grant_chosen_at_invite_time_is_what_the_joiner_gets() -> None:
    invite = make_invite(grant="messaging", grant_ttl=86400)
    joiner = joiner_for(invite.code)
    assert converse(joiner, inviter_for(Invites(invite)), now=NOW + 5) == (None, None)
    assert joiner.result is not None
    manifest = joiner.result.manifest
    assert manifest.grants() == ["msg.send", "msg.ask"]
    assert (manifest.not_before, manifest.expires) == (int(NOW) + 5, int(NOW) + 5 + 86400)


def test_the_code_never_crosses_the_wire() -> None:
    invite = make_invite()
    converse(joiner_for(invite.code), inviter_for(Invites(invite)))
    seen = converse.last_wire.bytes_seen.lower()  # type: ignore[attr-defined]
    assert b"pair.welcome" in seen
    for secret in (*invite.code.words, str(invite.code)):
        assert secret.encode() not in seen


def test_verification_words_depend_on_the_peer_ids() -> None:
    def words(phone_seed: int) -> tuple[str, ...]:
        _, phone = identity(phone_seed)
        invite = make_invite()
        joiner = joiner_for(invite.code, me=phone)
        assert converse(joiner, inviter_for(Invites(invite), them=phone)) == (None, None)
        assert joiner.result is not None
        return joiner.result.verification_words

    # same code, same PAKE randomness: only the joiner's peer id differs
    assert words(2) == words(2)
    assert words(2) != words(4)


# ---------------------------------------------------------------------------- failures


def test_wrong_code_fails_on_both_sides_and_costs_an_attempt() -> None:
    invite = make_invite()
    joiner, inviter = joiner_for(wrong_code(invite.code)), inviter_for(Invites(invite))

    joiner_error, inviter_error = converse(joiner, inviter)

    assert isinstance(inviter_error, PsymeshError) and inviter_error.code is ErrorCode.BAD_CODE
    assert isinstance(joiner_error, RemoteError) and joiner_error.code is ErrorCode.BAD_CODE
    assert joiner_error.message == WRONG_CODE and not joiner_error.details
    assert joiner.state is PairState.FAILED and inviter.state is PairState.FAILED
    assert joiner.result is None and inviter.result is None
    assert invite.attempts_left == MAX_ATTEMPTS - 1 and not invite.used


def test_third_wrong_code_kills_the_invite_even_for_the_right_code() -> None:
    invite = make_invite()
    store = Invites(invite)
    for seed in range(MAX_ATTEMPTS):
        _, inviter_error = converse(joiner_for(wrong_code(invite.code), seed=seed), inviter_for(store))
        assert inviter_error is not None and inviter_error.code is ErrorCode.BAD_CODE
    assert invite.state(NOW) is InviteState.EXHAUSTED

    joiner_error, inviter_error = converse(joiner_for(invite.code), inviter_for(store))
    assert inviter_error is not None and inviter_error.code is ErrorCode.NOT_FOUND
    assert joiner_error is not None and joiner_error.code is ErrorCode.NOT_FOUND
    assert "cancelled" in joiner_error.message


def test_an_invite_works_once() -> None:
    invite = make_invite()
    store = Invites(invite)
    assert converse(joiner_for(invite.code), inviter_for(store)) == (None, None)

    joiner_error, _ = converse(joiner_for(invite.code), inviter_for(store))
    assert joiner_error is not None and joiner_error.code is ErrorCode.NOT_FOUND
    assert "already used" in joiner_error.message


def test_expired_invite_is_refused() -> None:
    invite = make_invite(ttl=600)
    joiner_error, inviter_error = converse(joiner_for(invite.code), inviter_for(Invites(invite)), now=NOW + 600)
    assert joiner_error is not None and joiner_error.code is ErrorCode.EXPIRED
    assert inviter_error is not None and inviter_error.code is ErrorCode.EXPIRED


def test_invite_expiring_during_the_run_is_refused() -> None:
    invite = make_invite(ttl=600)
    joiner, inviter = joiner_for(invite.code), inviter_for(Invites(invite))
    pake = inviter.receive(unpack(pack(joiner.start())), NOW + 599)
    confirm = joiner.receive(unpack(pack(pake[0])))
    with pytest.raises(PsymeshError) as info:
        inviter.receive(unpack(pack(confirm[0])), NOW + 601)
    assert info.value.code is ErrorCode.EXPIRED and not invite.used


def other_nameplate(invite: Invite) -> int:
    return invite.nameplate % MAX_NAMEPLATE + 1


def test_an_unknown_nameplate_gets_a_decoy_that_fails_like_a_wrong_code_and_charges_nothing() -> None:
    """A stranger must not learn which numbers have an invite, nor spend an invite's
    attempts without its number: the decoy run looks exactly like a wrong code."""
    invite = make_invite()
    store = Invites(invite)
    wrong = converse(joiner_for(wrong_code(invite.code), seed=1), inviter_for(store, seed=2))
    wrong_bytes = converse.last_wire.bytes_seen  # type: ignore[attr-defined]
    guessed = PairingCode(nameplate=other_nameplate(invite), words=wrong_code(invite.code).words)
    decoy = converse(joiner_for(guessed, seed=1), inviter_for(store, seed=2))
    decoy_bytes = converse.last_wire.bytes_seen  # type: ignore[attr-defined]

    assert [(type(e), e.code, e.message, e.details) for e in decoy if e] == \
        [(type(e), e.code, e.message, e.details) for e in wrong if e]
    assert len(decoy_bytes) == len(wrong_bytes)  # the same messages, the same sizes
    assert invite.attempts_left == MAX_ATTEMPTS - 1  # the wrong code cost one; the decoy none
    for seed in range(10 * MAX_ATTEMPTS):  # any number of decoys: the invite still works
        converse(joiner_for(PairingCode(nameplate=other_nameplate(invite), words=invite.code.words), seed=seed),
                 inviter_for(store))
    assert converse(joiner_for(invite.code), inviter_for(store)) == (None, None)


@settings(max_examples=30, deadline=None)
@given(nameplate=st.integers(1, MAX_NAMEPLATE), secret=st.binary(min_size=2, max_size=2))
def test_any_guess_without_the_invites_number_fails_and_costs_it_nothing(nameplate: int, secret: bytes) -> None:
    invite = make_invite()
    guess = PairingCode.from_bytes(nameplate, secret)
    joiner_error, inviter_error = converse(joiner_for(guess), inviter_for(Invites(invite)))
    if guess == invite.code:
        assert (joiner_error, inviter_error) == (None, None)
        return
    assert joiner_error is not None and joiner_error.code is ErrorCode.BAD_CODE
    assert joiner_error.message == WRONG_CODE
    assert invite.attempts_left == MAX_ATTEMPTS - (nameplate == invite.nameplate)


def test_a_relay_between_two_noise_sessions_fails_key_confirmation() -> None:
    """Even with the right code: the phone's Noise session is with the relay, the home
    PC's too, so each side binds a different pair of peer ids into SPAKE2."""
    invite = make_invite()
    joiner = joiner_for(invite.code, them=RELAY)   # what the phone's Noise session sees
    inviter = inviter_for(Invites(invite), them=RELAY)  # what the home PC's Noise session sees

    joiner_error, inviter_error = converse(joiner, inviter)  # the relay forwards every message verbatim

    assert inviter_error is not None and inviter_error.code is ErrorCode.BAD_CODE
    assert joiner_error is not None and joiner_error.code is ErrorCode.BAD_CODE
    assert invite.attempts_left == MAX_ATTEMPTS - 1 and not invite.used


def test_a_joiner_that_binds_other_peer_ids_fails() -> None:
    invite = make_invite()
    joiner = joiner_for(invite.code, me=RELAY)  # claims another id than the one Noise shows the inviter
    _, inviter_error = converse(joiner, inviter_for(Invites(invite)))
    assert inviter_error is not None and inviter_error.code is ErrorCode.BAD_CODE


def test_parallel_runs_each_pay_an_attempt_and_only_one_can_win() -> None:
    invite = make_invite()
    store = Invites(invite)
    runs = [(joiner_for(invite.code, seed=s), inviter_for(store, seed=100 + s)) for s in range(2)]
    pakes = [inviter.receive(unpack(pack(joiner.start())), NOW) for joiner, inviter in runs]
    assert invite.attempts_left == MAX_ATTEMPTS - 2

    # a third, concurrent guesser takes the last attempt; a fourth charges nothing and cannot win:
    # with the right code it is told the invite is spent, with a wrong one it reads a wrong code
    guesser = inviter_for(store, seed=9)
    guesser.receive(joiner_for(wrong_code(invite.code), seed=9).start(), NOW)
    joiner_error, inviter_error = converse(joiner_for(invite.code), inviter_for(store))
    assert inviter_error is not None and inviter_error.code is ErrorCode.NOT_FOUND
    assert joiner_error is not None and joiner_error.code is ErrorCode.NOT_FOUND
    joiner_error, _ = converse(joiner_for(wrong_code(invite.code)), inviter_for(store))
    assert joiner_error is not None and joiner_error.code is ErrorCode.BAD_CODE
    assert invite.attempts_left == 0

    (j0, i0), (j1, i1) = runs
    i0.receive(j0.receive(pakes[0][0])[0], NOW)
    assert i0.state is PairState.DONE and invite.used
    with pytest.raises(PsymeshError) as lost:
        i1.receive(j1.receive(pakes[1][0])[0], NOW)
    assert lost.value.code is ErrorCode.NOT_FOUND


def test_joiner_abort_leaves_the_attempt_spent() -> None:
    invite = make_invite()
    joiner, inviter = joiner_for(invite.code), inviter_for(Invites(invite))
    inviter.receive(joiner.start(), NOW)
    with pytest.raises(RemoteError) as info:
        inviter.receive(Error.of(ErrorCode.CANCELED, "user gave up"), NOW)
    assert info.value.code is ErrorCode.CANCELED
    assert inviter.state is PairState.FAILED and invite.attempts_left == MAX_ATTEMPTS - 1


# ---------------------------------------------------------------------------- protocol violations


def test_out_of_order_message_breaks_the_machine_for_good() -> None:
    invite = make_invite()
    inviter = inviter_for(Invites(invite))
    stray = PairConfirm(mac=bytes(32), info=PHONE_INFO)
    with pytest.raises(ProtocolError) as first:
        inviter.receive(stray, NOW)
    assert "expecting pair.hello" in first.value.message
    with pytest.raises(ProtocolError) as again:
        inviter.receive(joiner_for(invite.code).start(), NOW)
    assert again.value is first.value
    assert invite.attempts_left == MAX_ATTEMPTS  # nothing was charged

    joiner = joiner_for(invite.code)
    with pytest.raises(ProtocolError):
        joiner.receive(PairPake(pake=b"B" + bytes(32)))  # start() not called
    assert joiner.state is PairState.FAILED


def test_a_message_after_success_is_refused_but_the_pairing_stands() -> None:
    invite = make_invite()
    joiner, inviter = joiner_for(invite.code), inviter_for(Invites(invite))
    converse(joiner, inviter)
    with pytest.raises(ProtocolError):
        inviter.receive(PairHello(nameplate=1, pake=b"A" + bytes(32)), NOW)
    assert inviter.state is PairState.DONE and inviter.result is not None


def test_joiner_rejects_a_grant_for_someone_else() -> None:
    invite = make_invite()
    joiner, inviter = joiner_for(invite.code), inviter_for(Invites(invite))
    pake = inviter.receive(joiner.start(), NOW)
    welcome = inviter.receive(joiner.receive(pake[0])[0], NOW)[0]
    assert isinstance(welcome, PairWelcome)
    foreign = preset("phone", HOME, RELAY, NOW).sign(HOME_KEY)
    with pytest.raises(ProtocolError) as info:
        joiner.receive(welcome.model_copy(update={"manifest": foreign}))
    assert info.value.code is ErrorCode.BAD_REQUEST and joiner.result is None


def test_joiner_rejects_a_bad_inviter_mac() -> None:
    invite = make_invite()
    joiner, inviter = joiner_for(invite.code), inviter_for(Invites(invite))
    pake = inviter.receive(joiner.start(), NOW)
    welcome = inviter.receive(joiner.receive(pake[0])[0], NOW)[0]
    with pytest.raises(ProtocolError) as info:
        joiner.receive(welcome.model_copy(update={"mac": bytes(32)}))
    assert info.value.code is ErrorCode.BAD_CODE


@pytest.mark.parametrize("pake", [b"B" + bytes(32), b"A" + bytes(32), b"A" + b"\xff" * 32, b"A", b"A" + bytes(40)],
                         ids=["wrong side", "identity", "not a point", "short", "long"])
def test_malformed_hellos_are_refused_and_charge_no_attempt(pake: bytes) -> None:
    """Protocol.md §5.2: an attempt is charged when the inviter sends `pair.pake`; a hello
    whose `pake` is malformed gets `bad_request` and no `pair.pake`, so any number of them
    leave the invite as it was, and the right code still pairs."""
    invite = make_invite()
    for _ in range(MAX_ATTEMPTS + 1):
        inviter = inviter_for(Invites(invite))
        with pytest.raises(ProtocolError) as info:
            inviter.receive(PairHello(nameplate=invite.nameplate, pake=pake), NOW)
        assert info.value.code is ErrorCode.BAD_REQUEST
    assert invite.attempts_left == MAX_ATTEMPTS
    assert converse(joiner_for(invite.code), inviter_for(Invites(invite))) == (None, None) and invite.used


def test_misconfigured_machines_are_caught_early() -> None:
    with pytest.raises(PsymeshError) as info:
        joiner_for("1-aardvark-adroitness", me=HOME, them=HOME)
    assert info.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(ValueError):
        PairingInviter(local_peer_id=PHONE, remote_peer_id=HOME, info=HOME_INFO, signing_key=HOME_KEY,
                       find_invite=Invites().find)


# ---------------------------------------------------------------------------- codes and invites


def test_codes_read_aloud_are_forgiving_about_case_and_separators() -> None:
    code = parse_code("  7 Chisel_molecule ")
    assert str(code) == "7-chisel-molecule" and code.password == b"7-chisel-molecule"
    assert parse_code(str(code)) == code


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("7-chisle-molecule", "did you mean 'chisel'"),
        ("7-molecule-chisel", "words swapped"),
        ("7-chisel", "looks like"),
        ("chisel-molecule-7", "looks like"),
        ("0-chisel-molecule", "no such pairing code number"),
        ("7-xyzzy-molecule", "not a pairing word"),
    ],
)
def test_typos_in_codes_are_caught_before_any_attempt(text: str, hint: str) -> None:
    with pytest.raises(PsymeshError) as info:
        parse_code(text)
    assert info.value.code is ErrorCode.BAD_REQUEST and hint in info.value.message


def test_new_invite_draws_a_random_free_nameplate_and_is_deterministic_with_a_seed() -> None:
    a = new_invite(NOW, rng=random.Random(5), taken={1, 2, 4})
    b = new_invite(NOW, rng=random.Random(5), taken={1, 2, 4})
    assert a == b
    drawn = {new_invite(NOW, rng=random.Random(seed)).nameplate for seed in range(200)}
    assert len(drawn) > 150 and min(drawn) >= 1 and max(drawn) <= MAX_NAMEPLATE  # not 1, 2, 3...
    crowded = set(range(1, MAX_NAMEPLATE + 1)) - {4242}
    assert new_invite(NOW, rng=random.Random(5), taken=crowded).nameplate == 4242
    with pytest.raises(PsymeshError) as info:
        new_invite(NOW, taken=crowded | {4242})
    assert info.value.code is ErrorCode.CONFLICT
    assert (a.attempts_left, a.used, a.expires_at, a.grant) == (MAX_ATTEMPTS, False, NOW + 600, "phone")
    with pytest.raises(PsymeshError) as info:
        new_invite(NOW, grant="root")
    assert info.value.code is ErrorCode.BAD_REQUEST


def test_invite_survives_storage() -> None:
    invite = make_invite(grant="messaging", grant_ttl=86400)
    invite.record_failure()
    assert Invite.model_validate_json(invite.model_dump_json()) == invite


def test_invite_string_round_trip_and_qr_case() -> None:
    invite = make_invite()
    ticket = invite.ticket(HOME, ["/ip4/192.168.1.23/tcp/4001", "/ip6/fe80::1/tcp/4001"])
    text = encode_invite(ticket)
    assert text.startswith("psymesh1:") and len(text) < 200
    assert parse_invite(text) == ticket
    assert parse_invite(text.upper()) == ticket  # QR alphanumeric mode is upper case
    extra = parse_invite(text, "/dns/home.example/tcp/4001")
    assert extra.addrs == (*ticket.addrs, "/dns/home.example/tcp/4001")


@pytest.mark.parametrize(
    ("address", "addr", "peer"),
    [
        (f"/ip4/192.168.1.23/tcp/4001/p2p/{HOME}", "/ip4/192.168.1.23/tcp/4001", HOME),
        ("/ip4/192.168.1.23/udp/4001/quic-v1", "/ip4/192.168.1.23/udp/4001/quic-v1", None),
        ("192.168.1.23:4001", "/ip4/192.168.1.23/tcp/4001", None),
        ("[::1]:4001", "/ip6/::1/tcp/4001", None),
        ("homepc.local:4001", "/dns/homepc.local/tcp/4001", None),
    ],
)
def test_code_plus_address(address: str, addr: str, peer: str | None) -> None:
    ticket = parse_invite("7-chisel-molecule", address)
    assert (str(ticket.code), ticket.addrs, ticket.peer_id) == ("7-chisel-molecule", (addr,), peer)


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("7-chisel-molecule", None),
        ("7-chisel-molecule", "homepc.local"),
        ("7-chisel-molecule", "1.2.3.4:99999"),
        ("7-chisel-molecule", "/ip4/1.2.3.4/tcp/1/p2p/notapeerid"),
        ("psymesh1:!!!!", None),
        ("psymesh1:" + base64.b32encode(msgpack.packb([1, 2])).decode(), None),
        ("psymesh1:" + base64.b32encode(msgpack.packb({"c": [1, b"\x00"], "k": bytes(32)})).decode(), None),
    ],
)
def test_bad_invites_are_typed_errors(text: str, address: str | None) -> None:
    with pytest.raises(PsymeshError) as info:
        parse_invite(text, address)
    assert info.value.code is ErrorCode.BAD_REQUEST


# ---------------------------------------------------------------------------- fuzzing


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.one_of(st.none(), st.text(max_size=80)))
def test_any_invite_text_parses_or_raises_a_typed_error(text: str, address: str | None) -> None:
    try:
        parse_invite(text, address)
    except PsymeshError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_invite_payload_parses_or_raises_a_typed_error(blob: bytes) -> None:
    try:
        parse_invite("psymesh1:" + base64.b32encode(blob).decode().rstrip("="))
    except PsymeshError:
        pass


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda kind, fields: msgpack.packb({"v": 1, "type": kind, **fields}, use_bin_type=True),
            st.sampled_from(["pair.hello", "pair.pake", "pair.confirm", "pair.welcome"]),
            st.dictionaries(st.sampled_from(["nameplate", "pake", "mac", "info", "manifest", "name"]),
                            _msgpack_values, max_size=4),
        ),
    )
)
def test_any_bytes_decode_to_a_pairing_message_or_a_protocol_error(body: bytes) -> None:
    try:
        unpack(body)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=128))
def test_an_inviter_fed_any_pake_bytes_fails_cleanly(pake: bytes) -> None:
    invite = make_invite()
    inviter = inviter_for(Invites(invite))
    try:
        inviter.receive(PairHello(nameplate=invite.nameplate, pake=pake), NOW)
    except PsymeshError:
        assert inviter.state is PairState.FAILED
        return
    with pytest.raises(PsymeshError):  # a lucky element still cannot pass key confirmation
        inviter.receive(PairConfirm(mac=bytes(32), info=PHONE_INFO), NOW)


# ---------------------------------------------------------------------------- limits for strangers


@pytest.mark.parametrize("grant", sorted(PRESETS))
def test_the_largest_pairing_messages_fit_the_pairing_frame_limit(grant: str) -> None:
    """A pairing stream refuses frames over PAIR_MAX_FRAME; every real message must fit."""
    largest = PeerInfo(name="n" * 64, role="r" * 32, addrs=tuple("/" + "a" * 255 for _ in range(16)))
    manifest = preset(grant, HOME, PHONE, NOW, 10**9).sign(HOME_KEY)
    for message in (PairHello(nameplate=MAX_NAMEPLATE, pake=bytes(128)), PairPake(pake=bytes(128)),
                    PairConfirm(mac=bytes(32), info=largest),
                    PairWelcome(mac=bytes(32), info=largest, manifest=manifest)):
        assert len(Channel(PAIR_MAX_FRAME).send(message)) <= PAIR_MAX_FRAME + 4


LIMITS = StrangerLimits(pair_runs=3, pair_runs_per_ip=2, hellos_per_minute=6, hellos_per_ip_per_minute=4,
                        hellos_per_peer_per_minute=2)


def refusal(guard: PairingGuard, peer: str, ip: str, now: float) -> ErrorCode | None:
    try:
        guard.start(peer, ip, now)
    except PsymeshError as exc:
        assert exc.retry_after is not None and exc.retry_after > 0
        return exc.code
    return None


def test_pairing_runs_at_once_are_capped_per_ip_and_node_wide_and_come_back() -> None:
    guard = PairingGuard(LIMITS.model_copy(update={"hellos_per_minute": 100, "hellos_per_ip_per_minute": 100}))
    assert [refusal(guard, f"p{i}", "10.0.0.1", NOW) for i in range(3)] == [None, None, ErrorCode.BUSY]
    assert refusal(guard, "q", "10.0.0.2", NOW) is None
    assert refusal(guard, "r", "10.0.0.3", NOW) is ErrorCode.BUSY  # 3 runs at once, node-wide
    guard.finish("10.0.0.1")
    assert refusal(guard, "r", "10.0.0.3", NOW) is None
    for ip in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        guard.finish(ip)
    assert guard.running() == 0


def test_one_address_cannot_spend_the_budget_of_the_others() -> None:
    """A burning loop from one IP with fresh keys is stopped by its per-IP budget; what it
    was refused spends nothing node-wide, so a joiner elsewhere still gets in."""
    guard = PairingGuard(LIMITS)
    outcomes = []
    for i in range(50):  # fresh keys every time, as fast as it likes
        outcomes.append(refusal(guard, f"fresh-{i}", "10.6.6.6", NOW + i * 0.01))
        if outcomes[-1] is None:
            guard.finish("10.6.6.6")
    assert outcomes.count(None) == LIMITS.hellos_per_ip_per_minute
    assert set(outcomes) == {None, ErrorCode.RATE_LIMITED}
    assert refusal(guard, "the-phone", "10.0.0.7", NOW + 1) is None


def test_many_addresses_together_are_held_to_the_node_wide_budget_and_it_refills() -> None:
    guard = PairingGuard(LIMITS)
    admitted = 0
    for i in range(40):
        if refusal(guard, f"k{i}", f"10.1.{i}.1", NOW) is None:
            admitted += 1
            guard.finish(f"10.1.{i}.1")
    assert admitted == LIMITS.hellos_per_minute
    assert refusal(guard, "later", "10.2.0.1", NOW + 60) is None


def test_one_key_is_held_to_its_own_budget() -> None:
    guard = PairingGuard(LIMITS)
    codes = []
    for i in range(3):
        codes.append(refusal(guard, "same-key", f"10.3.{i}.1", NOW))
        if codes[-1] is None:
            guard.finish(f"10.3.{i}.1")
    assert codes == [None, None, ErrorCode.RATE_LIMITED]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 30), st.floats(0, 5), st.booleans()), max_size=80))
def test_whatever_strangers_do_the_guard_keeps_its_bounds(events: list[tuple[int, int, float, bool]]) -> None:
    """Any interleaving of starts and finishes from any IPs and keys: never more runs at
    once than allowed, never more admitted hellos in a minute than the node-wide budget
    (GCRA: the burst, plus one per interval), and per IP likewise."""
    guard = PairingGuard(LIMITS)
    now, running, admitted = NOW, [], []
    for ip_n, peer_n, dt, finish in events:
        now += dt
        if finish and running:
            guard.finish(running.pop(0))
            continue
        ip = f"10.9.0.{ip_n}"
        if refusal(guard, f"peer{peer_n}", ip, now) is None:
            running.append(ip)
            admitted.append((now, ip))
        assert guard.running() == len(running) <= LIMITS.pair_runs
        assert max((running.count(x) for x in set(running)), default=0) <= LIMITS.pair_runs_per_ip
    for start, _ in admitted:
        window = [a for a in admitted if start <= a[0] < start + 60]
        assert len(window) <= 2 * LIMITS.hellos_per_minute
        for ip in {a[1] for a in window}:
            assert sum(a[1] == ip for a in window) <= 2 * LIMITS.hellos_per_ip_per_minute
