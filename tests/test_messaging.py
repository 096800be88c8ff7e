"""Agent-to-agent letters between real daemons on loopback: signed, receipted, exactly once,
in order within a thread, held for a recipient that is away, refused (and audited) for a
sender without `msg.send`."""
from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from letters import inbox, threads_in_order
from waiting import wait_until
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.core.db import open_db
from psymesh.node.core.home import NodeHome
from psymesh.node.messaging.store import MessageStore, OutState
from psymesh.protocol import ids
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.limits import Limits
from psymesh.protocol.messaging import (
    Letter,
    LetterKind,
    MsgReceipt,
    MsgReceipts,
    MsgSend,
    MsgSendMany,
    ReceiptStatus,
    releasable,
)

pytestmark = pytest.mark.anyio
ROOMY = Limits(requests_per_minute=100_000)


async def test_letters_arrive_once_in_order_with_receipts(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["msg.send"], limits=ROOMY)
        sent = [phone.messaging.send("home", f"note {i}", thread=f"t{i % 3}", body={"i": i}) for i in range(60)]
        got = await inbox(home, 60)
        assert sorted(letter.id for letter in got) == sorted(letter.id for letter in sent)
        assert threads_in_order(got)
        assert all(letter.sender == phone.identity.peer_id and letter.signature_valid() for letter in got)
        for letter in sent:
            with anyio.fail_after(10):
                assert (await phone.messaging.wait_sent(letter.id)).state is OutState.DELIVERED
        # a resend of a letter it already holds is answered, and dropped
        again = await phone.sessions.request(home.identity.peer_id, MsgSend(letter=sent[0]), MsgReceipt)
        assert again.id == sent[0].id
        assert len(home.messaging.store.released_after(0)) == 60
        rows = [r for r in home.audit.query(peer_id=phone.identity.peer_id, limit=1000) if r["operation"] == "msg.send"]
        assert len(rows) == 61 and all(r["allowed"] and r["protocol"] == ids.SESSION for r in rows)


async def test_a_recipient_that_is_away_gets_its_letters_when_it_is_back(tmp_path: Path) -> None:
    home_dir = tmp_path / "home"
    async with run_nodes(tmp_path, "phone") as nodes:
        phone = nodes["phone"]
        async with run_nodes(tmp_path, "home") as h:
            await pair(h["home"].home.path, phone.home.path)
        # home is down now: letters wait in the phone's outbox, in order
        letters = [phone.messaging.send("home", f"while you were out {i}", thread="away") for i in range(20)]
        await wait_until(lambda: phone.messaging.store.pending(letters[0].recipient) != [], "the courier to try")
        assert all(phone.messaging.store.sent(x.id).state is OutState.PENDING for x in letters)
        async with anyio.create_task_group() as tg:
            home = Node(NodeHome(home_dir))  # the same home, back on a new port
            await tg.start(home.run)
            phone.trust.set_addrs(home.identity.peer_id, home.p2p.addrs())
            got = await inbox(home, 20, timeout=60)
            assert [x.id for x in got] == [x.id for x in letters]
            tg.cancel_scope.cancel()


async def test_a_sender_without_msg_send_is_refused_and_audited(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["tool:system.info"])  # no msg.send
        letter = phone.messaging.send("home", "let me in", thread="x")
        with anyio.fail_after(20):
            refused = await phone.messaging.wait_sent(letter.id)
        assert refused.state is OutState.REFUSED and refused.code == ErrorCode.FORBIDDEN.value
        await wait_until(lambda: phone.messaging.store.pending(home.identity.peer_id) == [],
                         "the courier to give the letter (and its stub) up")
        assert home.messaging.store.released_after(0) == []
        denied = [r for r in home.audit.query(peer_id=phone.identity.peer_id, denied_only=True, limit=100)
                  if r["operation"] == "msg.send"]
        assert denied and {r["code"] for r in denied} == {"forbidden"}
        # and a stranger cannot send at all
        with pytest.raises(PsymeshError) as info:
            home.messaging.send("nobody", "hi")
        assert info.value.code is ErrorCode.UNKNOWN_PEER


async def test_a_refused_letter_does_not_hold_its_thread(tmp_path: Path) -> None:
    """A letter over the grant's payload limit is refused; its withdrawn stub keeps the
    thread going, so the letters after it are released in order."""
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["msg.send"], limits=Limits(max_payload_bytes=1000, requests_per_minute=10_000))
        first = phone.messaging.send("home", "short", thread="t")
        big = phone.messaging.send("home", "x" * 5000, thread="t")
        last = phone.messaging.send("home", "after the big one", thread="t")
        got = await inbox(home, 2)
        assert [x.id for x in got] == [first.id, last.id]
        with anyio.fail_after(10):
            assert (await phone.messaging.wait_sent(big.id)).code == ErrorCode.TOO_LARGE.value


