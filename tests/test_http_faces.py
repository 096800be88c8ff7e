"""Every HTTP face of a node is bounded, and never answers a bare 500 (issue 32, items 5 and 6).

The faces: the OpenAI-compatible endpoint (hypercorn), the A2A agent (a2a-sdk under uvicorn on
its own asyncio thread) and the dashboard (hypercorn), all behind node/bridges/httpguard.py.
The owner's API is the control socket (no HTTP) and MCP is only a client here, so these three
are all the HTTP servers a node runs.

Real components: a daemon process started as a user starts one (`psymesh node start`, the
faces turned on in its config.toml, on 127.0.0.1 port 0, their URLs read from its log), asked
by httpx, or by a raw socket where a request must lie about its framing; for the failing
handler, the faces built by the test around a failing part of their node (their seam: the
parts the daemon wires in), served by their own `run` as the daemon serves them.

Before (issue 32): a 400 MB body took the A2A daemon from 446 MB to 1.35 GB (measured here
at the parent of this change: 122 MiB to 867 MiB, a chunked 400 MB body); 100,000-deep JSON
was a 500 and two tracebacks from the OpenAI endpoint; `/activity?peer=unknown` a bare 500
without the dashboard's security headers.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest

from conftest import run_nodes
from psymesh.agent.acting.tools import Tool
from psymesh.node.bridges.a2a import A2AEndpoint, A2AParts
from psymesh.node.bridges.apikey import ApiKey
from psymesh.node.bridges.httpguard import JSON_MAX_DEPTH, json_depth
from psymesh.node.bridges.openai import OpenAIEndpoint, OpenAIParts
from psymesh.node.control.dashboard import SECURITY_HEADERS, Dashboard, DashboardParts
from psymesh.node.control.process import DaemonProcess
from psymesh.node.core.bridgeconfig import A2AServe, OpenAIServe, ServeSettings, UiServe
from psymesh.node.core.home import NodeHome
from psymesh.node.daemon import Node
from psymesh.protocol.messages import Message
from waiting import wait_until

pytestmark = pytest.mark.anyio

MIB = 1024 * 1024
BIG = 400 * MIB                 # the body
CHUNK = b"x" * MIB              # one buffer, sent again and again: the test never holds BIG
RSS_SLACK = 64 * MIB            # what the daemon may grow by while refusing BIG (far less than it)
DEEP = 100_000                  # the nesting
KEY = "faces-test-key-0123456789"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RPC = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "nope"}}
CARD = "/.well-known/agent-card.json"


# --------------------------------------------------------------------------- a daemon with its faces


@dataclass(frozen=True)
class Face:
    """One face of the daemon: where to send a JSON body, with what headers, and how its
    error answers name their code."""

    name: str
    url: str               # the route a body goes to
    headers: dict[str, str]
    limit: int             # its max_body_bytes

    def code(self, response: httpx.Response | RawAnswer) -> str:
        """The error code of an answer in this face's own shape."""
        if self.name == "ui":
            found = re.search(r"<h1>\d+ ([a-z_]+)</h1>", response.text)
            assert found, response.text[:500]
            return found.group(1)
        error = json.loads(response.text)["error"]
        return error["code"] if self.name == "openai" else error["data"]["code"]


