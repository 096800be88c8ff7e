"""The dashboard (node/control/dashboard.py) as its owner uses it: a real headless Chromium (Debian's
`chromium`, driven by Playwright for Python; never a downloaded browser) against real
daemons on 127.0.0.1. What a person relies on: pairing through the Pair page by code shows
the same words on both devices; ticking a capability lets the peer's next request through
and unticking it refuses the next one, the refusal appearing in the open Activity page
without a reload; an irreversible tool call of a delegated agent task is approved in the
page and the task completes; a letter with <script> in it is shown as text; and the page
refuses a request without the token, with a foreign Host header, from another origin, or a
form without its CSRF token. The tests take the screenshots docs/ui.md shows (docs/ui/).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import pytest

from conftest import pair, run_nodes
from psymesh.node.core.bridgeconfig import UiServe
from psymesh.node.control.client import Client
from psymesh.node.daemon import Node
from psymesh.node.core.home import NodeHome
from psymesh.node.control.process import DaemonProcess
from psymesh.protocol.errors import ErrorCode, RemoteError
from websites import serving
from test_agent_node import SEND, _grant_notes, _scripted_home  # home's irreversible notes.send, scripted

REPO = Path(__file__).resolve().parent.parent
SHOTS = REPO / "docs" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
UI = {"ui": UiServe(enabled=True, port=0)}
T = TypeVar("T")


def _browser_missing() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"no {CHROMIUM}: the dashboard's browser tests need Debian's chromium (scripts/bootstrap.sh " \
               "installs it when run as root: apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install -e '.[dev]')"
    return None


browser_test = pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")


class Browser:
    """A headless Chromium driven from one thread of its own (Playwright's sync API belongs
    to the thread that started it), so the daemons keep running on trio meanwhile."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chromium")
        self._profile = tempfile.mkdtemp(prefix="psymesh-chromium-")

    async def do(self, fn: Callable[..., T], *args: Any) -> T:
        future = self._thread.submit(fn, *args)
        return await anyio.to_thread.run_sync(future.result)

    def _start(self) -> None:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self._context = self._pw.chromium.launch_persistent_context(
            self._profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1000, "height": 760})

    def page(self) -> Any:
        return self._context.new_page()

    def _stop(self) -> None:
        self._context.close()
        self._pw.stop()

    @classmethod
    @asynccontextmanager
    async def running(cls) -> AsyncIterator["Browser"]:
        browser = cls()
        await browser.do(browser._start)
        try:
            yield browser
        finally:
            with anyio.CancelScope(shield=True):
                await browser.do(browser._stop)
            browser._thread.shutdown()
            shutil.rmtree(browser._profile, ignore_errors=True)


def _shot(page: Any, name: str) -> None:
    """docs/ui/NAME.png: taken when it is missing, or every time with PSYMESH_UI_SHOTS=1 (so a
    test run does not leave a checkout with changed pictures); always taken, to a temp file
    otherwise, so the page is rendered and captured either way."""
    target = SHOTS / f"{name}.png"
    if target.exists() and os.environ.get("PSYMESH_UI_SHOTS") != "1":
        target = Path(tempfile.gettempdir()) / f"psymesh-ui-{name}.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target), full_page=True)


def _login(page: Any, node: Node) -> None:
    assert node.ui is not None
    page.goto(node.ui.login_url())
    assert page.url.rstrip("/") == node.ui.url  # traded the token for the cookie, then home


def _address(node: Node) -> str:
    return f"{node.p2p.addrs()[0]}/p2p/{node.identity.peer_id}" if "/p2p/" not in node.p2p.addrs()[0] \
        else node.p2p.addrs()[0]


# --------------------------------------------------------------------------------- pairing