async def test_one_bad_letter_in_a_batch_refuses_only_itself(tmp_path: Path) -> None:
    """A batch with a letter too large and an ask the grant does not allow: the others are
    stored and receipted, each refused one gets its own result (and, from the courier, its
    withdrawn stub), and the thread is released in order."""
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["msg.send"], limits=Limits(max_payload_bytes=1000, requests_per_minute=10_000))

        def letter(tseq: int, text: str, kind: LetterKind = LetterKind.SEND) -> Letter:
            return Letter(id=f"raw-{tseq}", sender=phone.identity.peer_id, recipient=home.identity.peer_id,
                          thread="raw", tseq=tseq, kind=kind, text=text,
                          at=int(time.time() * 1000)).sign(phone.identity.private_key)

        # on the wire: one receipt per letter, in order, the refused ones saying why
        batch = [letter(1, "one"), letter(2, "x" * 5000), letter(3, "may I?", LetterKind.ASK), letter(4, "four")]
        reply = await phone.sessions.request(home.identity.peer_id, MsgSendMany(letters=batch), MsgReceipts)
        assert [(r.id, r.status, r.code) for r in reply.results] == [
            ("raw-1", ReceiptStatus.STORED, None), ("raw-2", ReceiptStatus.REFUSED, ErrorCode.TOO_LARGE),
            ("raw-3", ReceiptStatus.REFUSED, ErrorCode.FORBIDDEN), ("raw-4", ReceiptStatus.STORED, None)]
        assert [r.letter.id for r in home.messaging.store.released_after(0)] == ["raw-1"]  # 4 waits for 2, 3
        rows = home.audit.query(peer_id=phone.identity.peer_id, limit=100)
        assert [(r["operation"], r["allowed"], r["code"]) for r in rows[-5:]] == [
            ("msg.send_many", True, None), ("msg.send", True, None), ("msg.send", False, "too_large"),
            ("msg.ask", False, "forbidden"), ("msg.send", True, None)]

        # through the courier: all four leave in one batch (send() returns before it runs)
        first = phone.messaging.send("home", "short", thread="t")
        big = phone.messaging.send("home", "x" * 5000, thread="t")
        ask = phone.messaging.send("home", "may I?", thread="t", kind=LetterKind.ASK)
        last = phone.messaging.send("home", "after the bad ones", thread="t")
        got = await inbox(home, 3)
        assert [x.id for x in got] == ["raw-1", first.id, last.id]
        with anyio.fail_after(10):
            assert (await phone.messaging.wait_sent(big.id)).code == ErrorCode.TOO_LARGE.value
            assert (await phone.messaging.wait_sent(ask.id)).code == ErrorCode.FORBIDDEN.value
            assert (await phone.messaging.wait_sent(last.id)).state is OutState.DELIVERED
        await wait_until(lambda: phone.messaging.store.pending(home.identity.peer_id) == [], "the stubs to be taken")
        stubs = [r.letter for r in home.messaging.store.released_after(0) if r.letter.thread == "t"]
        assert [(x.tseq, x.withdrawn) for x in stubs] == [(1, False), (2, True), (3, True), (4, False)]


