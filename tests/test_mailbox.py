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
from psymesh.node.core.home import NodeHome
from psymesh.node.messaging.mailbox import Held
from psymesh.node.messaging.mailclient import load_mail_ring
from psymesh.node.messaging.store import OutState
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
from psymesh.protocol.messaging import Letter, check_receipt
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


async def meet_then_sleep(home: Node, laptop: Node, ph: NodeHome) -> str:
    """Pair home with the laptop and the phone, the phone with the laptop (which may write to
    it); once both hold the phone's mail key naming home, the phone goes off. Its peer id."""
    await pair(home.home.path, laptop.home.path)
    async with anyio.create_task_group() as tg:
        phone = start_phone(ph)
        await tg.start(phone.run)
        await pair(home.home.path, ph.path)
        await pair(ph.path, laptop.home.path)
        phone_id = phone.identity.peer_id
        await wait_until(lambda: knows_mailbox(laptop, phone_id, home.identity.peer_id)
                         and knows_mailbox(home, phone_id, home.identity.peer_id), "the phone's mail key")
        tg.cancel_scope.cancel()
    return phone_id


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
        secret = load_mail_ring(ph, MailSettings(), time.time()).current.secret
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
        phone_id = await meet_then_sleep(home, laptop, ph)

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
    # docs/protocol.md §5.6, byte for byte: plain RFC 9180 with the documented info opens it,
    # and the plaintext is 0x01 || u32 length || the msgpack letter || zeros to a 1 KiB bucket
    ref = hashlib.sha256(letter.signature).digest()[:16]
    info = b"psymesh/mail/v2\x00" + b"".join(len(p).to_bytes(2, "big") + p
                                             for p in (owner_id.encode(), other_id.encode(), ref))
    plain = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.CHACHA20_POLY1305).decrypt(sealed, secret, info=info)
    length = int.from_bytes(plain[1:5], "big")
    assert len(plain) == 1024 and plain[0] == 1 and plain[5 + length:] == bytes(1024 - 5 - length)
    assert Letter.model_validate(msgpack.unpackb(plain[5:5 + length])) == letter and ref == item.ref
    # the mailbox learns the bucket, not the length: a word and 600 bytes seal to the same size
    longer = Letter(id="l2", sender=other_id, recipient=owner_id, tseq=2, text="y" * 600, at=1).sign(other)
    assert len(seal(longer, key)) == len(sealed) == 1024 + 48
    assert len(seal(longer.model_copy(update={"text": "z" * 2000}).sign(other), key)) == 4096 + 48
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


async def test_a_letter_its_mailbox_withholds_is_noticed_and_delivered_directly_with_a_signed_receipt(
        tmp_path: Path) -> None:
    ph = phone_home(tmp_path)
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop = nodes["home"], nodes["laptop"]
        phone_id = await meet_then_sleep(home, laptop, ph)  # the phone is off

        laptop.messaging.grace_s = 0.1
        sent = [laptop.messaging.send("phone", f"part {i} of the plan", thread="plan") for i in range(1, 4)]
        for letter in sent:
            with anyio.fail_after(30):
                assert (await laptop.messaging.wait_sent(letter.id)).state is OutState.DEPOSITED
        # home, malicious or forgetful, drops the second letter and says nothing
        withheld = sent[1]
        home.mailbox.store.conn.execute("DELETE FROM mail_held WHERE ref = ?", (mail_ref(withheld),))
        assert len(held(home, phone_id)) == 2
        # the laptop still holds all three: a deposit is not a delivery
        assert laptop.messaging.store.recipients_pending() == [phone_id]

        async with anyio.create_task_group() as tg:
            phone = start_phone(NodeHome(ph.path))
            await tg.start(phone.run)
            got = await inbox(phone, 3, timeout=30)
            assert [x.id for x in got] == [x.id for x in sent] and threads_in_order(got)

            def delivered() -> bool:
                return all(laptop.messaging.store.sent(x.id).state is OutState.DELIVERED for x in sent)

            await wait_until(delivered, "the laptop to hold the phone's receipt for every letter")
            for letter in sent:
                proof = laptop.messaging.store.proof(letter.id)
                assert proof is not None and letter.id in proof.ids
                check_receipt(proof, recipient=phone_id, local_peer_id=laptop.identity.peer_id)
            # the withheld one came directly, on the session, not from the mailbox
            direct = [r for r in phone.audit.query(peer_id=laptop.identity.peer_id, limit=100)
                      if r["protocol"] == ids.SESSION and r["operation"] == "msg.send"]
            assert direct, "the withheld letter reached the phone directly"
            acks = [r for r in laptop.audit.query(peer_id=phone_id, limit=100) if r["operation"] == "msg.ack"]
            assert acks and all(r["allowed"] for r in acks)  # the mailbox's letters: receipts came back
            assert laptop.messaging.store.recipients_pending() == []
            tg.cancel_scope.cancel()


