"""The letter courier (protocol/courier.py), driven by hand: which batches a round sends,
what each answer or failure makes of its letters, when letters go to the recipient's
mailbox, and how long the courier waits before the next round."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings, strategies as st

from psymesh.protocol.courier import (
    BATCH,
    BATCH_BYTES,
    PARKED_RETRY_MAX_S,
    RETRY_MAX_S,
    RETRY_MIN_S,
    Again,
    Away,
    CheckParked,
    Courier,
    Deposit,
    Deposited,
    OutState,
    Refusal,
    Send,
    Settle,
    StubDone,
    Suspect,
    TakeReceipts,
    WaitUntil,
    batches,
)
from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.messaging import (
    Letter,
    LetterResult,
    MsgReceipt,
    MsgReceipts,
    MsgSend,
    MsgSendMany,
    Receipt,
    ReceiptStatus,
)

ME_KEY, THEM_KEY, OTHER_KEY = (Ed25519PrivateKey.generate() for _ in range(3))
ME, THEM, OTHER = (peer_id_from_public_key(k.public_key().public_bytes_raw()) for k in (ME_KEY, THEM_KEY, OTHER_KEY))


@dataclass(frozen=True)
class Out:
    """An outbox row, as the store hands it to the driver."""

    letter: Letter
    state: OutState = OutState.PENDING


def letter(n: int, text: str = "hi") -> Letter:
    return Letter(id=f"l{n}", sender=ME, recipient=THEM, tseq=n, text=text, at=1).sign(ME_KEY)


def outs(*states: OutState) -> list[Out]:
    return [Out(letter(n), state) for n, state in enumerate(states, start=1)]


def proof(*ids: str, key: Ed25519PrivateKey = THEM_KEY, recipient: str = THEM) -> Receipt:
    return Receipt(recipient=recipient, sender=ME, ids=list(ids), at=1).sign(key)


def stored(send: Send, *, proof_ids: list[str] | None = None) -> MsgReceipts:
    """Every letter of the batch stored, with the recipient's signed receipt over their ids."""
    ids = [x.id for x in send.letters]
    return MsgReceipts(results=[LetterResult(id=i) for i in ids], proof=proof(*(ids if proof_ids is None else proof_ids)))


def stub(x: Letter) -> Letter:
    return x.stub().sign(ME_KEY)


def courier(grace_s: float = 5.0) -> Courier:
    return Courier(THEM, local_peer_id=ME, grace_s=grace_s)


# -- a round -------------------------------------------------------------------------------
def test_nothing_waiting_is_no_round() -> None:
    assert courier().begin([]) == []


def test_a_round_delivered_with_its_signed_receipt_settles_and_begins_again_at_once() -> None:
    c = courier()
    [send] = c.begin(outs(OutState.PENDING, OutState.PENDING))
    assert send.stubs == (False, False) and isinstance(send.request(stub), MsgSendMany)
    reply = stored(send)
    assert c.answered(send, reply, 0.0) == [Settle(delivered=("l1", "l2"), proof=reply.proof)]
    assert c.round_over(0.0) == Again()


def test_a_lone_letter_goes_as_msg_send_and_its_receipt_counts_as_a_batch_of_one() -> None:
    c = courier()
    [send] = c.begin(outs(OutState.PENDING))
    assert send.request(stub) == MsgSend(letter=letter(1)) and send.reply_type is MsgReceipt
    receipt = MsgReceipt(id="l1", proof=proof("l1"))
    assert c.answered(send, receipt, 0.0) == [Settle(delivered=("l1",), proof=receipt.proof)]


def test_a_refused_letter_goes_as_its_signed_withdrawn_stub() -> None:
    c = courier()
    [send] = c.begin(outs(OutState.REFUSED, OutState.PENDING))
    wire = send.request(stub)
    assert isinstance(wire, MsgSendMany) and send.reply_type is MsgReceipts
    first, second = wire.letters
    assert first.id == "l1" and first.withdrawn and first.text == "" and first.signature_valid()
    assert second == letter(2)
    assert c.answered(send, stored(send), 0.0)[0] == Settle(delivered=("l2",), stubs_done=("l1",),
                                                            proof=proof("l1", "l2"))


