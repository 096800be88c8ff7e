"""Asks answered by this node's agent: an `ask` letter from a paired peer goes to the
agent, and what it says goes back as an `answer` letter in the same thread, `reply_to`
the ask.

    Messaging.follow ─> an ask ─> the asker's grant, as it is now, still covers msg.ask?
                                  (the gate's `readmit`: an audit row `ask.answer`, either way)
        ─> AgentTaskRunner.run (the path delegated `agent` tasks take): the ask's text as
           the goal, its `body.params` checked as a peer's, only the tools the asker's
           grant covers as `tool:` operations, within the grant's max_runtime_s
        ─> Messaging.send(kind=answer, reply_to=ask.id, id derived from the ask)

Irreversible tools are never confirmed here: nobody is asked (the owner is not at the
node, and the asker may not decide for it), so the agent sees them refused as
`unconfirmed` and says what it wanted to do instead.

One ask at a time, in release order. Durable: the answer's letter id is derived from
the ask, so a crash between writing the answer and noting the ask as done writes no
second answer, and an ask whose answer exists is not run again; an ask the node died
while answering is run again after the restart.
"""
from __future__ import annotations

import logging
import sqlite3
import time
from contextlib import aclosing
from typing import Any, Protocol

import anyio
import anyio.abc

from ..models.agents import AgentTaskRunner, granted_tools
from ..core.db import ensure_schema
from ..core.redact import Redactor
from ..door.gate import ASK_ANSWER
from .service import Messaging
from .store import Received
from ..door.trust import TrustStore
from ...agent.acting.tools import ToolRegistry
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.manifest import Decision, Manifest, Operation
from ...protocol.messaging import Letter, LetterKind
from ...protocol.messaging import answer_id as protocol_answer_id
from ...protocol.tasks import JsonMap

log = logging.getLogger("psymesh.answering")

SCHEMA = """
CREATE TABLE IF NOT EXISTS msg_answered (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    release_seq  INTEGER NOT NULL        -- inbox letters up to here need no answer from us
);
"""


class Readmission(Protocol):
    def __call__(self, peer_id: str, service: str, operation: Operation) -> Decision:
        """The door's decision, audited, on work `peer_id` asked for earlier, as its grant is
        now (the gate's `readmit`)."""


def answer_id(ask: Letter) -> str:
    """The id of our answer to `ask`: the same every time (protocol.messaging.answer_id)."""
    return protocol_answer_id(ask.sender, ask.id)


class Answering:
    def __init__(self, conn: sqlite3.Connection, messaging: Messaging, trust: TrustStore, agents: AgentTaskRunner,
                 tools: ToolRegistry, local_peer_id: str, *, door: Readmission, redact: Redactor | None = None) -> None:
        """`redact`: this machine's paths taken out of every answer (and its error) before it is
        signed and sent (node/core/redact.py)."""
        self.conn = conn
        self.redact = redact or Redactor()
        self.door = door
        self.messaging = messaging
        self.trust = trust
        self.agents = agents
        self.tools = tools
        self.local_peer_id = local_peer_id
        ensure_schema(conn, SCHEMA)

    def _cursor(self) -> int:
        row = self.conn.execute("SELECT release_seq FROM msg_answered WHERE id = 1").fetchone()
        return row[0] if row else 0

    def _done_upto(self, release_seq: int) -> None:
        self.conn.execute("INSERT INTO msg_answered (id, release_seq) VALUES (1, ?) ON CONFLICT(id) DO UPDATE"
                          " SET release_seq = MAX(release_seq, excluded.release_seq)", (release_seq,))

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for received in self.messaging.follow(self._cursor()):
            if received.letter.kind is LetterKind.ASK:
                await self.answer(received.letter)
                assert received.release_seq is not None
                self._done_upto(received.release_seq)

    async def answer(self, ask: Letter) -> Letter | None:
        """Run the agent on `ask` and send what it says (or why it could not); None if the
        asker is no longer paired, or revoked us (nothing is sent to it)."""
        done = self.messaging.store.sent(answer_id(ask))
        if done is not None:
            return done.letter
        peer = self.trust.get(ask.sender)
        if peer is not None and peer.revoked_us_at is not None:  # nothing we write reaches it: nothing to decide
            log.info("ask %s from %s dropped: it revoked this node", ask.id, ask.sender)
            return None
        still = self.door(ask.sender, ASK_ANSWER, ask.operation())  # (no await before the grant is read below)
        if peer is None or peer.revoked or peer.granted is None:
            log.info("ask %s from %s dropped: no longer paired both ways", ask.id, ask.sender)
            return None
        grant = peer.granted
        try:
            still.raise_if_denied()
            body = await self._run(ask, grant)
            text = body.get("answer", "")
        except PsymeshError as exc:
            log.info("ask %s from %s not answered: %s", ask.id, peer.name, exc.message)
            body, text = {"ok": False, "error": {"code": exc.code.value, "message": exc.message}}, exc.message
        except Exception as exc:  # a bug in a tool or the runtime: the asker still hears, the node lives on
            log.exception("ask %s from %s failed", ask.id, peer.name)
            body = {"ok": False, "error": {"code": ErrorCode.INTERNAL.value, "message": type(exc).__name__}}
            text = "internal error"
        text, body = self.redact.text(text), self.redact.data(body)  # never the home's paths, to a peer
        try:
            return self.messaging.send(ask.sender, text, body=body, thread=ask.thread, kind=LetterKind.ANSWER,
                                       reply_to=ask.id, letter_id=answer_id(ask))
        except PsymeshError as exc:  # unpaired, or it revoked us, while the agent ran
            log.info("answer to ask %s from %s not sent: %s", ask.id, peer.name, exc.message)
            return None

    async def _run(self, ask: Letter, grant: Manifest) -> JsonMap:
        params = ask.body.get("params", {})
        if not isinstance(params, dict):
            raise PsymeshError("an ask's body.params must be a map of agent params", code=ErrorCode.BAD_REQUEST)

        max_runtime = grant.limits.max_runtime_s
        result = await self.agents.run(ask.text, params, peer_id=ask.sender,
                                       deadline=time.time() + max_runtime if max_runtime else None,
                                       tools=granted_tools(self.tools, grant, local_peer_id=self.local_peer_id,
                                                           peer_id=ask.sender, now=time.time()))
        return {"ok": True, **result}


async def wait_answer(messaging: Messaging, ask: Letter, after: int) -> Received:
    """The answer to `ask`, once it is released here. `after`: the inbox's last release
    number before the ask was written (its answer cannot be older)."""
    async with aclosing(messaging.follow(after)) as letters:
        async for received in letters:
            letter = received.letter
            if letter.kind is LetterKind.ANSWER and letter.reply_to == ask.id and letter.sender == ask.recipient:
                return received
    raise AssertionError("a live follow() does not end")


def ask_body(params: dict[str, Any]) -> JsonMap:
    """An ask letter's body: the agent params the asker sets (checked by the answering node)."""
    return {"params": params} if params else {}
