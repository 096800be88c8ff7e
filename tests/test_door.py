"""The one door, table-driven: every request message of every service, sent over a real
session by peers in every standing (a stranger, paired without the capability, with an
expired grant, revoked, allowed), with the answer and the audit row each one leaves.
And a session killed under a running task: the task completes exactly once."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import anyio
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from conftest import pair, run_nodes
from test_relay import home_with
from waiting import wait_until
from psymesh.agent.acting.tools import tool_from_function
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.protocol import ids
from psymesh.protocol.addresses import AddrRecord, AddrsPush
from psymesh.protocol.admission import REQUESTS, Need
from psymesh.protocol.common import Error, Ping
from psymesh.protocol.dialback import DialBack
from psymesh.protocol.errors import NetworkError, PsymeshError
from psymesh.protocol.mailbox import (
    MailAck,
    MailDeposit,
    MailFetch,
    MailKey,
    MailKeyPush,
    MailLeaveReceipt,
    MailTakeReceipts,
)
from psymesh.protocol.manifest import ManifestPush, ManifestRevoke, revocation
from psymesh.protocol.messages import Message
from psymesh.protocol.messaging import (
    Letter,
    MsgAck,
    MsgMissing,
    MsgReceipts,
    MsgSend,
    MsgSendMany,
    Receipt,
    ReceiptStatus,
)
from psymesh.protocol.tasks import (
    EventKind,
    TaskAck,
    TaskAcks,
    TaskAttach,
    TaskCancel,
    TaskCaps,
    TaskInput,
    TaskList,
    TaskSpec,
    TaskSubmit,
)

from psymesh.protocol.oblivious import ExitSecret
from psymesh.protocol.relay import DCUTR, HOLE_PUNCH, STOP, TAKE_CIRCUIT, RelaySettings
from psymesh.protocol.web import WebFetch, WebKeyGet, WebKeyOf, WebKeyPush, WebRelay, WebSealed, WebSearch

pytestmark = pytest.mark.anyio
OK = "ok"  # allowed: the service answered (whatever it said)


def requests_from(peer: Node, home: Node, n: int) -> dict[type[Message], Message]:
    """One request of every type the door knows, as `peer` would send it to `home`."""
    grant_to_home = peer.trust.get(home.identity.peer_id).granted
    assert grant_to_home is not None  # pairing gave home a grant back
    notice = revocation(peer.identity.peer_id, home.identity.peer_id, grant_to_home, now=time.time())
    return {
        TaskSubmit: TaskSubmit(spec=TaskSpec(id=f"door-{n}", kind="tool", tool="system.info")),
        TaskAttach: TaskAttach(task_id="nobodys-task"),
        TaskAck: TaskAck(task_id="nobodys-task", upto_seq=1),
        TaskAcks: TaskAcks(acks=[TaskAck(task_id="nobodys-task", upto_seq=1)]),
        TaskCancel: TaskCancel(task_id="nobodys-task"),
        TaskInput: TaskInput(task_id="nobodys-task", data={"approve": True}),
        TaskList: TaskList(),
        TaskCaps: TaskCaps(),
        Ping: Ping(seq=n),
        DialBack: DialBack(ports=[1]),  # home connects to the peer's own IP only: 127.0.0.1:1, refused
        ManifestPush: ManifestPush(manifest=grant_to_home),
        ManifestRevoke: notice.sign(peer.identity.private_key),
        MsgSend: MsgSend(letter=Letter(id=f"door-{n}", sender=peer.identity.peer_id, recipient=home.identity.peer_id,
                                       tseq=n, text="hello", at=int(time.time() * 1000)).sign(peer.identity.private_key)),
        # a batch: the envelope needs a grant, then its letter is admitted as the msg.send it stands for
        MsgSendMany: MsgSendMany(letters=[
            Letter(id=f"door-many-{n}", sender=peer.identity.peer_id, recipient=home.identity.peer_id,
                   thread="many", tseq=n, text="hello", at=int(time.time() * 1000)).sign(peer.identity.private_key)]),
        # the peer's signed receipt for letters of home's; its ask for letters of home's again
        MsgAck: MsgAck(receipt=Receipt(recipient=peer.identity.peer_id, sender=home.identity.peer_id,
                                       ids=[f"door-{n}"], at=int(time.time() * 1000)).sign(peer.identity.private_key)),
        MsgMissing: MsgMissing(thread="main", tseqs=[1]),
        # the peer names home its mailbox (before it deposits for itself there, and fetches)
        MailKeyPush: MailKeyPush(key=MailKey(owner=peer.identity.peer_id, mailbox=home.identity.peer_id, serial=n,
                                             public=X25519PrivateKey.generate().public_key().public_bytes_raw())
                                 .sign(peer.identity.private_key)),
        MailDeposit: MailDeposit(recipient=peer.identity.peer_id, ref=bytes(16), sealed=bytes(64)),
        MailFetch: MailFetch(),
        MailAck: MailAck(upto=0),
        # (after its mail.key named home) the peer's receipt for a sender it cannot reach; taking its own
        MailLeaveReceipt: MailLeaveReceipt(receipt=Receipt(recipient=peer.identity.peer_id, sender=STRANGER_ID,
                                                           ids=[f"door-{n}"], at=1).sign(peer.identity.private_key)),
        MailTakeReceipts: MailTakeReceipts(recipient=STRANGER_ID),
        AddrsPush: AddrsPush(record=AddrRecord(peer_id=peer.identity.peer_id, seq=n,
                                               addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer.identity.peer_id}",))
                             .sign(peer.identity.private_key)),
        # home is no web exit: once let in, these are answered `unavailable` by the service
        WebSearch: WebSearch(query="door"),
        WebFetch: WebFetch(url="http://127.0.0.1:1/door"),
        WebSealed: WebSealed(sealed=bytes(64)),
        WebRelay: WebRelay(exit=STRANGER_ID, sealed=bytes(64)),   # an exit home is not paired with
        WebKeyOf: WebKeyOf(exit=STRANGER_ID),    # home's view of an exit it is not paired with: not_found
        WebKeyGet: WebKeyGet(),                  # home is no exit: unavailable
        WebKeyPush: WebKeyPush(key=ExitSecret.generate(1).public(peer.identity.private_key, peer.identity.peer_id,
                                                                  now=time.time(), ttl_s=3600)),
    }


STRANGER_ID = "12D3KooWRpx9AHSGygNZvwDQB6XaVnnA3CXTGFgmHNYLwQbaGAGy"  # nobody's: no node here has this key


# What each standing is answered, per rule ("capability", "grant", "issuer", "paired"): an error
# code, or OK when the door let it through. Issuer-signed and "paired" messages need only a pairing.
EXPECTED = {
    "nocap": {"capability": "forbidden", "grant": OK, "issuer": OK, "paired": OK},
    "expired": {"capability": "expired", "grant": "expired", "issuer": OK, "paired": OK},
    "revoked": {"capability": "unknown_peer", "grant": "unknown_peer", "issuer": "unknown_peer",
                "paired": "unknown_peer"},
    "allowed": {"capability": OK, "grant": OK, "issuer": OK, "paired": OK},
}


async def ask(peer: Node, home: Node, request: Message) -> str:
    """Send one request on `peer`'s session to `home`; the error code it got, or OK."""
    try:
        async with peer.sessions.stream(home.identity.peer_id, request) as replies:
            first = [m async for m in replies][0]
    except NetworkError as exc:
        return f"network:{exc.code.value}"
    except Exception as exc:  # a refusal of the whole session arrives as RemoteError
        return getattr(getattr(exc, "code", None), "value", repr(exc))
    if isinstance(first, MsgReceipts):  # a batch let in: what its letter got, by its own decision
        refused = [r.code.value for r in first.results if r.status is ReceiptStatus.REFUSED and r.code]
        return refused[0] if refused else OK
    return first.code if isinstance(first, Error) and first.code in (
        "forbidden", "expired", "unknown_peer", "rate_limited", "bad_request") else OK


