"""The A2A project's conformance requirements (its TCK's), run against `serve a2a` of a real daemon.

The A2A TCK (a2aproject/a2a-tck) is in no registry this project reaches (not on PyPI, nor npm), so
this module runs its requirements that apply to a JSON-RPC agent without push notifications,
by their TCK ids, on the wire (httpx, JSON-RPC bodies as a stranger's client writes them) and
through the official a2a-sdk client, for A2A 1.0 and for 0.3 (the method names, the `kind`
fields, and no `A2A-Version` header, which 0.3 clients do not send). docs/bridges.md lists what
passes. Each test collects every requirement that fails, so one run names them all.

Real components: an in-process daemon with the endpoint on 127.0.0.1 port 0, its real
AgentTaskRunner (the agent's replies scripted, as tests/test_a2a.py does).
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.client import A2ACardResolver
from a2a.types import a2a_pb2 as a2a

from test_a2a import ANSWER, a2a_node, client, message, on_asyncio, url_of

#: A2A's JSON-RPC error codes (spec §5.4 / the TCK's tck/requirements/base.py).
TASK_NOT_FOUND = -32001
TASK_NOT_CANCELABLE = -32002
PUSH_NOT_SUPPORTED = -32003
UNSUPPORTED_OPERATION = -32004
CONTENT_TYPE_NOT_SUPPORTED = -32005
VERSION_NOT_SUPPORTED = -32009
METHOD_NOT_FOUND = -32601


class Checks:
    """Requirement id -> what went wrong (nothing: it passed)."""

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}
        self.ran: list[str] = []

    def check(self, rid: str, ok: bool, why: str) -> None:
        self.ran.append(rid)
        if not ok:
            self.failed[rid] = why


def rpc(method: str, params: dict[str, Any], rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


def error_code(body: dict[str, Any]) -> int | None:
    return body.get("error", {}).get("code") if isinstance(body.get("error"), dict) else None


def text_message_v1(text: str, **extra: Any) -> dict[str, Any]:
    return {"message": {"role": "ROLE_USER", "messageId": str(uuid.uuid4()), "parts": [{"text": text}], **extra}}


def text_message_v03(text: str, **extra: Any) -> dict[str, Any]:
    return {"message": {"kind": "message", "role": "user", "messageId": str(uuid.uuid4()),
                        "parts": [{"kind": "text", "text": text}], **extra}}


def sse_events(raw: str) -> list[dict[str, Any]]:
    import json

    return [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]


@pytest.mark.anyio
async def test_a2a_1_0_requirements(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with a2a_node(tmp_path, tiny_model, monkeypatch, [ANSWER] * 8) as (node, _):
        url = url_of(node)

        async def run(http: httpx.AsyncClient) -> Checks:
            c = Checks()
            v1 = {"A2A-Version": "1.0"}

            async def call(method: str, params: dict[str, Any], headers: dict[str, str] = v1) -> dict[str, Any]:
                return (await http.post(url, json=rpc(method, params), headers=headers)).json()

            card = (await http.get(url.rstrip("/") + "/.well-known/agent-card.json",
                                   headers={"Authorization": ""})).json()
            c.check("CARD-001", bool(card.get("name")) and bool(card.get("skills")), f"card: {card}")
            c.check("CARD-002", any(i.get("protocolVersion") == "1.0" and i.get("protocolBinding") == "JSONRPC"
                                    and i.get("url") == url for i in card.get("supportedInterfaces", [])),
                    f"supportedInterfaces: {card.get('supportedInterfaces')}")
            c.check("CARD-003", "text/plain" in card.get("defaultInputModes", []), "defaultInputModes")
            sdk_card = await A2ACardResolver(http, url).get_agent_card()  # the SDK parses it
            c.check("CARD-004", sdk_card.name == card.get("name"), "the SDK could not read the card")

            sent = await call("SendMessage", text_message_v1("Hello from TCK"))
            task = sent.get("result", {}).get("task", {})
            c.check("CORE-SEND-001", task.get("status", {}).get("state") == "TASK_STATE_COMPLETED", f"{sent}")
            c.check("CORE-EXECUTION-MODE-001", bool(task.get("artifacts")), f"blocking send: {sent}")
            got = await call("GetTask", {"id": task.get("id", "")})
            c.check("CORE-GET-001", got.get("result", {}).get("id") == task.get("id")
                    and got["result"]["status"]["state"] == "TASK_STATE_COMPLETED", f"{got}")
            short = await call("GetTask", {"id": task.get("id", ""), "historyLength": 0})
            c.check("CORE-HIST-003", not short.get("result", {}).get("history"), f"historyLength 0: {short}")
            missing = await call("GetTask", {"id": "tck-nonexistent-get-002"})
            c.check("CORE-GET-002", error_code(missing) == TASK_NOT_FOUND, f"{missing}")
            done = await call("CancelTask", {"id": task.get("id", "")})
            c.check("CORE-CANCEL-002", error_code(done) == TASK_NOT_CANCELABLE, f"{done}")
            nobody = await call("CancelTask", {"id": "tck-nonexistent-cancel-003"})
            c.check("CORE-CANCEL-003", error_code(nobody) == TASK_NOT_FOUND, f"{nobody}")
            again = await call("SendMessage", text_message_v1("more", taskId=task.get("id", "")))
            c.check("CORE-SEND-002", error_code(again) == UNSUPPORTED_OPERATION, f"to a terminal task: {again}")
            raw = await call("SendMessage", {"message": {
                "role": "ROLE_USER", "messageId": str(uuid.uuid4()),
                "parts": [{"raw": "dGNr", "mediaType": "application/x-unsupported-tck-type"}]}})
            c.check("CORE-SEND-003", error_code(raw) == CONTENT_TYPE_NOT_SUPPORTED, f"{raw}")
            listed = await call("ListTasks", {})
            result = listed.get("result", {})
            c.check("CORE-LIST-001", task.get("id") in [t.get("id") for t in result.get("tasks", [])], f"{listed}")
            c.check("CORE-LIST-004", result.get("nextPageToken", None) == "", f"nextPageToken: {listed}")
            c.check("CORE-LIST-005", all("artifacts" not in t for t in result.get("tasks", [])), f"{listed}")
            push = await call("CreateTaskPushNotificationConfig", {
                "taskId": task.get("id", ""), "url": "http://127.0.0.1:9/hook"})
            c.check("CORE-PUSH-NOT-SUPPORTED", error_code(push) == PUSH_NOT_SUPPORTED, f"{push}")
            unknown = await call("NoSuchMethod", {})
            c.check("JSONRPC-METHOD-NOT-FOUND", error_code(unknown) == METHOD_NOT_FOUND, f"{unknown}")

            stream = await http.post(url, json=rpc("SendStreamingMessage", text_message_v1("Stream task lifecycle")),
                                     headers={**v1, "Accept": "text/event-stream"})
            events = [e.get("result", {}) for e in sse_events(stream.text)]
            c.check("CORE-STREAM-001", stream.headers.get("content-type", "").startswith("text/event-stream"),
                    f"content-type {stream.headers.get('content-type')}")
            c.check("CORE-STREAM-003", bool(events) and "task" in events[0]
                    and events[-1].get("statusUpdate", {}).get("status", {}).get("state") == "TASK_STATE_COMPLETED",
                    f"events: {events}")

            bad = await call("GetTask", {"id": task.get("id", "")}, headers={"A2A-Version": "9.9"})
            c.check("VER-SERVER-002", error_code(bad) == VERSION_NOT_SUPPORTED, f"{bad}")
            patch = await call("GetTask", {"id": task.get("id", "")}, headers={"A2A-Version": "1.0.1"})
            c.check("VER-CLIENT-002", patch.get("result", {}).get("id") == task.get("id"), f"1.0.1: {patch}")

            sdk = await client(http, url, streaming=False)  # the official client end to end
            [response] = [r async for r in sdk.send_message(message("through the SDK"))]
            c.check("SDK-SEND", response.task.status.state == a2a.TASK_STATE_COMPLETED, f"{response}")
            return c

        checks = await on_asyncio(run)
    assert not checks.failed, checks.failed
    assert len(checks.ran) >= 20


@pytest.mark.anyio
async def test_a2a_0_3_requirements(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with a2a_node(tmp_path, tiny_model, monkeypatch, [ANSWER] * 8) as (node, _):
        url = url_of(node)

        async def run(http: httpx.AsyncClient) -> Checks:
            c = Checks()

            async def call(method: str, params: dict[str, Any], headers: dict[str, str] | None = None
                           ) -> dict[str, Any]:
                return (await http.post(url, json=rpc(method, params), headers=headers or {})).json()

            # 0.3 clients send no A2A-Version: the agent MUST take its absence as 0.3 (VER-SERVER-003).
            sent = await call("message/send", text_message_v03("Hello from TCK"))
            task = sent.get("result", {})
            c.check("VER-SERVER-003", task.get("kind") == "task", f"no A2A-Version header: {sent}")
            c.check("CORE-SEND-001", task.get("status", {}).get("state") == "completed", f"{sent}")
            explicit = await call("message/send", text_message_v03("Hello again"), {"A2A-Version": "0.3"})
            c.check("VER-SERVER-001", explicit.get("result", {}).get("kind") == "task", f"{explicit}")
            got = await call("tasks/get", {"id": task.get("id", "")})
            c.check("CORE-GET-001", got.get("result", {}).get("status", {}).get("state") == "completed", f"{got}")
            missing = await call("tasks/get", {"id": "tck-nonexistent-get-002"})
            c.check("CORE-GET-002", error_code(missing) == TASK_NOT_FOUND, f"{missing}")
            done = await call("tasks/cancel", {"id": task.get("id", "")})
            c.check("CORE-CANCEL-002", error_code(done) == TASK_NOT_CANCELABLE, f"{done}")
            nobody = await call("tasks/cancel", {"id": "tck-nonexistent-cancel-003"})
            c.check("CORE-CANCEL-003", error_code(nobody) == TASK_NOT_FOUND, f"{nobody}")
            again = await call("message/send", text_message_v03("more", taskId=task.get("id", "")))
            c.check("CORE-SEND-002", error_code(again) is not None, f"to a terminal task: {again}")
            stream = await http.post(url, json=rpc("message/stream", text_message_v03("Stream task lifecycle")),
                                     headers={"Accept": "text/event-stream"})
            events = [e.get("result", {}) for e in sse_events(stream.text)]
            c.check("CORE-STREAM-003", bool(events) and events[0].get("kind") == "task"
                    and events[-1].get("kind") == "status-update" and events[-1].get("final") is True
                    and events[-1]["status"]["state"] == "completed", f"events: {events}")
            card = (await http.get(url.rstrip("/") + "/.well-known/agent-card.json")).json()
            c.check("CARD-0.3", any(i.get("protocolVersion") == "0.3" for i in card.get("supportedInterfaces", [])),
                    f"{card.get('supportedInterfaces')}")
            return c

        checks = await on_asyncio(run)
    assert not checks.failed, checks.failed
    assert len(checks.ran) >= 10