# What each letter's result does: (state it went in, its result) -> (what is settled, the
# retry it asks for: None, 0.0 "at once", or seconds).
RESULTS = [
    (OutState.PENDING, LetterResult(id="l1"), "delivered", None),
    (OutState.DEPOSITED, LetterResult(id="l1"), "delivered", None),
    (OutState.REFUSED, LetterResult(id="l1"), "stubs_done", None),
    (OutState.PENDING, LetterResult(id="l1", status=ReceiptStatus.REFUSED, code=ErrorCode.BUSY, retry_after=7.0),
     None, 7.0),
    (OutState.PENDING, LetterResult(id="l1", status=ReceiptStatus.REFUSED, code=ErrorCode.RATE_LIMITED), None,
     RETRY_MIN_S),
    (OutState.PENDING, LetterResult(id="l1", status=ReceiptStatus.REFUSED), None, RETRY_MIN_S),  # no code: again
    (OutState.PENDING, LetterResult(id="l1", status=ReceiptStatus.REFUSED, code=ErrorCode.FORBIDDEN, reason="no"),
     "refused", 0.0),
    (OutState.REFUSED, LetterResult(id="l1", status=ReceiptStatus.REFUSED, code=ErrorCode.FORBIDDEN), "stubs_done",
     None),
    (OutState.REFUSED, LetterResult(id="l1", status=ReceiptStatus.REFUSED, code=ErrorCode.BUSY), None, RETRY_MIN_S),
]


@pytest.mark.parametrize(("state", "result", "settled", "retry"), RESULTS)
def test_each_result_of_a_batch(state: OutState, result: LetterResult, settled: str | None,
                                retry: float | None) -> None:
    c = courier()
    [send] = c.begin([Out(letter(1), state)])
    reply = MsgReceipts(results=[result], proof=proof("l1") if result.status is ReceiptStatus.STORED else None)
    [settle] = c.answered(send, reply, 100.0)
    assert isinstance(settle, Settle)
    expected = {"delivered": (), "stubs_done": (), "refused": ()}
    if settled == "refused":
        expected["refused"] = (Refusal("l1", ErrorCode.FORBIDDEN.value, "no"),)
    elif settled is not None:
        expected[settled] = ("l1",)
    assert (settle.delivered, settle.stubs_done, settle.refused) == tuple(expected.values())
    step = c.round_over(100.0)
    if retry is None:
        assert step == Again()
        return
    assert step == CheckParked()
    step = c.parked([Out(letter(1), OutState.PENDING)], 100.0)
    assert step == (Again() if retry == 0.0 else WaitUntil(100.0 + max(RETRY_MIN_S, retry)))


@pytest.mark.parametrize("reply", [
    MsgReceipts(results=[LetterResult(id="l2")], proof=proof("l2")),              # another letter's result
    MsgReceipts(results=[LetterResult(id="l1")]),                                # stored, but no receipt
    MsgReceipts(results=[LetterResult(id="l1")], proof=proof("l1", key=OTHER_KEY, recipient=OTHER)),  # another's
    MsgReceipts(results=[LetterResult(id="l1")], proof=proof("l1").model_copy(update={"signature": bytes(64)})),
    MsgReceipts(results=[LetterResult(id="l1")], proof=proof("l9")),             # over other ids
    MsgReceipts(results=[LetterResult(id="l1", status=ReceiptStatus.REFUSED, code=ErrorCode.FORBIDDEN)],
                proof=proof("l1")),                                              # a receipt for a refusal
], ids=["other-id", "no-proof", "another-peers", "forged", "other-proof-ids", "proof-of-nothing"])
def test_a_reply_without_the_recipients_receipt_for_what_it_stored_settles_nothing(reply: MsgReceipts) -> None:
    c = courier()
    [send] = c.begin(outs(OutState.PENDING))
    [suspect] = c.answered(send, reply, 0.0)
    assert isinstance(suspect, Suspect) and THEM in suspect.reason
    assert c.round_over(0.0) == CheckParked()
    assert c.parked(outs(OutState.PENDING), 0.0) == WaitUntil(RETRY_MIN_S)


def test_a_whole_request_refused() -> None:
    c = courier()
    [send] = c.begin(outs(OutState.PENDING, OutState.REFUSED))
    assert c.refused(send, PsymeshError("full", code=ErrorCode.BUSY, retry_after=3.0), 10.0) == []
    assert c.round_over(10.0) == CheckParked()
    assert c.parked(outs(OutState.PENDING), 10.0) == WaitUntil(13.0)
    # for good: each letter as it would be alone (the stub needs no more sending)
    [send] = c.begin(outs(OutState.PENDING, OutState.REFUSED))
    assert c.refused(send, PsymeshError("no", code=ErrorCode.FORBIDDEN), 20.0) == [
        Settle(stubs_done=("l2",), refused=(Refusal("l1", "forbidden", "no"),))]