def door_rows(home: Node, peer: Node) -> dict[int, dict]:
    return {r["id"]: r for r in home.audit.query(peer_id=peer.identity.peer_id, limit=1000)
            if r["protocol"] == ids.SESSION}


def last_row(before: dict[int, dict], after: dict[int, dict], operation: str | None = None) -> dict:
    """The door's row for the peer's latest request (of `operation`, if there is one): a new row, or
    the row of the same refusal made earlier in the audit window, its count one higher (a
    task it let in may add a task.start row, not a door row)."""
    changed = [r for i, r in after.items() if i not in before or before[i]["count"] < r["count"]]
    return ([r for r in changed if r["operation"] == operation] or changed)[-1]


async def test_every_request_of_every_service_against_every_standing(tmp_path: Path) -> None:
    names = ("home", "nocap", "expired", "revoked", "allowed", "stranger")
    async with run_nodes(tmp_path, *names) as nodes:
        home = nodes["home"]
        for name in ("nocap", "expired", "revoked", "allowed"):
            await pair(home.home.path, nodes[name].home.path)
        async with Client(home.home.path) as h:
            await h.grant("nocap", ["tool:nothing.here"])
            await h.grant("expired", ["tool:*"], expires_s=60)
            await h.grant("allowed", ["tool:*", "msg.send", "mail.deposit", "web.search", "web.fetch", "web.relay"])
            await h.grant("revoked", ["tool:*"])
        # revoked without being told (its notice lost): it may still call, and hears unknown_peer
        home.trust.revoke(nodes["revoked"].identity.peer_id)
        home.gate.clock = lambda: time.time() + 120  # the expired grant is out of date now
        await nodes["stranger"].p2p.connect(home.p2p.addrs()[0])

        for standing, expected in EXPECTED.items():
            peer = nodes[standing]
            requests = requests_from(peer, home, n=len(standing))
            for i, (kind, request) in enumerate(sorted(requests.items(), key=lambda kv: kv[0] is ManifestRevoke)):
                rule = REQUESTS[kind]
                # a batch's letters each need what a lone msg.send needs; the last row is its letter's
                need = Need.CAPABILITY if kind is MsgSendMany else rule.need
                want = expected[need.value]
                before = door_rows(home, peer)
                got = await ask(peer, home, request)
                assert got == want, (standing, kind.__name__, got)
                row = last_row(before, door_rows(home, peer), "msg.send" if kind is MsgSendMany else None)
                assert row["protocol"] == ids.SESSION and row["allowed"] is (want == OK), (standing, kind, row)
                assert row["code"] == (None if want == OK else want)

        # A stranger reaches no session at all: each attempt is one refused, audited stream
        # (identical refusals: counted into one row of the audit window).
        stranger = nodes["stranger"]
        before = sum(r["count"] for r in home.audit.query(peer_id=stranger.identity.peer_id, limit=1000))
        for request in requests_from(nodes["allowed"], home, n=99).values():
            assert await ask(stranger, home, request) == "unknown_peer"
        rows = home.audit.query(peer_id=stranger.identity.peer_id, limit=1000)
        assert sum(r["count"] for r in rows) - before == len(REQUESTS)
        assert {(r["protocol"], r["allowed"], r["code"]) for r in rows} == {(ids.SESSION, False, "unknown_peer")}


