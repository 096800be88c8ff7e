"""The dashboard: the node in a browser, served by the daemon itself (docs/ui.md).

    GET  /login?code=C        trades the one-use code of the link `psymesh ui` opens for a session
    POST /logout              ends the session
    GET  /                    overview: identity, reachability, doctor's findings, peers
    GET  /pair                invite (QR as SVG, code, string, expiry), join by code, LAN
    GET  /peers               each peer's grant as boxes to tick; revoke; what it grants us
    GET  /activity            the audit log (filters: peer, decision, capability), tasks, letters
    GET  /tasks/{id}          a delegated task's events; approve / deny when it asks; cancel
    GET  /agent               a goal for the node's agent (delegated per policy)
    GET  /models              loaded models (`model ps`), keep-alive, add from a path
    GET  /events?view=PATH    server-sent events: PATH's live region, re-rendered when
                              anything happens (a task event, a letter, an audit row)
    POST ...                  forms, each with the CSRF token

Every request passes node/bridges/httpguard.py first (Host allow-list against DNS rebinding, no
cross-site Origin, the token or the HttpOnly SameSite=Strict cookie of a live session made at
this Host name, the session's CSRF token on every request with a body). Logins and sessions are
node/control/uisessions.py's policy: a login link works once, within a minute, at a name of its
own (NAME.localhost), so the cookie it sets reaches no other local server. What the pages do,
they do through the owner's control handlers (node/control/owner.py, `ControlServer.call`): a
grant, an approval (`task.input`), a letter are the very requests the CLI sends. Pages are jinja2 with autoescape on: letters,
task results, page text and peer names came from peers or the web and are shown as text.
The Content-Security-Policy allows only this daemon's own script and style (no inline
code), no frames, no form posts elsewhere; nothing is loaded from the internet.

One job, one file (about 700 lines): the routes above are the one face's pages, and each is a
few lines of reading what it shows (DashboardParts) and rendering its template; split by page,
each file would repeat the session, CSRF and render plumbing that sits here once.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlencode, urlsplit

import anyio
import anyio.abc
import jinja2
import segno
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from sse_starlette.event import ServerSentEvent

from ..core.commands import Commands
from ...agent.acting.loop import AgentEvent
from ...agent.acting.policy import DelegationInputs, decide
from ..models.agents import task_event
from ..bridges.apikey import ApiKey
from ..core.bridgeconfig import UiServe
from ..tasks.ids import new_task_id
from ..bridges.httpguard import AllowedHosts, Check, GuardRules, HttpGuard, Refusal, SessionRules, http_status
from .uisessions import Refused, Session, Sessions, shared_name
from ..bridges.httpserve import serve_face
from ...protocol import control as c
from ...protocol.common import Error
from ...protocol.errors import ErrorCode, PsymeshError, RemoteError, raised
from ...protocol.manifest import PRESETS, explain_capability
from ...protocol.common import expect
from ...protocol.messages import Message
from ...protocol.tasks import EventKind, Outcome, TaskKind, TaskSpec, TaskState

if TYPE_CHECKING:
    from ...agent.acting.tools import ToolRegistry
    from ..core.home import Identity, NodeConfig
    from ..core.notify import Pulse
    from ..door.trust import TrustStore
    from ..messaging.mailbox import Mailbox
    from ..messaging.service import Messaging
    from ..models import ModelPool
    from ..models.agents import AgentTaskRunner
    from ..tasks.submitter import TaskSubmitter
    from .server import ControlServer

log = logging.getLogger("psymesh.ui")

R = TypeVar("R", bound=Message)
COOKIE = "psymesh_ui"
HERE = Path(__file__).resolve().parent / "ui"
# same-origin, not no-referrer: under no-referrer Chromium sends `Origin: null` with a form's
# POST, which the door (rightly) refuses as cross-origin.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "same-origin", "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
MAX_RUNS = 20             # local agent runs kept for their pages (finished ones go first)
AUDIT_ROWS = 100          # rows the activity page shows
DOCTOR_FRESH_S = 30.0     # the overview's doctor findings are re-probed after this
DOCTOR_TIMEOUT_S = 5.0
LETTERS = 200             # the newest letters it shows, by thread
LIVE_MIN_INTERVAL_S = 0.05  # at most 20 re-renders a second per open page, however busy the node
LIVE_KEEPALIVE_S = 15.0   # a comment line this often, so a dead browser is noticed
PAGES = (("/", "Overview"), ("/pair", "Pair"), ("/peers", "Peers"), ("/activity", "Activity"),
         ("/agent", "Agent"), ("/models", "Models"))


def _when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _refused(refusal: Refusal) -> Response:
    """A request the door refused: a short page (the check is its code), no app involved;
    without the token, a way to give it."""
    body = (f"<!doctype html><meta charset=utf-8><title>refused</title><h1>{refusal.status} {refusal.check.value}</h1>"
            f"<p>{jinja2.utils.markupsafe.escape(refusal.message)}</p>")
    if refusal.check is Check.KEY:
        body += "<p>To sign in, run <code>psymesh ui</code> on this machine: it opens a signed-in page.</p>"
    return HTMLResponse(body, status_code=refusal.status, headers={**SECURITY_HEADERS, **refusal.headers})


@dataclass
class PairRun:
    """An invite made on the Pair page, and what became of it (the verification words)."""

    invite: c.PairInviteReply
    qr_svg: str
    outcome: c.PairedReply | None = None
    error: str | None = None


@dataclass(frozen=True)
class Shown:
    """One event as a task page shows it (a delegated task's, or a local run's)."""

    kind: EventKind
    state: TaskState | None
    data: dict[str, Any]


@dataclass
class LocalRun:
    """A run of this node's own agent started on the Agent page."""

    id: str
    goal: str
    state: TaskState = TaskState.WORKING
    events: list[Shown] = field(default_factory=list)
    asking: dict[str, Any] | None = None    # the question while it waits for a yes
    answered: anyio.Event | None = None     # set by Approve / Deny
    approved: bool = False
    outcome: Outcome | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


