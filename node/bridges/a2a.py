"""The node's agent as an A2A agent, through the official a2a-sdk (docs/bridges.md).

    GET  /.well-known/agent-card.json   the card: this node, its agent and tools as
                                        skills, the bearer scheme, the URL (public)
    POST /                              JSON-RPC: SendMessage, SendStreamingMessage,
                                        GetTask, CancelTask, ... (A2A 1.0), and the
                                        0.3 names message/send, message/stream,
                                        tasks/get, tasks/cancel (the SDK's compat)

Why a thread: a2a-sdk's server is written on asyncio itself (asyncio.create_task,
asyncio.Lock, asyncio queues), and the daemon runs on trio. So the SDK's Starlette
app runs under uvicorn on an asyncio loop of its own, in one thread (`psymesh-a2a`)
that this service starts and joins: nothing of it outlives the service.

Two threads, one rule: node state is touched on the trio thread only. A user message
becomes an agent run (AgentTaskRunner.run, the path delegated `agent` tasks and asks
take) started from the asyncio thread into this service's own trio task group
(`anyio.from_thread.run_sync` with the daemon's token), so a run is cancelled with
the service, never left behind; its events come back to the asyncio loop with
`loop.call_soon_threadsafe`. Trio never waits on the asyncio thread, so the two
cannot deadlock.

Every request passes node/bridges/httpguard.py first (the Host allow-list, no cross-site
Origin, the bearer key but for the card, JSON bodies, and an A2A-Version of 1.0 or 0.3,
a patch number ignored, none meaning 0.3 as A2A 1.0 §3.6.2 says); the body
is read there, at most `max_body_bytes` (the SDK would hold any size), and must be JSON
nested at most httpguard.JSON_MAX_DEPTH deep. What the guard refuses, and what the app
fails to answer, comes back as a JSON-RPC error (`refused`).

An A2A client holds the owner's key, so the agent gets this node's tools; but nobody
is there to confirm an irreversible one (A2A's input-required would park the run
between HTTP requests), so they are refused as for a peer's `ask`: the agent sees
`unconfirmed` and says what it wanted to do. States map from ours (protocol.tasks
TaskState) at the edge: see STATES.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
from a2a.helpers.proto_helpers import new_task, new_text_artifact
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import a2a_pb2 as a2a
from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH, PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0, VERSION_HEADER
from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

import psymesh
from .apikey import ApiKey
from ..core.commands import Commands
from ..core.bridgeconfig import A2AServe
from .httpguard import AllowedHosts, Check, GuardRules, HttpGuard, Refusal, VersionHeader
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.tasks import TaskState

if TYPE_CHECKING:
    import uvicorn

    from ...agent.acting.loop import AgentEvent
    from ...agent.acting.tools import ToolRegistry
    from ..core.home import Profile
    from ..models.agents import AgentTaskRunner

log = logging.getLogger("psymesh.a2a")

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

RPC_PATH = "/"
THREAD_NAME = "psymesh-a2a"
SHUTDOWN_GRACE_S = 2.0  # open streams get this long to end once the node stops

#: Our task states as A2A's (A2A has auth-required besides; we never ask for it).
STATES: Mapping[TaskState, a2a.TaskState.ValueType] = {
    TaskState.SUBMITTED: a2a.TASK_STATE_SUBMITTED,
    TaskState.WORKING: a2a.TASK_STATE_WORKING,
    TaskState.INPUT_REQUIRED: a2a.TASK_STATE_INPUT_REQUIRED,
    TaskState.COMPLETED: a2a.TASK_STATE_COMPLETED,
    TaskState.FAILED: a2a.TASK_STATE_FAILED,
    TaskState.CANCELED: a2a.TASK_STATE_CANCELED,
    TaskState.REJECTED: a2a.TASK_STATE_REJECTED,
}


# -------------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Step:
    """Something the agent did, told to the client as a `working` status message."""

    text: str


@dataclass(frozen=True)
class Ended:
    """How a run ended: `state` is terminal; `answer` (completed) or `error` (why not)."""

    state: TaskState
    answer: str = ""
    result: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""


def step_text(ev: AgentEvent) -> str | None:
    """An agent event as one line for the client, or None if it tells nothing new."""
    d = ev.data
    if ev.kind == "tool_call":
        return f"calling {d['name']}({json.dumps(d.get('arguments', {}), ensure_ascii=False)})"
    if ev.kind == "tool_result":
        return f"{d['name']}: {d['status']}"
    if ev.kind == "error":
        return f"error: {d.get('message', '')}"
    return None


class Run:
    """One agent run seen from both threads. Its trio half (the scope, the run itself)
    is touched on the trio thread only; what it tells goes to `events`, an asyncio
    queue, through the loop's thread-safe door."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: asyncio.Queue[Step | Ended] = asyncio.Queue()
        self._scope: anyio.CancelScope | None = None  # trio thread only
        self._cancel_asked = False                    # trio thread only

    def tell(self, item: Step | Ended) -> None:
        """From the trio thread: hand `item` to the asyncio side (dropped if its loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        """On the trio thread: stop the run (before or after it started)."""
        self._cancel_asked = True
        if self._scope is not None:
            self._scope.cancel()

    async def drive(self, endpoint: A2AEndpoint, goal: str, params: Mapping[str, Any]) -> None:
        """On the trio thread, in the service's task group: the agent run, then how it ended."""
        end = Ended(TaskState.CANCELED, error="canceled")  # unless it gets further
        try:
            with anyio.CancelScope() as self._scope:
                if self._cancel_asked:
                    self._scope.cancel()
                end = await endpoint.agent_run(goal, params, self)
        finally:
            self.tell(end)