async def test_every_message_the_node_serves_has_a_row_in_the_door_table(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home") as nodes:
        served = set(nodes["home"].services)
    assert served == set(REQUESTS), "a service whose requests are not in protocol/admission.py skips the door"


# Work a peer asked for earlier, decided again by the door when it is done (`Gate.readmit`):
# a queued task as it starts (task.start), a peer's ask as the agent takes it up (ask.answer).
# What each standing gets then, with one audit row under the moment's name.
READMITTED = {"nocap": "forbidden", "expired": "expired", "revoked": "unknown_peer", "allowed": OK,
              "stranger": "unknown_peer"}


async def test_work_asked_for_earlier_is_decided_again_at_the_door_with_its_audit_row(tmp_path: Path) -> None:
    from psymesh.node.door.gate import ASK_ANSWER, RECHECK
    from psymesh.protocol.admission import task_operation
    from psymesh.protocol.manifest import Operation

    async with run_nodes(tmp_path, "home", *READMITTED) as nodes:
        home = nodes["home"]
        for name in ("nocap", "expired", "revoked", "allowed"):
            await pair(home.home.path, nodes[name].home.path)
        async with Client(home.home.path) as h:
            await h.grant("nocap", ["tool:nothing.here"])
            await h.grant("expired", ["tool:*", "msg.ask"], expires_s=60)
            await h.grant("allowed", ["tool:*", "msg.ask"])
            await h.grant("revoked", ["tool:*", "msg.ask"])
        home.trust.revoke(nodes["revoked"].identity.peer_id)
        home.gate.clock = lambda: time.time() + 120  # the expired grant is out of date now
        moments = {RECHECK: task_operation(TaskSpec(id="t", kind="tool", tool="system.info")),
                   ASK_ANSWER: Operation(name="msg.ask", payload_bytes=5)}
        for standing, want in READMITTED.items():
            peer_id = nodes[standing].identity.peer_id
            for service, operation in moments.items():
                decision = home.gate.readmit(peer_id, service, operation)
                assert decision.allowed is (want == OK) and decision.code == (None if want == OK else want), \
                    (standing, service, decision)
                [row] = [r for r in home.audit.query(peer_id=peer_id, limit=100) if r["protocol"] == service]
                assert row["operation"] == operation.required() and row["allowed"] is (want == OK)
                assert row["code"] == (None if want == OK else want), (standing, service, row)


async def test_a_revoked_peer_that_was_told_may_open_pairing_only(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        async with Client(home.home.path) as h:
            await h.revoke("phone")
        assert home.trust.get(phone.identity.peer_id).revocation_told_at is not None
        home.gate.admit_stream(phone.identity.peer_id, ids.PAIR)  # it may pair again (a new invite)
        with pytest.raises(PsymeshError):
            home.gate.admit_stream(phone.identity.peer_id, ids.SESSION)
        # even a phone that ignored the notice gets no session, so no request
        phone.trust.conn.execute("UPDATE peers SET revoked_us_at = NULL")
        phone.trust.version += 1  # a write behind the store's back: its rows read before are stale
        with pytest.raises(Exception):
            await phone.p2p.connect(home.p2p.addrs()[0])
            await phone.sessions.request(home.identity.peer_id, Ping(seq=1), Message)


async def test_a_session_killed_under_a_running_task_completes_it_exactly_once(tmp_path: Path) -> None:
    runs: Counter[str] = Counter()
    release = anyio.Event()

    async def slow(tag: str) -> dict:
        runs[tag] += 1
        await release.wait()
        return {"tag": tag}

    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path)
        home.tools.register(tool_from_function(slow, "test.slow"))
        async with Client(home.home.path) as h:
            await h.grant("phone", ["tool:test.*"])
        async with Client(phone.home.path) as c:
            task = await c.delegate("home", tool="test.slow", args={"tag": "once"})
            await wait_until(lambda: runs["once"] == 1, "the task to start on home")
            [first] = phone.sessions.sessions()
            await phone.p2p.disconnect(home.identity.peer_id)  # the connection dies mid-task
            await wait_until(lambda: not first.alive, "the phone to notice the dead session")
            release.set()
            with anyio.fail_after(20):
                assert await task.result() == {"tag": "once"}
            events = [ev async for ev in task.events()]
        assert runs == Counter({"once": 1})
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # each event once, in order
        assert [e.kind for e in events].count(EventKind.RESULT) == 1
        [again] = phone.sessions.sessions()
        assert again is not first  # the driver redialled and re-attached on a new session
        await wait_until(lambda: home.executor.store.get(task.id).acked_seq == len(events), "home to get the ack")


# Checks at the stream, not the session, that go through the door too (issue 19 item 6): what a
# paired peer opens, and the one audit row its owner then sees (`psymesh audit`).
IDENTIFY = "/ipfs/id/1.0.0"  # libp2p's identify: psymesh serves it to nobody
STREAM_CHECKS = {
    # case: (protocol opened, audit row's protocol, operation, code)
    "identify from a paired peer": (IDENTIFY, IDENTIFY, IDENTIFY, "bad_request"),   # not "unknown_peer"
    "DCUtR on a direct connection": (DCUTR, DCUTR, HOLE_PUNCH, "bad_request"),       # nothing to punch
    "a circuit on STOP without a reservation": (STOP, STOP, TAKE_CIRCUIT, "not_found"),
}


async def test_stream_checks_of_a_paired_peer_are_refused_by_the_door_with_one_row_each(tmp_path: Path) -> None:
    home_with(tmp_path / "home", "home", RelaySettings(hole_punch=True))
    async with run_nodes(tmp_path, "home", "phone") as nodes:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="messaging")
        async with Client(home.home.path) as h:
            for case, (protocol, service, operation, code) in STREAM_CHECKS.items():
                try:  # refused in the negotiation (`na`) or, once it is open, reset
                    stream = await phone.p2p.open_stream(home.p2p.addrs()[0], protocol)
                    assert await stream.receive_some() == b"", case
                except PsymeshError:
                    pass

                async def rows() -> list[tuple[str, str, bool, str | None, int]]:
                    return [(r.protocol, r.operation, r.allowed, r.code, r.count)
                            for r in await h.audit(peer="phone") if r.protocol == service]

                async def seen() -> bool:  # the row is there once home's handler ran
                    return bool(await rows())

                await wait_until(seen, case)
                assert await rows() == [(service, operation, False, code, 1)], case
