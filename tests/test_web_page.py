"""A web page the owner visits, and another local program, against the node's local HTTP
faces: the OpenAI-compatible endpoint and the A2A agent (issue 21; node/bridges/httpguard.py).

A page can make the browser send a "simple" request to 127.0.0.1 with no preflight: a
text/plain (or form) POST carrying an `Origin` of the page's site and a
`Sec-Fetch-Site: cross-site`, but no Authorization or A2A-Version header. With DNS
rebinding (its own name re-pointed at 127.0.0.1) the request carries the page's name in
`Host`, and the page can read the answer. Both faces used to answer all of it with 200
when no key was set (the issue's probe: a completion for a cross-site text/plain POST).

Real components: one in-process daemon with both faces on 127.0.0.1 (port 0), hypercorn
and a2a-sdk's app under uvicorn; the requests are what a browser sends, made by httpx
(which lets a test write Host, Origin and Sec-Fetch-* the way a browser would).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import run_nodes
from psymesh.node.core.bridgeconfig import A2AServe, OpenAIServe, ServeSettings
from psymesh.node.daemon import Node
from psymesh.node.bridges.httpguard import AllowedHosts, split_host

pytestmark = pytest.mark.anyio

PAGE = "http://evil.example"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ban_bytes": True}
RPC = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "nope"}}
CARD = "/.well-known/agent-card.json"


@asynccontextmanager
async def faces(tmp_path: Path, tiny_model: Path) -> AsyncIterator[Node]:
    """`home` with both faces on, no key configured (so each made its own in the home)."""
    serve = ServeSettings(openai=OpenAIServe(enabled=True, port=0), a2a=A2AServe(enabled=True, port=0))
    async with run_nodes(tmp_path, "home", configs={"home": {"serve": serve}}) as nodes:
        node = nodes["home"]
        node.models.registry.add("tiny", tiny_model, n_ctx=4096, n_threads=1)
        yield node


def _urls(node: Node) -> tuple[str, str]:
    assert node.openai is not None and node.openai.url is not None
    assert node.a2a is not None and node.a2a.url is not None
    return node.openai.url, node.a2a.url


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _code(response: httpx.Response) -> str:
    """The refusal's code, from either face's error shape (OpenAI's, or JSON-RPC's)."""
    error = response.json()["error"]
    return error["code"] if isinstance(error["code"], str) else error["data"]["code"]


async def test_a_pages_simple_cross_site_post_reaches_neither_face(tmp_path: Path, tiny_model: Path) -> None:
    """The issue's attack: text/plain, the page's Origin, no key. Refused by the door (403),
    and the same with the key (which a page cannot have anyway), as a form, or with only
    Sec-Fetch-Site telling that it came from another site."""
    async with faces(tmp_path, tiny_model) as node:
        openai_url, a2a_url = _urls(node)
        assert node.openai is not None and node.a2a is not None
        keyed_openai = {"Authorization": f"Bearer {node.openai.key.value}"}
        keyed_a2a = {"Authorization": f"Bearer {node.a2a.key.value}", "A2A-Version": "1.0"}
        page = {"Content-Type": "text/plain", "Origin": PAGE, "Sec-Fetch-Site": "cross-site"}
        form = {"Content-Type": "application/x-www-form-urlencoded", "Origin": PAGE}
        fetch_only = {"Content-Type": "text/plain", "Sec-Fetch-Site": "cross-site"}
        async with httpx.AsyncClient(timeout=60) as http:
            answers = {
                "openai": await http.post(openai_url + "/v1/chat/completions", content=json.dumps(CHAT),
                                          headers=page),
                "openai keyed": await http.post(openai_url + "/v1/chat/completions", content=json.dumps(CHAT),
                                                headers={**page, **keyed_openai}),
                "openai form": await http.post(openai_url + "/v1/chat/completions", content=json.dumps(CHAT),
                                               headers=form),
                "openai fetch-site": await http.post(openai_url + "/v1/chat/completions",
                                                     content=json.dumps(CHAT), headers=fetch_only),
                "a2a": await http.post(a2a_url, content=json.dumps(RPC), headers=page),
                "a2a keyed": await http.post(a2a_url, content=json.dumps(RPC), headers={**page, **keyed_a2a}),
                "a2a form": await http.post(a2a_url, content=json.dumps(RPC), headers=form),
                "a2a card": await http.get(a2a_url.rstrip("/") + CARD, headers={"Origin": PAGE}),
                # What a page's fetch() with JSON would send first: a preflight, which gets no CORS yes.
                "openai preflight": await http.options(openai_url + "/v1/chat/completions", headers={
                    "Origin": PAGE, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization,content-type"}),
                "a2a preflight": await http.options(a2a_url, headers={
                    "Origin": PAGE, "Access-Control-Request-Method": "POST"}),
            }
            # A program that is no browser, with the key, still cannot send a body that is not JSON.
            not_json = {
                "openai": await http.post(openai_url + "/v1/chat/completions", content=json.dumps(CHAT),
                                          headers={**keyed_openai, "Content-Type": "text/plain"}),
                "a2a": await http.post(a2a_url, content=json.dumps(RPC),
                                       headers={**keyed_a2a, "Content-Type": "text/plain"}),
            }
            # And what the owner's own page (same origin) or a script sends passes.
            same_origin = await http.post(openai_url + "/v1/chat/completions", json=CHAT,
                                          headers={**keyed_openai, "Origin": _origin(openai_url),
                                                   "Sec-Fetch-Site": "same-origin"})
            a2a_fine = await http.post(a2a_url, json=RPC, headers=keyed_a2a)

    for what, answer in answers.items():
        assert answer.status_code == 403, (what, answer.text)
        assert _code(answer) == "cross_origin", what
        assert "access-control-allow-origin" not in answer.headers, what
    for what, answer in not_json.items():
        assert answer.status_code == 415 and _code(answer) == "unsupported_media_type", (what, answer.text)
    assert same_origin.status_code == 200 and same_origin.json()["object"] == "chat.completion"
    assert a2a_fine.status_code == 200 and a2a_fine.json()["error"]["code"] == -32001  # past the door: no such task


async def test_a_rebound_name_in_host_is_refused_by_both_faces(tmp_path: Path, tiny_model: Path) -> None:
    """DNS rebinding: the page's own name now points at 127.0.0.1, so the browser sends
    `Host: evil.example` and would let the page read the answer. Refused on every route,
    the public card included, key or not; the node's own names pass."""
    async with faces(tmp_path, tiny_model) as node:
        openai_url, a2a_url = _urls(node)
        assert node.openai is not None and node.a2a is not None
        port_o, port_a = urlsplit(openai_url).port, urlsplit(a2a_url).port
        keyed_openai = {"Authorization": f"Bearer {node.openai.key.value}"}
        keyed_a2a = {"Authorization": f"Bearer {node.a2a.key.value}", "A2A-Version": "1.0"}
        async with httpx.AsyncClient(timeout=60) as http:
            foreign = [
                await http.get(openai_url + "/v1/models", headers={"Host": f"evil.example:{port_o}"}),
                await http.get(openai_url + "/v1/models", headers={**keyed_openai, "Host": f"evil.example:{port_o}"}),
                await http.post(openai_url + "/v1/chat/completions", json=CHAT,
                                headers={**keyed_openai, "Host": "localhost.evil.example"}),
                await http.get(a2a_url.rstrip("/") + CARD, headers={"Host": f"evil.example:{port_a}"}),
                await http.post(a2a_url, json=RPC, headers={**keyed_a2a, "Host": f"evil.example:{port_a}"}),
                await http.post(a2a_url, json=RPC, headers={**keyed_a2a, "Host": "192.168.1.20"}),
            ]
            own = [
                await http.get(openai_url + "/v1/models", headers={**keyed_openai, "Host": f"localhost:{port_o}"}),
                await http.get(openai_url + "/v1/models", headers={**keyed_openai, "Host": f"[::1]:{port_o}"}),
                await http.get(a2a_url.rstrip("/") + CARD, headers={"Host": f"127.0.0.1:{port_a}"}),
            ]
    for answer in foreign:
        assert answer.status_code == 403 and _code(answer) == "host_not_allowed", answer.text
    assert [a.status_code for a in own] == [200, 200, 200]


