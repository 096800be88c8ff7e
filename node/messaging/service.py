"""Messaging on the node: letters out (one courier per recipient) and in (the door's
`msg.send` service), on the sessions every other request uses.

    send(to, text) ─> outbox (signed, numbered in its thread) ─> courier(recipient)
        courier: a short loop running protocol/courier.py's `Courier`, which decides: up to
                 WINDOW letters a round, BATCH to a `msg.send_many`; its receipts recorded in
                 one transaction: stored -> delivered; busy / unreachable -> retry with
                 backoff; refused for good -> refused, and a withdrawn stub goes in its place
                 so its thread is not held; unreachable for longer than `grace_s` -> sealed
                 and left at the recipient's mailbox, if it named one
                 (node/messaging/mailclient.py) -> deposited, and still offered directly
                 (backoff up to PARKED_RETRY_MAX_S) until the recipient's signed receipt
                 comes back, on a direct delivery or a `msg.ack`
    msg.send (admitted by the door, which checks the letter itself) ─> inbox (exactly once) ─> receipt,
        with `proof`: our signed Receipt over the ids stored
    msg.ack     (the recipient's signed receipt for letters its mailbox handed over) ─> delivered
    msg.missing (the recipient held a gap past `gap_s`) ─> those letters pending again
    gap timer   one timer at the next deadline: a thread held behind a gap for `gap_s`
                asks its sender for the missing tseqs (again every `gap_s` while it lasts);
                a gap still open after [inbox] held_s (a day) is given up: the letters
                behind it are released, each saying how many it skipped
    acker       letters our mailbox handed us owe their sender a receipt: `msg.ack`, or, when
                the sender cannot be reached, left at our own mailbox for it to take
    parked      a courier whose letters all sit at the mailbox takes the receipts the
                recipient left there, each round, besides offering the letters directly
    msg.send_many (the envelope admitted by the door, then each letter as its msg.send)
        ─> the accepted ones stored in one transaction ─> receipts
        released letters wake `follow()` (the app's inbox stream)
"""
from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import anyio
import anyio.abc

from ..core.home import Identity
from .store import MessageStore, OutState, Received, Sent, Stored
from ..core.notify import Notifier
from ..net.session import Call, Links, SessionPool
from ..door.trust import TrustStore
from ..core.wakelock import WakeLock
from ...protocol import ids
from ...protocol.courier import (
    PARKED_RETRY_MAX_S,
    RETRY_MIN_S,
    RETRYABLE,
    WINDOW,
    Action,
    Away,
    CheckParked,
    Courier,
    Deposit,
    Deposited,
    Send,
    Settle,
    StubDone,
    Suspect,
    TakeReceipts,
    WaitUntil,
)
from ...protocol.errors import ErrorCode, NetworkError, ProtocolError, PsymeshError, RemoteError
from ...protocol.messages import Message
from ...protocol.messaging import (
    Letter,
    LetterKind,
    LetterResult,
    MsgAck,
    MsgAckOk,
    MsgMissing,
    MsgMissingOk,
    MsgReceipt,
    MsgReceipts,
    MsgSend,
    MsgSendMany,
    Receipt,
    check_receipt,
)
from ...protocol.tasks import JsonMap

log = logging.getLogger("psymesh.msg")

_INBOX = "inbox"       # the Notifier key for "letters were released"
_HELD = "held"         # ... for "a letter is held behind a gap"
EXPIRE_EVERY_S = 300.0  # how often held letters are looked at for a gap to give up (at most)


def _nudge(peer_id: str) -> str:
    """The Notifier key that cuts a courier's (or acker's) backoff short."""
    return f"nudge:{peer_id}"


class LetterDoor(Protocol):
    def __call__(self, peer_id: str, service: str, requests: Sequence[Message]) -> list[PsymeshError | None]:
        """Admit each letter of a batch as the `msg.send` it stands for (the gate's
        `admit_each`): per letter, None or why it was refused."""


class LetterUndo(Protocol):
    def __call__(self, peer_id: str, request: Message, refusal: PsymeshError) -> None:
        """A letter the door admitted that the inbox refused: its charge given back, the refusal
        audited (the gate's `undo`)."""


class MailDrop(Protocol):
    async def deposit(self, letter: Letter) -> bool:
        """Leave `letter` at its recipient's mailbox: True once held there, False if the
        recipient named no mailbox we can use. A refusal or a network failure raises."""

    async def leave_receipt(self, receipt: Receipt) -> bool:
        """Leave our receipt for its sender at our own mailbox: True once held, False if we
        named none. A refusal or a network failure raises."""

    async def take_receipts(self, recipient: str) -> list[Receipt]:
        """The receipts `recipient` left for us at its mailbox (unchecked). Raises as above."""


