"""The Python SDK: drive your own node daemon from a script.

    async with psymesh.Client(home="~/psy-home") as node:
        status = await node.status()
        result = await node.ping("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...")

Talks to the daemon's control socket with anyio, so it runs under asyncio and trio
alike (libp2p itself lives only inside the daemon). One request at a time per
connection; streaming calls open a connection of their own.

Requests carry secrets (an invite string is a bearer credential), so before sending
anything the client makes sure it talks to its owner's daemon (control_socket.py: a
socket owned by us, in a directory only we may enter, whose listener runs as us).
"""
from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, cast, overload

import anyio
import anyio.abc
from pydantic import ValidationError

from ..net.framed import AnyioByteStream, FramedStream
from ..tasks.ids import new_task_id
from ..core.paths import HomePaths
from .control_socket import ControlSocket, DaemonNotRunning, NotOurDaemon  # the last two: re-exported for scripts
from ...protocol import control as c
from ...protocol.errors import ErrorCode, ProtocolError, PsymeshError, RemoteError, raised
from ...protocol.framing import DEFAULT_MAX_FRAME_SIZE
from ...protocol.common import expect
from ...protocol.messages import Message, first_error

if TYPE_CHECKING:  # (protocol.tasks is loaded when a task is: not by what `status` loads)
    from ...protocol.limits import Limits
    from ...protocol.tasks import AgentTaskResult, ChatMessage, InferResult, Outcome, TaskEvent, TaskKind, TaskSpec, ToolDef
    from ...protocol.web import WebPage, WebResults

R = TypeVar("R", bound=Message)
T = TypeVar("T")  # what a task handle's result() gives


MAX_IDLE_CONNECTIONS = 4


@dataclass
class _Lease:
    framed: FramedStream
    clean: bool = False  # the request ended as the protocol says: the connection can serve another


