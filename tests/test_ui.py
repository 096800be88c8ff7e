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
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

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
from waiting import wait_until
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

    def __init__(self, args: tuple[str, ...] = ()) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chromium")
        self._profile = tempfile.mkdtemp(prefix="psymesh-chromium-")
        self._args = args

    async def do(self, fn: Callable[..., T], *args: Any) -> T:
        future = self._thread.submit(fn, *args)
        return await anyio.to_thread.run_sync(future.result)

    def _start(self) -> None:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self._context = self._pw.chromium.launch_persistent_context(
            self._profile, executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *self._args], headless=True,
            viewport={"width": 1000, "height": 760})

    def page(self) -> Any:
        return self._context.new_page()

    def _stop(self) -> None:
        self._context.close()
        self._pw.stop()

    @classmethod
    @asynccontextmanager
    async def running(cls, *args: str) -> AsyncIterator["Browser"]:
        browser = cls(args)
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


def _login(page: Any, node: Node) -> str:
    """Open a one-use login link in `page`; the signed-in dashboard's base URL (its name of
    its own, NAME.localhost: the session lives there, and only there)."""
    assert node.ui is not None
    link = urlsplit(node.ui.mint_login())
    base = f"{link.scheme}://{link.netloc}"
    page.goto(link.geturl())
    page.wait_for_url(base + "/")  # traded the code for the cookie, then on to the overview
    assert link.hostname is not None and link.hostname.endswith(".localhost")
    return base


def _csrf_of(html: str) -> str:
    """The session's CSRF token, as its pages carry it."""
    found = re.search(r'data-csrf="([^"]+)"', html)
    assert found is not None and found[1], "the page carries no CSRF token"
    return found[1]


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
            base = _login(inviter, home)
            _shot(inviter, "overview")
            inviter.goto(base + "/pair")
            inviter.click("#make-invite")
            inviter.wait_for_selector("#invite-waiting")
            inviter.evaluate("window.__stayed = true")  # a reload would lose it: the words must come live
            _shot(inviter, "pair")
            return inviter.inner_text("#invite-code")

        code = await browser.do(invite)

        def join() -> str:
            joiner.goto(_login(joiner, laptop) + "/pair")
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
            page.goto(base + "/peers")
            box = page.locator('#peer-phone input[value="tool:system.info"]')
            box.check() if on else box.uncheck()
            page.click("#peer-phone .save-grant")
            page.wait_for_selector(".flash.ok")

        def shot_peers() -> None:
            _shot(page, "peers")

        base = await browser.do(_login, page, home)
        await browser.do(tick, True)
        await browser.do(shot_peers)
        allowed = await (await phone.delegate("home", tool="system.info")).result()
        assert allowed["profile"] == "home"

        await browser.do(tick, False)
        activity = await browser.do(browser.page)

        def open_activity() -> None:
            activity.goto(base + "/activity?decision=denied")
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
            page.goto(_login(page, phone) + "/agent")
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
            page.goto(_login(page, home) + "/agent")
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

        def look() -> tuple[str, Any, int, str]:
            base = _login(page, phone)
            page.goto(base + "/activity")
            text = page.inner_text(".letter-text")
            return (text, page.evaluate("window.__pwned"),
                    page.locator(".letters b, .letters img, .letters script").count(), base)

        text, pwned, elements, base = await browser.do(look)

        # Another site's page, open in the same browser (signed in), posts the revoke form itself.
        with serving() as evil:
            evil.route("/", f"""<form id=f method=post action="{base}/peers/revoke">
                <input name=peer value="{home.identity.peer_id}"><input name=csrf value=guess></form>
                <script>document.getElementById("f").submit()</script>""")

            def forged() -> str:
                page.goto(evil.url("/", host="localhost"))
                page.wait_for_url(base + "/peers/revoke")
                return page.content()

            answer = await browser.do(forged)
        still_trusted = not phone.trust.get(home.identity.peer_id).revoked

        def models() -> None:
            page.goto(base + "/models")
            _shot(page, "models")
            page.set_viewport_size({"width": 390, "height": 760})
            page.goto(base + "/activity")
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
            page.goto(_login(page, phone) + "/activity")
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


# --------------------------------------------------------------------------------- login and sessions