def test_held_back_on_our_side_waits_the_longest() -> None:
    c = courier()
    [send] = c.begin(outs(OutState.PENDING))
    assert c.held_back(send) == []
    assert c.round_over(0.0) == CheckParked() and c.parked(outs(OutState.PENDING), 0.0) == WaitUntil(RETRY_MAX_S)


# -- away: the grace period and the mailbox ------------------------------------------------------
def test_unreachable_within_grace_retries_and_tells_waiters_once() -> None:
    c = courier(grace_s=5.0)
    first, second = c.begin([Out(letter(n)) for n in range(1, 66)])  # two batches: 64 + 1
    assert c.unreachable(first, 100.0) == [Away(tuple(x.id for x in first.letters))]
    assert c.unreachable(second, 100.1) == []  # already told
    assert c.away_since == 100.0
    assert c.round_over(100.1) == CheckParked()
    assert c.parked([Out(letter(1))], 100.1) == WaitUntil(100.1 + RETRY_MIN_S)


def test_past_grace_each_letter_not_at_the_mailbox_is_deposited() -> None:
    c = courier(grace_s=5.0)
    [send] = c.begin(outs(OutState.PENDING, OutState.DEPOSITED, OutState.REFUSED))
    c.unreachable(send, 100.0)
    [send] = c.begin(outs(OutState.PENDING, OutState.DEPOSITED, OutState.REFUSED))
    deposits = c.unreachable(send, 105.0)
    assert deposits == [Deposit(letter(1), stub=False), Deposit(letter(3), stub=True)]
    assert deposits[1].wire(stub).withdrawn and deposits[0].wire(stub) == letter(1)
    assert c.deposit_done(deposits[0], held=True) == [Deposited("l1")]
    assert c.deposit_done(deposits[1], held=True) == [StubDone("l3")]
    # the deposited letter is still offered directly: another round later, parked
    assert c.round_over(105.0) == CheckParked()
    assert c.parked(outs(OutState.DEPOSITED, OutState.DEPOSITED), 105.0) == TakeReceipts()
    assert c.receipts_taken(False, 105.0) == WaitUntil(105.0 + RETRY_MIN_S)


def test_a_deposit_the_mailbox_did_not_take_is_retried() -> None:
    c = courier(grace_s=0.0)
    [send] = c.begin(outs(OutState.PENDING))
    [away, deposit] = c.unreachable(send, 1.0)
    assert isinstance(away, Away) and isinstance(deposit, Deposit)
    assert c.deposit_done(deposit, held=False) == []
    assert c.round_over(1.0) == CheckParked() and c.parked(outs(OutState.PENDING), 1.0) == WaitUntil(1.2)


def test_an_answer_ends_the_away_spell() -> None:
    c = courier(grace_s=5.0)
    [send] = c.begin(outs(OutState.PENDING))
    c.unreachable(send, 0.0)
    [send] = c.begin(outs(OutState.PENDING))
    c.answered(send, stored(send), 1.0)
    assert c.away_since is None
    [send] = c.begin(outs(OutState.PENDING))
    assert c.unreachable(send, 100.0) == [Away(("l1",))]  # a new spell: waiters told again, grace anew


def test_receipts_from_the_mailbox_that_deliver_begin_again_at_once() -> None:
    c = courier(grace_s=0.0)
    [send] = c.begin(outs(OutState.DEPOSITED))
    assert c.unreachable(send, 0.0) == [Away(("l1",))]  # held there already: nothing to deposit
    assert c.round_over(0.0) == CheckParked() and c.parked(outs(OutState.DEPOSITED), 0.0) == TakeReceipts()
    assert c.receipts_taken(True, 0.0) == Again()


# -- the wait between rounds -----------------------------------------------------------------
def waits(c: Courier, rounds: int, *, parked: bool, now: float = 0.0) -> list[float]:
    """The courier's waits over `rounds` rounds to a recipient that never answers."""
    state = OutState.DEPOSITED if parked else OutState.PENDING
    out: list[float] = []
    for _ in range(rounds):
        [send] = c.begin(outs(state))
        c.unreachable(send, now)
        assert c.round_over(now) == CheckParked()
        step = c.parked(outs(state), now)
        if isinstance(step, TakeReceipts):
            step = c.receipts_taken(False, now)
        assert isinstance(step, WaitUntil)
        out.append(round(step.when - now, 6))
        now = step.when
    return out