class Client:
    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        *,
        socket_path: str | os.PathLike[str] | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        self.home = HomePaths(home)  # its paths only: a script's client needs no config or key
        self.socket_path = Path(socket_path) if socket_path else self.home.socket_path
        self._socket = ControlSocket(self.socket_path, self.home.path)
        self.max_frame_size = max_frame_size
        self._framed: FramedStream | None = None
        self._lock = anyio.Lock()
        self._idle: list[FramedStream] = []  # side connections a finished long request handed back

    async def _open(self) -> FramedStream:
        self._socket.check_file()
        try:
            raw = await anyio.connect_unix(self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise self._socket.not_running(exc.strerror or str(exc)) from None
        try:
            self._socket.check_listener(raw.extra(anyio.abc.SocketAttribute.raw_socket))
        except BaseException:
            await raw.aclose()
            raise
        return FramedStream(AnyioByteStream(raw), self.max_frame_size)

    @contextlib.asynccontextmanager
    async def _side(self) -> AsyncIterator["_Lease"]:
        """A control connection for one long request (a watch, a wait): an idle one when there
        is one, handed back for the next when its request ended cleanly (`lease.clean`), closed
        otherwise. Each `result()` would otherwise connect (and check the socket's owner) anew."""
        lease = _Lease(self._idle.pop() if self._idle else await self._open())
        try:
            yield lease
        finally:
            if lease.clean and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(lease.framed)
            else:
                with anyio.CancelScope(shield=True):
                    await lease.framed.aclose()

    async def __aenter__(self) -> "Client":
        self._framed = await self._open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for framed in idle:
            await framed.aclose()
        if self._framed is not None:
            framed, self._framed = self._framed, None
            await framed.aclose()

    async def request(self, message: Message, reply_type: type[R]) -> R:
        """Send one control request and return its reply. An `error` reply raises: a
        NetworkError (ConnectError, NetworkTimeout, ConnectionLost) when the daemon could not
        reach the peer, which may work later; a RemoteError when the request was refused."""
        if self._framed is None:
            raise PsymeshError("use `async with Client(...)` (or await client.__aenter__()) first")
        async with self._lock:
            return await self._request_on(self._framed, message, reply_type)

    @staticmethod
    async def _request_on(framed: FramedStream, message: Message, reply_type: type[R]) -> R:
        try:
            return await framed.request(message, reply_type)
        except RemoteError as exc:
            raise raised(exc) from None

    # -- node ---------------------------------------------------------------
    async def status(self) -> c.StatusReply:
        return await self.request(c.StatusRequest(), c.StatusReply)

    async def ping(self, peer: str, count: int = 4, payload_size: int = 32) -> c.PingReply:
        """Round trips over the encrypted channel to `peer` (multiaddr with /p2p/, or a paired peer's id or name)."""
        return await self.request(c.PingRequest(peer=peer, count=count, payload_size=payload_size), c.PingReply)

    async def shutdown(self) -> None:
        await self.request(c.ShutdownRequest(), c.Ok)

    async def doctor(self, timeout_s: float = 10.0, *, dialback: bool = True) -> c.DoctorReply:
        """The daemon's view for `psymesh doctor`: its listen addresses, how it is reachable,
        and each paired peer probed now (reachable? path, round trip, clock skew, dial-back)."""
        return await self.request(c.DoctorRequest(timeout_s=timeout_s, dialback=dialback), c.DoctorReply)

    # -- pairing and trust -----------------------------------------------------
    async def pair_invite(self, *, name: str | None = None, grant: str = "phone", ttl_s: float = 600.0,
                          grant_ttl_s: float | None = None) -> c.PairInviteReply:
        """Make a one-time invite; give its `code` (or `invite` string) to the joining device."""
        return await self.request(c.PairInviteRequest(name=name, grant=grant, ttl_s=ttl_s, grant_ttl_s=grant_ttl_s),
                                  c.PairInviteReply)

    async def pair_invite_and_wait(self, on_invite: Callable[[c.PairInviteReply], object], *,
                                   name: str | None = None, grant: str = "phone", ttl_s: float = 600.0,
                                   grant_ttl_s: float | None = None) -> c.PairedReply:
        """Make an invite, hand it to `on_invite` (to show it), then wait until a device pairs
        with it (-> the pairing, with verification words) or it dies (-> RemoteError)."""
        framed = await self._open()  # a connection of its own: the wait may be long
        try:
            invite = await framed.request(c.PairInviteRequest(name=name, grant=grant, ttl_s=ttl_s,
                                                              grant_ttl_s=grant_ttl_s, wait=True), c.PairInviteReply)
            on_invite(invite)
            return expect(await framed.receive_required(), c.PairedReply)
        finally:
            await framed.aclose()

    async def pair_join(self, invite: str, *, address: str | None = None, grant: str | None = None) -> c.PairedReply:
        """Pair with the node that made `invite` (an invite string, or a code plus `address`).
        `grant` optionally gives the inviter a preset (e.g. "messaging") in return."""
        return await self.request(c.PairJoinRequest(invite=invite, address=address, grant=grant), c.PairedReply)

    async def peers(self, *, include_revoked: bool = True) -> list[c.PeerView]:
        return (await self.request(c.PeersRequest(include_revoked=include_revoked), c.PeersReply)).peers

    async def grant(self, peer: str, capabilities: list[str] | None = None, *, add: list[str] | None = None,
                    remove: list[str] | None = None, preset: str | None = None, expires_s: float | None = None,
                    until_revoked: bool = False, preset_limits: str | None = None, limits: Limits | None = None,
                    set_limits: Mapping[str, int | None] | None = None) -> c.PeerReply:
        """A new grant to `peer` (capabilities in CLI spelling, e.g. "tool:files.*"):
        `capabilities` if given, else the preset `preset`'s (e.g. "phone"), else the current
        grant's; then `remove` taken out and `add` put in. Limits: `limits` if given, else a
        preset's (`preset_limits`, else `preset`), else the current grant's; then each of
        `set_limits` (e.g. `{"concurrent_tasks": 8, "max_runtime_s": None}`) replaces one of
        them, None meaning no limit from the grant. It lasts `expires_s` seconds, else (with
        `until_revoked`) until revoked, else as long as the current grant. Unknown names or values out of range raise
        PsymeshError (bad_request) before anything is sent."""
        try:
            req = c.GrantRequest(peer=peer, capabilities=capabilities or [], add=add or [], remove=remove or [],
                                 preset=preset, expires_s=expires_s, until_revoked=until_revoked,
                                 preset_limits=preset_limits, limits=limits,
                                 set_limits=dict(set_limits or {}))
        except ValidationError as exc:
            raise PsymeshError(f"invalid grant: {first_error(exc)[1]}", code=ErrorCode.BAD_REQUEST) from None
        return await self.request(req, c.PeerReply)

    async def revoke(self, peer: str) -> c.PeerReply:
        return await self.request(c.RevokeRequest(peer=peer), c.PeerReply)

    # -- discovery ---------------------------------------------------------------
    async def discovered(self, wait_s: float = 0.0) -> c.DiscoverReply:
        """Nodes seen on the LAN (mDNS) or at static addresses, paired or not, with fingerprints
        (most recent first), after listening `wait_s` more seconds (at most 60)."""
        return await self.request(c.DiscoverRequest(wait_s=wait_s), c.DiscoverReply)

    # -- delegated tasks ---------------------------------------------------------
    @overload
    async def delegate(self, to: str | None = None, *, tool: str, args: Mapping[str, Any] | None = None,
                       deadline_s: float | None = None, task_id: str | None = None,
                       timeout: float | None = None) -> TaskHandle[Any]: ...

    @overload
    async def delegate(self, to: str | None = None, *, infer: str | Sequence[ChatMessage | Mapping[str, Any]],
                       model: str, max_tokens: int | None = None, params: Mapping[str, Any] | None = None,
                       tools: Sequence[ToolDef | Mapping[str, Any]] | None = None, tool_choice: str | None = None,
                       deadline_s: float | None = None, task_id: str | None = None,
                       timeout: float | None = None) -> TaskHandle[InferResult]: ...

    @overload
    async def delegate(self, to: str | None = None, *, goal: str, params: Mapping[str, Any] | None = None,
                       deadline_s: float | None = None, task_id: str | None = None,
                       timeout: float | None = None) -> TaskHandle[AgentTaskResult]: ...

    async def delegate(
        self,
        to: str | None = None,
        *,
        tool: str | None = None,
        args: Mapping[str, Any] | None = None,
        infer: str | Sequence[ChatMessage | Mapping[str, Any]] | None = None,
        model: str | None = None,
        max_tokens: int | None = None,
        goal: str | None = None,
        params: Mapping[str, Any] | None = None,
        tools: Sequence[ToolDef | Mapping[str, Any]] | None = None,
        tool_choice: str | None = None,
        deadline_s: float | None = None,
        task_id: str | None = None,
        timeout: float | None = None,
    ) -> TaskHandle[Any]:
        """Hand a task to a paired node (`to`: its name or peer id; None picks the best one).

        Exactly one of `tool` (with `args`; `result()` is the tool's output, as the tool
        defines it), `infer` (a prompt, or chat messages; with `model`; `tools`: functions
        the model may call, ToolDef or {name, description, parameters}; `result()` is an
        InferResult) or `goal` (an agent run; `result()` is an AgentTaskResult).

        `deadline_s` bounds the task's life on the executor: if it has not ended that many
        seconds after the executor accepted it (waiting in its queue counts), it fails with
        code `timeout`. It does not bound this call or `result()`: wrap those in
        `anyio.fail_after` (or `asyncio.timeout`) to stop waiting. (`timeout=` is its old
        name, still taken, with a DeprecationWarning.)

        The spec is checked here: a bad value raises PsymeshError (bad_request) naming it
        (e.g. `invalid task: tools[0].name: Field required`) before anything is sent. The task
        is stored durably before this returns, and is delivered, run and reported even if
        either node restarts meanwhile. Passing the same `task_id` again returns the same task.
        """
        if timeout is not None:
            if deadline_s is not None:
                raise PsymeshError("give deadline_s= (timeout= is its old name), not both",
                                   code=ErrorCode.BAD_REQUEST)
            warnings.warn("delegate(timeout=) is now deadline_s= (it bounds the task on the executor, "
                          "not this call)", DeprecationWarning, stacklevel=2)
            deadline_s = timeout
        spec = task_spec(task_id or new_task_id(), tool=tool, args=args, infer=infer, model=model,
                         max_tokens=max_tokens, goal=goal, params=params, tools=tools, tool_choice=tool_choice,
                         deadline_s=deadline_s)
        reply = await self.request(c.TaskSubmitRequest(to=to, spec=spec.model_dump(mode="json", exclude_none=True)),
                                   c.TaskSubmitted)
        return TaskHandle(self, reply, spec.kind)

    async def offers(self, operation: str = "task.agent") -> list[c.Offer]:
        """Paired peers that would take `operation` now, with their models and tools."""
        return (await self.request(c.OffersRequest(operation=operation), c.OffersReply)).offers

    async def models_ps(self) -> list[c.LoadedModel]:
        """This node's models and their runner processes (loaded or not, pid, memory, idle time)."""
        return (await self.request(c.ModelsPsRequest(), c.ModelsPsReply)).models

    async def worker(self, action: Literal["start", "stop", "status"] = "status") -> c.WorkerReply:
        """Lend this node's compute to paired peers' split models (`start`), stop (`stop`), or
        say how it stands: the RPC server's process, its isolation, the owner served now."""
        return await self.request(c.WorkerRequest(action=action), c.WorkerReply)

    async def mcp_status(self) -> list[c.McpServerState]:
        """The MCP servers the daemon mounted: up or down (and why), their tools, their log file."""
        return (await self.request(c.McpStatusRequest(), c.McpStatusReply)).servers

    async def ui(self, *, port: int | None = None) -> c.UiReply:
        """The dashboard's address (started now if it was not running, at `port` if given, else at
        `[ui] port`) and its login link."""
        return await self.request(c.UiRequest(port=port), c.UiReply)

    def task(self, task_id: str, kind: TaskKind | str | None = None) -> TaskHandle[Any]:
        """A handle on a task this node delegated earlier (e.g. before a restart). Its
        `result()` is typed as `delegate()`'s is: by `kind` if given, else by the kind this
        node's mirror of the task records."""
        from ...protocol.tasks import TaskKind

        return TaskHandle(self, c.TaskSubmitted(task_id=task_id, target="", target_name="", accepted=True),
                          TaskKind(kind) if kind is not None else None)

    async def task_kind(self, task_id: str) -> TaskKind | None:
        """What kind of task this node delegated as `task_id` (None: its mirror no longer holds it)."""
        listed = await self.request(c.TaskListRequest(limit=1000), c.TaskListReply)
        return next((t.kind for t in listed.submitted if t.task_id == task_id), None)

    async def tasks(self, limit: int = 100) -> c.TaskListReply:
        return await self.request(c.TaskListRequest(limit=limit), c.TaskListReply)

    async def audit(self, *, peer: str | None = None, limit: int = 100,
                    denied_only: bool = False) -> list[c.AuditRow]:
        return (await self.request(c.AuditRequest(peer=peer, limit=limit, denied_only=denied_only), c.AuditReply)).rows

    # -- messages between agents -------------------------------------------------------
    async def send(self, to: str, text: str = "", *, body: Mapping[str, Any] | None = None, thread: str = "main",
                   letter_id: str | None = None) -> c.SentLetter:
        """Write a letter to `to` (a paired peer's name or id). It is durable here when this
        returns (state `pending`); the node delivers it, exactly once, in order within
        `thread`, retrying while the peer is away. Passing the same `letter_id` again
        returns the same letter. See `letter()` for its state later."""
        reply = await self.request(_checked(c.MsgSendRequest, to=to, text=text, body=dict(body or {}), thread=thread,
                                              letter_id=letter_id), c.MsgSentReply)
        return reply.letter

    async def serve(self, section: str, *, host: str | None = None, port: int | None = None,
                    api_key_file: str | None = None) -> c.ServeReply:
        """Turn the daemon's OpenAI-compatible endpoint (`openai`) or A2A agent (`a2a`) on now,
        with its config.toml settings and these over them; returns where it listens."""
        return await self.request(_checked(c.ServeRequest, section=section, host=host, port=port,
                                           api_key_file=api_key_file), c.ServeReply)

    async def letter(self, letter_id: str, *, wait: bool = False, until_away: bool = False) -> c.SentLetter:
        """A sent letter's state (`pending`, `delivered`, `refused` with code and reason);
        with `wait`, once it is no longer pending, or (`until_away`) once its recipient has
        been found unreachable (then `away` says since when and why)."""
        if wait:  # may take long: a connection of its own
            framed = await self._open()
            try:
                request = _checked(c.MsgStatusRequest, id=letter_id, wait=True, until_away=until_away)
                return (await self._request_on(framed, request, c.MsgSentReply)).letter
            finally:
                await framed.aclose()
        return (await self.request(_checked(c.MsgStatusRequest, id=letter_id), c.MsgSentReply)).letter

    async def inbox(self, after: int = 0, *, follow: bool = True, limit: int | None = None
                    ) -> AsyncIterator[c.InboxLetter]:
        """Letters from peers, in the order the node released them (within a thread, the
        order they were written), each once: `async for m in node.inbox(): ...`.

        Live by default (it waits for the next letter); `follow=False` ends after the last
        one held now. Resume after a restart with `after` = the last `m.seq` handled."""
        framed = await self._open()  # a stream of its own
        try:
            await framed.send(_checked(c.MsgInboxRequest, after=after, follow=follow, limit=limit))
            while True:
                message = await framed.receive_required()
                if isinstance(message, c.Ok):
                    return
                yield expect(message, c.InboxLetter)
        finally:
            await framed.aclose()

    async def ask(self, to: str, question: str, *, thread: str = "main", params: Mapping[str, Any] | None = None,
                  timeout: float = 120.0) -> c.InboxLetter:
        """Ask `to`'s agent (it needs `msg.ask` from us) and return its answer letter: the
        answer's `text`, and in `body` `ok`, `steps`, `stopped` and the `tool_calls` it made
        (or `error`). `params`: agent params the peer lets us set (max_steps, seed, ...).
        A refused ask raises its RemoteError at once; no answer within `timeout` raises
        TIMEOUT (NetworkTimeout if the ask never reached the peer)."""
        framed = await self._open()  # may take long: a connection of its own
        try:
            reply = await self._request_on(framed, _checked(c.MsgAskRequest, to=to, text=question, thread=thread,
                                                             params=dict(params or {}), timeout_s=timeout),
                                           c.MsgAnswerReply)
        finally:
            await framed.aclose()
        return reply.answer

    # -- web queries -------------------------------------------------------------------------
    async def web_search(self, query: str, *, limit: int = 5, via: str | None = None, relay: str | None = None,
                         hops: int | None = None) -> WebResults:
        """Search the web through a trusted exit (this node opens no connection to the web).
        `via`: the exit; `relay` or `hops=2`: sealed through a relay, so the exit never learns
        who asked. Results are untrusted text."""
        reply = await self.web_query(search=query, limit=limit, via=via, relay=relay, hops=hops)
        assert reply.results is not None
        return reply.results

    async def web_fetch(self, url: str, *, max_chars: int | None = None, via: str | None = None,
                        relay: str | None = None, hops: int | None = None) -> WebPage:
        """Fetch `url`'s readable text through a trusted exit (see web_search), cut to
        `max_chars` (None: the protocol's default, 8000)."""
        reply = await self.web_query(url=url, max_chars=max_chars, via=via, relay=relay, hops=hops)
        assert reply.page is not None
        return reply.page

    async def web_query(self, *, search: str | None = None, url: str | None = None, limit: int = 5,
                        max_chars: int | None = None, via: str | None = None, relay: str | None = None,
                        hops: int | None = None) -> c.WebQueryReply:
        """A search (`search`) or a fetch (`url`, cut to `max_chars`; None: the protocol's
        default), and the way it went (exit, relay)."""
        from ...protocol.web import WebFetch, WebSearch  # its exit key's crypto: not every command's cost

        if (search is None) == (url is None):
            raise PsymeshError("give a search or a url, not both", code=ErrorCode.BAD_REQUEST)
        fetch = {"url": url} if max_chars is None else {"url": url, "max_chars": max_chars}
        query = (_checked(WebSearch, query=search, limit=limit) if search is not None
                 else _checked(WebFetch, **fetch))
        request = _checked(c.WebQueryRequest, search=query if isinstance(query, WebSearch) else None,
                           fetch=query if isinstance(query, WebFetch) else None, via=via, relay=relay, hops=hops)
        return await self.request(request, c.WebQueryReply)

    # -- groups ----------------------------------------------------------------------------
    async def group_create(self, name: str, members: list[str] | None = None) -> c.GroupView:
        """A named list of paired peers (names or ids), kept by this node only."""
        return (await self.request(_checked(c.GroupCreateRequest, name=name, members=members or []), c.GroupReply)).group

    async def group_add(self, name: str, members: list[str]) -> c.GroupView:
        return (await self.request(_checked(c.GroupAddRequest, name=name, members=members), c.GroupReply)).group

    async def group_remove(self, name: str, members: list[str]) -> c.GroupView:
        return (await self.request(_checked(c.GroupRemoveRequest, name=name, members=members), c.GroupReply)).group

    async def groups(self) -> list[c.GroupView]:
        return (await self.request(c.GroupListRequest(), c.GroupsReply)).groups

    async def group_send(self, name: str, text: str = "", *, body: Mapping[str, Any] | None = None
                         ) -> list[c.SentLetter]:
        """One letter to each member of group `name` (thread `group:<name>`), as `send()` would."""
        reply = await self.request(_checked(c.GroupSendRequest, name=name, text=text, body=dict(body or {})), c.GroupSentReply)
        return reply.letters


def _checked(cls: type[R], **fields: Any) -> R:
    """A request built from a caller's arguments: a value out of bounds (a thread name
    too long, a group name with a space) is a BAD_REQUEST naming it, before anything is sent."""
    try:
        return cls(**fields)
    except ValidationError as exc:
        where, what = first_error(exc)
        raise PsymeshError(f"invalid {where or cls.type}: {what}", code=ErrorCode.BAD_REQUEST) from None


def task_spec(task_id: str, *, tool: str | None = None, args: Mapping[str, Any] | None = None,
              infer: str | Sequence[ChatMessage | Mapping[str, Any]] | None = None, model: str | None = None,
              max_tokens: int | None = None, goal: str | None = None, params: Mapping[str, Any] | None = None,
              tools: Sequence[ToolDef | Mapping[str, Any]] | None = None, tool_choice: str | None = None,
              deadline_s: float | None = None) -> TaskSpec:
    """The TaskSpec `delegate()`'s arguments describe, checked here: a mistake is a BAD_REQUEST
    naming the argument (`invalid task: tools[0].name: Field required`), never the daemon's."""
    from ...protocol.tasks import TaskKind, TaskSpec

    if sum(x is not None for x in (tool, infer, goal)) != 1:
        raise PsymeshError("give exactly one of tool=, infer= or goal=", code=ErrorCode.BAD_REQUEST)
    spec: dict[str, Any] = {"id": task_id, "timeout": deadline_s}
    if tool is not None:
        stray = [n for n, v in (("model", model), ("max_tokens", max_tokens), ("params", params), ("tools", tools),
                                ("tool_choice", tool_choice)) if v is not None]
        spec.update(kind=TaskKind.TOOL, tool=tool, args=dict(args or {}))
    elif infer is not None:
        stray = ["args"] if args is not None else []
        spec.update(kind=TaskKind.INFER, model=model, max_tokens=max_tokens, params=dict(params or {}),
                    tools=list(tools) if tools else None, tool_choice=tool_choice)
        if isinstance(infer, str):
            spec["prompt"] = infer
        else:
            spec["messages"] = list(infer)
    else:
        stray = [n for n, v in (("args", args), ("model", model), ("max_tokens", max_tokens), ("tools", tools),
                                ("tool_choice", tool_choice)) if v is not None]
        spec.update(kind=TaskKind.AGENT, goal=goal, params=dict(params or {}))
    if stray:
        kind = spec["kind"].value
        raise PsymeshError(f"invalid task: {', '.join(n + '=' for n in stray)} not taken by a {kind} task",
                           code=ErrorCode.BAD_REQUEST)
    try:
        return TaskSpec.model_validate(spec)
    except ValidationError as exc:
        where, what = first_error(exc)
        head = re.match(r"[^.\[]*", where).group()  # the argument's name, where it differs from the spec's
        where = {"timeout": "deadline_s", "prompt": "infer", "messages": "infer"}.get(head, head) + where[len(head):]
        raise PsymeshError(f"invalid task: {where + ': ' if where else ''}{what}", code=ErrorCode.BAD_REQUEST) from None


class TaskHandle(Generic[T]):
    """A delegated task, as its submitter sees it (from its own node's durable mirror).
    `result()` gives a T: InferResult for an infer task, AgentTaskResult for an agent task,
    the tool's own output for a tool task."""

    def __init__(self, client: Client, submitted: c.TaskSubmitted, kind: TaskKind | None = None) -> None:
        self._client = client
        self.id = submitted.task_id
        self.kind = kind  # None: not known yet (a handle from `Client.task(id)`): result() asks
        self.target = submitted.target
        self.target_name = submitted.target_name
        self.accepted = submitted.accepted
        self.away = submitted.away  # not accepted because the target is unreachable: since when, why
        self._final = submitted.final  # the task had ended when delegate() returned

    def __repr__(self) -> str:
        return f"<TaskHandle {self.id} -> {self.target_name or self.target}>"

    async def events(self, after_seq: int = 0) -> AsyncIterator[TaskEvent]:
        """Every event after `after_seq`, in order, live until the task ends."""
        from ...protocol.tasks import TaskEvent  # (with the task's messages: not what `status` loads)

        async with self._client._side() as lease:
            await lease.framed.send(c.TaskWatchRequest(task_id=self.id, after_seq=after_seq))
            while True:
                message = await lease.framed.receive_required()
                if isinstance(message, c.Ok):
                    lease.clean = True
                    return
                yield expect(message, TaskEvent)

    async def outcome(self) -> Outcome:
        """Wait for the task to end: how it ended (known already if it had when delegate()
        returned; else one request, answered with the final event)."""
        from ...protocol.tasks import TaskEvent

        final = self._final
        if final is None:
            async with self._client._side() as lease:
                final = await self._client._request_on(lease.framed, c.TaskWaitRequest(task_id=self.id), TaskEvent)
                lease.clean = True
        if final.outcome is None:
            raise PsymeshError(f"task {self.id} answered with an event that is not final", code=ErrorCode.INTERNAL)
        return final.outcome

    async def result(self) -> T:
        """Wait for the task to end: its result (typed by the task's kind, see the class), or
        RemoteError with the failure's code. A result that does not read as its kind's raises
        ProtocolError."""
        value = (await self.outcome()).unwrap()
        if self.kind is None:
            self.kind = await self._client.task_kind(self.id)
        reader = _result_model(self.kind)
        if reader is None:
            return cast(T, value)
        try:
            return cast(T, reader.model_validate(value))
        except ValidationError as exc:
            where, what = first_error(exc)
            raise ProtocolError(f"task {self.id}'s result is no {self.kind.value} result: "
                                f"{where + ': ' if where else ''}{what}") from None

    async def cancel(self) -> None:
        await self._client.request(c.TaskCancelRequest(task_id=self.id), c.Ok)

    async def respond(self, data: dict[str, Any]) -> None:
        """Answer the task while it is `input-required` (an agent asking to run an
        irreversible tool: `{"approve": True}` or `{"approve": False}`)."""
        await self._client.request(c.TaskInputRequest(task_id=self.id, data=data), c.Ok)


def _result_model(kind: TaskKind | None) -> type[Message] | None:
    """How a task's result reads, by its kind (None: as it came, a tool task's own output)."""
    from ...protocol.tasks import AgentTaskResult, InferResult, TaskKind

    return {TaskKind.INFER: InferResult, TaskKind.AGENT: AgentTaskResult}.get(kind) if kind is not None else None