_SCAN = """import json, os, sys
secrets = json.load(sys.stdin)
hits, read = [], 0
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read()
        except OSError:
            continue
        read += 1
        hits += [[pid, what] for what, value in secrets.items() if value.encode() in line]
try:
    open(sys.argv[1]).read()
    launch = "read"
except OSError as exc:
    launch = type(exc).__name__
print(json.dumps({"uid": os.getuid(), "read": read, "hits": hits, "launch": launch}))
"""

_FAKE_BROWSER = """import json, subprocess, sys
json.dump(sys.argv, open({argv!r}, "w"))
browser = subprocess.Popen([{chromium!r}, *{args!r}, "--user-data-dir=" + {profile!r}, "--remote-debugging-port=0",
                            sys.argv[1]], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
open({pid!r}, "w").write(str(browser.pid))
"""


def _second_uid_missing() -> str | None:
    if os.geteuid() != 0:
        return "reading /proc/*/cmdline as another local user needs root here (to switch to nobody)"
    if shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"):
        return "needs setpriv and /usr/bin/python3 to run a scan as nobody"
    return None


async def _scan_cmdlines(secrets: dict[str, str], launch: Path, *, as_nobody: bool) -> dict[str, Any]:
    """Every process's command line, read as this user or as nobody, searched for `secrets`
    (given on stdin: a command line would show them); and whether the launch file opens."""
    command = ["/usr/bin/python3", "-c", _SCAN, str(launch)]
    if as_nobody:
        command = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", *command]
    done = await anyio.run_process(command, input=json.dumps(secrets).encode(), check=True, cwd="/")
    return json.loads(done.stdout)


@browser_test
@pytest.mark.anyio
async def test_psymesh_ui_opens_a_signed_in_browser_with_no_secret_on_any_command_line(tmp_path: Path) -> None:
    """Item 1: `psymesh ui` ran the browser with the login link on its command line, where
    `ps` shows it to every local user. Now the browser ($BROWSER here: a real Chromium) is
    given the path of a 0600 file in the owner's home, which sends it on to a link that works
    once; nobody, reading every /proc/*/cmdline meanwhile, finds no key, code, name or cookie."""
    async with run_nodes(tmp_path, "home", configs={"home": UI}) as nodes:
        home = nodes["home"]
        assert home.ui is not None and home.ui.url is not None
        profile, argv_file, pid_file = tmp_path / "chromium", tmp_path / "argv.json", tmp_path / "chromium.pid"
        fake = tmp_path / "browser.py"
        fake.write_text(_FAKE_BROWSER.format(argv=str(argv_file), chromium=CHROMIUM, args=CHROMIUM_ARGS,
                                             profile=str(profile), pid=str(pid_file)))
        env = {**os.environ, "BROWSER": f"{sys.executable} {fake} %s"}
        done = await anyio.run_process([sys.executable, "-m", "psymesh", "ui", "--home", str(home.home.path)],
                                       check=False, env=env, cwd=REPO)
        assert done.returncode == 0, done.stderr.decode()
        try:
            await wait_until(lambda: (profile / "DevToolsActivePort").exists(), "Chromium's DevTools port")
            port = int((profile / "DevToolsActivePort").read_text().split()[0])

            def signed_in() -> tuple[str, str, str]:
                from playwright.sync_api import sync_playwright

                with sync_playwright() as pw:
                    browser = pw.chromium.connect_over_cdp(f"http://127.0.0.1:{port}")
                    context = browser.contexts[0]
                    deadline = time.monotonic() + 15
                    while not context.pages and time.monotonic() < deadline:
                        context.wait_for_event("page", timeout=15000)
                    page = context.pages[0]
                    page.wait_for_url(re.compile(r"^http://ui-[0-9a-f]+\.localhost:\d+/$"), timeout=15000)
                    cookie = next(c["value"] for c in context.cookies() if c["name"] == "psymesh_ui")
                    url, text = page.url, page.inner_text("main")
                    browser.close()
                    return url, text, cookie

            url, overview, cookie = await anyio.to_thread.run_sync(signed_in)
            launch = home.home.path / "ui-open.html"
            link = urlsplit(re.search(r'url=([^"]+)"', launch.read_text())[1].replace("&amp;", "&"))  # type: ignore[index]
            secrets = {"ui.key": home.ui.key.value, "code": parse_qs(link.query)["code"][0],
                       "name": (link.hostname or "").removesuffix(".localhost"), "cookie": cookie}
            mine = await _scan_cmdlines(secrets, launch, as_nobody=False)
            skip_nobody = _second_uid_missing()
            nobody = None if skip_nobody else await _scan_cmdlines(secrets, launch, as_nobody=True)
            async with httpx.AsyncClient(base_url=home.ui.url) as web:
                again = await web.get(f"/login?{link.query}", headers={"Host": link.netloc})
        finally:
            if pid_file.exists():
                os.killpg(int(pid_file.read_text()), signal.SIGTERM)  # the Chromium the fake browser started

    argv = json.loads(argv_file.read_text())
    assert argv[1:] == [launch.as_uri()]  # the browser was given a file's path, and nothing else
    assert "signed in" in done.stdout.decode() and "code=" not in done.stdout.decode()
    assert stat.S_IMODE(launch.stat().st_mode) == 0o600
    assert url.startswith(f"http://{link.hostname}:") and "Overview" in overview
    assert again.status_code == 401  # the code inside the file was used up by the browser
    assert mine["read"] > 3 and mine["hits"] == [] and mine["launch"] == "read"
    if skip_nobody is not None:
        pytest.skip(f"the browser's command line holds no secret; the second user's view was not checked: {skip_nobody}")
    assert nobody is not None and nobody["uid"] != 0 and nobody["read"] > 3
    assert nobody["hits"] == [] and nobody["launch"] == "PermissionError"


