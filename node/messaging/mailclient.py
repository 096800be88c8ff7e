"""Using mailboxes: a sender leaving sealed letters at a recipient's mailbox, and a node
(a phone) collecting its own mail from the mailbox it named.

    MailSender.deposit(letter)   the courier's fallback once the recipient has been
                                 unreachable for `[mail] grace_s`: seal the signed letter to
                                 the recipient's mail key, hand it to the mailbox the key
                                 names (or keep it here, if that is us)
    MailOwner.run()
      ├── publisher   our mail key and mailbox (config `mailbox`), signed, to every paired
      │               peer: at start, when it changes, and to peers paired since (woken
      │               by the trust store's changes, no timer; a peer that did not answer
      │               is retried with backoff, from RESCAN_S)
      └── fetcher     while the mailbox can be reached, one `mail.fetch` open on it: each
                      item is opened, checked, and admitted through this node's own door as
                      the sender's `msg.send` (audited `mailbox`), stored in the inbox
                      (which drops a letter it holds), then acknowledged so the mailbox
                      deletes it; its sender is owed our signed receipt (`msg.ack`).
                      A letter the door refuses for good keeps its place as a withdrawn
                      stub, but only when the sender is paired with us: a stranger's
                      letters cost our inbox nothing. A crash between storing and acknowledging re-delivers;
                      the inbox drops the duplicate.

The mail key is an X25519 key of its own (`<home>/mail.key`, 0600), not the identity key:
the mailbox and the peers see only its public half, and it can change without a new
identity. It rotates (`[mail] key_rotate_s`, protocol/keyring.py): a new key is published
with a larger serial, the old secret still opens mail sealed to it for `[mail] keep_s`, and
is then deleted from the file, so a stolen file opens no older letter.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ..core.home import Identity, NodeHome
from ..core.keyrings import load_ring, save_ring
from .mailbox import Mailbox, MailStore
from .service import Messaging
from ..net.session import Call, SessionPool
from ..door.trust import TrustStore
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.keyring import KeyRing, RingKey
from ...protocol.mailbox import (
    VIA_MAILBOX,
    MailAck,
    MailAcked,
    MailDeposit,
    MailFetch,
    MailItem,
    MailKey,
    MailKeyOk,
    MailKeyPush,
    MailLeaveReceipt,
    MailReceipt,
    MailReceiptLeft,
    MailReceiptsTaken,
    MailSettings,
    MailTakeReceipts,
    mail_ref,
    seal,
    unseal,
)
from ...protocol.common import expect
from ...protocol.messages import Message
from ...protocol.messaging import Letter, MsgSend, Receipt
from ...protocol.session import SessionEnd

log = logging.getLogger("psymesh.mail")
MAX_TIMER_S = 86_400.0

# Refusals that may pass later (a letter's, or the mailbox's): try again, never give up.
_AGAIN = frozenset({ErrorCode.BUSY, ErrorCode.RATE_LIMITED, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT,
                    ErrorCode.INTERNAL, ErrorCode.CANCELED, ErrorCode.BAD_FRAME})


class MailDoor(Protocol):
    async def __call__(self, call: Call, via: str) -> Message:
        """Admit `call.request` as from `call.peer_id` (audited as arriving `via`) and serve it."""


MAIL_KEY_FILE = "mail.key"


def load_mail_ring(home: NodeHome, settings: MailSettings, now: float) -> KeyRing:
    """The node's X25519 mail keys, `<home>/mail.key` (0600): the current one, and retired ones
    kept `[mail] keep_s` (mail sealed to them may wait that long at the mailbox)."""
    return load_ring(home, MAIL_KEY_FILE, rotate_s=settings.key_rotate_s, keep_s=settings.keep_s, now=now,
                     legacy=_bare_key)


def _bare_key(data: bytes, now: float) -> RingKey | None:
    """A mail key file from before rings: 32 raw bytes."""
    return RingKey(1, X25519PrivateKey.from_private_bytes(data), now) if len(data) == 32 else None


async def _no_frames(rid: int, messages: tuple[Message, ...]) -> None:
    raise AssertionError("msg.send is answered with one frame")


class MailSender:
    """Letters for a recipient that cannot be reached, left at the mailbox it named; and
    receipts travelling the same way back: ours left at our own mailbox for a sender we
    cannot reach, a recipient's taken from its mailbox."""

    def __init__(self, local_peer_id: str, store: MailStore, trust: TrustStore, sessions: SessionPool,
                 mailbox: Mailbox) -> None:
        self.local_peer_id = local_peer_id
        self.store = store
        self.trust = trust
        self.sessions = sessions
        self.mailbox = mailbox

    async def deposit(self, letter: Letter) -> bool:
        """Seal `letter` to its recipient and leave it at the recipient's mailbox: True once the
        mailbox holds it; False if the recipient named no mailbox we can use (none, itself, or
        a node we are not paired with). A refusal or a network failure raises."""
        key = self.store.key_of(letter.recipient)
        if key is None or key.mailbox is None or key.mailbox == letter.recipient:
            return False
        sealed, ref = seal(letter, key), mail_ref(letter)
        if key.mailbox == self.local_peer_id:  # we are its mailbox: keep it here
            self.mailbox.hold(self.local_peer_id, letter.recipient, ref, sealed)
            return True
        box = self.trust.get(key.mailbox)
        if box is None or box.revoked or box.revoked_us_at is not None:
            return False
        await self.sessions.request(key.mailbox, MailDeposit(recipient=letter.recipient, ref=ref, sealed=sealed),
                                    MailReceipt)
        return True

    async def leave_receipt(self, receipt: Receipt) -> bool:
        """Leave our receipt for its sender at our own mailbox: True once held there, False if
        we named none. A refusal or a network failure raises."""
        key = self.store.key_of(self.local_peer_id)
        if key is None or key.mailbox is None:
            return False
        if key.mailbox == self.local_peer_id:
            self.store.keep_receipt(receipt)
        else:
            await self.sessions.request(key.mailbox, MailLeaveReceipt(receipt=receipt), MailReceiptLeft)
        return True

    async def take_receipts(self, recipient: str) -> list[Receipt]:
        """What `recipient` left for us at its mailbox (unchecked: the caller checks each).
        A refusal or a network failure raises."""
        key = self.store.key_of(recipient)
        if key is None or key.mailbox is None or key.mailbox == recipient:
            return []
        if key.mailbox == self.local_peer_id:
            return self.store.take_receipts(self.local_peer_id, recipient)
        reply = await self.sessions.request(key.mailbox, MailTakeReceipts(recipient=recipient), MailReceiptsTaken)
        return reply.receipts