async def test_a_missing_key_is_refused_by_both_faces_the_card_excepted(tmp_path: Path, tiny_model: Path) -> None:
    """No key was configured, and still every route wants one (the node made it): another
    local user's program, or a page's GET that needs no preflight, gets 401."""
    async with faces(tmp_path, tiny_model) as node:
        openai_url, a2a_url = _urls(node)
        async with httpx.AsyncClient(timeout=60) as http:
            missing = [
                await http.get(openai_url + "/v1/models"),
                await http.get(openai_url + "/v1/models/tiny"),
                await http.post(openai_url + "/v1/chat/completions", json=CHAT),
                await http.post(a2a_url, json=RPC, headers={"A2A-Version": "1.0"}),
                await http.post(a2a_url, json={**RPC, "method": "message/send"}, headers={"A2A-Version": "0.3"}),
            ]
            card = await http.get(a2a_url.rstrip("/") + CARD)
    for answer in missing:
        assert answer.status_code == 401 and _code(answer) == "invalid_api_key", answer.text
        assert answer.headers["www-authenticate"].startswith("Bearer")
    assert card.status_code == 200 and "bearer" in card.json()["securitySchemes"]


async def test_a2a_reads_its_version_header_as_a2a_says(tmp_path: Path, tiny_model: Path) -> None:
    """A2A 1.0 §3.6: no (or an empty) A2A-Version is 0.3, a patch number is ignored, and a
    version the agent does not serve is refused with -32009. A page still cannot send
    any of these: the key needs a preflight (test_a_missing_key_is_refused_by_both_faces_the_card_excepted)."""
    async with faces(tmp_path, tiny_model) as node:
        _, a2a_url = _urls(node)
        assert node.a2a is not None
        auth = {"Authorization": f"Bearer {node.a2a.key.value}"}
        async with httpx.AsyncClient(timeout=60, headers=auth) as http:
            unknown = await http.post(a2a_url, json=RPC, headers={"A2A-Version": "2.0"})
            v10 = await http.post(a2a_url, json=RPC, headers={"A2A-Version": "1.0"})
            v102 = await http.post(a2a_url, json=RPC, headers={"A2A-Version": "1.0.2"})
            v03 = await http.post(a2a_url, json={**RPC, "method": "tasks/get"}, headers={"A2A-Version": "0.3"})
            none = await http.post(a2a_url, json={**RPC, "method": "tasks/get"})
            empty = await http.post(a2a_url, json={**RPC, "method": "tasks/get"}, headers={"A2A-Version": ""})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == -32009, unknown.text
    assert _code(unknown) == "version_not_supported" and "A2A-Version: 0.3 or 1.0" in unknown.json()["error"]["message"]
    for answer in (v10, v102, v03, none, empty):  # past the door: no such task (-32001), in the SDK's words
        assert answer.status_code == 200 and answer.json()["error"]["code"] == -32001, answer.text