@browser_test
@pytest.mark.anyio
async def test_a_cookie_sent_to_another_local_server_opens_nothing(tmp_path: Path) -> None:
    """Item 2: browsers send a host's cookies to every port of it, so a server on
    127.0.0.1:19999 received the dashboard's cookie and replayed it. The session now lives at
    a name of its own (NAME.localhost), and the cookie opens it only there: another local
    server, visited by the signed-in browser under every name it can know, gets no cookie of
    the dashboard's, and what it gets, replayed to the dashboard under any name, opens nothing."""
    async with run_nodes(tmp_path, "home", configs={"home": UI}) as nodes, Browser.running() as browser:
        home = nodes["home"]
        assert home.ui is not None and home.ui.url is not None
        page = await browser.do(browser.page)
        with serving() as other:
            other.route("/", "<!doctype html><title>another local server</title><p>hello")

            def visit() -> tuple[str, str, int]:
                base = _login(page, home)
                for host in ("127.0.0.1", "localhost", "ui-guess.localhost"):
                    page.goto(other.url("/", host=host))
                cookie = next(c for c in page.context.cookies() if c["name"] == "psymesh_ui")
                page.goto(base + "/peers")  # the browser itself is still signed in
                return base, cookie["value"], page.locator("h1, h2").count()

            base, cookie, headings = await browser.do(visit)
            heard = list(other.heard)
        name = urlsplit(base).netloc
        port = urlsplit(home.ui.url).port
        hosts = (name, f"127.0.0.1:{port}", f"localhost:{port}")
        async with httpx.AsyncClient(base_url=home.ui.url) as replay:
            replayed = [(await replay.get("/peers", headers={"Host": h, "Cookie": got})).status_code
                        for _, got in heard for h in hosts]
            at_other_names = [(await replay.get("/peers", headers={"Host": h, "Cookie": f"psymesh_ui={cookie}"}))
                              .status_code for h in hosts[1:]]
            own = await replay.get("/peers", headers={"Host": name, "Cookie": f"psymesh_ui={cookie}"})

    assert headings > 0 and len(heard) >= 3
    assert all("psymesh_ui" not in got for _, got in heard), heard  # no cookie of the dashboard's reached it
    assert set(replayed) == {401} and set(at_other_names) == {401}
    assert own.status_code == 200  # the cookie works at its own name: the one the other server never saw