def test_the_wait_doubles_up_to_its_cap_and_a_delivery_resets_it() -> None:
    c = courier(grace_s=1e9)
    assert waits(c, 10, parked=False) == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]
    [send] = c.begin(outs(OutState.PENDING))
    c.answered(send, stored(send), 0.0)
    assert c.round_over(0.0) == Again()
    assert waits(c, 1, parked=False) == [0.2]


def test_a_parked_recipient_is_offered_its_letters_more_seldom() -> None:
    assert waits(courier(grace_s=0.0), 14, parked=True)[-4:] == [204.8, 300.0, 300.0, 300.0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lost", "busy", "held_back", "stored", "forbidden"]),
                          st.none() | st.floats(0.0, 1000.0)), min_size=1, max_size=30),
       st.booleans())
def test_every_wait_is_within_bounds_and_honours_what_the_recipient_asked(
        rounds: list[tuple[str, float | None]], parked: bool) -> None:
    c = courier(grace_s=1e9)
    cap = PARKED_RETRY_MAX_S if parked else RETRY_MAX_S
    state = OutState.DEPOSITED if parked else OutState.PENDING
    now = 0.0
    for what, retry_after in rounds:
        [send] = c.begin(outs(state))
        if what == "lost":
            c.unreachable(send, now)
        elif what == "busy":
            c.refused(send, PsymeshError("busy", code=ErrorCode.BUSY, retry_after=retry_after), now)
        elif what == "held_back":
            c.held_back(send)
        elif what == "stored":
            c.answered(send, stored(send), now)
        else:
            c.answered(send, MsgReceipts(results=[LetterResult(id="l1", status=ReceiptStatus.REFUSED,
                                                               code=ErrorCode.FORBIDDEN)]), now)
        step = c.round_over(now)
        if what == "stored":
            assert step == Again()
            continue
        assert step == CheckParked()
        step = c.parked(outs(state), now)
        if isinstance(step, TakeReceipts):
            step = c.receipts_taken(False, now)
        if what == "forbidden":  # its stub goes next, at once
            assert step == Again()
            continue
        assert isinstance(step, WaitUntil)
        wait = step.when - now
        assert RETRY_MIN_S - 1e-9 <= wait <= cap + 1e-9
        asked = {"busy": retry_after or RETRY_MIN_S, "held_back": RETRY_MAX_S}.get(what, RETRY_MIN_S)
        assert wait >= min(cap, asked) - 1e-9
        now = step.when


# -- batches ----------------------------------------------------------------------------------
def sized(sizes: list[int]) -> list[Out]:
    """Letters of about these payloads: text (at most 64 KiB), the rest a body pad."""
    def make(i: int, size: int) -> Letter:
        text = min(size, 60_000)
        return Letter(id=f"l{i}", sender=ME, recipient=THEM, tseq=i + 1, text="x" * text,
                      body={"pad": "y" * (size - text)} if size > text else {}, at=1)
    return [Out(make(i, size)) for i, size in enumerate(sizes)]


@pytest.mark.parametrize(("sizes", "cut"), [
    ([1] * 64, [64]),
    ([1] * 65, [64, 1]),
    ([1] * 200, [64, 64, 64, 8]),
    ([BATCH_BYTES // 2 - 100, BATCH_BYTES // 2 - 100, 1000], [2, 1]),
    ([10, BATCH_BYTES + 5, 10], [1, 1, 1]),      # a letter over the byte limit goes alone
    ([BATCH_BYTES + 5], [1]),
])
def test_batches_are_cut_at_their_count_and_bytes(sizes: list[int], cut: list[int]) -> None:
    assert [len(b) for b in batches(sized(sizes))] == cut


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 5000), st.sampled_from([BATCH_BYTES // 3, BATCH_BYTES, BATCH_BYTES + 1])),
                max_size=100))
def test_batches_keep_order_and_limits(sizes: list[int]) -> None:
    waiting = sized(sizes)
    cut = list(batches(waiting))
    assert [o for b in cut for o in b] == waiting
    for b in cut:
        assert 1 <= len(b) <= BATCH
        assert len(b) == 1 or sum(o.letter.payload_bytes for o in b) <= BATCH_BYTES
