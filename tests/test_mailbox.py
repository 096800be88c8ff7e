"""A mailbox for a sleeping phone, with real daemons on loopback: the phone names its home
PC; a laptop's letters for it, while it is off, are sealed to the phone's mail key and held
at home (which holds ciphertext only, and refuses mail for peers that did not name it);
the phone, back on, gets each letter exactly once, in order, admitted by its own door; the
mailbox forgets what was acknowledged. Per-sender limits and expiry, with an injected clock."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import anyio
import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite

from conftest import pair, run_nodes
from letters import inbox, threads_in_order
from waiting import wait_until
from psymesh.node.daemon import Node
from psymesh.node.home import NodeHome
from psymesh.node.mailbox import Held
from psymesh.node.mailclient import load_mail_secret
from psymesh.node.msgstore import OutState
from psymesh.protocol import ids
from psymesh.protocol.errors import ErrorCode, PsymeshError, RemoteError
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.mailbox import (
    VIA_MAILBOX,
    MailDeposit,
    MailFetch,
    MailItem,
    MailKey,
    MailReceipt,
    MailSettings,
    mail_ref,
    seal,
    unseal,
)
from psymesh.protocol.messaging import Letter
from psymesh.protocol.session import SessionEnd

pytestmark = pytest.mark.anyio


def phone_home(tmp_path: Path) -> NodeHome:
    """A phone's home whose config names the paired peer "home" as its mailbox."""
    home = NodeHome(tmp_path / "phone")
    home.init(profile="phone", name="phone")
    home.save_config(home.load_config().model_copy(update={"mailbox": "home"}))
    return home


def start_phone(home: NodeHome) -> Node:
    phone = Node(home)
    phone.mail.RESCAN_S = 0.1  # peers it pairs with during the test hear its key at once
    return phone


def held(node: Node, recipient: str) -> list[Held]:
    return node.mailbox.store.held_for(recipient, after=0, limit=10_000)


def knows_mailbox(node: Node, owner: str, mailbox: str) -> bool:
    key = node.mailbox.store.key_of(owner)
    return key is not None and key.mailbox == mailbox