# -------------------------------------------------------------------------------- the asyncio half


class NodeAgentExecutor(AgentExecutor):
    """a2a-sdk's side of a run (on the asyncio thread): starts it on the trio side and
    turns what it tells into A2A events, states mapped by STATES."""

    def __init__(self, endpoint: A2AEndpoint) -> None:
        self.endpoint = endpoint
        self.runs: dict[str, Run] = {}  # task id -> its run (asyncio thread only)

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None and context.message is not None
        task_id, context_id = context.task_id, context.context_id
        if context.current_task is None:
            await event_queue.enqueue_event(new_task(task_id, context_id, STATES[TaskState.SUBMITTED],
                                                     history=[context.message]))
        updater = TaskUpdater(event_queue, task_id, context_id)
        goal = context.get_user_input().strip()
        params = MessageToDict(context.message.metadata).get("params", {})  # agent params, checked as a peer's
        if not goal or not isinstance(params, dict):
            await updater.update_status(STATES[TaskState.REJECTED], updater.new_agent_message([a2a.Part(
                text="send the goal as a text part (and agent params, if any, as metadata.params, an object)")]))
            return
        run = Run(asyncio.get_running_loop())
        self.runs[task_id] = run
        try:
            self.endpoint.to_trio(self.endpoint.start_run, run, goal, params)
            await updater.update_status(STATES[TaskState.WORKING])
            while True:
                item = await run.events.get()
                if isinstance(item, Step):
                    await updater.update_status(STATES[TaskState.WORKING], updater.new_agent_message(
                        [a2a.Part(text=item.text)]))
                    continue
                if item.state is TaskState.COMPLETED:
                    await event_queue.enqueue_event(a2a.TaskArtifactUpdateEvent(
                        task_id=task_id, context_id=context_id,
                        artifact=new_text_artifact("answer", item.answer),
                        last_chunk=True))
                    await updater.update_status(STATES[item.state], updater.new_agent_message(
                        [a2a.Part(text=item.answer)], metadata={"result": dict(item.result)}))
                else:
                    await updater.update_status(STATES[item.state], updater.new_agent_message(
                        [a2a.Part(text=item.error)]))
                return
        finally:  # an ended run: a no-op; one whose request was cancelled: stopped on the trio side
            del self.runs[task_id]
            self.endpoint.to_trio(run.cancel)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """tasks/cancel: the run is stopped on the trio side; the SDK cancels execute()
        and records the task as canceled."""
        run = self.runs.get(context.task_id or "")
        if run is not None:
            self.endpoint.to_trio(run.cancel)
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).update_status(
            STATES[TaskState.CANCELED])


#: JSON-RPC codes of the door's answers (JSON-RPC's own for a body that is too large, not
#: JSON, or a failure; A2A's -32009 for the version; the rest are ours, in JSON-RPC's server
#: range, clear of A2A's -32001..-32009).
_RPC_CODES: Mapping[Check, int] = {Check.HOST: -32010, Check.ORIGIN: -32010, Check.KEY: -32011,
                                   Check.CONTENT_TYPE: -32600, Check.HEADER: -32009, Check.SIZE: -32600,
                                   Check.JSON: -32700, Check.INTERNAL: -32603}