async def test_a_gap_held_past_its_timeout_asks_the_sender_again(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "laptop", "phone") as nodes:
        laptop, phone = nodes["laptop"], nodes["phone"]
        await pair(phone.home.path, laptop.home.path)
        phone.messaging.gap_s = 0.5
        first = laptop.messaging.send("phone", "one", thread="t")
        assert (await laptop.messaging.wait_sent(first.id)).state is OutState.DELIVERED
        # The laptop believes the second was delivered (a restored backup, a lost disk at the
        # phone): the phone never saw it, and the third waits behind the gap.
        lost = laptop.messaging.store.write(
            lambda tseq: Letter(id="lost", sender=laptop.identity.peer_id, recipient=phone.identity.peer_id,
                                thread="t", tseq=tseq, text="two", at=int(time.time() * 1000))
            .sign(laptop.identity.private_key), phone.identity.peer_id, "t")
        laptop.messaging.store.settle(delivered=[lost.id])
        third = laptop.messaging.send("phone", "three", thread="t")
        assert (await laptop.messaging.wait_sent(third.id)).state is OutState.DELIVERED
        got = await inbox(phone, 3, timeout=20)
        assert [x.text for x in got] == ["one", "two", "three"]
        asks = [r for r in laptop.audit.query(peer_id=phone.identity.peer_id, limit=100)
                if r["operation"] == "msg.missing"]
        assert asks and all(r["allowed"] for r in asks)
        await wait_until(lambda: laptop.messaging.store.sent("lost").state is OutState.DELIVERED,
                         "the resent letter's receipt")
        assert laptop.messaging.store.proof("lost") is not None


async def test_letters_from_a_sender_the_phone_never_paired_leave_no_stub_in_its_inbox(tmp_path: Path) -> None:
    ph = phone_home(tmp_path)
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop = nodes["home"], nodes["laptop"]
        await pair(home.home.path, laptop.home.path)   # the laptop may deposit at home; the phone never met it
        async with anyio.create_task_group() as tg:
            phone = start_phone(ph)
            await tg.start(phone.run)
            phone_id = phone.identity.peer_id
            await pair(home.home.path, ph.path)
            await wait_until(lambda: knows_mailbox(home, phone_id, home.identity.peer_id), "the phone's mail key")
            key = home.mailbox.store.key_of(phone_id)
            assert key is not None
            for i in range(20):  # each one refused for good at the phone's door: unknown_peer
                letter = Letter(id=f"junk-{i}", sender=laptop.identity.peer_id, recipient=phone_id, thread=f"j{i}",
                                tseq=1, text="x" * 1000, at=int(time.time() * 1000)).sign(laptop.identity.private_key)
                await laptop.sessions.request(home.identity.peer_id, MailDeposit(
                    recipient=phone_id, ref=mail_ref(letter), sealed=seal(letter, key)), MailReceipt)
            await wait_until(lambda: held(home, phone_id) == [], "the phone to take (and refuse) them all")
            refused = [r for r in phone.audit.query(peer_id=laptop.identity.peer_id, limit=100)
                       if r["protocol"] == VIA_MAILBOX]
            # every refusal counted (identical ones share a row, with its count: docs/security.md)
            assert sum(r["count"] for r in refused) == 20 and {r["code"] for r in refused} == {"unknown_peer"}
            count = phone.messaging.store.conn.execute("SELECT COUNT(*) FROM msg_inbox").fetchone()[0]
            assert count == 0
            tg.cancel_scope.cancel()


async def test_the_mail_key_rotates_while_the_phone_runs_and_mail_sealed_to_the_old_one_still_opens(
        tmp_path: Path) -> None:
    ph = phone_home(tmp_path)
    ph.save_config(ph.load_config().model_copy(update={"mail": MailSettings(key_rotate_s=2.0, keep_s=60.0)}))
    async with run_nodes(tmp_path, "home", "laptop") as nodes:
        home, laptop = nodes["home"], nodes["laptop"]
        phone_id = await meet_then_sleep(home, laptop, ph)  # off
        old = laptop.mailbox.store.key_of(phone_id)
        assert old is not None
        laptop.messaging.grace_s = 0.1
        letter = laptop.messaging.send("phone", "sealed to the key the phone had", thread="k")
        with anyio.fail_after(30):
            assert (await laptop.messaging.wait_sent(letter.id)).state is OutState.DEPOSITED
        sealed = held(home, phone_id)[0].sealed

        async with anyio.create_task_group() as tg:
            phone = start_phone(NodeHome(ph.path))
            await tg.start(phone.run)
            assert [x.id for x in await inbox(phone, 1, timeout=30)] == [letter.id]   # opened with the retired key

            def rotated_and_told() -> bool:
                key = laptop.mailbox.store.key_of(phone_id)
                return key is not None and key.public != old.public and key.serial > old.serial

            await wait_until(rotated_and_told, "the running phone to make a new mail key and publish it")
            assert any(k.public == old.public for k in phone.mail.ring.keys)  # kept for keep_s
            tg.cancel_scope.cancel()
    # keep_s later (an injected clock), the old secret is gone from the file and opens nothing
    ring = load_mail_ring(ph, MailSettings(key_rotate_s=2.0, keep_s=60.0), time.time() + 120)
    file_bytes = (ph.path / "mail.key").read_bytes()
    assert all(k.public != old.public for k in ring.keys)
    for key in ring.keys:
        with pytest.raises(PsymeshError) as info:
            unseal(sealed, key.secret, recipient=phone_id, sender=laptop.identity.peer_id, ref=mail_ref(letter))
        assert info.value.code is ErrorCode.FORBIDDEN
    assert len(file_bytes) < 200  # the current key only (a ring entry is ~50 bytes)