async def test_mail_for_a_phone_that_is_off_is_held_sealed_and_handed_over_once(tmp_path: Path) -> None:
    ph = phone_home(tmp_path)
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop = nodes["home"], nodes["laptop"]
        await pair(home.home.path, laptop.home.path)
        async with anyio.create_task_group() as tg:
            phone = start_phone(ph)
            await tg.start(phone.run)
            phone_id = phone.identity.peer_id
            await pair(home.home.path, ph.path)
            await pair(ph.path, laptop.home.path)  # the laptop may write to the phone (msg.send)
            await wait_until(lambda: knows_mailbox(home, phone_id, home.identity.peer_id)
                             and knows_mailbox(laptop, phone_id, home.identity.peer_id),
                             "home and the laptop to hold the phone's mail key, naming home")
            tg.cancel_scope.cancel()  # the phone is off now

        laptop.messaging.grace_s = 0.2
        texts = [f"meet at the north gate, {i} o'clock (xyzzy-{i})" for i in range(12)]
        sent = [laptop.messaging.send("phone", text, thread=f"t{i % 2}") for i, text in enumerate(texts)]
        ours = [home.messaging.send("phone", f"from home {i}", thread="home") for i in range(2)]  # kept at home itself
        for letter in sent + ours:
            with anyio.fail_after(30):
                assert (await laptop.messaging.wait_sent(letter.id) if letter in sent
                        else await home.messaging.wait_sent(letter.id)).state is OutState.DEPOSITED

        # What home holds: who, for whom, how big, when, and ciphertext; never the letter or its id.
        rows = held(home, phone_id)
        assert len(rows) == 14
        assert {r.sender for r in rows} == {laptop.identity.peer_id, home.identity.peer_id}
        assert all(r.size == len(r.sealed) and r.ref not in r.sealed for r in rows)
        db_bytes = b"".join(p.read_bytes() for p in home.home.path.glob("node.db*"))
        for letter in sent:
            assert letter.text.encode() not in db_bytes and letter.id.encode() not in db_bytes
            assert not any(letter.text.encode() in r.sealed for r in rows)
        secret = load_mail_secret(ph)
        row = next(r for r in rows if r.sender == laptop.identity.peer_id)
        opened = unseal(row.sealed, secret, recipient=phone_id, sender=row.sender, ref=row.ref)
        assert opened in sent and opened.signature_valid()
        for wrong in ({"secret": X25519PrivateKey.generate()}, {"sender": home.identity.peer_id}):
            args = {"secret": secret, "sender": row.sender, **wrong}
            with pytest.raises(PsymeshError) as info:
                unseal(row.sealed, args["secret"], recipient=phone_id, sender=args["sender"], ref=row.ref)
            assert info.value.code is ErrorCode.FORBIDDEN
        deposits = [r for r in home.audit.query(peer_id=laptop.identity.peer_id, limit=1000)
                    if r["operation"] == "mail.deposit"]
        assert deposits and all(r["allowed"] and r["protocol"] == ids.SESSION for r in deposits)
        # only the recipient fetches its mail: the laptop asking gets nothing of the phone's
        async with laptop.sessions.stream(home.identity.peer_id, MailFetch()) as replies:
            assert [type(m) async for m in replies] == [SessionEnd]

        async with anyio.create_task_group() as tg:
            phone = start_phone(NodeHome(ph.path))  # back on, same home, a new port
            await tg.start(phone.run)
            got = await inbox(phone, 14, timeout=30)
            assert sorted(x.id for x in got) == sorted(x.id for x in sent + ours)
            assert threads_in_order(got) and all(x.signature_valid() for x in got)
            assert [x.text for x in got if x.sender == laptop.identity.peer_id and x.thread == "t0"] == texts[0::2]
            await wait_until(lambda: held(home, phone_id) == [], "home to forget the mail the phone took")
            taken = [r for r in phone.audit.query(peer_id=laptop.identity.peer_id, limit=1000)
                     if r["protocol"] == VIA_MAILBOX]
            assert len(taken) == 12 and all(r["allowed"] and r["operation"] == "msg.send" for r in taken)

            # Taken but not acknowledged (a crash in between): handed over again, stored once.
            for r in rows:
                home.mailbox.hold(r.sender, phone_id, r.ref, r.sealed)
            await wait_until(lambda: held(home, phone_id) == [], "the phone to take them again")
            assert len(phone.messaging.store.released_after(0)) == 14
            tg.cancel_scope.cancel()


async def test_a_mailbox_refuses_mail_for_peers_that_did_not_name_it_and_limits_each_sender(tmp_path: Path) -> None:
    ph = phone_home(tmp_path)
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop = nodes["home"], nodes["laptop"]
        await pair(home.home.path, laptop.home.path)
        async with anyio.create_task_group() as tg:
            phone = start_phone(ph)
            await tg.start(phone.run)
            phone_id = phone.identity.peer_id
            await pair(home.home.path, ph.path)
            await pair(ph.path, laptop.home.path)
            await wait_until(lambda: knows_mailbox(laptop, phone_id, home.identity.peer_id)
                             and knows_mailbox(home, phone_id, home.identity.peer_id), "the phone's mail key")
            tg.cancel_scope.cancel()

        # Mail for a peer that never named home (the laptop itself; a stranger): refused, audited.
        key = laptop.mailbox.store.key_of(phone_id)
        assert key is not None
        stranger = peer_id_from_public_key(Ed25519PrivateKey.generate().public_key().public_bytes_raw())
        for recipient in (laptop.identity.peer_id, stranger):
            with pytest.raises(RemoteError) as info:
                await laptop.sessions.request(home.identity.peer_id,
                                              MailDeposit(recipient=recipient, ref=bytes(16), sealed=bytes(100)),
                                              MailReceipt)
            assert info.value.code is ErrorCode.FORBIDDEN
        refused = [r for r in home.audit.query(peer_id=laptop.identity.peer_id, denied_only=True, limit=100)
                   if r["operation"] == "mail.deposit"]
        assert sum(r["count"] for r in refused) == 2 and {r["code"] for r in refused} == {"forbidden"}
        assert all("not named this node its mailbox" in r["reason"] for r in refused)

        # A sender's share: 3 letters and 64 KiB here, at an injected time.
        t0 = 1_000_000.0
        home.mailbox.clock = lambda: t0
        home.mailbox.settings = MailSettings(max_items_per_sender=3, max_bytes_per_sender=64 * 1024, keep_s=3600)
        big = Letter(id="big", sender=laptop.identity.peer_id, recipient=phone_id, tseq=99, text="x" * 60_000,
                     body={"pad": "y" * 6000}, at=int(time.time() * 1000)).sign(laptop.identity.private_key)
        with pytest.raises(RemoteError) as info:
            await laptop.sessions.request(home.identity.peer_id, MailDeposit(recipient=phone_id, ref=mail_ref(big),
                                                                             sealed=seal(big, key)), MailReceipt)
        assert info.value.code is ErrorCode.TOO_LARGE
        laptop.messaging.grace_s = 0.0
        sent = [laptop.messaging.send("phone", f"note {i}") for i in range(5)]

        def states() -> list[OutState]:
            return sorted(laptop.messaging.store.sent(x.id).state for x in sent)

        # (the courier deposits its letters concurrently: any three of the five get in)
        await wait_until(lambda: states() == [OutState.DEPOSITED] * 3 + [OutState.PENDING] * 2,
                         "three letters deposited, two waiting")
        await wait_until(lambda: any(r["code"] == "busy" for r in home.audit.query(
            peer_id=laptop.identity.peer_id, denied_only=True, limit=100)), "home to refuse the fourth: busy")
        assert len(held(home, phone_id)) == 3 and {r.at for r in held(home, phone_id)} == {t0}

        # Expiry: kept for keep_s, then the housekeeping drops it (and the share frees).
        assert home.mailbox.housekeep(t0 + 3599) == 0
        assert home.mailbox.housekeep(t0 + 3601) == 3
        assert held(home, phone_id) == [] and home.mailbox.store.usage(laptop.identity.peer_id) == (0, 0)