def refused(refusal: Refusal) -> JSONResponse:
    """A request the door (node/bridges/httpguard.py) refused, or one the app failed, as a
    JSON-RPC error; `data.code` names the check."""
    return JSONResponse({"jsonrpc": "2.0", "id": None, "error": {
        "code": _RPC_CODES[refusal.check], "message": refusal.message, "data": {"code": refusal.check.value}}},
        status_code=refusal.status, headers=dict(refusal.headers))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """A route the app lacks (404), or a method it does not take there (405), as a JSON-RPC error."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"jsonrpc": "2.0", "id": None, "error": {
        "code": -32600, "message": f"{request.method} {request.url.path}: {exc.detail}",
        "data": {"code": "not_found" if exc.status_code == 404 else "invalid_request"}}},
        status_code=exc.status_code, headers=exc.headers)


#: a2a-sdk's loggers that log a traceback (logger.exception) for a request it cannot parse,
#: and those messages: a client's mistake, which the answer already tells the client.
_SDK_PARSE_LOGGERS = ("a2a.server.routes.jsonrpc_dispatcher", "a2a.compat.v0_3.jsonrpc_adapter")
_SDK_PARSE_FAILURES = ("Failed to validate base JSON-RPC request", "Failed to parse request params")


class ClientMistakeLine(logging.Filter):
    """One WARNING line, with the exception's first line, in place of the SDK's ERROR and
    traceback for a request it could not parse (bad input is not the node failing)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith(_SDK_PARSE_FAILURES):
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            record.args, record.exc_info, record.exc_text = None, None, None
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def _quiet_sdk_parse_failures() -> None:
    for name in _SDK_PARSE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ClientMistakeLine) for f in logger.filters):
            logger.addFilter(ClientMistakeLine())


def guard_rules(settings: A2AServe, key: str) -> GuardRules:
    """The door's rules for the A2A face: the card is public; every other request needs the
    key and an A2A-Version the SDK serves."""
    return GuardRules(key=key, hosts=AllowedHosts.of(settings.host_names()),
                      public=frozenset({AGENT_CARD_WELL_KNOWN_PATH}),
                      header=VersionHeader(VERSION_HEADER, frozenset({PROTOCOL_VERSION_1_0, PROTOCOL_VERSION_0_3}),
                                            absent=PROTOCOL_VERSION_0_3),
                      max_body=settings.max_body_bytes)


# -------------------------------------------------------------------------------- the service


@dataclass(frozen=True)
class A2AParts:
    """What the A2A face uses of its node (wired in node/daemon.py): who it is (its name,
    profile and peer id, for the card), the agent runner and the tools the agent gets."""

    name: str
    profile: Profile
    peer_id: str
    agents: AgentTaskRunner
    tools: ToolRegistry
    commands: Commands = Commands()  # how its log spells the command that prints its key