def test_a_deposited_letter_refused_for_good_when_offered_directly_ends_refused(tmp_path: Path) -> None:
    """A letter its recipient's mailbox withheld until the recipient gave its place up
    (`expired`) is refused, its stub goes, and the courier has nothing left to send
    (it was once left deposited and offered again at once, for ever)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from psymesh.protocol.identity import peer_id_from_public_key

    store = MessageStore(open_db(tmp_path / "db"))
    key = Ed25519PrivateKey.generate()
    me = peer_id_from_public_key(key.public_key().public_bytes_raw())
    them = peer_id_from_public_key(Ed25519PrivateKey.generate().public_key().public_bytes_raw())
    sent = store.write(lambda tseq: Letter(id="l1", sender=me, recipient=them, tseq=tseq, text="hi",
                                           at=int(time.time() * 1000)).sign(key), them, "main")
    store.deposited(sent.id)
    assert [s.state for s in store.pending(them)] == [OutState.DEPOSITED]
    store.settle(refused=[(sent.id, ErrorCode.EXPIRED.value, "place 1 was given up")])
    held = store.sent(sent.id)
    assert held is not None and held.state is OutState.REFUSED and held.code == ErrorCode.EXPIRED.value
    assert [s.stub_sent for s in store.pending(them)] == [False]  # its stub is due
    store.settle(stubs_done=[sent.id])
    assert store.pending(them) == [] and store.recipients_pending() == []


def test_the_inbox_holds_a_letter_until_its_predecessor_arrives(tmp_path: Path) -> None:
    store = MessageStore(open_db(tmp_path / "db"))
    from psymesh.protocol.identity import peer_id_from_public_key
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    sender = peer_id_from_public_key(key.public_key().public_bytes_raw())
    me = peer_id_from_public_key(other.public_key().public_bytes_raw())

    at = int(time.time() * 1000)

    def letter(tseq: int) -> Letter:  # the same letter each time it is asked for (a resend)
        return Letter(id=f"l{tseq}", sender=sender, recipient=me, thread="t", tseq=tseq, text=str(tseq),
                      at=at, body={"pi": 3.14}).sign(key)

    assert store.store(letter(2)) == [] and store.held() == 1
    assert store.store(letter(3)) == []
    released = store.store(letter(1))
    assert [r.letter.tseq for r in released] == [1, 2, 3] and [r.release_seq for r in released] == [1, 2, 3]
    assert store.store(letter(2)) == [] and len(store.released_after(0)) == 3  # a resend changes nothing
    # a batch, in one transaction: out of order, a resend inside it, a letter held behind a gap
    batch = [letter(5), letter(4), letter(4), letter(7)]
    assert [(r.letter.tseq, r.release_seq) for r in store.store_many(batch).released] == [(4, 4), (5, 5)]
    assert store.held() == 1
    assert releasable([5, 3, 4, 7], 2) == [3, 4, 5]


async def test_a_letter_with_a_bad_signature_is_refused_at_the_door_and_spends_no_rate(tmp_path: Path) -> None:
    """Issue 34 item 3: a letter whose signature does not verify (alone, or in a batch) is
    refused by the door (`forbidden`), its audit row says so, and it spends nothing of the
    grant's request rate: the good letters after it are all taken."""
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["msg.send"], limits=Limits(requests_per_minute=2))

        def letter(tseq: int, text: str, *, forged: bool = False) -> Letter:
            signed = Letter(id=f"sig-{tseq}", sender=phone.identity.peer_id, recipient=home.identity.peer_id,
                            thread="sig", tseq=tseq, text=text, at=int(time.time() * 1000)
                            ).sign(phone.identity.private_key)
            return signed.model_copy(update={"text": text + " (altered)"}) if forged else signed

        to_home = home.identity.peer_id
        with pytest.raises(PsymeshError) as info:
            await phone.sessions.request(to_home, MsgSend(letter=letter(1, "one", forged=True)), MsgReceipt)
        assert info.value.code is ErrorCode.FORBIDDEN and "signature" in info.value.message
        reply = await phone.sessions.request(to_home, MsgSendMany(letters=[letter(1, "one", forged=True)]), MsgReceipts)
        assert [(r.status, r.code) for r in reply.results] == [(ReceiptStatus.REFUSED, ErrorCode.FORBIDDEN)]
        # the grant's 2 a minute are all still there
        assert (await phone.sessions.request(to_home, MsgSend(letter=letter(1, "one")), MsgReceipt)).id == "sig-1"
        reply = await phone.sessions.request(to_home, MsgSendMany(letters=[letter(2, "two")]), MsgReceipts)
        assert [r.status for r in reply.results] == [ReceiptStatus.STORED]
        assert [r.letter.text for r in home.messaging.store.released_after(0)] == ["one", "two"]
        rows = [r for r in home.audit.query(peer_id=phone.identity.peer_id, limit=100) if r["operation"] == "msg.send"]
        assert [(r["allowed"], r["code"], r["count"]) for r in rows] == [
            (False, "forbidden", 2), (True, None, 1), (True, None, 1)]
        assert "signature" in rows[0]["reason"]


async def test_a_letter_the_inbox_refuses_after_the_door_gives_its_charge_back(tmp_path: Path) -> None:
    """Issue 34 item 3: a letter the door admits and the inbox then refuses (here `conflict`:
    another letter under a used id) spends nothing of the grant's rate, and the audit log
    says what became of it: a refused `msg.inbox` row with the code, after the door's row."""
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["msg.send"], limits=Limits(requests_per_minute=2))

        def letter(tseq: int, text: str, letter_id: str) -> Letter:
            return Letter(id=letter_id, sender=phone.identity.peer_id, recipient=home.identity.peer_id,
                          thread="inbox", tseq=tseq, text=text, at=int(time.time() * 1000)
                          ).sign(phone.identity.private_key)

        to_home = home.identity.peer_id
        assert (await phone.sessions.request(to_home, MsgSend(letter=letter(1, "one", "a")), MsgReceipt)).id == "a"
        with pytest.raises(PsymeshError) as info:  # the same id, other content
            await phone.sessions.request(to_home, MsgSend(letter=letter(1, "uno", "a")), MsgReceipt)
        assert info.value.code is ErrorCode.CONFLICT
        reply = await phone.sessions.request(to_home, MsgSendMany(letters=[letter(1, "eins", "a")]), MsgReceipts)
        assert [r.code for r in reply.results] == [ErrorCode.CONFLICT]
        # one of the two a minute is left: the refused ones gave theirs back
        assert (await phone.sessions.request(to_home, MsgSend(letter=letter(2, "two", "b")), MsgReceipt)).id == "b"
        rows = [(r["protocol"], r["allowed"], r["code"], r["count"])
                for r in home.audit.query(peer_id=phone.identity.peer_id, limit=100) if r["operation"] == "msg.send"]
        assert ("msg.inbox", False, "conflict", 2) in rows
        assert [row for row in rows if row[1]] == [(ids.SESSION, True, None, 1)] * 4  # the door let all 4 in