class MailOwner:
    """This node's own mail: its key published, its mail fetched (start with `tg.start`)."""

    RESCAN_S = 5.0            # the first wait before a peer that did not take our key is asked again
    PUSH_RETRY_MAX_S = 900.0  # the longest between two attempts to hand a silent peer our key
    FETCH_WAIT_S = 300.0      # one fetch stays open this long, then the next is sent
    RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0
    REFUSED_RETRY_S = 900.0   # the mailbox refused us (revoked, no grant): ask seldom

    def __init__(self, home: NodeHome, identity: Identity, mailbox: str | None, store: MailStore,
                 trust: TrustStore, sessions: SessionPool, door: MailDoor, inbox: Messaging,
                 settings: MailSettings | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.home = home
        self.settings = settings or MailSettings()
        self.clock = clock
        self.identity = identity
        self.mailbox = mailbox     # config `mailbox`: a paired peer's name or id
        self.store = store
        self.trust = trust
        self.sessions = sessions
        self.door = door
        self.inbox = inbox
        self._told: dict[str, int] = {}                   # peer -> serial of ours it took
        self._retry: dict[str, tuple[float, float]] = {}  # peer -> (next attempt, backoff)
        self._after: dict[str, int] = {}                  # mailbox -> last item taken from it
        self._peers_changed = anyio.Event()               # a peer was paired or revoked (trust.on_change)
        self._key_made = anyio.Event()                    # the publisher made or checked our key
        trust.on_change(self._on_peers)

    def _on_peers(self) -> None:
        self._peers_changed.set()

    @functools.cached_property
    def ring(self) -> KeyRing:
        return load_mail_ring(self.home, self.settings, self.clock())

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._publish_forever)
            tg.start_soon(self._fetch_forever)
            tg.start_soon(self._rotate_forever)
            task_status.started()

    async def _rotate_forever(self) -> None:
        """One timer, at the ring's next deadline (on the injected clock): a new mail key, or a
        retired one deleted; a new key wakes the publisher, which hands it out (it has no rescan
        timer of its own)."""
        while True:
            await anyio.sleep(min(max(0.0, self.ring.next_deadline() - self.clock()), MAX_TIMER_S))
            if self.ring.step(self.clock()):
                save_ring(self.home, MAIL_KEY_FILE, self.ring)
                log.info("mail keys now held: %s", [k.key_id for k in self.ring.keys])
                self._peers_changed.set()

    # -- our key ---------------------------------------------------------------------------
    def current_key(self) -> MailKey | None:
        """The mail key we publish (signed, stored), made anew when the mailbox or the key
        changed; None when we never named a mailbox."""
        box = self._mailbox_id()
        held = self.store.key_of(self.identity.peer_id)
        if held is None and box is None:
            return None
        public = self.ring.current.public
        if held is not None and held.mailbox == box and held.public == public:
            return held
        serial = max(int(time.time() * 1000), held.serial + 1 if held is not None else 0)
        key = MailKey(owner=self.identity.peer_id, public=public, mailbox=box, serial=serial)
        self.store.put_key(key.sign(self.identity.private_key))
        log.info("mail key %d: mailbox %s", serial, box)
        return self.store.key_of(self.identity.peer_id)

    def _mailbox_id(self) -> str | None:
        if self.mailbox is None:
            return None
        try:
            peer = self.trust.resolve(self.mailbox)
        except PsymeshError as exc:  # not paired yet: named again at the next rescan
            log.debug("mailbox %r: %s", self.mailbox, exc.message)
            return None
        return None if peer.revoked or peer.revoked_us_at is not None else peer.peer_id

    async def _publish_forever(self) -> None:
        """Our key to each peer that lacks it: at start, and then only when a peer is paired
        or revoked (or the mailbox named becomes one) or a retry is due; no timer otherwise."""
        while True:
            self._peers_changed = anyio.Event()
            key = self.current_key()
            self._key_made.set()
            wake_at = math.inf
            if key is not None:
                now = anyio.current_time()
                untold = [p.peer_id for p in self.trust.list(include_revoked=False)
                          if p.revoked_us_at is None and self._told.get(p.peer_id) != key.serial]
                due = [p for p in untold if self._retry.get(p, (0.0, 0.0))[0] <= now]
                async with anyio.create_task_group() as tg:
                    for peer_id in due:
                        tg.start_soon(self._tell, peer_id, key)
                retries = [self._retry[p][0] for p in untold if p in self._retry]
                wake_at = min(retries, default=math.inf)
            with anyio.move_on_after(max(0.0, wake_at - anyio.current_time())):
                await self._peers_changed.wait()

    async def _tell(self, peer_id: str, key: MailKey) -> None:
        try:
            await self.sessions.request(peer_id, MailKeyPush(key=key), MailKeyOk, timeout=10)
        except PsymeshError as exc:
            backoff = min(self.PUSH_RETRY_MAX_S, max(self.RESCAN_S, 2 * self._retry.get(peer_id, (0.0, 0.0))[1]))
            self._retry[peer_id] = (anyio.current_time() + backoff, backoff)
            log.debug("could not hand %s our mail key: %s", self.trust.label(peer_id), exc)
            return
        self._told[peer_id] = key.serial
        self._retry.pop(peer_id, None)

    # -- our mail --------------------------------------------------------------------------
    async def _fetch_forever(self) -> None:
        delay = 0.0
        while True:
            key = self.store.key_of(self.identity.peer_id)
            if key is None or key.mailbox is None:  # no mailbox (yet): until the publisher names one
                self._key_made = anyio.Event()
                await self._key_made.wait()
                continue
            try:
                await self._fetch(key.mailbox)
                delay = 0.0
                continue
            except PsymeshError as exc:
                if exc.code in _AGAIN:
                    delay = max(exc.retry_after or 0.0, min(self.RETRY_MAX_S, max(self.RETRY_MIN_S, delay * 2)))
                else:
                    delay = self.REFUSED_RETRY_S
                log.debug("mail from %s: %s (again in %.1f s)", key.mailbox, exc, delay)
            await anyio.sleep(delay)

    async def _fetch(self, box: str) -> None:
        """One `mail.fetch` on the mailbox: take each item in order, acknowledging behind. A
        failure of the fetch or of an ack (the mailbox went away) is raised as itself, not in
        the task group's exception group, so that `_fetch_forever` retries: before, it escaped
        as a group, and a phone with a `mailbox` stopped whenever its home PC did."""
        failed: list[PsymeshError] = []
        send_ack, receive_ack = anyio.create_memory_object_stream[int](math.inf)
        async with anyio.create_task_group() as tg:
            async def acknowledge() -> None:
                try:
                    await self._acknowledge(box, receive_ack)
                except PsymeshError as exc:
                    failed.append(exc)
                    tg.cancel_scope.cancel()

            tg.start_soon(acknowledge)
            with send_ack:
                try:
                    await self._take_all(box, send_ack)
                except PsymeshError as exc:
                    failed.append(exc)
                    tg.cancel_scope.cancel()
        if failed:
            raise failed[0]

    async def _take_all(self, box: str, send_ack: MemoryObjectSendStream[int]) -> None:
        request = MailFetch(after=self._after.get(box, 0), wait_s=self.FETCH_WAIT_S)
        async with self.sessions.stream(box, request) as replies:
            async for reply in replies:
                if isinstance(reply, SessionEnd):
                    break
                item = expect(reply, MailItem)
                await self._take(item)
                self._after[box] = item.seq
                try:
                    send_ack.send_nowait(item.seq)
                except anyio.BrokenResourceError:  # the acknowledger stopped: the node is stopping
                    return                         # (unacknowledged, the item comes again: no loss)

    async def _acknowledge(self, box: str, acks: MemoryObjectReceiveStream[int]) -> None:
        """Acknowledge the latest item taken, one `mail.ack` at a time: a burst of items
        costs a few acks, not one each."""
        async with acks:
            async for upto in acks:
                while True:
                    try:
                        upto = acks.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                await self.sessions.request(box, MailAck(upto=upto), MailAcked)

    def open(self, item: MailItem) -> Letter:
        """The letter in a mail item, opened with whichever of our held mail keys it was
        sealed to (newest first); FORBIDDEN if none (sealed to a key deleted since)."""
        refusal: PsymeshError | None = None
        for key in self.ring.keys:
            try:
                return unseal(item.sealed, key.secret, recipient=self.identity.peer_id, sender=item.sender,
                              ref=item.ref)
            except PsymeshError as exc:
                if exc.code is not ErrorCode.FORBIDDEN:
                    raise
                refusal = exc
        assert refusal is not None
        raise refusal

    async def _take(self, item: MailItem) -> None:
        """Open one item and admit its letter through our door, as its sender's `msg.send`.
        An item that does not open or check is dropped; a letter the door refuses for good
        keeps its place in its thread (a withdrawn stub), so the letters after it are not
        held; a stale copy (`MessageStore.stale`) is dropped. A refusal that may pass later
        raises: the item is taken again then."""
        try:
            letter = self.open(item)
        except PsymeshError as exc:
            log.warning("mail item %d from %s dropped: %s", item.seq, item.sender, exc.message)
            return
        if self.inbox.stale(letter):
            log.info("letter %s from %s, from the mailbox, dropped: a copy of one delivered directly before its "
                     "thread was pruned here", letter.id, letter.sender)
            return
        try:
            await self.door(Call(letter.sender, item.seq, MsgSend(letter=letter), _no_frames), VIA_MAILBOX)
        except PsymeshError as exc:
            if exc.code in _AGAIN:
                raise
            log.info("letter %s from %s, from the mailbox, refused: %s", letter.id, letter.sender, exc.message)
            if exc.code is not ErrorCode.UNKNOWN_PEER:  # a stranger's letters hold no thread here: no stub
                self.inbox.withdrawn(letter)
            return
        self.inbox.took(letter)