class Messaging:
    def __init__(self, identity: Identity, store: MessageStore, trust: TrustStore, sessions: SessionPool,
                 door: LetterDoor, mail: MailDrop | None = None, grace_s: float = 5.0,
                 gap_s: float = 600.0, wake: WakeLock | None = None, links: Links | None = None,
                 undo: LetterUndo | None = None) -> None:
        """`links`: the p2p host's connections (P2PNode), so that a recipient that connects
        gets its letters at once, not after its courier's back-off (None: after it). `undo`:
        told of each letter the door admitted and the inbox refused."""
        self.identity = identity
        self.undo = undo
        self.links = links
        self.wake = wake or WakeLock(None)  # held while letters wait to be delivered
        self.door = door
        self.store = store
        self.trust = trust
        self.sessions = sessions
        self.mail = mail
        self.grace_s = grace_s      # unreachable this long: letters go to the recipient's mailbox
        self.gap_s = gap_s          # a thread held this long behind a gap asks its sender again
        self._asked: dict[tuple[str, str], float] = {}  # (sender, thread) -> when we last sent msg.missing
        self._ackers: set[str] = set()     # senders we are sending receipts to
        self.changed = Notifier()   # _INBOX: letters released; letter id: its outbox row changed
        self._couriers: set[str] = set()   # recipients with a courier at work (it re-reads the outbox each round)
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                for recipient in self.store.recipients_pending():  # after a restart
                    self._wake(recipient)
                for sender in self.store.senders_owed():
                    self._wake_acker(sender)
                task_status.started()
                tg.start_soon(self._expire_held)
                if self.links is not None:
                    tg.start_soon(self._nudge_when_connected, self.links)
                await self._watch_gaps(tg)
            finally:  # stopping: the group takes no new task, so a letter the mailbox client
                self._tg = None  # still hands over waits for the next run() (senders_owed)

    # -- sending ---------------------------------------------------------------------------
    def send(self, to: str, text: str = "", *, body: JsonMap | None = None, thread: str = "main",
             kind: LetterKind = LetterKind.SEND, reply_to: str | None = None, group: str | None = None,
             letter_id: str | None = None) -> Letter:
        """Write, sign and store a letter for `to` (a paired peer's name or id); a courier
        delivers it. Returns at once: the letter is durable here."""
        peer = self.trust.resolve(to)
        peer.refuse_if_revoked_us()
        existing = self.store.sent(letter_id) if letter_id else None
        if existing is not None:  # a script resending the same letter: it is already on its way
            return existing.letter

        def make(tseq: int) -> Letter:
            return Letter(id=letter_id or uuid.uuid4().hex, sender=self.identity.peer_id, recipient=peer.peer_id,
                          thread=thread, tseq=tseq, kind=kind, text=text, body=body or {}, at=int(time.time() * 1000),
                          reply_to=reply_to, group=group).sign(self.identity.private_key)

        letter = self.store.write(make, peer.peer_id, thread)
        self._wake(peer.peer_id)
        return letter

    def _wake(self, recipient: str) -> None:
        """Make sure a courier is at work for `recipient` (a running one finds the new letters
        at its next read of the outbox)."""
        if recipient in self._couriers:
            self.changed.notify(_nudge(recipient))
            return
        if self._tg is None:
            raise PsymeshError("messaging is not running", code=ErrorCode.UNAVAILABLE)
        self._couriers.add(recipient)
        self._tg.start_soon(self._courier, recipient)

    async def _courier(self, recipient: str) -> None:
        """Run `recipient`'s `protocol.courier.Courier` until no letter waits: its batches
        handed over concurrently, WINDOW letters a round, then a wait if it says so (the wake
        lock held meanwhile: a phone's CPU stays up while letters wait to leave)."""
        courier = Courier(recipient, local_peer_id=self.identity.peer_id, grace_s=self.grace_s)
        try:
            while sends := courier.begin(self.store.pending(recipient, limit=WINDOW)):
                with self.wake.held():  # awake while handing letters over, not while waiting to retry
                    async with anyio.create_task_group() as tg:
                        for send in sends:
                            tg.start_soon(self._deliver, courier, send)
                    step = courier.round_over(time.monotonic())
                    if isinstance(step, CheckParked):
                        step = courier.parked(self.store.pending(recipient, WINDOW), time.monotonic())
                    if isinstance(step, TakeReceipts):
                        step = courier.receipts_taken(await self._take_receipts(recipient), time.monotonic())
                if isinstance(step, WaitUntil):  # the recipient is away or busy (new letters wait too)
                    with anyio.move_on_after(step.when - time.monotonic()):  # a new letter, or word from
                        await self.changed.wait(_nudge(recipient))          # the recipient, cuts it short
        finally:
            self._couriers.discard(recipient)  # (no await since the last read: no letter is missed)

    async def _deliver(self, courier: Courier, send: Send) -> None:
        """Hand one batch over and carry out what the courier makes of how it went."""
        recipient = courier.recipient
        try:
            reply = await self.sessions.request(recipient, send.request(self._stub), send.reply_type, timeout=30)
        except RemoteError as exc:
            actions = courier.refused(send, exc, time.monotonic())
        except (NetworkError, ProtocolError, TimeoutError) as exc:
            log.debug("%d letter(s) to %s: %s", len(send.letters), recipient, exc)
            actions = courier.unreachable(send, time.monotonic())
        except PsymeshError as exc:  # e.g. the peer revoked us: they stay pending, the app sees why
            log.info("%d letter(s) to %s cannot leave: %s", len(send.letters), self.trust.label(recipient), exc.message)
            actions = courier.held_back(send)
        else:
            actions = courier.answered(send, reply, time.monotonic())
        for action in actions:
            if isinstance(action, Deposit):
                for done in courier.deposit_done(action, await self._deposit(action)):
                    self._apply(recipient, done)
            else:
                self._apply(recipient, action)

    async def _nudge_when_connected(self, links: Links) -> None:
        """A recipient our courier waits for (or a sender we owe receipts) that connects to us,
        or we to it, is handed what waits for it at once, not after the back-off: a phone that
        cannot be dialed comes back only by dialing us (node/reach/keep.py). Woken by changes of
        connections only (no timer)."""
        connected: set[str] = set()
        while True:
            changed = links.changes()  # taken before reading, so no change is missed
            now = {peer_id for peer_id in self._couriers | self._ackers if links.path(peer_id) is not None}
            for peer_id in now - connected:
                self.changed.notify(_nudge(peer_id))
            connected = now
            await changed.wait()

    def _stub(self, letter: Letter) -> Letter:
        return letter.stub().sign(self.identity.private_key)

    def _apply(self, recipient: str, action: Action) -> None:
        """Carry out one of the courier's actions (a deposit is `_deliver`'s to await)."""
        if isinstance(action, Settle):  # what the receipts said, all in one transaction
            for refusal in action.refused:
                log.info("letter %s refused by %s: %s", refusal.id, self.trust.label(recipient), refusal.reason)
            self.store.settle(action.delivered, action.stubs_done, [(r.id, r.code, r.reason) for r in action.refused],
                              action.proof)
            for letter_id in action.delivered + tuple(r.id for r in action.refused):
                self.changed.notify(letter_id)
        elif isinstance(action, Suspect):
            log.warning("%s; resending", action.reason)
        elif isinstance(action, Away):  # a sender waiting on these is told the recipient is away
            for letter_id in action.ids:
                self.changed.notify(letter_id)
        elif isinstance(action, Deposited):
            self.store.deposited(action.id)
            self.changed.notify(action.id)
        elif isinstance(action, StubDone):
            self.store.stub_done(action.id)

    async def _take_receipts(self, recipient: str) -> bool:
        """The receipts `recipient` left for us at its mailbox, checked and recorded; whether
        any letter was delivered by them."""
        if self.mail is None:
            return False
        try:
            receipts = await self.mail.take_receipts(recipient)
        except (PsymeshError, TimeoutError) as exc:
            log.debug("receipts from %s's mailbox: %s", recipient, exc)
            return False
        done: list[str] = []
        for receipt in receipts:
            try:
                check_receipt(receipt, recipient=recipient, local_peer_id=self.identity.peer_id)
            except PsymeshError:
                log.warning("a receipt from %s's mailbox is not %s's: dropped", recipient, recipient)
                continue
            done += self.store.confirm(recipient, receipt)
        for letter_id in done:
            self.changed.notify(letter_id)
        return bool(done)

    async def _deposit(self, deposit: Deposit) -> bool:
        """Leave the letter (or its stub) at the recipient's mailbox: whether it is held there
        (not if the recipient named no mailbox we can use, or the mailbox did not take it)."""
        if self.mail is None:
            return False
        try:
            return await self.mail.deposit(deposit.wire(self._stub))
        except (PsymeshError, TimeoutError) as exc:
            log.info("letter %s for %s: its mailbox did not take it: %s", deposit.letter.id, deposit.letter.recipient,
                     exc)
            return False

    async def wait_sent(self, letter_id: str, *, until_away: bool = False) -> Sent:
        """Until the letter is delivered, deposited at the recipient's mailbox, or refused;
        `until_away`: or, still pending, until its recipient is found unreachable."""
        while True:
            sent = self.store.sent(letter_id)
            if sent is None:
                raise PsymeshError(f"no letter {letter_id!r} was sent from here", code=ErrorCode.NOT_FOUND)
            if sent.state is not OutState.PENDING:
                return sent
            if until_away and self.sessions.away(sent.letter.recipient) is not None:
                return sent
            await self.changed.wait(letter_id)

    # -- receiving (a door service) ----------------------------------------------------------
    async def receive(self, call: Call) -> Message:
        request = call.request
        assert isinstance(request, MsgSend)  # the door checked it is the sender's, to us, signed
        stored = self._stored([request.letter])
        if request.letter.id in stored.refused:  # a refusal (conflict, expired, busy) is the peer's error
            self._undo(call.peer_id, request.letter, stored.refused[request.letter.id])
            raise stored.refused[request.letter.id]
        return MsgReceipt(id=request.letter.id, proof=self._receipt(call.peer_id, [request.letter.id]))

    def _stored(self, letters: Sequence[Letter]) -> Stored:
        """Keep letters (durably, exactly once) and wake who waits on what that changed."""
        stored = self.store.store_many(letters)
        if stored.released:
            self.changed.notify(_INBOX)
        if len(stored.released) < len(letters) - len(stored.refused):  # some may be held behind a gap
            self.changed.notify(_HELD)
        return stored

    def _undo(self, sender: str, letter: Letter, refusal: PsymeshError) -> None:
        if self.undo is not None:
            self.undo(sender, MsgSend(letter=letter), refusal)

    def _receipt(self, sender: str, ids: list[str]) -> Receipt:
        return Receipt(recipient=self.identity.peer_id, sender=sender, ids=ids,
                       at=int(time.time() * 1000)).sign(self.identity.private_key)

    async def receive_many(self, call: Call) -> Message:
        """A batch: each letter admitted and checked on its own (the door let the envelope in);
        the accepted ones stored in one transaction; a receipt per letter, refused ones saying
        why, so one bad letter refuses only itself."""
        request = call.request
        assert isinstance(request, MsgSendMany)
        refusals = self.door(call.peer_id, ids.SESSION, [MsgSend(letter=letter) for letter in request.letters])
        refused: dict[str, PsymeshError] = {}
        accepted: list[Letter] = []
        for letter, refusal in zip(request.letters, refusals):  # (the door checked each letter itself)
            if refusal is None:
                accepted.append(letter)
            else:
                refused[letter.id] = refusal
        kept: list[str] = []
        if accepted:
            stored = self._stored(accepted)
            for letter in accepted:
                if letter.id in stored.refused:
                    self._undo(call.peer_id, letter, stored.refused[letter.id])
            refused = {**stored.refused, **refused}
            kept = [letter.id for letter in accepted if letter.id not in refused]
        return MsgReceipts(results=[LetterResult.refused(letter.id, refused[letter.id]) if letter.id in refused
                                    else LetterResult(id=letter.id) for letter in request.letters],
                           proof=self._receipt(call.peer_id, kept) if kept else None)

    def withdrawn(self, letter: Letter) -> None:
        """A letter that came by another way (its recipient's mailbox) and that our door
        refused for good: keep its place in its thread with a withdrawn stub, so the letters
        after it are released (on the direct way its sender sends the stub)."""
        self._stored([letter.stub()])  # refused: the letter itself is here already, or its place was given up

    def stale(self, letter: Letter) -> bool:
        """A letter from our mailbox that is a copy of one delivered directly long ago (see
        MessageStore.stale): dropped, not admitted."""
        return self.store.stale(letter)

    def took(self, letter: Letter) -> None:
        """A letter our mailbox handed over was stored: its sender is owed our receipt."""
        self.store.owe(letter.sender, [letter.id])
        self._wake_acker(letter.sender)

    # -- receipts and gaps (door services, and the timers behind them) ------------------------
    async def receive_ack(self, call: Call) -> Message:
        """The recipient's signed receipt (the door checked it is the peer's own, about our letters)."""
        request = call.request
        assert isinstance(request, MsgAck)
        for letter_id in self.store.confirm(call.peer_id, request.receipt):
            self.changed.notify(letter_id)
        self.changed.notify(_nudge(call.peer_id))  # it is reachable: what its mailbox lost goes now
        return MsgAckOk()

    async def receive_missing(self, call: Call) -> Message:
        """The recipient lacks these letters of ours: send them again (their stubs, if refused)."""
        request = call.request
        assert isinstance(request, MsgMissing)
        count = self.store.resend(call.peer_id, request.thread, request.tseqs)
        if count:
            log.info("%s lacks %d letter(s) of thread %r: sending them again", self.trust.label(call.peer_id), count, request.thread)
            self._wake(call.peer_id)
        return MsgMissingOk(resending=count)

    def _wake_acker(self, sender: str) -> None:
        if sender in self._ackers:
            self.changed.notify(_nudge(sender))
            return
        if self._tg is None:
            return  # run() starts it
        self._ackers.add(sender)
        self._tg.start_soon(self._acker, sender)

    async def _acker(self, sender: str) -> None:
        """Hand `sender` our signed receipts for the letters our mailbox brought, until none is owed."""
        backoff = 0.0
        try:
            while ids := self.store.owed(sender):
                try:
                    await self.sessions.request(sender, MsgAck(receipt=self._receipt(sender, ids)), MsgAckOk,
                                                timeout=30)
                except RemoteError as exc:
                    if exc.code not in RETRYABLE:  # it takes nothing from us: its direct resend gets the receipt
                        log.info("%s refused our receipt: %s", sender, exc.message)
                        self.store.paid(sender, ids)
                        continue
                except (NetworkError, ProtocolError, TimeoutError, PsymeshError) as exc:
                    log.debug("receipt to %s: %s", sender, exc)
                    if await self._leave_receipt(sender, ids):
                        continue
                else:
                    self.store.paid(sender, ids)
                    backoff = 0.0
                    continue
                backoff = min(PARKED_RETRY_MAX_S, max(RETRY_MIN_S, backoff * 2))
                with anyio.move_on_after(backoff):
                    await self.changed.wait(_nudge(sender))
        finally:
            self._ackers.discard(sender)

    async def _leave_receipt(self, sender: str, ids: list[str]) -> bool:
        """`sender` cannot be reached: leave our receipt at our mailbox for it to take."""
        if self.mail is None:
            return False
        try:
            if not await self.mail.leave_receipt(self._receipt(sender, ids)):
                return False
        except (PsymeshError, TimeoutError) as exc:
            log.debug("could not leave a receipt for %s at our mailbox: %s", sender, exc)
            return False
        self.store.paid(sender, ids)
        return True

    async def _expire_held(self) -> None:
        """Gaps waited for longer than [inbox] held_s are given up (their letters released)."""
        while True:
            if self.store.expire_held():
                self.changed.notify(_INBOX)
            await anyio.sleep(min(self.store.settings.held_s / 4, EXPIRE_EVERY_S))

    async def _watch_gaps(self, tg: anyio.abc.TaskGroup) -> None:
        """One timer, at the next deadline: a (sender, thread) held behind a gap for `gap_s`
        asks its sender for what is missing (and again each `gap_s` while the gap lasts)."""
        while True:
            now = time.time()
            gaps = self.store.gaps()
            self._asked = {k: v for k, v in self._asked.items() if k in {(g.sender, g.thread) for g in gaps}}
            due = math.inf
            for gap in gaps:
                key = (gap.sender, gap.thread)
                at = max(gap.since, self._asked.get(key, 0.0)) + self.gap_s
                if at <= now:
                    self._asked[key] = now
                    tg.start_soon(self._ask_missing, gap.sender, MsgMissing(thread=gap.thread, tseqs=gap.lacks))
                    at = now + self.gap_s
                due = min(due, at)
            with anyio.move_on_after(due - now):
                await self.changed.wait(_HELD)

    async def _ask_missing(self, sender: str, request: MsgMissing) -> None:
        try:
            reply = await self.sessions.request(sender, request, MsgMissingOk, timeout=30)
        except (PsymeshError, TimeoutError) as exc:
            log.info("could not ask %s for tseq %s of %r: %s", self.trust.label(sender), request.tseqs[:8], request.thread, exc)
            return
        log.info("%s resends %d of the %d letter(s) missing from thread %r", self.trust.label(sender), reply.resending,
                 len(request.tseqs), request.thread)

    async def follow(self, after: int = 0, *, live: bool = True) -> AsyncIterator[Received]:
        """Released letters numbered above `after`, in order (withdrawn stubs skipped), then,
        if `live`, each one as it is released."""
        cursor = after
        while True:
            batch = self.store.released_after(cursor)
            for received in batch:
                cursor = received.release_seq or cursor
                if not received.letter.withdrawn:
                    yield received
            if batch:
                continue
            if not live:
                return
            await self.changed.wait(_INBOX)
