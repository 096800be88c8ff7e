"""Control messages of letters between agents: send, status, the inbox, asks, and groups."""
from typing import Annotated

from pydantic import Field

from ..messages import Message
from ..messaging import LetterBody, LetterId, LetterKind, Thread
from .common import PeerAway, View


GroupName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]


class SentLetter(View):
    """A letter this node wrote, as its outbox holds it: `pending` until the recipient's
    receipt (`delivered`), or `refused` for good (`code`, `reason` say why)."""

    id: str
    recipient: str
    recipient_name: str
    thread: str
    tseq: int
    kind: LetterKind
    group: str | None = None
    state: str              # pending | delivered | refused
    code: str | None = None
    reason: str = ""
    away: PeerAway | None = None  # pending, and the recipient could not be reached when last tried


class InboxLetter(Message):
    """A letter released to this node's app, in release order (`seq`: 1, 2, 3 ... across
    the inbox; a reader resumes with `after` = the last `seq` it took). Streamed by
    `control.msg_inbox`, one per frame."""

    type = "control.inbox_letter"
    seq: int
    id: str
    sender: str
    sender_name: str        # the sender's peer id if it is no longer paired
    thread: str
    tseq: int
    kind: LetterKind
    text: str = ""
    body: dict = Field(default_factory=dict)
    at: float               # when the sender wrote it, Unix seconds by its clock (the letter's `at` / 1000)
    received_at: float      # when this node stored it, Unix seconds
    reply_to: str | None = None
    group: str | None = None
    # Letters of this thread before this one that never came: their place was given up after
    # the letters behind them had waited `[inbox] held_s` (0: none skipped).
    skipped: int = 0


class MsgSendRequest(Message):
    """Write a letter to `to` (a paired peer's name or id). Durable once this returns; a
    courier delivers it. The same `letter_id` again is the same letter (not sent twice)."""

    type = "control.msg_send"
    to: str = Field(min_length=1, max_length=256)
    text: str = ""
    body: LetterBody = Field(default_factory=dict)
    thread: Thread = "main"
    letter_id: LetterId | None = None


class MsgSentReply(Message):
    type = "control.msg_sent"
    durable = True
    letter: SentLetter


class MsgStatusRequest(Message):
    """A sent letter's state; with `wait`, once it is delivered or refused."""

    type = "control.msg_status"
    id: LetterId
    wait: bool = False
    until_away: bool = False  # with wait: also answer (still pending) once the recipient is found unreachable


class MsgInboxRequest(Message):
    """Stream released letters after `after` (`control.inbox_letter` each), then
    `control.ok`: once the inbox is read (`follow` false), after `limit` letters, or,
    following, never (the client closes the connection to stop)."""

    type = "control.msg_inbox"
    after: int = Field(default=0, ge=0)
    follow: bool = False
    limit: int | None = Field(default=None, ge=1)


class MsgAskRequest(Message):
    """Ask `to`'s agent (it needs our `msg.ask`); the reply is its answer letter. `params`
    are agent params the peer may set (model, max_steps, seed, ...), checked there."""

    type = "control.msg_ask"
    to: str = Field(min_length=1, max_length=256)
    text: str = Field(min_length=1)
    thread: Thread = "main"
    params: dict = Field(default_factory=dict)
    timeout_s: float = Field(default=120.0, gt=0, le=3600)


class MsgAnswerReply(Message):
    type = "control.msg_answer"
    ask: SentLetter
    answer: InboxLetter


class GroupMember(View):
    peer_id: str
    name: str


class GroupView(View):
    """A named list of peers kept by this node alone: a message to it is one letter per member."""

    name: str
    members: list[GroupMember] = Field(default_factory=list)
    created_at: float


class GroupCreateRequest(Message):
    type = "control.group_create"
    name: GroupName
    members: list[str] = Field(default_factory=list, max_length=1000)  # paired peers' names or ids


class GroupAddRequest(Message):
    type = "control.group_add"
    name: GroupName
    members: list[str] = Field(min_length=1, max_length=1000)


class GroupRemoveRequest(Message):
    type = "control.group_remove"
    name: GroupName
    members: list[str] = Field(min_length=1, max_length=1000)


class GroupListRequest(Message):
    type = "control.group_list"


class GroupReply(Message):
    type = "control.group"
    group: GroupView


class GroupsReply(Message):
    type = "control.groups"
    groups: list[GroupView] = Field(default_factory=list)


class GroupSendRequest(Message):
    """One letter to each member, in the thread `group:<name>`, each carrying the group's name."""

    type = "control.group_send"
    name: GroupName
    text: str = ""
    body: LetterBody = Field(default_factory=dict)


class GroupSentReply(Message):
    type = "control.group_sent"
    durable = True
    group: str
    letters: list[SentLetter] = Field(default_factory=list)