def test_a_mail_key_is_signed_by_its_owner_and_binds_what_it_seals(tmp_path: Path) -> None:
    owner, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    owner_id = peer_id_from_public_key(owner.public_key().public_bytes_raw())
    other_id = peer_id_from_public_key(other.public_key().public_bytes_raw())
    secret = X25519PrivateKey.generate()
    key = MailKey(owner=owner_id, public=secret.public_key().public_bytes_raw(), mailbox=other_id, serial=1)
    assert key.sign(owner).signature_valid() and not key.model_copy(update={"signature": bytes(64)}).signature_valid()
    with pytest.raises(ValueError):
        key.sign(other)
    forged = key.model_copy(update={"public": bytes(32)}, deep=True)
    assert not forged.model_copy(update={"signature": key.sign(owner).signature}).signature_valid()

    letter = Letter(id="l1", sender=other_id, recipient=owner_id, tseq=1, text="hi", at=1).sign(other)
    sealed = seal(letter, key)
    assert len(sealed) == len(seal(letter, key)) and sealed != seal(letter, key)  # a fresh ephemeral key each time
    item = MailItem(seq=1, sender=other_id, ref=mail_ref(letter), at=0.0, sealed=sealed)
    # docs/protocol.md §5.6, byte for byte: plain RFC 9180 with the documented info opens it
    ref = hashlib.sha256(letter.signature).digest()[:16]
    info = b"psymesh/mail/v1\x00" + b"".join(len(p).to_bytes(2, "big") + p
                                             for p in (owner_id.encode(), other_id.encode(), ref))
    plain = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.CHACHA20_POLY1305).decrypt(sealed, secret, info=info)
    assert Letter.model_validate(msgpack.unpackb(plain)) == letter and ref == item.ref
    assert unseal(item.sealed, secret, recipient=owner_id, sender=other_id, ref=item.ref) == letter
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for bad in ({"sealed": tampered}, {"ref": bytes(16)}, {"recipient": other_id}):
        args = {"sealed": sealed, "ref": item.ref, "recipient": owner_id, **bad}
        with pytest.raises(PsymeshError) as info:
            unseal(args["sealed"], secret, recipient=args["recipient"], sender=other_id, ref=args["ref"])
        assert info.value.code is ErrorCode.FORBIDDEN
    # a letter signed by someone else than the sender it claims does not pass, sealed or not
    impostor = letter.model_copy(update={"signature": owner.sign(letter.signing_bytes())})
    with pytest.raises(PsymeshError):
        unseal(seal(impostor, key), secret, recipient=owner_id, sender=other_id, ref=mail_ref(impostor))
