"""Asks: a paired peer's `ask` letter goes to the node's agent, which answers with the
tools the asker's grant covers, and the answer comes back as a letter in the same thread.

Real in-process daemons on loopback; the agent runs either the generated tiny qwen35
GGUF under the tool-call grammar (what a user gets) or, where the test is about what the
agent may touch, a scripted model in its place (the same runner, tools and checks).
"""
from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from conftest import pair, run_nodes
from waiting import wait_until
from psymesh.agent.acting.loop import ScriptedModel, tool_call_text
from psymesh.agent.acting.tools import tool_from_function
from psymesh.node.door.gate import ASK_ANSWER
from psymesh.node.models import agents
from psymesh.node.messaging.answering import answer_id
from psymesh.node.control.client import Client
from psymesh.protocol.errors import ErrorCode, RemoteError
from psymesh.protocol.limits import Limits
from psymesh.protocol.messaging import LetterKind

pytestmark = pytest.mark.anyio
MODEL = {"n_ctx": 16384, "n_threads": 1}


class _Notes:
    """An irreversible tool on home that remembers what it really did."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, text: str) -> dict:
        """Send a note to the family (cannot be undone)."""
        self.sent.append(text)
        return {"sent": text}


async def test_an_ask_is_answered_with_the_tools_the_asker_may_use(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone")
        notes = _Notes()
        home.tools.register(tool_from_function(notes.send, "notes.send", irreversible=True))
        home.models.registry.add("tiny", tiny_model, **MODEL)
        model = ScriptedModel([tool_call_text("system.info"), tool_call_text("notes.send", {"text": "home by 6"}),
                               "Home runs psymesh; I did not send the note: nobody could say yes."])
        monkeypatch.setattr(agents, "llama_model", lambda worker, params: model)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["msg.ask", "tool:system.info", "tool:notes.*"], limits=Limits(max_runtime_s=60))
        async with Client(phone.home.path) as p:
            answer = await p.ask("home", "What are you, and tell the family I am home by 6.", thread="evening",
                                 timeout=60)
            asks = [m async for m in p.inbox(follow=False)]

        assert answer.kind is LetterKind.ANSWER and answer.thread == "evening" and answer.sender_name == "home"
        assert answer.text == "Home runs psymesh; I did not send the note: nobody could say yes."
        assert [m.id for m in asks] == [answer.id]  # the answer is an ordinary letter in the phone's inbox
        body = answer.body
        assert body["ok"] is True and body["stopped"] == "final" and body["steps"] == 3
        assert [(c["name"], c["status"]) for c in body["tool_calls"]] == [("system.info", "ok"),
                                                                          ("notes.send", "unconfirmed")]
        assert notes.sent == []  # irreversible: nobody at home said yes, so it never ran
        offered = {spec.name for spec in model.seen[0][1]}
        assert offered == {"system.info", "notes.send"}  # files.* is home's too, but not the phone's to use

        [ask] = [r.letter for r in home.messaging.store.released_after(0)]
        assert ask.kind is LetterKind.ASK and answer.reply_to == ask.id and answer.id == answer_id(ask)
        # answering the same ask again (a restart before it was noted as done) sends nothing new
        again = await home.answering.answer(ask)
        assert again is not None and again.id == answer.id and model.remaining == 0
        assert [s.letter.id for s in home.messaging.store.outbox()] == [answer.id]


async def test_an_ask_is_answered_by_the_generated_model(tmp_path: Path, tiny_model: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        await pair(nodes["home"].home.path, nodes["phone"].home.path, grant="phone")
        nodes["home"].models.registry.add("tiny", tiny_model, **MODEL)
        async with Client(nodes["phone"].home.path) as phone:
            answer = await phone.ask("home", "Show system info.", params={"seed": 26, "ban_bytes": True,
                                                                          "max_steps": 2}, timeout=120)

    assert answer.kind is LetterKind.ANSWER and answer.reply_to and answer.thread == "main"
    assert answer.body["ok"] is True and 1 <= answer.body["steps"] <= 2  # the asker's limit held
    assert answer.body["stopped"] in ("final", "max_steps") and answer.text == answer.body["answer"] != ""
    assert all(c["name"] in ("system.info", "files.list", "files.read", "files.search")
               for c in answer.body["tool_calls"])  # only what the phone preset grants


async def test_an_ask_without_msg_ask_is_refused_at_once(tmp_path: Path, tiny_model: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home = nodes["home"]
        await pair(home.home.path, nodes["phone"].home.path, grant="phone")
        model = ScriptedModel([])
        monkeypatch.setattr(agents, "llama_model", lambda worker, params: model)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["msg.send"])
        async with Client(nodes["phone"].home.path) as phone:
            with anyio.fail_after(30), pytest.raises(RemoteError) as info:
                await phone.ask("home", "Delete everything.", timeout=600)
            # its withdrawn stub (a `send`, so msg.send) keeps the thread going before msg.send goes
            await wait_until(lambda: nodes["phone"].messaging.store.pending(home.identity.peer_id) == [],
                             "the refused ask's stub to be taken")
            # bad params are the asker's bad request, answered as such
            async with Client(home.home.path) as h:
                await h.grant("phone", ["msg.ask"])
            failed = await phone.ask("home", "Hello?", params={"max_steps": "lots"}, timeout=60)
        got = [r.letter for r in home.messaging.store.released_after(0) if not r.letter.withdrawn]

    assert info.value.code is ErrorCode.FORBIDDEN and "msg.ask" in info.value.message
    assert [x.text for x in got] == ["Hello?"]  # only the allowed ask got in
    assert failed.body == {"ok": False, "error": {"code": "bad_request", "message": failed.text}}
    assert "max_steps" in failed.text and model.seen == []  # the agent never ran for either


async def test_an_asker_that_revoked_us_meanwhile_gets_nothing_and_the_node_lives_on(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone")
        home.models.registry.add("tiny", tiny_model, **MODEL)
        model = ScriptedModel(["First answer.", "Never sent."])
        monkeypatch.setattr(agents, "llama_model", lambda worker, params: model)
        async with Client(phone.home.path) as p:
            first = await p.ask("home", "Still there?", timeout=60)
            await p.revoke("home")  # home is told (a signed notice), so it writes nothing more to the phone
        [ask] = [r.letter for r in home.messaging.store.released_after(0)]
        await wait_until(lambda: home.trust.get(phone.identity.peer_id).revoked_us_at is not None,
                         "home to take the revocation notice")
        again = ask.model_copy(update={"id": "another-ask"})  # as if it were still waiting its turn
        assert await home.answering.answer(again) is None and model.remaining == 1  # the agent did not run
        assert first.text == "First answer."
        async with Client(home.home.path) as h:  # home goes on serving
            assert (await h.status()).name == "home"


async def test_an_ask_whose_grant_was_withdrawn_while_it_waited_is_refused_at_the_door_with_its_audit_row(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone")
        entered, release = anyio.Event(), anyio.Event()

        async def hold() -> dict:
            """Hold the agent on the first ask until the test lets it go."""
            entered.set()
            await release.wait()
            return {"held": True}

        home.tools.register(tool_from_function(hold, "test.hold"))
        home.models.registry.add("tiny", tiny_model, **MODEL)
        model = ScriptedModel([tool_call_text("test.hold"), "First answer."])
        monkeypatch.setattr(agents, "llama_model", lambda worker, params: model)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["msg.ask", "tool:test.*"])
        answers: dict[str, dict] = {}

        async def ask(question: str) -> None:
            async with Client(phone.home.path) as p:
                answers[question] = (await p.ask("home", question, timeout=60)).body

        def asks_at_home() -> int:
            return sum(r.letter.kind is LetterKind.ASK for r in home.messaging.store.released_after(0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "First?")
            await wait_until(entered.is_set, "the agent to take up the first ask")
            tg.start_soon(ask, "Second?")  # let in at the door: the grant still covers msg.ask
            await wait_until(lambda: asks_at_home() == 2, "the second ask to wait its turn at home")
            async with Client(home.home.path) as h:
                await h.grant("phone", ["msg.send"])  # the owner takes msg.ask away meanwhile
            release.set()

        assert answers["First?"]["ok"] is True and answers["First?"]["answer"] == "First answer."
        refused = answers["Second?"]
        assert refused["ok"] is False and refused["error"]["code"] == "forbidden"
        assert "msg.ask" in refused["error"]["message"] and model.remaining == 0  # the agent never ran for it
        rows = [r for r in home.audit.query(peer_id=phone.identity.peer_id, limit=1000)
                if r["protocol"] == ASK_ANSWER]
        assert [(r["operation"], r["allowed"], r["code"]) for r in rows] == [("msg.ask", True, None),
                                                                             ("msg.ask", False, "forbidden")]

        # unpaired meanwhile: nothing is sent, and the door's row says why
        [first_ask] = [r.letter for r in home.messaging.store.released_after(0) if r.letter.text == "First?"]
        async with Client(home.home.path) as h:
            await h.revoke("phone")
        assert await home.answering.answer(first_ask.model_copy(update={"id": "asked-before-unpairing"})) is None
        last = home.audit.query(peer_id=phone.identity.peer_id, denied_only=True, limit=1)[-1]
        assert (last["protocol"], last["operation"], last["code"]) == (ASK_ANSWER, "msg.ask", "unknown_peer")


async def test_no_answer_or_task_error_tells_the_peer_this_machine_s_paths(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34 item 6: a tool whose error names a file under the node's home (as an OSError
    does), and an agent that repeats it: the task's error, its events and the ask's answer
    reach the peer with `<node home>` (and `~` for the user's home) in place of the paths."""
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone")
        secret = home.home.path / "keys" / "spare.key"
        user_home = Path.home() / "notes.txt"

        def read(name: str) -> dict:
            """Read a note."""
            raise PermissionError(13, "Permission denied", str(secret))

        home.tools.register(tool_from_function(read, "notes.read"))
        home.models.registry.add("tiny", tiny_model, **MODEL)
        model = ScriptedModel([tool_call_text("notes.read", {"name": "x"}),
                               f"I could not read {secret}; try {user_home} instead."])
        monkeypatch.setattr(agents, "llama_model", lambda worker, params: model)
        async with Client(home.home.path) as h:
            await h.grant("phone", ["msg.ask", "tool:notes.*"], limits=Limits(max_runtime_s=60))
        async with Client(phone.home.path) as p:
            task = await p.delegate("home", tool="notes.read", args={"name": "x"})
            with pytest.raises(RemoteError) as err:
                await task.result()
            events = [e async for e in task.events(0)]
            answer = await p.ask("home", "Read my note x.", timeout=60)

        said = repr((err.value.message, [e.data for e in events], answer.text, answer.body))
        assert str(home.home.path) not in said and str(Path.home()) not in said
        assert "<node home>/keys/spare.key" in err.value.message
        assert answer.text == "I could not read <node home>/keys/spare.key; try ~/notes.txt instead."