@browser_test
@pytest.mark.anyio
async def test_sign_out_ends_the_session_in_the_daemon_and_its_open_live_page(tmp_path: Path) -> None:
    """Item 3: after `POST /logout` the same cookie still read /peers. Now Sign out ends the
    session in the daemon: the cookie, replayed, opens nothing, and a live page of the session
    that is still streaming stops at the next event."""
    async with run_nodes(tmp_path, "home", configs={"home": UI}) as nodes, Browser.running() as browser:
        home = nodes["home"]
        assert home.ui is not None and home.ui.url is not None
        page = await browser.do(browser.page)

        def sign_in() -> tuple[str, str]:
            base = _login(page, home)
            return base, next(c["value"] for c in page.context.cookies() if c["name"] == "psymesh_ui")

        base, cookie = await browser.do(sign_in)
        named = {"Host": urlsplit(base).netloc, "Cookie": f"psymesh_ui={cookie}"}
        async with httpx.AsyncClient(base_url=home.ui.url, timeout=30) as replay:
            before = await replay.get("/peers", headers=named)
            async with replay.stream("GET", "/events", params={"view": "/activity"}, headers=named) as live:
                lines = live.aiter_lines()
                with anyio.fail_after(10):
                    async for line in lines:
                        if line == "event: region":
                            break

                def sign_out() -> str:
                    page.goto(base + "/activity")
                    page.click("#logout")
                    page.wait_for_url(base + "/login")
                    page.goto(base + "/peers")
                    return page.content()

                after_in_browser = await browser.do(sign_out)
                home.activity.fire()  # something happens: the stream looks, and ends
                with anyio.fail_after(10):
                    rest = [line async for line in lines]
            after = await replay.get("/peers", headers=named)
            stream_again = await replay.get("/events", params={"view": "/activity"}, headers=named)

    assert before.status_code == 200
    assert after.status_code == 401 and stream_again.status_code == 401
    assert "invalid_api_key" in after_in_browser and "psymesh ui" in after_in_browser
    assert "event: region" not in rest  # nothing more reached the signed-out page


@pytest.mark.anyio
async def test_a_new_ui_key_ends_every_session(tmp_path: Path) -> None:
    """A new ui.key (written by the owner; `psymesh ui` reads it) ends every session and the
    old key as a bearer; the new key works."""
    async with run_nodes(tmp_path, "home", configs={"home": UI}) as nodes:
        home = nodes["home"]
        assert home.ui is not None and home.ui.url is not None
        old = home.ui.key.value
        link = urlsplit(home.ui.mint_login())
        named = {"Host": link.netloc}
        async with httpx.AsyncClient(base_url=home.ui.url) as web, Client(home.home.path) as client:
            login = await web.get(f"/login?{link.query}", headers=named)
            cookie = {**named, "Cookie": f"psymesh_ui={login.cookies['psymesh_ui']}"}
            before = await web.get("/peers", headers=cookie)
            key_file = home.home.path / "ui.key"
            key_file.write_text("a-new-key-of-the-owners-0123456789\n")
            same = await client.ui()  # read again: it changed
            after = await web.get("/peers", headers=cookie)
            old_bearer = await web.get("/peers", headers={"Authorization": f"Bearer {old}"})
            new_bearer = await web.get("/peers", headers={"Authorization": "Bearer a-new-key-of-the-owners-0123456789"})

    assert before.status_code == 200 and same.url == home.ui.url
    assert after.status_code == 401 and old_bearer.status_code == 401 and new_bearer.status_code == 200


