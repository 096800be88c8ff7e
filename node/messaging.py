"""Messaging on the node: letters out (one courier per recipient) and in (the door's
`msg.send` service), on the sessions every other request uses.

    send(to, text) ─> outbox (signed, numbered in its thread) ─> courier(recipient)
        courier: up to WINDOW letters in flight on the session, BATCH to a `msg.send_many`;
                 its receipts recorded in one transaction: stored -> delivered;
                 busy / unreachable -> retry with backoff; refused for good -> refused,
                 and a withdrawn stub goes in its place so its thread is not held;
                 unreachable for longer than `grace_s` -> sealed and left at the
                 recipient's mailbox, if it named one (node/mailclient.py) -> deposited
    msg.send (admitted by the door) ─> check_letter ─> inbox (exactly once) ─> receipt
    msg.send_many (the envelope admitted by the door, then each letter as its msg.send)
        ─> check_letter each ─> the accepted ones stored in one transaction ─> receipts
        released letters wake `follow()` (the app's inbox stream)
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Protocol

import anyio
import anyio.abc

from psymesh.node.home import Identity
from psymesh.node.msgstore import MessageStore, OutState, Received, Sent
from psymesh.node.notify import Notifier
from psymesh.node.session import Call, SessionPool
from psymesh.node.trust import TrustStore
from psymesh.node.wakelock import WakeLock
from psymesh.protocol import ids
from psymesh.protocol.errors import ErrorCode, NetworkError, ProtocolError, PsymeshError, RemoteError
from psymesh.protocol.messages import Message
from psymesh.protocol.messaging import (
    Letter,
    LetterKind,
    LetterResult,
    MsgReceipt,
    MsgReceipts,
    MsgSend,
    MsgSendMany,
    ReceiptStatus,
    check_letter,
)
from psymesh.protocol.tasks import JsonMap

log = logging.getLogger("psymesh.msg")

WINDOW = 256           # letters in flight to one recipient ...
BATCH = 64             # ... at most this many in one msg.send_many ...
BATCH_BYTES = 1 << 20  # ... and this much text and body (a frame holds 4 MiB; one big letter goes alone)
RETRY_MIN_S = 0.2
RETRY_MAX_S = 30.0
_RETRYABLE = frozenset({ErrorCode.BUSY, ErrorCode.RATE_LIMITED, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT,
                        ErrorCode.INTERNAL, ErrorCode.CANCELED})
_INBOX = "inbox"       # the Notifier key for "letters were released"


class LetterDoor(Protocol):
    def __call__(self, peer_id: str, service: str, requests: Sequence[Message]) -> list[PsymeshError | None]:
        """Admit each letter of a batch as the `msg.send` it stands for (the gate's
        `admit_each`): per letter, None or why it was refused."""


class MailDrop(Protocol):
    async def deposit(self, letter: Letter) -> bool:
        """Leave `letter` at its recipient's mailbox: True once held there, False if the
        recipient named no mailbox we can use. A refusal or a network failure raises."""


class Messaging:
    def __init__(self, identity: Identity, store: MessageStore, trust: TrustStore, sessions: SessionPool,
                 door: LetterDoor, mail: MailDrop | None = None, grace_s: float = 5.0,
                 wake: WakeLock | None = None) -> None:
        self.identity = identity
        self.wake = wake or WakeLock(None)  # held while letters wait to be delivered
        self.door = door
        self.store = store
        self.trust = trust
        self.sessions = sessions
        self.mail = mail
        self.grace_s = grace_s      # unreachable this long: letters go to the recipient's mailbox
        self._away: dict[str, float] = {}  # recipient -> when it was first found unreachable
        self.changed = Notifier()   # _INBOX: letters released; letter id: its outbox row changed
        self._couriers: set[str] = set()   # recipients with a courier at work (it re-reads the outbox each round)
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for recipient in self.store.recipients_pending():  # after a restart
                self._wake(recipient)
            task_status.started()
            await anyio.sleep_forever()

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
            return
        if self._tg is None:
            raise PsymeshError("messaging is not running", code=ErrorCode.UNAVAILABLE)
        self._couriers.add(recipient)
        self._tg.start_soon(self._courier, recipient)

    async def _courier(self, recipient: str) -> None:
        """Deliver `recipient`'s pending letters, WINDOW at a time in batches, until none is left
        (the wake lock held meanwhile: a phone's CPU stays up while letters wait to leave)."""
        backoff = 0.0
        try:
            with self.wake.held():
                while True:
                    pending = self.store.pending(recipient, limit=WINDOW)
                    if not pending:
                        return
                    retry_after: list[float] = []
                    async with anyio.create_task_group() as tg:
                        for batch in _batches(pending):
                            tg.start_soon(self._deliver, recipient, batch, retry_after)
                    if any(retry_after):  # the recipient is away or busy: wait (new letters wait too)
                        backoff = min(RETRY_MAX_S, max(RETRY_MIN_S, backoff * 2, max(retry_after)))
                        await anyio.sleep(backoff)
                    elif not retry_after:
                        backoff = 0.0
        finally:
            self._couriers.discard(recipient)  # (no await since the last read: no letter is missed)
            self._away.pop(recipient, None)

    async def _deliver(self, recipient: str, batch: list[Sent], retry_after: list[float]) -> None:
        """Hand a batch over (a refused letter as the stub that keeps its thread going).
        Appends to `retry_after` when the courier should try again later."""
        stubs = [sent.state is OutState.REFUSED for sent in batch]
        wire = [sent.letter.stub().sign(self.identity.private_key) if stub else sent.letter
                for sent, stub in zip(batch, stubs)]
        try:
            if len(wire) == 1:  # alone: a plain msg.send (one decision at the door, not two)
                receipt = await self.sessions.request(recipient, MsgSend(letter=wire[0]), MsgReceipt, timeout=30)
                reply = MsgReceipts(results=[LetterResult(id=receipt.id)])
            else:
                reply = await self.sessions.request(recipient, MsgSendMany(letters=wire), MsgReceipts, timeout=30)
        except RemoteError as exc:
            if exc.code in _RETRYABLE:
                retry_after.append(exc.retry_after or RETRY_MIN_S)
                return
            # refused for good (a batch's envelope, or a lone letter): each letter is, as it would be alone
            results = [LetterResult.refused(letter.id, exc) for letter in wire]
        except (NetworkError, ProtocolError, TimeoutError) as exc:
            log.debug("%d letter(s) to %s: %s", len(batch), recipient, exc)
            away = self._away.setdefault(recipient, time.monotonic())
            if time.monotonic() - away < self.grace_s:
                retry_after.append(RETRY_MIN_S)
                return
            for sent, letter, stub in zip(batch, wire, stubs):
                if not await self._deposit(sent.letter, letter, stub):
                    retry_after.append(RETRY_MIN_S)
            return
        except PsymeshError as exc:  # e.g. the peer revoked us: they stay pending, the app sees why
            log.info("%d letter(s) to %s cannot leave: %s", len(batch), recipient, exc.message)
            retry_after.append(RETRY_MAX_S)
            return
        else:
            self._away.pop(recipient, None)
            results = reply.results
            if [r.id for r in results] != [letter.id for letter in wire]:
                log.warning("%s answered a batch with receipts for other letters; resending", recipient)
                retry_after.append(RETRY_MIN_S)
                return
        self._settle(batch, stubs, results, retry_after)

    def _settle(self, batch: list[Sent], stubs: list[bool], results: list[LetterResult],
                retry_after: list[float]) -> None:
        """Record what each letter's receipt said, all in one transaction."""
        delivered: list[str] = []
        stubs_done: list[str] = []
        refused: list[tuple[str, str, str]] = []
        for sent, stub, result in zip(batch, stubs, results):
            letter = sent.letter
            code = result.code or ErrorCode.INTERNAL  # a refusal without a code: try again
            if result.status is ReceiptStatus.STORED:
                (stubs_done if stub else delivered).append(letter.id)
            elif code in _RETRYABLE:
                retry_after.append(result.retry_after or RETRY_MIN_S)
            elif stub:  # the recipient takes nothing from us now: no thread of ours is held there
                stubs_done.append(letter.id)
            else:
                log.info("letter %s refused by %s: %s", letter.id, letter.recipient, result.reason)
                refused.append((letter.id, code.value, result.reason))
                retry_after.append(0.0)  # its stub goes in the next round, at once
        self.store.settle(delivered, stubs_done, refused)
        for letter_id in delivered + [r[0] for r in refused]:
            self.changed.notify(letter_id)

    async def _deposit(self, letter: Letter, wire: Letter, stub: bool) -> bool:
        """Leave `wire` (the letter, or its stub) at the recipient's mailbox. False if it
        named none we can use or the mailbox did not take it: the letter stays pending."""
        if self.mail is None:
            return False
        try:
            if not await self.mail.deposit(wire):
                return False
        except (PsymeshError, TimeoutError) as exc:
            log.info("letter %s for %s: its mailbox did not take it: %s", letter.id, letter.recipient, exc)
            return False
        if stub:
            self.store.stub_done(letter.id)
        else:
            self.store.deposited(letter.id)
            self.changed.notify(letter.id)
        return True

    async def wait_sent(self, letter_id: str) -> Sent:
        """Until the letter is delivered, deposited at the recipient's mailbox, or refused."""
        while True:
            sent = self.store.sent(letter_id)
            if sent is None:
                raise PsymeshError(f"no letter {letter_id!r} was sent from here", code=ErrorCode.NOT_FOUND)
            if sent.state is not OutState.PENDING:
                return sent
            await self.changed.wait(letter_id)

    # -- receiving (a door service) ----------------------------------------------------------
    async def receive(self, call: Call) -> Message:
        request = call.request
        assert isinstance(request, MsgSend)
        check_letter(request.letter, sender=call.peer_id, local_peer_id=self.identity.peer_id)
        if self.store.store(request.letter):
            self.changed.notify(_INBOX)
        return MsgReceipt(id=request.letter.id)

    async def receive_many(self, call: Call) -> Message:
        """A batch: each letter admitted (the door let the envelope in) and checked on its own;
        the accepted ones stored in one transaction; a receipt per letter, refused ones saying
        why, so one bad letter refuses only itself."""
        request = call.request
        assert isinstance(request, MsgSendMany)
        refusals = self.door(call.peer_id, ids.SESSION, [MsgSend(letter=letter) for letter in request.letters])
        results: list[LetterResult] = []
        accepted: list[Letter] = []
        for letter, refusal in zip(request.letters, refusals):
            if refusal is None:
                try:
                    check_letter(letter, sender=call.peer_id, local_peer_id=self.identity.peer_id)
                except PsymeshError as exc:
                    refusal = exc
            if refusal is None:
                accepted.append(letter)
                results.append(LetterResult(id=letter.id))
            else:
                results.append(LetterResult.refused(letter.id, refusal))
        if accepted and self.store.store_many(accepted):
            self.changed.notify(_INBOX)
        return MsgReceipts(results=results)

    def withdrawn(self, letter: Letter) -> None:
        """A letter that came by another way (its recipient's mailbox) and that our door
        refused for good: keep its place in its thread with a withdrawn stub, so the letters
        after it are released (on the direct way its sender sends the stub)."""
        if self.store.store(letter.stub()):
            self.changed.notify(_INBOX)

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



def _batches(pending: list[Sent]) -> Iterator[list[Sent]]:
    """Oldest first, cut at BATCH letters or BATCH_BYTES of payload (a letter over that goes alone)."""
    batch: list[Sent] = []
    size = 0
    for sent in pending:
        weight = sent.letter.payload_bytes
        if batch and (len(batch) == BATCH or size + weight > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(sent)
        size += weight
    if batch:
        yield batch