@browser_test
@pytest.mark.anyio
async def test_pair_by_code_through_the_pair_page_shows_the_same_words_on_both(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "laptop", configs={"home": UI, "laptop": UI}) as nodes, \
            Browser.running() as browser:
        home, laptop = nodes["home"], nodes["laptop"]
        inviter, joiner = await browser.do(browser.page), await browser.do(browser.page)

        def invite() -> str:
            _login(inviter, home)
            _shot(inviter, "overview")
            inviter.goto(home.ui.url + "/pair")
            inviter.click("#make-invite")
            inviter.wait_for_selector("#invite-waiting")
            inviter.evaluate("window.__stayed = true")  # a reload would lose it: the words must come live
            _shot(inviter, "pair")
            return inviter.inner_text("#invite-code")

        code = await browser.do(invite)

        def join() -> str:
            _login(joiner, laptop)
            joiner.goto(laptop.ui.url + "/pair")
            joiner.fill("#join-invite", code)
            joiner.fill("#join-address", _address(home))
            joiner.click("#join")
            return joiner.inner_text("#joined-words")

        joined_words = await browser.do(join)

        def inviter_words() -> tuple[str, bool]:
            words = inviter.wait_for_selector("#invite-words", timeout=5000).inner_text()
            _shot(inviter, "pair-done")
            return words, inviter.evaluate("window.__stayed === true")

        words, stayed = await browser.do(inviter_words)
        paired = [p.name for p in home.trust.list()], [p.name for p in laptop.trust.list()]

    assert len(joined_words.split()) == 4 and words == joined_words
    assert stayed  # the words came to the open page over the live stream
    assert paired == (["laptop"], ["home"])


# --------------------------------------------------------------------------------- grants


@browser_test
@pytest.mark.anyio
async def test_a_ticked_capability_lets_the_next_request_in_and_an_unticked_one_is_refused_live(
        tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}, configs={"home": UI}) as nodes, \
            Browser.running() as browser, Client(nodes["phone"].home.path) as phone:
        home = nodes["home"]
        await pair(home.home.path, nodes["phone"].home.path, grant="messaging")
        page = await browser.do(browser.page)

        def tick(on: bool) -> None:
            page.goto(home.ui.url + "/peers")
            box = page.locator('#peer-phone input[value="tool:system.info"]')
            box.check() if on else box.uncheck()
            page.click("#peer-phone .save-grant")
            page.wait_for_selector(".flash.ok")

        def shot_peers() -> None:
            _shot(page, "peers")

        await browser.do(_login, page, home)
        await browser.do(tick, True)
        await browser.do(shot_peers)
        allowed = await (await phone.delegate("home", tool="system.info")).result()
        assert allowed["profile"] == "home"

        await browser.do(tick, False)
        activity = await browser.do(browser.page)

        def open_activity() -> None:
            activity.goto(home.ui.url + "/activity?decision=denied")
            activity.evaluate("window.__stayed = true")

        await browser.do(open_activity)
        started = time.perf_counter()
        with pytest.raises(RemoteError) as refused:
            await (await phone.delegate("home", tool="system.info")).result()

        def refusal_row() -> tuple[str, bool]:
            row = activity.wait_for_selector('#audit tr.denied:has-text("tool:system.info")', timeout=5000)
            _shot(activity, "activity")
            return row.inner_text(), activity.evaluate("window.__stayed === true")

        row, stayed = await browser.do(refusal_row)
        shown_after_s = time.perf_counter() - started

    assert refused.value.code is ErrorCode.FORBIDDEN
    assert "phone" in row and stayed  # the row came over the live stream, not by a reload
    assert shown_after_s < 5


# --------------------------------------------------------------------------------- approvals