async def test_receipts_travel_back_through_the_mailbox_between_two_phones_never_awake_together(
        tmp_path: Path) -> None:
    ph = phone_home(tmp_path)
    other = NodeHome(tmp_path / "other")          # a second phone, the writer: it names no mailbox
    other.init(profile="phone", name="other")
    async with run_nodes(tmp_path, "home") as nodes:
        home = nodes["home"]
        async with anyio.create_task_group() as tg:
            phone, writer = start_phone(ph), start_phone(other)
            await tg.start(phone.run)
            await tg.start(writer.run)
            phone_id, writer_id = phone.identity.peer_id, writer.identity.peer_id
            await pair(home.home.path, ph.path)
            await pair(home.home.path, other.path)    # the writer may deposit at home, and take receipts
            await pair(ph.path, other.path)           # the writer may write to the phone
            await wait_until(lambda: knows_mailbox(writer, phone_id, home.identity.peer_id)
                             and knows_mailbox(home, phone_id, home.identity.peer_id), "the phone's mail key")
            tg.cancel_scope.cancel()                  # both off

        async with anyio.create_task_group() as tg:   # the writer wakes, writes, sleeps
            writer = start_phone(NodeHome(other.path))
            writer.messaging.grace_s = 0.1
            await tg.start(writer.run)
            letter = writer.messaging.send("phone", "see you at the gate")
            with anyio.fail_after(30):
                assert (await writer.messaging.wait_sent(letter.id)).state is OutState.DEPOSITED
            tg.cancel_scope.cancel()

        def receipts_held() -> int:
            return home.mailbox.store.conn.execute("SELECT COUNT(*) FROM mail_receipts WHERE sender = ?",
                                                   (writer_id,)).fetchone()[0]

        async with anyio.create_task_group() as tg:   # the phone wakes, reads, cannot reach the writer
            phone = start_phone(NodeHome(ph.path))
            await tg.start(phone.run)
            assert [x.id for x in await inbox(phone, 1, timeout=30)] == [letter.id]
            await wait_until(lambda: receipts_held() == 1, "the phone to leave its receipt at home for the writer")
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:   # the writer wakes: the receipt waits at the phone's mailbox
            writer = start_phone(NodeHome(other.path))
            await tg.start(writer.run)
            await wait_until(lambda: writer.messaging.store.sent(letter.id).state is OutState.DELIVERED,
                             "the writer to take the phone's receipt from home")
            proof = writer.messaging.store.proof(letter.id)
            assert proof is not None and proof.ids == [letter.id]
            check_receipt(proof, recipient=phone_id, local_peer_id=writer_id)
            assert receipts_held() == 0                # handed over once
            tg.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_phone_with_a_mailbox_keeps_running_while_its_home_pc_is_down(tmp_path: Path) -> None:
    """The README's phone names home as its mailbox; home stops (a reboot, a power cut). The
    phone's open mail.fetch fails, and the phone waits for home to come back: it does not stop
    (before, the failure left its fetch loop as an exception group and took the daemon down).
    Home back at its address, the phone dials it again and its letters arrive."""
    import socket

    from psymesh.node.control.process import DaemonProcess

    with socket.socket() as probe:  # home comes back where it was, as at its fixed port in the README
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    home = DaemonProcess(tmp_path / "home", name="home", listen=[f"/ip4/127.0.0.1/tcp/{port}"])
    phone = DaemonProcess(tmp_path / "phone", profile="phone", name="phone")
    await home.start()
    await phone.start()
    try:
        await pair(home.home, phone.home)
        await phone.stop()
        config = NodeHome(phone.home)
        config.save_config(config.load_config().model_copy(update={"mailbox": "home"}))
        await phone.start()
        async with phone.client() as p:
            async def fetching() -> bool:  # the phone's mail.fetch is open on home
                return bool((await p.status()).connected_peers)

            await wait_until(fetching, "the phone connected to its mailbox")
            await home.stop()
            await wait_until(_not(fetching), "the phone to see home gone", timeout=30)
            assert phone.running, phone.log_tail()
        await home.start()
        async with home.client() as h, phone.client() as p:
            sent = await h.send("phone", "back")
            with anyio.fail_after(60):
                letter = await p.inbox().__anext__()
            assert letter.id == sent.id
        assert phone.running, phone.log_tail()
    finally:
        if phone.running:
            await phone.stop()
        if home.running:
            await home.stop()


def _not(check):  # type: ignore[no-untyped-def]
    async def negated() -> bool:
        return not await check()
    return negated