@dataclass(frozen=True)
class Faces:
    daemon: DaemonProcess
    openai: Face
    a2a: Face
    ui: Face

    def all(self) -> tuple[Face, Face, Face]:
        return self.openai, self.a2a, self.ui

    def rss(self) -> int:
        assert self.daemon.proc is not None
        for line in Path(f"/proc/{self.daemon.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def tracebacks(self) -> list[str]:
        return [line for line in self.daemon.log_path.read_text(errors="replace").splitlines()
                if "Traceback" in line]


@asynccontextmanager
async def faces(tmp_path: Path) -> AsyncIterator[Faces]:
    """A home daemon (`psymesh node start`) with the OpenAI endpoint, the A2A agent and the
    dashboard on 127.0.0.1, each on a free port, each with the key KEY."""
    home = NodeHome(tmp_path / "home")
    home.init(profile="home", name="home")
    for name in ("openai.key", "a2a.key", "ui.key"):
        (home.path / name).write_text(KEY + "\n")
        (home.path / name).chmod(0o600)
    config = home.load_config()
    home.save_config(config.model_copy(update={
        "serve": ServeSettings(openai=OpenAIServe(enabled=True, port=0), a2a=A2AServe(enabled=True, port=0)),
        "ui": UiServe(enabled=True, port=0)}))
    daemon = DaemonProcess(home.path)
    await daemon.start(timeout=60)
    try:
        urls: dict[str, str] = {}

        def listening() -> bool:
            text = daemon.log_path.read_text(errors="replace")
            for name, pattern in (("openai", r"OpenAI-compatible endpoint at (http://\S+)/v1 "),
                                  ("a2a", r"A2A agent at (http://\S+/) "), ("ui", r"dashboard at (http://\S+) ")):
                found = re.search(pattern, text)
                if found:
                    urls[name] = found.group(1)
            return len(urls) == 3

        await wait_until(listening, "the three faces' URLs in the daemon's log", timeout=60)
        key = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        yield Faces(daemon=daemon,
                    openai=Face("openai", urls["openai"] + "/v1/chat/completions", key, 4 * MIB),
                    a2a=Face("a2a", urls["a2a"], {**key, "A2A-Version": "1.0"}, 4 * MIB),
                    ui=Face("ui", urls["ui"] + "/peers/revoke", key, 64 * 1024))
    finally:
        assert await daemon.stop() == 0, daemon.log_tail()


async def streamed(total: int) -> AsyncIterator[bytes]:
    """`total` bytes, one CHUNK at a time (a generator: nothing of it is held)."""
    sent = 0
    while sent < total:
        piece = CHUNK[:total - sent]
        sent += len(piece)
        yield piece


# --------------------------------------------------------------------------- a raw HTTP/1.1 exchange


@dataclass(frozen=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    text: str
    sent: int   # body bytes the client got to send before the server stopped it


async def raw_post(url: str, headers: dict[str, str], total: int, *, chunked: bool = False) -> RawAnswer:
    """POST `total` bytes of CHUNK to `url` on a bare socket, framed exactly as `headers` say
    (a Content-Length may lie), chunked if asked; the answer is read while the body is still
    going out, and the sending stops when the server closes."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n{head}\r\n").encode()
    stream = await anyio.connect_tcp(parts.hostname, parts.port)
    received = bytearray()
    sent = 0
    async with stream, anyio.create_task_group() as tg:

        async def send_body() -> None:
            nonlocal sent
            try:
                await stream.send(request)
                async for piece in streamed(total):
                    await stream.send(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)
                    sent += len(piece)
                if chunked:
                    await stream.send(b"0\r\n\r\n")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # the server closed: the rest is not wanted

        tg.start_soon(send_body)
        try:
            while b"\r\n\r\n" not in received or len(received) < _answer_length(received):
                received += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            pass
        tg.cancel_scope.cancel()
    head_bytes, _, body = bytes(received).partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), received[:200]
    answer_headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(answer_headers.get("content-length", len(body)))
    return RawAnswer(int(lines[0].split()[1]), answer_headers, body[:length].decode(), sent)


def _answer_length(received: bytearray) -> int:
    head, _, _ = bytes(received).partition(b"\r\n\r\n")
    found = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
    return len(head) + 4 + (int(found.group(1)) if found else 0)


# --------------------------------------------------------------------------- item 5: the body limit


async def test_a_400_mb_body_to_a2a_is_refused_as_it_streams_and_the_daemon_stays_small(tmp_path: Path) -> None:
    """The issue's probe: 400 MB posted to the A2A agent, chunked (no length to refuse it by)
    and with its true Content-Length. Both 413 in JSON-RPC's shape; the daemon's memory
    grows by far less than the body; the agent answers the next request."""
    async with faces(tmp_path) as node:
        face = node.a2a
        async with httpx.AsyncClient(timeout=120) as http:
            await http.get(face.url.rstrip("/") + CARD)  # warm: the first request's own cost is not the body's
            before = node.rss()
            chunked = await http.post(face.url, content=streamed(BIG), headers=face.headers)
            after_chunked = node.rss()
            declared = await http.post(face.url, content=streamed(BIG),
                                       headers={**face.headers, "Content-Length": str(BIG)})
            after = node.rss()
            card = await http.get(face.url.rstrip("/") + CARD)
            rpc = await http.post(face.url, json=RPC, headers=face.headers)
        print(f"A2A daemon RSS: {before / MIB:.1f} MiB before, {after_chunked / MIB:.1f} MiB after a chunked "
              f"400 MB body, {after / MIB:.1f} MiB after a declared one")
        for answer in (chunked, declared):
            assert answer.status_code == 413, answer.text
            assert face.code(answer) == "request_too_large" and answer.json()["error"]["code"] == -32600
            assert answer.headers["connection"] == "close"
        assert after - before < RSS_SLACK, (before, after_chunked, after)
        assert card.status_code == 200 and rpc.status_code == 200 and rpc.json()["error"]["code"] == -32001
        assert node.tracebacks() == []


async def test_every_face_refuses_a_body_past_its_limit_however_it_is_framed(tmp_path: Path) -> None:
    """Each face, past its own limit (4 MiB; the dashboard 64 KiB): a declared length is
    refused unread, a chunked body once it passes the limit; a Content-Length under the limit
    on a chunked body (a lie: the chunks are what counts) is refused the same. A length
    that lies short frames a short body (the server reads no further): refused as what it
    is, not JSON. Each answer in the face's shape, the dashboard's with its security
    headers; the daemon holds none of the 64 MiB sent each time."""
    async with faces(tmp_path) as node:
        before = node.rss()
        for face in node.all():
            total = 64 * MIB
            declared = await raw_post(face.url, {**face.headers, "Content-Length": str(total)}, total)
            chunked = await raw_post(face.url, {**face.headers, "Transfer-Encoding": "chunked"}, total, chunked=True)
            lying = await raw_post(face.url, {**face.headers, "Content-Length": "100", "Transfer-Encoding": "chunked"},
                                   total, chunked=True)
            short = await raw_post(face.url, {**face.headers, "Content-Length": "100"}, total)
            for what, answer in (("declared", declared), ("chunked", chunked), ("lying", lying)):
                assert answer.status == 413, (face.name, what, answer)
                assert face.code(answer) == "request_too_large", (face.name, what)
                assert answer.sent < total, (face.name, what, "the whole body was read")
            assert declared.sent < face.limit + 16 * MIB  # refused before it was read (what the buffers took)
            assert short.status == 400 and face.code(short) == "invalid_json", (face.name, short)
            if face.name == "ui":
                for answer in (declared, chunked, lying, short):
                    assert {k.lower(): v for k, v in SECURITY_HEADERS.items()}.items() <= answer.headers.items()
        grown = node.rss() - before
        assert grown < RSS_SLACK, grown
        assert node.tracebacks() == []


async def test_json_nested_too_deep_or_malformed_is_400_on_every_json_face(tmp_path: Path) -> None:
    """100,000 arrays deep (the issue's probe) is 400 `invalid_json` from each face, as is a
    body that is no JSON at all and one just past JSON_MAX_DEPTH; JSON at the limit passes
    the door. Nothing is logged as a traceback, not even for JSON a2a-sdk cannot parse as
    a request (it would log one for each)."""
    deep = b"[" * DEEP + b"]" * DEEP
    past = json.dumps({"messages": json.loads("[" * JSON_MAX_DEPTH + "]" * JSON_MAX_DEPTH)}).encode()
    at_limit = {**RPC, "params": {"id": "nope", "metadata": json.loads("[" * 60 + "]" * 60)}}
    async with faces(tmp_path) as node:
        async with httpx.AsyncClient(timeout=60) as http:
            for face in node.all():
                # the dashboard takes 64 KiB: its deep body is as deep as fits
                body = deep if len(deep) <= face.limit else b"[" * 30_000 + b"]" * 30_000
                for what, content in (("deep", body), ("past the limit", past), ("not JSON", b'{"model": ')):
                    answer = await http.post(face.url, content=content, headers=face.headers)
                    assert answer.status_code == 400, (face.name, what, answer.text)
                    assert face.code(answer) == "invalid_json", (face.name, what)
                    if face.name == "a2a":
                        assert answer.json()["error"]["code"] == -32700
                    if face.name == "ui":
                        assert {k.lower(): v for k, v in SECURITY_HEADERS.items()}.items() <= answer.headers.items()
            fine = await http.post(node.a2a.url, json=at_limit, headers=node.a2a.headers)
            # JSON, but no request a2a-sdk can parse: its answer says so, and its log no traceback
            sdk = [await http.post(node.a2a.url, json=body, headers={**node.a2a.headers, "A2A-Version": version})
                   for version, body in (("1.0", {"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                                                  "params": {"message": 5}}),
                                         ("1.0", [1, 2]), ("1.0", {"jsonrpc": "2.0", "id": 1}),
                                         ("0.3", {"jsonrpc": "2.0", "id": 1, "method": "message/send",
                                                  "params": {"message": 5}}))]
            nowhere = await http.get(node.a2a.url + "nowhere", headers=node.a2a.headers)
    assert fine.status_code == 200 and fine.json()["error"]["code"] == -32001  # past the door: no such task
    assert [a.json()["error"]["code"] for a in sdk] == [-32602, -32600, -32600, -32600]
    assert nowhere.status_code == 404 and nowhere.json()["error"]["data"]["code"] == "not_found"  # JSON-RPC's shape
    assert node.tracebacks() == []


def test_json_depth_counts_brackets_outside_strings_in_linear_time() -> None:
    """The depth is counted before the body is parsed, on any bytes: a string (escaped
    quotes and all) hides its brackets, and a body built to make a backtracking scan
    quadratic (4 MB of escaped quotes in a string that never ends) is read once."""
    assert json_depth(b"1") == 0 and json_depth(b"[]") == 1 and json_depth(b'{"a": [[], {}]}') == 3
    assert json_depth(b'["[[[[", "\\"[[["]') == 1
    assert json_depth(b'[["unterminated [[[[') == 2
    assert json_depth(b"[" * DEEP + b"]" * DEEP) == DEEP
    hostile = b'"' + b'\\"' * 2_000_000 + b"[["
    started = time.perf_counter()
    assert json_depth(hostile) == 0
    assert time.perf_counter() - started < 5  # about 0.1 s; a quadratic scan would take hours


# --------------------------------------------------------------------------- item 6: no bare 500


async def test_an_unknown_peer_on_the_activity_page_is_a_404_page(tmp_path: Path) -> None:
    """`/activity?peer=unknown` (the issue: a bare 500 without the security headers) is the
    dashboard's error page, 404, with its headers; so is its live region."""
    async with faces(tmp_path) as node:
        base = node.ui.url.removesuffix("/peers/revoke")
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
            page = await http.get(base + "/activity", params={"peer": "unknown"})
            live = await http.get(base + "/events", params={"view": "/activity?peer=unknown"})
            fine = await http.get(base + "/activity")
    for answer in (page, live):
        assert answer.status_code == 404, answer.text
        assert answer.headers["content-type"].startswith("text/html")
        assert {k.lower(): v for k, v in SECURITY_HEADERS.items()}.items() <= answer.headers.items()
        assert "unknown" in answer.text and "<h1>404</h1>" in answer.text
    assert fine.status_code == 200
    assert node.tracebacks() == []


class BrokenModels:
    """A model pool whose registry fails (the OpenAI face's `models` part)."""

    @property
    def registry(self) -> Any:
        raise RuntimeError("the model registry broke")


class BrokenControl:
    """Control handlers that fail (the dashboard's `control` part)."""

    async def call(self, request: Message, on_item: Any = None) -> Message:
        raise RuntimeError("the control handlers broke")


class BreakingTools:
    """The node's tools, until `broken` (the A2A face's `tools` part: its card lists them
    at every request)."""

    def __init__(self, tools: Any) -> None:
        self.tools, self.broken = tools, False

    def __iter__(self) -> Iterator[Tool]:
        if self.broken:
            raise RuntimeError("the tool registry broke")
        return iter(self.tools)


def _failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_a_failing_handler_gets_each_faces_500_logged_once(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A part of the node that fails under each face: OpenAI's `{"error": ...}`, A2A's
    JSON-RPC error, the dashboard's HTML page with its security headers, each 500; each
    failure logged once, with its traceback (no second one from Starlette or the server)."""
    caplog.set_level(logging.INFO)
    key = ApiKey(KEY, "test")
    async with run_nodes(tmp_path, "home") as nodes:
        node: Node = nodes["home"]
        tools = BreakingTools(node.tools)
        openai = OpenAIEndpoint(OpenAIParts(peer_id=node.identity.peer_id, models=BrokenModels(),  # type: ignore[arg-type]
                                            trust=node.trust, submitter=node.submitter, offers=node.offers),
                                OpenAIServe(enabled=True, port=0), key)
        a2a = A2AEndpoint(A2AParts(name="home", profile=node.config.profile, peer_id=node.identity.peer_id,
                                   agents=node.agents, tools=tools),  # type: ignore[arg-type]
                          A2AServe(enabled=True, port=0), key)
        ui = Dashboard(DashboardParts(config=node.config, identity=node.identity, trust=node.trust,
                                      models=node.models, tools=node.tools, agents=node.agents,
                                      messaging=node.messaging, mailbox=node.mailbox, submitter=node.submitter,
                                      control=BrokenControl(), activity=node.activity),  # type: ignore[arg-type]
                       UiServe(enabled=True, port=0), key)
        async with anyio.create_task_group() as tg:
            for face in (openai, a2a, ui):
                await tg.start(face.run)
            tools.broken = True
            assert openai.url and a2a.url and ui.url
            caplog.clear()
            auth = {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(timeout=60, headers=auth) as http:
                answers = {"openai": await http.get(openai.url + "/v1/models"),
                           "a2a": await http.get(a2a.url.rstrip("/") + CARD),
                           "ui": await http.get(ui.url + "/peers")}
                # a failure is logged once its answer is out (Starlette re-raises after it)
                await wait_until(lambda: len(_failures(caplog)) >= 3, "the three failures in the log")
                failures = _failures(caplog)
            tg.cancel_scope.cancel()
    openai_answer, a2a_answer, ui_answer = answers["openai"], answers["a2a"], answers["ui"]
    for answer in answers.values():
        assert answer.status_code == 500, answer.text
    assert openai_answer.json() == {"error": {"message": "the node failed to answer; see its log",
                                              "type": "server_error", "param": None, "code": "internal"}}
    assert a2a_answer.json()["error"]["code"] == -32603 and a2a_answer.json()["error"]["data"]["code"] == "internal"
    assert ui_answer.headers["content-type"].startswith("text/html") and "500 internal" in ui_answer.text
    assert {k.lower(): v for k, v in SECURITY_HEADERS.items()}.items() <= ui_answer.headers.items()
    assert [(r.name, r.getMessage()) for r in failures] == [
        ("psymesh.http", "GET /v1/models failed"), ("psymesh.http", f"GET {CARD} failed"),
        ("psymesh.http", "GET /peers failed")], [(r.name, r.getMessage()) for r in failures]
    assert all(r.exc_info for r in failures)