@dataclass
class Flash:
    """The one-line result of the last form, shown on the page it returns to."""

    text: str
    ok: bool = True


@dataclass
class _State:
    pair_runs: dict[str, PairRun] = field(default_factory=dict)   # invite code -> its run
    joined: c.PairedReply | None = None


@dataclass(frozen=True)
class DashboardParts:
    """What the dashboard uses of its node (wired in node/daemon.py): what it shows (the
    config, identity, peers, models, tools, letters, mail, delegated tasks), the control
    handlers its forms call, the pulse that re-renders open pages and the agent it runs."""

    config: NodeConfig
    identity: Identity
    trust: TrustStore
    models: ModelPool
    tools: ToolRegistry
    agents: AgentTaskRunner
    messaging: Messaging
    mailbox: Mailbox
    submitter: TaskSubmitter
    control: ControlServer
    activity: Pulse
    commands: Commands = Commands()  # how its log spells `psymesh ui` for this node


class Dashboard:
    """The dashboard of one node; `run` serves it in the node's task group."""

    def __init__(self, node: DashboardParts, settings: UiServe, key: ApiKey, *, now: Callable[[], float] = time.time,
                 reload_key: Callable[[], ApiKey] | None = None) -> None:
        self.node = node
        self.settings = settings
        self.key = key
        self.now = now
        self.reload_key = reload_key  # ui.key as it is now: read at each `psymesh ui`
        self.url: str | None = None  # http://HOST:PORT once listening
        self.sessions = Sessions()
        self.state = _State()
        self._doctor: tuple[float, c.DoctorReply] | None = None  # (when, findings)
        self.runs: dict[str, LocalRun] = {}  # runs of this node's own agent, newest last
        self._tg: anyio.abc.TaskGroup | None = None
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE), autoescape=True,
                                      undefined=jinja2.StrictUndefined)
        self.env.filters["when"] = _when
        self.env.filters["explain"] = explain_capability
        routes = Starlette(
            routes=[Route("/login", self._login, methods=["GET"]),
                    Route("/logout", self._logout, methods=["POST"]),
                    Route("/static/{name}", self._static, methods=["GET"]),
                    Route("/events", self._events, methods=["GET"]),
                    Route("/", self._page("overview"), methods=["GET"]),
                    Route("/pair", self._page("pair"), methods=["GET"]),
                    Route("/pair/invite", self._pair_invite, methods=["POST"]),
                    Route("/pair/join", self._pair_join, methods=["POST"]),
                    Route("/peers", self._page("peers"), methods=["GET"]),
                    Route("/peers/grant", self._grant, methods=["POST"]),
                    Route("/peers/revoke", self._revoke, methods=["POST"]),
                    Route("/activity", self._page("activity"), methods=["GET"]),
                    Route("/letters/send", self._send_letter, methods=["POST"]),
                    Route("/tasks/{task_id}", self._page("task"), methods=["GET"]),
                    Route("/tasks/{task_id}/input", self._task_input, methods=["POST"]),
                    Route("/tasks/{task_id}/cancel", self._task_cancel, methods=["POST"]),
                    Route("/runs/{run_id}", self._page("run"), methods=["GET"]),
                    Route("/runs/{run_id}/input", self._run_input, methods=["POST"]),
                    Route("/runs/{run_id}/cancel", self._run_cancel, methods=["POST"]),
                    Route("/agent", self._page("agent"), methods=["GET"]),
                    Route("/agent", self._agent_submit, methods=["POST"]),
                    Route("/models", self._page("models"), methods=["GET"]),
                    Route("/models/add", self._model_add, methods=["POST"])],
            exception_handlers={HTTPException: self._http_error, PsymeshError: self._failed})
        # every NAME.localhost: a login's own name (uisessions.py), which browsers resolve to
        # loopback themselves, never by DNS, so no page can re-point it (nor read its cookie)
        self.rules = GuardRules(key=key.value, hosts=AllowedHosts.of([*settings.host_names(), "*.localhost"]),
                                public=frozenset({"/login"}), links=frozenset({"/login"}),
                                session=SessionRules(cookie=COOKIE, find=self._session_csrf),
                                max_body=settings.max_body_bytes)
        self.app = HttpGuard(routes, self.rules, _refused)

    def mint_login(self) -> str:
        """A link that signs a browser in once, within a minute (`psymesh ui`): at a name of
        its own, NAME.localhost, when the dashboard listens on loopback; else at its host.
        ui.key is read again first: a new key ends every session."""
        assert self.url is not None
        if self.reload_key is not None:
            key = self.reload_key()
            if key.value != self.key.value:
                self.rekey(key)
        login = self.sessions.mint(now=self.now())
        host = login.name if shared_name(self.settings.host) or self.settings.host in ("0.0.0.0", "::") \
            else self.settings.host
        return f"http://{host}:{urlsplit(self.url).port}/login?{urlencode({'code': login.code})}"

    def rekey(self, key: ApiKey) -> None:
        """A new ui.key: it is the bearer key from now on, and every session is over."""
        self.key = key
        self.sessions.end_all()
        self.rules = dataclasses.replace(self.rules, key=key.value)
        self.app.rules = self.rules
        log.info("the dashboard's key changed (%s): every session ended", key.source)

    def _session_csrf(self, sid: str, host: str) -> str | None:
        """The guard's lookup: the CSRF token of the live session this cookie opens at `host`."""
        session = self.sessions.find(sid, host, now=self.now())
        return None if session is None else session.csrf

    def _session(self, request: Request) -> Session | None:
        """The session that admitted this request (None: the bearer key did)."""
        sid = request.scope.get("psymesh.session")
        return None if sid is None else self.sessions.find(sid, request.headers.get("host", ""), now=self.now())

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        failure: PsymeshError | None = None
        async with anyio.create_task_group() as tg:
            self._tg = tg  # where an invite made on the Pair page waits for its joiner
            try:
                await tg.start(functools.partial(
                    serve_face, self.app, self.settings.host, self.settings.port, what="the dashboard",
                    port_hint=f"{self.node.commands('ui', '--port N')}, or [ui] port in config.toml and a restart",
                    errorlog="psymesh.ui.http", on_listening=self._listening))
            except PsymeshError as exc:  # a port in use: raised out of the group, for start_ui to tell
                failure = exc
            else:
                task_status.started()
        if failure is not None:
            raise failure

    def _listening(self, url: str) -> None:
        self.url = url
        log.info("dashboard at %s (open it with: %s)", url, self.node.commands("ui"))

    # -- the owner's control handlers, in this process --------------------------------------
    async def ask(self, request: Message, reply_type: type[R]) -> R:
        """One control request, answered by the handler the CLI's would be (node/control/owner.py)."""
        try:
            return expect(await self.node.control.call(request), reply_type)
        except RemoteError as exc:
            raise raised(exc) from None

    async def stream(self, request: Message, item_type: type[R]) -> list[R]:
        """A streaming control request that ends (e.g. the inbox without follow): its items."""
        items: list[R] = []

        async def take(message: Message) -> None:
            if isinstance(message, item_type):
                items.append(message)

        expect(await self.node.control.call(request, take), c.Ok)
        return items

    # -- what each page shows ----------------------------------------------------------------
    async def _overview(self, request: Request, live: bool) -> dict:
        """The doctor probes every peer (seconds, for one that is off): the page shows at once,
        and its live stream brings the findings, kept DOCTOR_FRESH_S for later renders."""
        status = await self.ask(c.StatusRequest(), c.StatusReply)
        peers = await self.ask(c.PeersRequest(include_revoked=False), c.PeersReply)
        doctor = self._doctor[1] if self._doctor and self.now() - self._doctor[0] < DOCTOR_FRESH_S else None
        if doctor is None and live:
            doctor = await self.ask(c.DoctorRequest(timeout_s=DOCTOR_TIMEOUT_S, dialback=False), c.DoctorReply)
            self._doctor = (self.now(), doctor)
        return {"status": status, "doctor": doctor, "peers": peers.peers}

    async def _pair(self, request: Request, live: bool) -> dict:
        found = await self.ask(c.DiscoverRequest(wait_s=0.0), c.DiscoverReply)
        code = request.query_params.get("invite")
        run = self.state.pair_runs.get(code) if code else None
        return {"run": run, "joined": self.state.joined, "discovered": found, "presets": sorted(PRESETS),
                "now": self.now()}

    async def _peers(self, request: Request, live: bool) -> dict:
        peers = (await self.ask(c.PeersRequest(include_revoked=True), c.PeersReply)).peers
        return {"peers": peers, "choices": self.capability_choices(peers)}

    def capability_choices(self, peers: list[c.PeerView]) -> list[str]:
        """What a person may tick: the presets' capabilities, one per tool and model of this
        node, messaging and relay, and whatever a peer holds already."""
        choices = {cap for caps, _ in PRESETS.values() for cap in caps}
        choices |= {f"tool:{name}" for name in self.node.tools.names()}
        choices |= {f"task.infer:models={name}" for name in self.node.models.registry.names()}
        choices |= {"relay", "msg.send", "msg.ask"}
        for peer in peers:
            choices |= set(peer.granted)
        return sorted(choices)

    async def _activity(self, request: Request, live: bool) -> dict:
        q = request.query_params
        peer, decision, cap = q.get("peer") or None, q.get("decision", ""), q.get("cap", "").strip()
        peers = (await self.ask(c.PeersRequest(include_revoked=True), c.PeersReply)).peers
        names = {p.peer_id: p.name for p in peers}
        # the control API filters by peer and refusals; by capability and "allowed" we filter
        # here, out of a wider window of the newest rows
        window = AUDIT_ROWS * 10 if cap or decision == "allowed" else AUDIT_ROWS
        rows = (await self.ask(c.AuditRequest(peer=peer, limit=window, denied_only=decision == "denied"),
                               c.AuditReply)).rows
        rows = [r for r in reversed(rows) if (decision != "allowed" or r.allowed) and (not cap or cap in r.operation)]
        tasks = await self.ask(c.TaskListRequest(limit=20), c.TaskListReply)
        newest = max(0, self.node.messaging.store.last_released() - LETTERS)
        letters = await self.stream(c.MsgInboxRequest(after=newest, follow=False), c.InboxLetter)
        threads: dict[str, list[c.InboxLetter]] = {}
        for letter in letters:
            threads.setdefault(f"{letter.sender_name} / {letter.thread}", []).append(letter)
        outbox = [self.node.messaging.store.sent(s.letter.id) for s in self.node.messaging.store.outbox(20)]
        held = [(p.name, *self.node.mailbox.store.usage(p.peer_id)) for p in peers]
        return {"rows": rows[:AUDIT_ROWS], "names": names, "peers": peers,
                "filters": {"peer": peer or "", "decision": decision, "cap": cap},
                "tasks": tasks, "threads": threads, "outbox": [s for s in outbox if s is not None],
                "held": [h for h in held if h[1]]}

    async def _task(self, request: Request, live: bool) -> dict:
        task_id = request.path_params["task_id"]
        outbox = self.node.submitter.outbox
        try:
            task = outbox.get(task_id)
        except PsymeshError:
            raise HTTPException(404, f"no task {task_id} was delegated from this node") from None
        events = outbox.events_after(task_id, 0, limit=1000)
        asking = events[-1].data if events and events[-1].state is TaskState.INPUT_REQUIRED else None
        names = self.node.trust.names()
        target = names.get(task.target or "", task.target or "")
        return {"heading": "Task", "id": task_id, "action": f"/tasks/{task_id}", "kind": task.spec.kind,
                "where": f"on {target}", "who": target, "goal": task.spec.goal, "state": task.state,
                "terminal": task.terminal, "events": [Shown(e.kind, e.state, e.data) for e in events],
                "asking": asking, "result": outbox.result(task_id)}

    async def _run(self, request: Request, live: bool) -> dict:
        run = self.runs.get(request.path_params["run_id"])
        if run is None:
            raise HTTPException(404, "no such run of this node's agent (runs are kept until the daemon stops)")
        return {"heading": "Agent run", "id": run.id, "action": f"/runs/{run.id}", "kind": "agent",
                "where": "here, on this node", "who": "the agent", "goal": run.goal, "state": run.state,
                "terminal": run.state.terminal, "events": run.events, "asking": run.asking, "result": run.outcome}

    async def _agent(self, request: Request, live: bool) -> dict:
        offers = await self.ask(c.OffersRequest(operation="task.agent"), c.OffersReply)
        return {"offers": offers.offers, "local_models": self.node.models.registry.names(),
                "runs": list(reversed(self.runs.values()))}

    async def _models(self, request: Request, live: bool) -> dict:
        return {"models": await self.models_ps(),
                "keep_alive_s": self.node.config.models.keep_alive_for(self.node.config.profile)}

    async def models_ps(self) -> list[c.LoadedModel]:
        """`psymesh model ps`: the one source of the Models page."""
        return (await self.ask(c.ModelsPsRequest(), c.ModelsPsReply)).models

    _VIEWS: Mapping[str, str] = {"overview": "_overview", "pair": "_pair", "peers": "_peers",
                                 "activity": "_activity", "task": "_task", "run": "_run", "agent": "_agent",
                                 "models": "_models"}

    async def render(self, view: str, request: Request, *, csrf: str, live_only: bool = False,
                     flash: Flash | None = None) -> str:
        data = await getattr(self, self._VIEWS[view])(request, live_only)
        template = self.env.get_template("task.html" if view == "run" else f"{view}.html")
        context = {**data, "csrf": csrf, "pages": PAGES, "path": request.url.path,
                   "flash": flash, "node_name": self.node.config.name,
                   "live_view": request.url.path + (f"?{request.url.query}" if request.url.query else "")}
        if live_only:
            block = template.blocks.get("live")  # a page with nothing live has none
            return "" if block is None else "".join(block(template.new_context(context)))
        return template.render(context)

    def _page(self, view: str) -> Callable[[Request], object]:
        async def page(request: Request) -> Response:
            flash = None
            if "ok" in request.query_params or "error" in request.query_params:
                flash = Flash(request.query_params.get("ok") or request.query_params.get("error", ""),
                              ok="ok" in request.query_params)
            session = self._session(request)
            return self._html(await self.render(view, request, csrf=session.csrf if session else "", flash=flash))

        return page

    @staticmethod
    def _html(body: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)

    # -- login, static files, live updates ----------------------------------------------------
    async def _login(self, request: Request) -> Response:
        """The link `psymesh ui` opened: its code, once, for a session at this Host name. The
        answer is a page that goes on to the overview by itself: the link came from a file (a
        cross-site navigation), and a SameSite=Strict cookie rides only a same-site one."""
        template = self.env.get_template("login.html")
        code = request.query_params.get("code", "")
        if not code:
            return self._html(template.render(error=None, signed_in=False))
        try:
            session = self.sessions.redeem(code, request.headers.get("host", ""), now=self.now())
        except Refused as exc:
            return self._html(template.render(error=str(exc), signed_in=False), status=401)
        response = self._html(template.render(error=None, signed_in=True))
        response.set_cookie(COOKIE, session.id, httponly=True, samesite="strict", path="/",
                            secure=False)  # plain http on loopback: Secure would drop it
        return response

    async def _logout(self, request: Request) -> Response:
        """The session is over here, not only in this browser: its cookie opens nothing now."""
        sid = request.scope.get("psymesh.session")
        if sid is not None:
            self.sessions.end(sid)
        response = RedirectResponse("/login", status_code=303, headers=SECURITY_HEADERS)
        response.delete_cookie(COOKIE, path="/")
        return response

    async def _static(self, request: Request) -> Response:
        name = request.path_params["name"]
        types = {"ui.js": "text/javascript", "ui.css": "text/css"}
        if name not in types:
            raise HTTPException(404, "no such file")
        return Response((HERE / name).read_bytes(), media_type=types[name],
                        headers={**SECURITY_HEADERS, "Cache-Control": "max-age=60"})

    def _view_of(self, path: str) -> tuple[str, Request]:
        """The view and a request for the page at `path` (a live region's own page)."""
        bare, _, query = path.partition("?")
        params: dict[str, str] = {}
        if bare == "/":
            view = "overview"
        elif bare.startswith("/tasks/") and bare.count("/") == 2:
            view, params = "task", {"task_id": bare.removeprefix("/tasks/")}
        elif bare.startswith("/runs/") and bare.count("/") == 2:
            view, params = "run", {"run_id": bare.removeprefix("/runs/")}
        else:
            view = bare.strip("/")
        if view not in self._VIEWS:
            raise HTTPException(404, f"no live view {bare}")
        return view, Request({"type": "http", "path": bare, "method": "GET", "query_string": query.encode(),
                              "headers": [], "path_params": params})

    async def _events(self, request: Request) -> Response:
        view, page_request = self._view_of(request.query_params.get("view", "/"))
        last = request.query_params.get("digest", "")

        session = self._session(request)
        csrf, host = (session.csrf if session else ""), request.headers.get("host", "")
        pulse = self.node.activity
        seen = pulse.count  # before the read: whatever happens from here on is rendered
        first = await self.render(view, page_request, csrf=csrf, live_only=True)  # an unknown task: 404, not a stream

        async def events() -> AsyncIterator[bytes]:
            nonlocal last, seen
            yield _sse(comment="live")
            rendered, html = time.monotonic(), first
            while True:
                digest = hashlib.sha256(html.encode()).hexdigest()[:16]
                if digest != last:
                    last = digest
                    yield _sse(html, event="region")
                with anyio.move_on_after(LIVE_KEEPALIVE_S) as waited:
                    await pulse.wait(after=seen)
                if session is not None and self.sessions.find(session.id, host, now=self.now()) is None:
                    return  # logged out, expired or a new key: the page gets nothing more
                if waited.cancelled_caught:
                    yield _sse(comment="keep-alive")
                since = time.monotonic() - rendered
                if since < LIVE_MIN_INTERVAL_S:  # a burst becomes one re-render; a lone event shows at once
                    await anyio.sleep(LIVE_MIN_INTERVAL_S - since)
                rendered, seen = time.monotonic(), pulse.count
                html = await self.render(view, page_request, csrf=csrf, live_only=True)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**SECURITY_HEADERS, "X-Accel-Buffering": "no"})

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return self._html(self.env.get_template("error.html").render(status=exc.status_code, message=exc.detail),
                          status=exc.status_code)

    async def _failed(self, request: Request, exc: Exception) -> Response:
        """A page whose control request was refused (`/activity?peer=nobody`: no such peer):
        the error page, its status from the error's code."""
        assert isinstance(exc, PsymeshError)
        status = http_status(exc.code)
        return self._html(self.env.get_template("error.html").render(status=status, message=exc.message),
                          status=status)

    # -- forms ----------------------------------------------------------------------------------
    @staticmethod
    def _back(path: str, *, ok: str | None = None, error: str | None = None) -> Response:
        query = urlencode({"ok": ok} if ok is not None else {"error": error or ""})
        sep = "&" if "?" in path else "?"
        return RedirectResponse(f"{path}{sep}{query}", status_code=303, headers=SECURITY_HEADERS)

    async def _form(self, request: Request) -> FormData:
        return await request.form()

    async def _pair_invite(self, request: Request) -> Response:
        """`control.pair_invite` with `wait`, as `psymesh pair invite` sends it: its first reply is
        the invite (shown at once), its second the pairing, whose words the open page then shows."""
        form = await self._form(request)
        try:
            invite_request = c.PairInviteRequest(name=str(form.get("name") or "").strip() or None,
                                                 grant=str(form.get("grant") or "phone"),
                                                 ttl_s=float(str(form.get("ttl_s") or 600)), wait=True)
        except ValueError as exc:
            return self._back("/pair", error=_message(exc))
        assert self._tg is not None
        first: list[c.PairInviteReply] = []
        failed: list[str] = []
        got = anyio.Event()

        async def on_invite(message: Message) -> None:
            if isinstance(message, c.PairInviteReply):
                first.append(message)
                got.set()

        async def wait_for_use() -> None:
            reply = await self.node.control.call(invite_request, on_invite)
            if not first:
                failed.append(reply.message if isinstance(reply, Error) else f"unexpected {reply.type}")
                got.set()
                return
            run = self.state.pair_runs.get(first[0].code)
            if run is not None:
                if isinstance(reply, c.PairedReply):
                    run.outcome = reply
                else:
                    run.error = reply.message if isinstance(reply, Error) else f"unexpected {reply.type}"
                self.node.activity.fire()

        self._tg.start_soon(wait_for_use)
        await got.wait()
        if not first:
            return self._back("/pair", error=failed[0] if failed else "the invite could not be made")
        invite = first[0]
        qr = segno.make(invite.invite, error="m").svg_inline(scale=3, dark="#111", light="#fff")
        self.state.pair_runs = {k: v for k, v in self.state.pair_runs.items() if v.invite.expires_at > self.now()}
        self.state.pair_runs[invite.code] = PairRun(invite=invite, qr_svg=qr)
        return RedirectResponse(f"/pair?{urlencode({'invite': invite.code})}", status_code=303,
                                headers=SECURITY_HEADERS)

    async def _pair_join(self, request: Request) -> Response:
        form = await self._form(request)
        invite = str(form.get("invite") or "").strip()
        address = str(form.get("address") or "").strip() or None
        grant = str(form.get("grant") or "").strip() or None
        try:
            self.state.joined = await self.ask(c.PairJoinRequest(invite=invite, address=address, grant=grant),
                                               c.PairedReply)
        except (PsymeshError, ValueError) as exc:
            return self._back("/pair", error=_message(exc))
        return self._back("/pair", ok=f"paired with {self.state.joined.name}")

    async def _grant(self, request: Request) -> Response:
        form = await self._form(request)
        peer = str(form.get("peer") or "")
        caps = [str(v) for v in form.getlist("cap")]
        caps += [v.strip() for v in str(form.get("more") or "").split(",") if v.strip()]
        expires = str(form.get("expires_s") or "").strip()
        limits = {k: (int(v) if str(v).strip() else None) for k in ("requests_per_minute", "concurrent_tasks")
                  if (v := form.get(k)) is not None}
        try:
            reply = await self.ask(c.GrantRequest(peer=peer, capabilities=caps, expires_s=float(expires) if expires else None,
                                                  set_limits=limits), c.PeerReply)
        except (PsymeshError, ValueError) as exc:
            return self._back("/peers", error=_message(exc))
        told = "" if reply.delivered else " (it was not reachable; it learns at its next request)"
        return self._back("/peers", ok=f"{reply.peer.name} may now: {', '.join(reply.peer.granted)}{told}")

    async def _revoke(self, request: Request) -> Response:
        form = await self._form(request)
        try:
            reply = await self.ask(c.RevokeRequest(peer=str(form.get("peer") or "")), c.PeerReply)
        except (PsymeshError, ValueError) as exc:
            return self._back("/peers", error=_message(exc))
        return self._back("/peers", ok=f"revoked {reply.peer.name}; pair again to trust it again")

    async def _send_letter(self, request: Request) -> Response:
        form = await self._form(request)
        try:
            reply = await self.ask(c.MsgSendRequest(to=str(form.get("to") or ""), text=str(form.get("text") or ""),
                                                    thread=str(form.get("thread") or "main")), c.MsgSentReply)
        except (PsymeshError, ValueError) as exc:
            return self._back("/activity", error=_message(exc))
        return self._back("/activity", ok=f"letter to {reply.letter.recipient_name}: {reply.letter.state}")

    async def _task_input(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        form = await self._form(request)
        approve = form.get("approve") == "yes"
        where = f"/tasks/{task_id}"
        try:  # the very request `psymesh task respond` and handle.respond() send
            await self.ask(c.TaskInputRequest(task_id=task_id, data={"approve": approve}), c.Ok)
        except (PsymeshError, ValueError) as exc:
            return self._back(where, error=_message(exc))
        return self._back(where, ok="approved" if approve else "denied")

    async def _task_cancel(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        try:
            await self.ask(c.TaskCancelRequest(task_id=task_id), c.Ok)
        except (PsymeshError, ValueError) as exc:
            return self._back(f"/tasks/{task_id}", error=_message(exc))
        return self._back(f"/tasks/{task_id}", ok="cancel sent")

    async def _agent_submit(self, request: Request) -> Response:
        """Run the goal here or delegate it, as the delegation policy decides for `psymesh agent
        run` (agent/acting/policy.py): on a home PC here; on a phone, a home while one offers it and
        the phone is low on battery or memory, or lacks a model."""
        form = await self._form(request)
        goal = str(form.get("goal") or "").strip()
        to = str(form.get("to") or "").strip() or None
        where = str(form.get("where") or "auto")
        try:
            if not goal:
                raise PsymeshError("write a goal first", code=ErrorCode.BAD_REQUEST)
            offers = [] if where == "local" else (await self.ask(c.OffersRequest(operation="task.agent"),
                                                                 c.OffersReply)).offers
            local = frozenset(self.node.models.registry.names())
            config = self.node.config
            decision = decide(DelegationInputs(
                profile=config.profile, force={"local": "local", "remote": "remote"}.get(where),  # type: ignore[arg-type]
                remote_available=bool(offers), local_models=local,
                needed_models=frozenset() if local else frozenset(["(any model)"]),
                battery_low=config.battery_low, memory_low=config.memory_low))
            if decision.where == "local":
                return RedirectResponse(f"/runs/{self._start_run(goal)}", status_code=303, headers=SECURITY_HEADERS)
            spec = TaskSpec(id=new_task_id(), kind=TaskKind.AGENT, goal=goal)
            submitted = await self.ask(c.TaskSubmitRequest(spec=spec.model_dump(mode="json"), to=to), c.TaskSubmitted)
        except (PsymeshError, ValueError) as exc:
            return self._back("/agent", error=_message(exc))
        return RedirectResponse(f"/tasks/{submitted.task_id}", status_code=303, headers=SECURITY_HEADERS)

    def _start_run(self, goal: str) -> str:
        """This node's agent on `goal`, with its own tools; an irreversible call waits for a
        yes on the run's page. The run lives in the dashboard's task group."""
        assert self._tg is not None
        run = LocalRun(id=new_task_id(), goal=goal)
        self.runs[run.id] = run
        for old in list(self.runs)[:-MAX_RUNS]:
            if self.runs[old].state.terminal:
                del self.runs[old]
        changed = self.node.activity.fire

        async def confirm(call: Any, tool: Any) -> bool:
            run.asking = {"question": f"allow {call.name} (irreversible) with {call.arguments}?",
                          "tool_call": {"name": call.name, "arguments": call.arguments}}
            run.answered, run.state = anyio.Event(), TaskState.INPUT_REQUIRED
            run.events.append(Shown(EventKind.STATE, run.state, run.asking))
            changed()
            await run.answered.wait()
            run.asking, run.state = None, TaskState.WORKING
            run.events.append(Shown(EventKind.STATE, run.state, {"answer": {"approve": run.approved}}))
            changed()
            return run.approved

        async def emit(ev: AgentEvent) -> None:
            mapped = task_event(ev)
            if mapped is not None:
                run.events.append(Shown(mapped[0], run.state, mapped[1]))
                changed()

        async def drive() -> None:
            with run.scope:
                try:
                    result = await self.node.agents.run(goal, {}, peer_id=self.node.identity.peer_id, deadline=None,
                                                        tools=self.node.tools, confirm=confirm, emit=emit)
                    run.outcome = Outcome(TaskState.COMPLETED, value=result)
                except PsymeshError as exc:
                    run.outcome = Outcome(TaskState.FAILED, code=exc.code, message=exc.message)
                except Exception as exc:  # a bug in a tool or the runtime: the page says so, the node lives on
                    log.exception("agent run from the dashboard failed")
                    run.outcome = Outcome(TaskState.FAILED, code=ErrorCode.INTERNAL,
                                          message=f"internal error ({type(exc).__name__}); see the node's log")
            if run.scope.cancelled_caught:
                run.outcome = Outcome(TaskState.CANCELED, code=ErrorCode.CANCELED, message="canceled from the page")
            run.state = run.outcome.state
            changed()

        self._tg.start_soon(drive)
        return run.id

    async def _run_input(self, request: Request) -> Response:
        run = self.runs.get(request.path_params["run_id"])
        form = await self._form(request)
        if run is None or run.answered is None or run.answered.is_set():
            return self._back(request.url.path.removesuffix("/input"), error="that run is not waiting for an answer")
        run.approved = form.get("approve") == "yes"
        run.answered.set()
        return self._back(f"/runs/{run.id}", ok="approved" if run.approved else "denied")

    async def _run_cancel(self, request: Request) -> Response:
        run = self.runs.get(request.path_params["run_id"])
        if run is None:
            raise HTTPException(404, "no such run")
        run.scope.cancel()
        return self._back(f"/runs/{run.id}", ok="canceled")

    async def _model_add(self, request: Request) -> Response:
        form = await self._form(request)
        name, path = str(form.get("name") or "").strip(), str(form.get("path") or "").strip()
        try:
            if not name or not Path(path).expanduser().is_file():
                raise PsymeshError(f"need a name and the path of a .gguf file (got {path!r})",
                                   code=ErrorCode.BAD_REQUEST)
            self.node.models.registry.add(name, Path(path).expanduser())
        except (PsymeshError, ValueError) as exc:
            return self._back("/models", error=_message(exc))
        return self._back("/models", ok=f"model {name} -> {path}")


def _sse(data: str | None = None, *, event: str | None = None, comment: str | None = None) -> bytes:
    """One server-sent event, the one place the live stream is framed: sse-starlette writes each
    line of `data` as a `data:` line, splitting on every line ending the SSE spec knows (CRLF, LF
    and a bare CR), so no text in the page (a peer's letter with a CR in it) can end the event
    early or add a field of its own. The browser joins the lines with LF."""
    return ServerSentEvent(data, event=event, comment=comment, sep="\n").encode()


def _message(exc: Exception) -> str:
    if isinstance(exc, PsymeshError):
        return exc.message
    return str(exc).splitlines()[0]