@browser_test
@pytest.mark.anyio
async def test_another_port_of_the_same_name_is_another_origin_when_host_names_no_port(tmp_path: Path) -> None:
    """Item 10: with a Host that names no port (the dashboard on port 80, or behind a reverse
    proxy) the Origin check took any port of the name. A LAN name (desk.test, which Chromium
    maps to 127.0.0.1 here) is no secure context, so Chromium sends no Sec-Fetch-Site: the
    Origin is the only word on it. A page of another server on desk.test:PORT, in the
    signed-in browser, posts the revoke form with the right CSRF token (worst case): refused
    by the Origin, the peer still trusted."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to serve the dashboard on port 80 (where Host names no port)")
    lan = {"ui": UiServe(enabled=True, port=80, allowed_hosts=["desk.test"])}
    async with run_nodes(tmp_path, "home", "phone", configs={"home": lan}) as nodes, \
            Browser.running("--host-resolver-rules=MAP desk.test 127.0.0.1") as browser:
        home = nodes["home"]
        if home.ui is None or home.ui.url is None:
            pytest.skip("port 80 is in use here")
        await pair(home.home.path, nodes["phone"].home.path, grant="messaging")
        phone_id = nodes["phone"].identity.peer_id
        page = await browser.do(browser.page)
        link = urlsplit(home.ui.mint_login())

        def sign_in_at_the_lan_name() -> str:
            page.goto(f"http://desk.test/login?{link.query}")  # the printed link, its name made the LAN's
            page.wait_for_url("http://desk.test/")
            return _csrf_of(page.content())

        csrf = await browser.do(sign_in_at_the_lan_name)
        with serving() as other:
            other.route("/", f"""<form id=f method=post action="http://desk.test/peers/revoke">
                <input name=peer value="{phone_id}"><input name=csrf value="{csrf}"></form>
                <script>document.getElementById("f").submit()</script>""")

            def forged() -> str:
                page.goto(other.url("/", host="desk.test"))
                page.wait_for_url("http://desk.test/peers/revoke")
                return page.content()

            answer = await browser.do(forged)
        still_trusted = not home.trust.get(phone_id).revoked

    assert "cross_origin" in answer and f"Origin 'http://desk.test:{other.port}'" in answer
    assert still_trusted


# --------------------------------------------------------------------------------- the door


@pytest.mark.anyio
async def test_the_dashboard_refuses_what_a_foreign_page_or_a_stranger_could_send(tmp_path: Path) -> None:
    async with run_nodes(tmp_path, "home", configs={"home": UI}) as nodes:
        ui = nodes["home"].ui
        assert ui is not None
        base = ui.url
        link = urlsplit(ui.mint_login())
        code, named = parse_qs(link.query)["code"][0], {"Host": link.netloc}
        async with httpx.AsyncClient(base_url=base) as anon:
            no_token = await anon.get("/")
            wrong = await anon.get("/login", params={"code": "not-it"}, headers=named)
            by_key = await anon.get("/login", params={"token": ui.key.value}, headers=named)  # the key signs no browser in
            at_shared = await anon.get("/login", params={"code": code})  # 127.0.0.1: every local server's name
            login = await anon.get("/login", params={"code": code}, headers=named)
            again = await anon.get("/login", params={"code": code}, headers=named)
        cookie = {"psymesh_ui": login.cookies["psymesh_ui"]}
        async with httpx.AsyncClient(base_url=base, cookies=cookie, headers=named) as owner:
            page = await owner.get("/activity")
            csrf = _csrf_of(page.text)
            at_ip = await owner.get("/activity", headers={"Host": link.netloc.replace(link.hostname or "", "127.0.0.1")})
            rebound = await owner.get("/activity", headers={"Host": f"evil.example:{base.rsplit(':', 1)[1]}"})
            cross = await owner.post("/pair/invite", data={"grant": "phone", "csrf": csrf},
                                     headers={"Origin": "http://evil.example"})
            no_csrf = await owner.post("/pair/invite", data={"grant": "phone"})
            bad_csrf = await owner.post("/pair/invite", data={"grant": "phone", "csrf": "guess"})
            json_no_csrf = await owner.post("/pair/invite", json={"grant": "phone"})
            text_plain = await owner.post("/pair/invite", content=b"grant=phone",
                                          headers={"Content-Type": "text/plain"})
            good = await owner.post("/pair/invite", data={"grant": "phone", "csrf": csrf})

    assert no_token.status_code == 401 and "psymesh ui" in no_token.text
    for refused in (wrong, at_shared, again):
        assert refused.status_code == 401 and "psymesh_ui" not in refused.cookies
    assert "psymesh_ui" not in by_key.cookies and "psymesh ui" in by_key.text  # the sign-in page, and no more
    assert "NAME.localhost" in at_shared.text and "used already" in again.text
    assert login.status_code == 200 and login.cookies["psymesh_ui"] != ui.key.value  # never the token itself
    assert '<meta http-equiv="refresh" content="0;url=/">' in login.text  # on to the overview, same-site
    set_cookie = login.headers["set-cookie"].lower()
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie and "domain" not in set_cookie
    assert page.status_code == 200
    assert at_ip.status_code == 401  # the cookie opens its session at its own name only
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
            link = urlsplit(where["login_url"])  # NAME.localhost: a browser (or curl) finds it at 127.0.0.1
            named = {"Host": link.netloc}
            login = await web.get(f"{where['url']}/login?{link.query}", headers=named)
            page = await web.get(where["url"] + "/", headers=named)
            again = await web.get(f"{where['url']}/login?{link.query}", headers=named)
    finally:
        await daemon.stop()
    assert where["url"].startswith("http://127.0.0.1:") and link.hostname and link.hostname.endswith(".localhost")
    assert login.status_code == 200 and again.status_code == 401  # the link works once
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