class A2AEndpoint:
    """The A2A face of one node; `run` serves it in the node's task group."""

    def __init__(self, node: A2AParts, settings: A2AServe, key: ApiKey) -> None:
        self.node = node
        self.settings = settings
        self.key = key
        self.url: str | None = None   # the card's URL once listening
        self.port: int | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None  # the daemon's, for the asyncio thread
        self._runs: anyio.abc.TaskGroup | None = None
        self._stop = threading.Event()
        self._server: uvicorn.Server | None = None  # set on the asyncio thread

    # -- on the trio thread -----------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        sock = self._listen()
        card = self._card(self.skills())
        self._token = anyio.lowlevel.current_token()
        ended = anyio.Event()
        failure: list[BaseException] = []

        def thread_main() -> None:
            try:
                asyncio.run(self._serve(sock, card))
            except BaseException as exc:  # told to the trio side, which raises it
                failure.append(exc)
            finally:
                sock.close()
                anyio.from_thread.run_sync(ended.set, token=self._token)

        thread = threading.Thread(target=thread_main, name=THREAD_NAME)
        async with anyio.create_task_group() as runs:
            self._runs = runs
            thread.start()
            try:
                log.info("A2A agent at %s (card %s%s; its key: %s, %s)", self.url,
                         self.url.rstrip("/") if self.url else "", AGENT_CARD_WELL_KNOWN_PATH, self.key.source,
                         self.node.commands("serve a2a", "--show-key"))
                task_status.started()
                await ended.wait()  # only if the server stopped by itself
                raise PsymeshError(f"the A2A endpoint stopped: {failure[0] if failure else 'no reason given'}",
                                   code=ErrorCode.INTERNAL)
            finally:
                with anyio.CancelScope(shield=True):
                    self._stop.set()
                    if self._server is not None:
                        self._server.should_exit = True
                    runs.cancel_scope.cancel()  # the runs tell their end to the asyncio side first
                    await ended.wait()
                    await anyio.to_thread.run_sync(thread.join)

    def _listen(self) -> socket.socket:
        host, port = self.settings.host, self.settings.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise PsymeshError(f"the A2A endpoint cannot listen on {host}:{port}: {exc.strerror or exc}; choose "
                               "another port ([serve.a2a] port, or --port)", code=ErrorCode.UNAVAILABLE) from None
        sock.set_inheritable(False)
        self.port = sock.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        self.url = (self.settings.public_url or f"http://{shown}:{self.port}").rstrip("/") + RPC_PATH
        return sock

    def start_run(self, run: Run, goal: str, params: Mapping[str, Any]) -> None:
        assert self._runs is not None
        self._runs.start_soon(run.drive, self, goal, params)

    async def agent_run(self, goal: str, params: Mapping[str, Any], run: Run) -> Ended:
        """The node's agent on `goal`, with this node's tools, no confirmations."""

        async def emit(ev: AgentEvent) -> None:
            text = step_text(ev)
            if text is not None:
                run.tell(Step(text))

        try:
            result = await self.node.agents.run(goal, params, peer_id=self.node.peer_id,
                                                deadline=time.time() + self.settings.max_runtime_s,
                                                tools=self.node.tools, confirm=None, emit=emit)
        except PsymeshError as exc:
            return Ended(TaskState.FAILED, error=f"{exc.code.value}: {exc.message}")
        except Exception as exc:  # a bug in a tool or the runtime: the client hears, the node lives on
            log.exception("A2A agent run failed")
            return Ended(TaskState.FAILED, error=f"internal error ({type(exc).__name__}); see the node's log")
        return Ended(TaskState.COMPLETED, answer=str(result.get("answer", "")), result=result)

    def skills(self) -> list[a2a.AgentSkill]:
        """The agent, then each tool it may call here (irreversible ones are refused)."""
        profile = self.node.profile
        tools = [t for t in self.node.tools if t.offered_on(profile)]
        skills = [a2a.AgentSkill(
            id="agent", name="agent", tags=["agent", profile],
            description=f"Runs {self.node.name}'s agent on your goal, with its tools: "
                        + (", ".join(t.name for t in tools) or "none")
                        + ". Irreversible tools are refused over A2A.",
            examples=["What is on this machine?"])]
        for t in tools:
            skills.append(a2a.AgentSkill(id=f"tool.{t.name}", name=t.name, description=t.description,
                                         tags=["tool", "irreversible (refused)" if t.irreversible else "reversible",
                                               *([f"device: {t.backend}"] if t.backend else [])]))
        return skills

    # -- from the asyncio thread ----------------------------------------------------------
    def to_trio(self, fn: Callable[[Unpack[Ts]], T], *args: Unpack[Ts]) -> T:
        """`fn(*args)` run on the trio thread: a quick function that does not block, so the
        asyncio loop waits for trio's next turn, no longer."""
        return anyio.from_thread.run_sync(fn, *args, token=self._token)

    def _card(self, skills: list[a2a.AgentSkill]) -> a2a.AgentCard:
        assert self.url is not None
        bearer = a2a.SecurityScheme(http_auth_security_scheme=a2a.HTTPAuthSecurityScheme(
            scheme="bearer", description="the node's A2A key (its owner runs: psymesh serve a2a --show-key)"))
        card = a2a.AgentCard(
            name=self.node.name, version=psymesh.__version__,
            description=f"psymesh node {self.node.name} ({self.node.profile}), peer id "
                        f"{self.node.peer_id}: its on-device agent, answering a goal with its tools.",
            supported_interfaces=[
                a2a.AgentInterface(url=self.url, protocol_binding="JSONRPC", protocol_version=PROTOCOL_VERSION_1_0),
                a2a.AgentInterface(url=self.url, protocol_binding="JSONRPC", protocol_version=PROTOCOL_VERSION_0_3)],
            capabilities=a2a.AgentCapabilities(streaming=True, push_notifications=False),
            default_input_modes=["text/plain"], default_output_modes=["text/plain"],
            skills=skills)
        card.security_schemes["bearer"].CopyFrom(bearer)
        card.security_requirements.add().schemes["bearer"].SetInParent()
        return card

    async def _fresh_card(self, card: a2a.AgentCard) -> a2a.AgentCard:
        """The card with the tools as they are now (MCP servers come and go)."""
        skills = self.to_trio(self.skills)
        fresh = a2a.AgentCard()
        fresh.CopyFrom(card)
        del fresh.skills[:]
        fresh.skills.extend(skills)
        return fresh

    async def _serve(self, sock: socket.socket, card: a2a.AgentCard) -> None:
        import uvicorn

        _quiet_sdk_parse_failures()
        handler = DefaultRequestHandler(agent_executor=NodeAgentExecutor(self), task_store=InMemoryTaskStore(),
                                        agent_card=card, validate_input_modes=True)
        app = Starlette(routes=[*create_agent_card_routes(card, card_modifier=self._fresh_card),
                                *create_jsonrpc_routes(handler, RPC_PATH, enable_v0_3_compat=True)],
                        exception_handlers={HTTPException: _http_error})
        guarded = HttpGuard(app, guard_rules(self.settings, self.key.value), refused)
        config = uvicorn.Config(guarded, lifespan="off", log_config=None, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        self._server = uvicorn.Server(config)
        if self._stop.is_set():  # the node stopped before the server existed
            return
        try:
            await self._server.serve(sockets=[sock])
        finally:
            await handler.aclose()