# Checks made through the door outside a session frame: (audit service, operation) of the row
# each leaves, and the request that makes it. A tool task or agent run on a web exit for a peer
# searches as that peer: held to its `web.search` capability and charged, like a web.search frame.
THROUGH_THE_DOOR = {
    ("web.agent", "web.search"): "a peer's tool task on the exit runs the web.search tool",
}


async def test_a_tool_tasks_web_search_on_an_exit_is_held_to_the_peers_web_search_grant(tmp_path: Path) -> None:
    from psymesh.node.core.websettings import WebSettings
    from psymesh.node.web.exit import ExitSettings, SearchSettings
    from psymesh.protocol.errors import ErrorCode, RemoteError
    from websites import serving

    with serving() as site:
        site.route("/search", '{"results": [{"title": "Door", "url": "http://127.0.0.1/door", "snippet": "s"}]}',
                   content_type="application/json")
        search = SearchSettings(backend="json", url=site.url("/search") + "?q={query}")
        exit_ = {"web": WebSettings(exit=ExitSettings(enabled=True, allow_loopback=True, search=search))}
        async with run_nodes(tmp_path, "home", "phone", configs={"home": exit_}) as nodes:
            home, phone_node = nodes["home"], nodes["phone"]
            await pair(home.home.path, phone_node.home.path)
            phone_id = phone_node.identity.peer_id
            async with Client(home.home.path) as h:
                await h.grant("phone", ["tool:web.search", "web.fetch"])   # the tool, but not web.search
            async with Client(phone_node.home.path) as phone:
                refused = await phone.delegate("home", tool="web.search", args={"query": "door"})
                with pytest.raises(RemoteError) as err:
                    await refused.result()
                async with Client(home.home.path) as h:
                    await h.grant("phone", ["tool:web.search", "web.search"])
                allowed = await phone.delegate("home", tool="web.search", args={"query": "door"})
                found = await allowed.result()
            rows = [r for r in home.audit.query(peer_id=phone_id, limit=1000)
                    if (r["protocol"], r["operation"]) in THROUGH_THE_DOOR]
    assert err.value.code is ErrorCode.FORBIDDEN and "web.search" in err.value.message
    assert [(r["allowed"], r["code"]) for r in rows] == [(False, "forbidden"), (True, None)]
    assert site.hits["/search"] == 1 and "door" in str(found)   # the refused search never ran