def test_the_host_allow_list() -> None:
    """Loopback addresses and localhost always; the configured names and the bind address;
    any IP literal on a bind to all (a rebinding page always sends a name); nothing else."""
    loopback = AllowedHosts.of(["127.0.0.1"])
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "LOCALHOST", "localhost."):
        assert loopback.allows(host), host
    for host in ("evil.example", "localhost.evil.example", "evil.localhost", "192.168.1.20", "0.0.0.0", "",
                 "127.0.0.1.nip.io"):
        assert not loopback.allows(host), host
    lan = AllowedHosts.of(["0.0.0.0", "desk.lan"])
    assert lan.allows("192.168.1.20") and lan.allows("Desk.LAN") and lan.allows("10.0.0.1")
    assert not lan.allows("evil.example")
    one = AllowedHosts.of(["192.168.1.20"])
    assert one.allows("192.168.1.20") and not one.allows("192.168.1.21")
    card_name = AllowedHosts.of(A2AServe(public_url="https://agent.example.org/a2a").host_names())
    assert card_name.allows("agent.example.org") and not card_name.allows("example.org")
    assert AllowedHosts.of(OpenAIServe(allowed_hosts=["pc.home.arpa"]).host_names()).allows("pc.home.arpa")

    assert split_host("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert split_host("[::1]:8080") == ("::1", 8080) and split_host("[::1]") == ("::1", None)
    assert split_host("localhost") == ("localhost", None)
    for bad in ("::1", "", ":80", "[::1", "[::1]x", "host:0", "host:99999", "host:8o"):
        assert split_host(bad) is None, bad