@browser_test
@pytest.mark.anyio
async def test_an_irreversible_call_of_a_delegated_agent_task_is_approved_in_the_page(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}) as nodes, \
            Browser.running() as browser:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone")
        notes = _scripted_home(home, monkeypatch, tiny_model, [SEND, "Sent."])
        await _grant_notes(home)
        assert phone.ui is None  # a phone runs no dashboard until asked: `psymesh ui`
        async with Client(phone.home.path) as p:
            where = await p.ui()
        assert phone.ui is not None and where.url == phone.ui.url
        page = await browser.do(browser.page)

        def run_and_approve() -> tuple[str, str]:
            _login(page, phone)
            page.goto(phone.ui.url + "/agent")
            _shot(page, "agent")
            page.fill("textarea[name=goal]", "Tell the family I am home by 6.")
            page.click("#run-agent")
            page.wait_for_selector("#approve", timeout=15000)
            question = page.inner_text("#ask")
            _shot(page, "task-approve")
            assert notes.sent == []  # nothing happens before the yes
            page.click("#approve")
            page.wait_for_selector('#task-state:has-text("completed")', timeout=15000)
            _shot(page, "task-done")
            return question, page.inner_text("#result")

        question, result = await browser.do(run_and_approve)

    assert "notes.send" in question and "home by 6" in question
    assert notes.sent == ["home by 6"]
    assert '"Sent."' in result


@browser_test
@pytest.mark.anyio
async def test_the_home_agent_runs_here_and_its_irreversible_call_waits_for_a_yes_in_the_page(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with run_nodes(tmp_path, "home", configs={"home": UI}) as nodes, Browser.running() as browser:
        home = nodes["home"]
        notes = _scripted_home(home, monkeypatch, tiny_model, [SEND, "Sent."])
        page = await browser.do(browser.page)

        def run_and_approve_here() -> tuple[str, str, list[str]]:
            _login(page, home)
            page.goto(home.ui.url + "/agent")
            page.fill("textarea[name=goal]", "Tell the family I am home by 6.")
            page.click("#run-agent")  # a home PC runs its agent here (the delegation policy)
            page.wait_for_selector("#approve", timeout=15000)
            where, before = page.url, list(notes.sent)
            page.click("#approve")
            page.wait_for_selector('#task-state:has-text("completed")', timeout=15000)
            _shot(page, "run-done")
            return where, page.inner_text("#result"), before

        where, result, before = await browser.do(run_and_approve_here)

    assert "/runs/" in where and before == []
    assert notes.sent == ["home by 6"] and '"Sent."' in result


# --------------------------------------------------------------------------------- untrusted text


@browser_test
@pytest.mark.anyio
async def test_a_letter_with_a_script_is_shown_as_text_and_another_site_cannot_post_a_form(tmp_path: Path) -> None:
    evil_text = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b>bold</b>'
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}, configs={"phone": UI}) as nodes, \
            Browser.running() as browser:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone", grant_back="messaging")
        async with Client(home.home.path) as h:
            sent = await h.send("phone", evil_text, thread="family")
            await h.letter(sent.id, wait=True)
        page = await browser.do(browser.page)

        def look() -> tuple[str, Any, int]:
            _login(page, phone)
            page.goto(phone.ui.url + "/activity")
            text = page.inner_text(".letter-text")
            return text, page.evaluate("window.__pwned"), page.locator(".letters b, .letters img, .letters script").count()

        text, pwned, elements = await browser.do(look)

        # Another site's page, open in the same browser (signed in), posts the revoke form itself.
        with serving() as evil:
            evil.route("/", f"""<form id=f method=post action="{phone.ui.url}/peers/revoke">
                <input name=peer value="{home.identity.peer_id}"><input name=csrf value=guess></form>
                <script>document.getElementById("f").submit()</script>""")

            def forged() -> str:
                page.goto(evil.url("/", host="localhost"))
                page.wait_for_url(phone.ui.url + "/peers/revoke")
                return page.content()

            answer = await browser.do(forged)
        still_trusted = not phone.trust.get(home.identity.peer_id).revoked

        def models() -> None:
            page.goto(phone.ui.url + "/models")
            _shot(page, "models")
            page.set_viewport_size({"width": 390, "height": 760})
            page.goto(phone.ui.url + "/activity")
            _shot(page, "phone-activity")

        await browser.do(models)

    assert text == evil_text and pwned is None and elements == 0
    assert "cross_origin" in answer and still_trusted


