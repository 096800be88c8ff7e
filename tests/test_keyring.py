"""Keys that rotate (protocol/keyring.py), on an injected clock: the current key replaced once
it is rotate_s old, a retired one still opening what was sealed to it for keep_s and then
gone, the one deadline a node sets its timer to; with the sealing it serves (sealed mail, a
sealed web query) opening in flight and not once the key is deleted."""
from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.keyring import KeyRing
from psymesh.protocol.mailbox import MailKey, mail_ref, seal, unseal
from psymesh.protocol.messaging import Letter
from psymesh.protocol.oblivious import ExitSecret, Gateway, seal_request

T0 = 1_800_000_000.0
DAY = 86_400.0


def test_a_ring_rotates_on_schedule_keeps_the_old_key_for_keep_s_and_then_deletes_it() -> None:
    ring = KeyRing.new(T0, rotate_s=7 * DAY, keep_s=2 * DAY)
    first = ring.current
    assert ring.next_deadline() == T0 + 7 * DAY
    assert not ring.step(T0 + 7 * DAY - 1) and ring.current is first
    assert ring.step(T0 + 7 * DAY)
    second = ring.current
    assert second.key_id == 2 and second.public != first.public and [k.key_id for k in ring.keys] == [2, 1]
    assert ring.next_deadline() == T0 + 9 * DAY                 # the old one's deletion comes first
    assert not ring.step(T0 + 9 * DAY - 1) and ring.get(1) is not None
    assert ring.step(T0 + 9 * DAY) and ring.get(1) is None and ring.next_deadline() == T0 + 14 * DAY
    # the file holds what the ring holds, and nothing deleted
    data = ring.to_bytes()
    again = KeyRing.from_bytes(data, rotate_s=7 * DAY, keep_s=2 * DAY)
    assert [(k.key_id, k.public, k.created_at) for k in again.keys] == [(2, second.public, T0 + 7 * DAY)]
    assert first.secret.private_bytes_raw() not in data
    # a node that slept through several rotations catches up in one step: one new key
    assert again.step(T0 + 40 * DAY) and [k.key_id for k in again.keys] == [3, 2]
    with pytest.raises(PsymeshError):
        KeyRing.from_bytes(b"not a ring", rotate_s=1, keep_s=1)


def test_key_ids_wrap_past_255_skipping_ids_still_held() -> None:
    ring = KeyRing.new(T0, rotate_s=1, keep_s=1.5)
    for i in range(1, 300):
        ring.step(T0 + i)
        ids = [k.key_id for k in ring.keys]
        assert len(ids) == len(set(ids)) and all(1 <= x <= 255 for x in ids)


def test_rotated_mail_keys_open_letters_in_flight_and_not_older_ones() -> None:
    owner, sender = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    owner_id = peer_id_from_public_key(owner.public_key().public_bytes_raw())
    sender_id = peer_id_from_public_key(sender.public_key().public_bytes_raw())
    ring = KeyRing.new(T0, rotate_s=7 * DAY, keep_s=7 * DAY)

    def sealed_now(tseq: int) -> tuple[Letter, bytes]:
        key = MailKey(owner=owner_id, public=ring.current.public, serial=tseq).sign(owner)
        letter = Letter(id=f"l{tseq}", sender=sender_id, recipient=owner_id, tseq=tseq, text="hi", at=1).sign(sender)
        return letter, seal(letter, key)

    def opens(letter: Letter, sealed: bytes) -> bool:
        for key in ring.keys:
            try:
                return unseal(sealed, key.secret, recipient=owner_id, sender=sender_id, ref=mail_ref(letter)) == letter
            except PsymeshError as exc:
                assert exc.code is ErrorCode.FORBIDDEN
        return False

    old = sealed_now(1)
    ring.step(T0 + 7 * DAY)                      # rotated: the letter waiting at the mailbox still opens
    assert opens(*old) and opens(*sealed_now(2))
    ring.step(T0 + 14 * DAY)                     # kept keep_s, then deleted: older mail no longer opens
    assert not opens(*old)


def test_a_rotated_exit_key_opens_queries_in_flight_and_not_older_ones() -> None:
    ring = KeyRing.new(T0, rotate_s=7 * DAY, keep_s=3600 + 60)
    identity = Ed25519PrivateKey.generate()
    exit_id = peer_id_from_public_key(identity.public_key().public_bytes_raw())

    def secrets() -> dict[int, ExitSecret]:
        return {k.key_id: ExitSecret(k.key_id, k.secret) for k in ring.keys}

    def key_now() -> object:
        return ExitSecret(ring.current.key_id, ring.current.secret).public(identity, exit_id, now=T0, ttl_s=DAY)

    gateway = Gateway(secrets())
    rotation = T0 + 7 * DAY
    in_flight, _ = seal_request(key_now(), b"sealed just before the rotation", now=rotation - 1)  # type: ignore[arg-type]
    ring.step(rotation)
    gateway.set_secrets(secrets())
    assert gateway.open(in_flight, now=rotation)[0] == b"sealed just before the rotation"
    late, _ = seal_request(ExitSecret(1, ring.get(1).secret).public(identity, exit_id, now=T0, ttl_s=DAY),  # type: ignore[union-attr]
                           b"sealed to the old key, late", now=rotation + 3600 + 59)
    ring.step(rotation + 3600 + 60)             # the old secret is deleted a replay window after it expired
    gateway.set_secrets(secrets())
    with pytest.raises(PsymeshError) as gone:
        gateway.open(late, now=rotation + 3600 + 60)
    assert gone.value.code is ErrorCode.BAD_REQUEST and "no exit key 1" in gone.value.message