@browser_test
@pytest.mark.anyio
async def test_a_letter_with_line_breaks_comes_live_and_the_activity_page_keeps_every_row(tmp_path: Path) -> None:
    """The live stream frames each re-render as one server-sent event: a CR, a CRLF or an LF in
    a letter neither ends the event early (the page cut after the letter) nor starts a field."""
    breaking = "one\rtwo\r\nthree\nfour\r\rfive </script><b>six</b>"
    async with run_nodes(tmp_path, "home", "phone", profiles={"phone": "phone"}, configs={"phone": UI}) as nodes, \
            Browser.running() as browser:
        home, phone = nodes["home"], nodes["phone"]
        await pair(home.home.path, phone.home.path, grant="phone", grant_back="messaging")
        page = await browser.do(browser.page)

        def open_activity() -> None:
            _login(page, phone)
            page.goto(phone.ui.url + "/activity")
            page.wait_for_selector("#audit")
            page.evaluate("window.__stayed = true")  # a reload would lose it: the letters must come live

        await browser.do(open_activity)

        def shown(letters: int) -> dict[str, Any]:
            page.locator("#live .letters .letter-text").nth(letters - 1).wait_for(timeout=10000)
            return {"letters": page.eval_on_selector_all(".letters .letter-text", "els => els.map(e => e.textContent)"),
                    "headings": page.eval_on_selector_all("#live h2, #live h3", "els => els.map(e => e.textContent)"),
                    "audit": page.eval_on_selector_all("#audit tbody tr", "rows => rows.map(r => r.textContent)"),
                    "elements": page.locator(".letters b, .letters script").count(),
                    "stayed": page.evaluate("window.__stayed === true")}

        async with Client(home.home.path) as h:
            sent = await h.send("phone", breaking, thread="family")
            await h.letter(sent.id, wait=True)
            first = await browser.do(shown, 1)
            after = await h.send("phone", "and after it", thread="family")  # the stream goes on
            await h.letter(after.id, wait=True)
            second = await browser.do(shown, 2)

    as_lines = "one\ntwo\nthree\nfour\n\nfive </script><b>six</b>"  # every line ending is a line feed in HTML
    assert first["letters"] == [as_lines] and second["letters"] == [as_lines, "and after it"]
    for seen in (first, second):
        assert seen["headings"] == ["Audit log", "Tasks", "Delegated from here", "Run here for peers", "Letters",
                                    "home / family", "Sent", "Held here as a mailbox"]
        assert any("home" in row and "msg.send" in row for row in seen["audit"])
        assert seen["elements"] == 0 and seen["stayed"]


# --------------------------------------------------------------------------------- the door


@pytest.mark.anyio
async def test_the_dashboard_refuses_what_a_foreign_page_or_a_stranger_could_send(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", configs={"home": UI}) as nodes:
        ui = nodes["home"].ui
        assert ui is not None
        base = ui.url
        async with httpx.AsyncClient(base_url=base) as anon:
            no_token = await anon.get("/")
            wrong = await anon.get("/login", params={"token": "not-it"})
            login = await anon.get("/login", params={"token": ui.key.value})
        cookie = {"psymesh_ui": login.cookies["psymesh_ui"]}
        async with httpx.AsyncClient(base_url=base, cookies=cookie) as owner:
            page = await owner.get("/activity")
            rebound = await owner.get("/activity", headers={"Host": f"evil.example:{base.rsplit(':', 1)[1]}"})
            cross = await owner.post("/pair/invite", data={"grant": "phone", "csrf": ui.session.csrf},
                                     headers={"Origin": "http://evil.example"})
            no_csrf = await owner.post("/pair/invite", data={"grant": "phone"})
            bad_csrf = await owner.post("/pair/invite", data={"grant": "phone", "csrf": "guess"})
            json_no_csrf = await owner.post("/pair/invite", json={"grant": "phone"})
            text_plain = await owner.post("/pair/invite", content=b"grant=phone",
                                          headers={"Content-Type": "text/plain"})
            good = await owner.post("/pair/invite", data={"grant": "phone", "csrf": ui.session.csrf})

    assert no_token.status_code == 401 and "psymesh ui" in no_token.text
    assert wrong.status_code == 401 and "psymesh_ui" not in wrong.cookies
    assert login.status_code == 303 and login.cookies["psymesh_ui"] != ui.key.value  # never the token itself
    set_cookie = login.headers["set-cookie"].lower()
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert rebound.status_code == 403 and "host_not_allowed" in rebound.text
    assert cross.status_code == 403 and "cross_origin" in cross.text
    for refused in (no_csrf, bad_csrf, json_no_csrf):
        assert refused.status_code == 403 and "csrf_token_invalid" in refused.text
    assert text_plain.status_code == 415
    assert good.status_code == 303 and good.headers["location"].startswith("/pair?invite=")


# --------------------------------------------------------------------------------- psymesh ui


@pytest.mark.anyio
async def test_psymesh_ui_starts_the_dashboard_of_a_phone_on_demand(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "phone")
    home.init(profile="phone", name="phone")
    home.save_config(home.load_config().model_copy(update={"ui": UiServe(port=0)}))
    daemon = DaemonProcess(home.path, profile="phone", name="phone")
    await daemon.start()
    try:
        async with httpx.AsyncClient() as web:
            done = await anyio.run_process([sys.executable, "-m", "psymesh", "ui", "--no-open", "--json",
                                            "--home", str(home.path)], check=False, cwd=REPO)
            assert done.returncode == 0, done.stderr.decode()
            import json

            where = json.loads(done.stdout)
            page = await web.get(where["login_url"], follow_redirects=True)
    finally:
        await daemon.stop()
    assert where["url"].startswith("http://127.0.0.1:")
    assert page.status_code == 200 and "Overview" in page.text and "phone" in page.text
    # a phone's overview says what its device tools act on (here nothing real is on PATH for messages)
    assert "Device tools" in page.text and "<code>messages.send</code> <span class=\"tag\">simulated</span>" in page.text


@pytest.mark.anyio
async def test_an_event_while_a_page_renders_is_not_lost() -> None:
    """A live region notes the pulse's count, renders (awaiting control handlers), then waits
    for a fire after that count: one that came during the render wakes it at once."""
    from psymesh.node.core.notify import Pulse

    pulse = Pulse()
    seen = pulse.count
    pulse.fire()  # during the render
    with anyio.fail_after(1):
        await pulse.wait(after=seen)
    woke: list[int] = []
    seen = pulse.count
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            async def waiter() -> None:
                await pulse.wait(after=seen)
                woke.append(pulse.count)

            tg.start_soon(waiter)
            pulse.fire()
    assert woke == [2]


@pytest.mark.anyio
async def test_ui_port_serves_the_dashboard_elsewhere_when_its_port_is_taken(tmp_path: Path) -> None:
    """Two nodes on one machine (the README's tour) cannot both have 127.0.0.1:8765: the second's
    `psymesh ui` says how to choose another port, and `psymesh ui --port 0` starts it on a free one,
    without editing config.toml or restarting the daemon."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        async with run_nodes(tmp_path, "phone", profiles={"phone": "phone"},
                             configs={"phone": {"ui": UiServe(port=port)}}) as nodes:
            async with Client(nodes["phone"].home.path) as phone:
                with pytest.raises(RemoteError) as refused:
                    await phone.ui()
                assert refused.value.code is ErrorCode.UNAVAILABLE
                assert f"127.0.0.1:{port}" in refused.value.message  # and the command for this node's home:
                assert f"psymesh ui --home {nodes['phone'].home.path} --port N" in refused.value.message
            done = await anyio.run_process([sys.executable, "-m", "psymesh", "ui", "--no-open", "--port", "0",
                                            "--json", "--home", str(nodes["phone"].home.path)], check=False)
            assert done.returncode == 0, done.stderr.decode()
            url = json.loads(done.stdout)["url"]
            assert url.startswith("http://127.0.0.1:") and f":{port}/" not in url
            async with httpx.AsyncClient() as http:
                assert (await http.get(url)).status_code in (200, 302, 303, 401)
    finally:
        taken.close()
