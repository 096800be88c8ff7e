"""An OpenAI-compatible HTTP endpoint inside the daemon, so apps that speak the OpenAI
API use this node's models, and its paired homes' models, unchanged.

    GET  /v1/models               this node's models, and `PEER/MODEL` for each model a
                                  paired peer offers that its grant to us covers
                                  (task.infer, `models=` globs included)
    GET  /v1/models/{id}
    POST /v1/chat/completions     messages, tools, tool_choice, stream (server-sent
                                  events), max_tokens / max_completion_tokens,
                                  temperature, top_p, seed, stop; usage counted

Why in the daemon: the daemon owns the models (one worker thread per model) and the
sessions to paired homes; a second process would load a second copy of a model, or
need a control round trip per token. Starlette on anyio and hypercorn on trio run
in the node's own task group (`[serve.openai]` in config.toml, or `psymesh serve
openai`), bound to 127.0.0.1 unless the owner says otherwise, behind node/bridges/httpguard.py
(a bearer key always, the Host allow-list, no cross-site Origin, JSON bodies).

A request becomes an infer task spec (protocol.tasks.TaskSpec: chat turns with tool
calls, tools, the tool choice) whichever way it runs: on a model of this node through
agent.runtime.generate.generate(), or delegated to the paired home it names (`home/tiny`)
through the node's submitter, where the home's door checks `task.infer:models=...`
and its executor renders the same spec with the same generate(). A reply's
`<tool_call>` text comes back as OpenAI `tool_calls` (finish_reason "tool_calls");
`tool_choice` "required" or a named function constrains decoding so the call is
well formed even from a small model (agent/runtime/infer_task.py).

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 401 for
a missing or wrong key, 403 for a foreign Host or Origin, 415 for a body that is not
application/json, 413 for one over `max_body_bytes`, 400 for one that is not JSON (or
nests past 64) and for a request we cannot take, 404 for an unknown model, 500 (logged
once, by the door) for a bug.

One job, one file (a little over 600 lines): OpenAI's request and reply shapes, the
translation of one into a TaskSpec and of a Generation or an InferResult back, and the three
routes that glue them; each part is only read with the others beside it.
"""
from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .apikey import ApiKey
from ..core.commands import Commands
from ..core.bridgeconfig import OpenAIServe
from ..tasks.ids import new_task_id
from .httpguard import AllowedHosts, GuardRules, HttpGuard, Refusal, http_status
from .httpserve import serve_face
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.manifest import Operation, check, grants_kind
from ...protocol.tasks import EventKind, InferCall, InferResult, TaskKind, TaskSpec

if TYPE_CHECKING:
    from ..door.trust import TrustStore
    from ..models import ModelPool
    from ..tasks.submitter import Offers, TaskSubmitter

log = logging.getLogger("psymesh.openai")

DEFAULT_MAX_TOKENS = 1024   # when the request names none (OpenAI's default is "the rest of the context")
DELEGATED_TIMEOUT_S = 600   # a delegated completion's deadline: a request nobody waits for must end
OFFERS_TIMEOUT_S = 3.0      # how long GET /v1/models waits for each paired peer's list

# -------------------------------------------------------------------------------- errors

_TYPES: Mapping[int, str] = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
                             404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
                             415: "invalid_request_error", 429: "rate_limit_error"}


class ApiError(Exception):
    """A request answered with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = status, message, code, param, retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        extra = {"Retry-After": str(math.ceil(self.retry_after))} if self.retry_after else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**extra, **(headers or {})})

    @classmethod
    def of(cls, exc: PsymeshError, *, model: str | None = None) -> ApiError:
        status = http_status(exc.code)
        code = "model_not_found" if status == 404 and model is not None else exc.code.value
        param = {"model_not_found": "model", ErrorCode.UNSUPPORTED.value: "tools"}.get(code)
        return cls(status, exc.message, code=code, param=param, retry_after=exc.retry_after)


def _validation_error(exc: ValidationError, what: str) -> ApiError:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{what}: {where + ': ' if where else ''}{message}", param=where or None,
                    code="invalid_request")


# -------------------------------------------------------------------------------- requests


class _Body(BaseModel):
    """OpenAI's request shapes: what we do not use is ignored, as OpenAI's own servers do."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class _TextPart(_Body):
    type: Literal["text", "input_text"]
    text: str


class _CallFunction(_Body):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class _ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: _CallFunction


class _Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None


class _Function(_Body):
    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class _Tool(_Body):
    type: Literal["function"]
    function: _Function


class _NamedFunction(_Body):
    name: str


class _NamedChoice(_Body):
    type: Literal["function"]
    function: _NamedFunction


class _StreamOptions(_Body):
    include_usage: bool = False


class ChatRequest(_Body):
    """POST /v1/chat/completions, checked. `top_k`, `min_p`, `grammar` (GBNF for the
    whole reply) and `ban_bytes` (ASCII only, for random-weight test models) are
    extensions; llama.cpp's server takes the first three as well."""

    model: str = Field(min_length=1)
    messages: list[_Message] = Field(min_length=1)
    tools: list[_Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | _NamedChoice | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=1)  # one choice per request
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    ban_bytes: bool | None = None
    grammar: str | None = None

    def check_supported(self) -> None:
        """Refuse what would silently change the answer if ignored."""
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ApiError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format",
                           code="unsupported_parameter")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ApiError(400, "at most 4 stop sequences", param="stop", code="invalid_request")

    def spec(self, model: str) -> TaskSpec:
        """This request as an infer task for `model` (its name where it runs)."""
        choice: str | None = self.tool_choice.function.name if isinstance(self.tool_choice, _NamedChoice) \
            else self.tool_choice
        params: dict[str, Any] = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                                    ("seed", self.seed), ("stop", self.stop), ("top_k", self.top_k),
                                                    ("min_p", self.min_p), ("ban_bytes", self.ban_bytes),
                                                    ("grammar", self.grammar))
                                  if v is not None}
        spec = {"id": new_task_id(), "kind": TaskKind.INFER, "model": model, "params": params,
                "messages": _turns(self.messages), "max_tokens": self.max_completion_tokens or self.max_tokens
                or DEFAULT_MAX_TOKENS, "tool_choice": choice, "timeout": DELEGATED_TIMEOUT_S,
                "tools": None if self.tools is None else [
                    {"name": t.function.name, "description": t.function.description,
                     "parameters": t.function.parameters} for t in self.tools]}
        try:
            return TaskSpec.model_validate(spec)
        except ValidationError as exc:
            raise _validation_error(exc, "invalid request") from None


def _text(content: str | list[_TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def _turns(messages: list[_Message]) -> list[dict[str, Any]]:
    """OpenAI's messages as the task's chat turns (`developer` is a system turn; call
    arguments parsed from their JSON text)."""
    turns = []
    for i, m in enumerate(messages):
        calls = []
        for j, call in enumerate(m.tool_calls or ()):
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ApiError(400, "tool call arguments must be a JSON object",
                               param=f"messages.{i}.tool_calls.{j}.function.arguments", code="invalid_request")
            calls.append({"id": call.id, "name": call.function.name, "arguments": arguments})
        turns.append({"role": "system" if m.role == "developer" else m.role, "content": _text(m.content),
                      "name": m.name if m.role != "tool" else None, "tool_calls": calls or None,
                      "tool_call_id": m.tool_call_id if m.role == "tool" else None})
    return turns


# -------------------------------------------------------------------------------- replies


@dataclass(frozen=True)
class Finished:
    """How a completion ended, from a local Generation or a delegated task's result."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    content: str | None
    tool_calls: list[InferCall] = field(default_factory=list)

    @classmethod
    def of_result(cls, value: Any) -> Finished:
        """An infer task's result (protocol.tasks.InferResult, built by node/tasks/executor.py)."""
        result = InferResult.model_validate(value)
        calls = list(result.tool_calls or [])
        content = result.text if result.content is None else result.content
        reason = result.finish_reason
        return cls(finish_reason="stop" if reason == "cancelled" else reason,
                   prompt_tokens=result.usage.prompt_tokens, completion_tokens=result.usage.completion_tokens,
                   content=content if content or not calls else None, tool_calls=calls)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def openai_calls(self, *, indexed: bool = False) -> list[dict[str, Any]]:
        return [{**({"index": i} if indexed else {}), "id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                for i, c in enumerate(self.tool_calls)]


Piece = str | Finished


class VisibleText:
    """The streamed text a client should see: with tools offered, everything before the
    first call (`<tool_call>`, `[TOOL_CALLS]` or `<|python_tag|>`, as the model's tool family
    writes it: agent/formats/families.py), which comes back parsed, as `tool_calls`. A suffix that
    may be the start of such a marker is held back until the next delta tells."""

    def __init__(self, hide_calls: bool) -> None:
        from ...agent.formats.families import CALL_OPENERS

        self.hide_calls, self.openers = hide_calls, CALL_OPENERS
        self._held = ""
        self._in_calls = False

    def feed(self, delta: str) -> str:
        if not self.hide_calls:
            return delta
        if self._in_calls:
            return ""
        text = self._held + delta
        found = [at for at in (text.find(m) for m in self.openers) if at >= 0]
        if found:
            self._in_calls, self._held = True, ""
            return text[:min(found)]
        keep = max(next((k for k in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:k])), 0)
                   for m in self.openers)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self._held = ("" if self._in_calls else self._held), ""
        return held


# -------------------------------------------------------------------------------- the endpoint


@dataclass(frozen=True)
class OpenAIParts:
    """What the endpoint uses of its node (wired in node/daemon.py): this node's peer id,
    its models, the paired peers, the submitter a delegated completion goes through and
    how a peer's offered models are asked for."""

    peer_id: str
    models: ModelPool
    trust: TrustStore
    submitter: TaskSubmitter
    offers: Offers
    commands: Commands = Commands()  # how its log spells the command that prints its key


@dataclass(frozen=True)
class _Target:
    """Where a model name runs: here (peer_id None), or on a paired peer."""

    model: str
    peer_id: str | None = None


class OpenAIEndpoint:
    """The endpoint of one node; `run` serves it in the node's task group."""

    def __init__(self, node: OpenAIParts, settings: OpenAIServe, key: ApiKey) -> None:
        self.node = node
        self.settings = settings
        self.key = key
        self.url: str | None = None   # http://HOST:PORT once listening
        routes = Starlette(
            routes=[Route("/v1/models", self._models, methods=["GET"]),
                    Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                    Route("/v1/chat/completions", self._chat, methods=["POST"])],
            exception_handlers={HTTPException: self._http_error})
        # The door of the HTTP face (node/bridges/httpguard.py): Host, Origin, the key, JSON bodies within
        # max_body_bytes; it also answers (and logs) what no route caught, as a 500 in OpenAI's shape.
        self.app = HttpGuard(routes, GuardRules(key=key.value, hosts=AllowedHosts.of(settings.host_names()),
                                                max_body=settings.max_body_bytes), _refused)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await serve_face(self.app, self.settings.host, self.settings.port, what="the OpenAI-compatible endpoint",
                         port_hint="[serve.openai] port, or --port", errorlog="psymesh.openai.http",
                         on_listening=self._listening, task_status=task_status)

    def _listening(self, url: str) -> None:
        self.url = url
        log.info("OpenAI-compatible endpoint at %s/v1 (its key: %s; %s)",
                 self.url, self.key.source, self.node.commands("serve openai", "--show-key"))

    # -- requests past the door ---------------------------------------------------------
    @staticmethod
    async def _body(request: Request) -> Any:
        """The request's JSON: the door read it, within the limit, and saw that it parses."""
        return json.loads(await request.body())

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed here"}.get(
            exc.status_code, exc.detail)
        return ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None).response()

    # -- models -------------------------------------------------------------------------
    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await self.model_list()})

    async def _model(self, request: Request) -> Response:
        name = request.path_params["model"]
        for entry in await self.model_list():
            if entry["id"] == name:
                return JSONResponse(entry)
        return ApiError(404, f"no model {name!r} here or on a paired peer", code="model_not_found",
                        param="model").response()

    async def model_list(self) -> list[dict[str, Any]]:
        """This node's models, then `PEER/MODEL` for each model a paired peer offers and
        its grant to us lets us run (peers that do not answer in time are left out)."""
        entries = [{"id": name, "object": "model", "created": 0, "owned_by": "psymesh"}
                   for name in self.node.models.registry.names()]
        offered: dict[str, list[str]] = {}

        async def ask(peer_id: str) -> None:
            with anyio.move_on_after(OFFERS_TIMEOUT_S):
                try:
                    offered[peer_id] = (await self.node.offers(peer_id)).models
                except PsymeshError:
                    pass

        now = time.time()
        # A peer is asked for its list when its grant to us holds any task.infer (one naming
        # models, `models=botpsy*`, included); each model it offers is then checked by name.
        peers = [p for p in self.node.trust.list(include_revoked=False)
                 if p.received is not None and grants_kind(p.received, "task.infer", local_peer_id=p.peer_id,
                                                           remote_peer_id=self.node.peer_id, now=now)]
        async with anyio.create_task_group() as tg:
            for peer in peers:
                tg.start_soon(ask, peer.peer_id)
        for peer in peers:
            for model in offered.get(peer.peer_id, []):
                if self._may_infer(peer.received, peer.peer_id, model, now):
                    entries.append({"id": f"{peer.name}/{model}", "object": "model", "created": 0,
                                    "owned_by": peer.name})
        return entries

    def _may_infer(self, grant: Any, peer_id: str, model: str, now: float) -> bool:
        return grant is not None and check(grant, Operation.infer(model), local_peer_id=peer_id,
                                           remote_peer_id=self.node.peer_id, now=now).allowed

    def _target(self, name: str) -> _Target:
        """`name` is a model of this node, or `PEER/MODEL` with PEER a paired peer's name or id."""
        if name in self.node.models.registry.names():
            return _Target(name)
        head, sep, rest = name.partition("/")
        while sep:
            try:
                peer = self.node.trust.resolve(head)
            except PsymeshError:
                peer = None
            if peer is not None and not peer.revoked and rest:
                return _Target(rest, peer.peer_id)
            more, sep, rest = rest.partition("/")
            head = f"{head}/{more}"
        known = ", ".join(self.node.models.registry.names()) or "none"
        raise ApiError(404, f"no model {name!r} on this node (its models: {known}) and no paired peer named by "
                            "its first part (PEER/MODEL runs MODEL on that peer)", code="model_not_found",
                       param="model")

    # -- chat completions ---------------------------------------------------------------
    async def _chat(self, request: Request) -> Response:
        model: str | None = None
        try:
            raw = await self._body(request)
            if not isinstance(raw, dict):
                raise ApiError(400, "the request body must be a JSON object", code="invalid_request")
            try:
                req = ChatRequest.model_validate(raw)
            except ValidationError as exc:
                raise _validation_error(exc, "invalid request") from None
            req.check_supported()
            model = req.model
            target = self._target(req.model)
            spec = req.spec(target.model)
            pieces = self._local(spec) if target.peer_id is None else self._remote(target.peer_id, spec)
            first = await self._first(pieces)  # errors before the first token get their HTTP status
        except ApiError as exc:
            return exc.response()
        except PsymeshError as exc:
            return ApiError.of(exc, model=model).response()
        reply = _Reply(req, spec)
        if req.stream:
            return StreamingResponse(reply.events(first, pieces), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return JSONResponse(await reply.whole(first, pieces))
        except PsymeshError as exc:
            return ApiError.of(exc, model=model).response()

    @staticmethod
    async def _first(pieces: AsyncIterator[Piece]) -> Piece:
        try:
            return await pieces.__anext__()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await pieces.aclose()  # type: ignore[attr-defined]
            raise

    async def _local(self, spec: TaskSpec) -> AsyncIterator[Piece]:
        """A completion on a model of this node: the same generate() an infer task runs."""
        from ...agent.runtime.generate import Generation, generate
        from ...agent.runtime.infer_task import infer_inputs

        assert spec.model is not None and spec.max_tokens is not None
        inputs = infer_inputs(spec, spec.max_tokens)
        worker = await self.node.models.get(spec.model)
        async with aclosing(generate(worker, inputs.messages, tools=inputs.tools, params=inputs.params)) as gen:
            async for piece in gen:
                if isinstance(piece, Generation):
                    reply = piece.reply
                    # the model's own parse, not wire input: taken as it is (model_construct), as before
                    calls = [InferCall.model_construct(id=c.id, name=c.name, arguments=c.arguments)
                             for c in piece.tool_calls]
                    content = piece.text if reply is None else reply.content
                    reason = "stop" if piece.finish_reason == "cancelled" else piece.finish_reason
                    yield Finished(finish_reason=reason, prompt_tokens=piece.usage.prompt_tokens,
                                   completion_tokens=piece.usage.completion_tokens,
                                   content=content if content or not calls else None, tool_calls=calls)
                    return
                yield piece.text

    async def _remote(self, peer_id: str, spec: TaskSpec) -> AsyncIterator[Piece]:
        """A completion delegated to a paired peer as an infer task: its token events as
        they are mirrored here, then its result. Canceled there if the client goes away."""
        submitter = self.node.submitter
        _, accepted, _ = await submitter.submit(spec, peer_id, self.node.offers)
        ended = False
        try:
            if not accepted:
                peer = self.node.trust.get(peer_id)
                raise PsymeshError(f"{peer.name if peer else peer_id} cannot be reached now; try again later",
                                   code=ErrorCode.UNAVAILABLE, retry_after=5)
            sent = 0
            while True:
                events = submitter.outbox.events_after(spec.id, sent)
                for event in events:
                    sent = event.seq
                    if event.kind is EventKind.TOKEN:
                        yield event.data["text"]
                    elif event.kind is EventKind.REQUEUED:  # output so far is void, and the client has it
                        raise PsymeshError("the peer restarted in the middle of the reply; ask again",
                                           code=ErrorCode.UNAVAILABLE)
                    outcome = event.outcome
                    if outcome is not None:
                        ended = True
                        yield Finished.of_result(outcome.unwrap())
                        return
                if not events:  # no await since the read: no event can slip by
                    await submitter.changed.wait(spec.id)
        finally:
            if not ended:
                with anyio.CancelScope(shield=True):
                    try:
                        await submitter.cancel(spec.id)
                    except PsymeshError as exc:
                        log.info("could not cancel delegated completion %s: %s", spec.id, exc)


class _Reply:
    """One chat completion's answer, whole or as server-sent events."""

    def __init__(self, req: ChatRequest, spec: TaskSpec) -> None:
        self.req = req
        self.id = f"chatcmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.visible = VisibleText(hide_calls=bool(spec.tools) and spec.tool_choice != "none")

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.req.model}

    async def whole(self, first: Piece, pieces: AsyncIterator[Piece]) -> dict[str, Any]:
        async with aclosing(pieces):  # type: ignore[type-var]
            piece = first
            while not isinstance(piece, Finished):
                piece = await pieces.__anext__()
        message: dict[str, Any] = {"role": "assistant", "content": piece.content}
        if piece.tool_calls:
            message["tool_calls"] = piece.openai_calls()
        return {**self._head("chat.completion"),
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": piece.finish_reason}],
                "usage": piece.usage()}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        chunk = {**self._head("chat.completion.chunk"),
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if self._usage:
            chunk["usage"] = None
        return _sse(chunk)

    @property
    def _usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    async def events(self, first: Piece, pieces: AsyncIterator[Piece]) -> AsyncIterator[bytes]:
        """`data: {chunk}` per delta, the calls, the finish reason (and usage), `data: [DONE]`.
        A failure after the first byte can only be told in the stream: an `error` event."""
        async with aclosing(pieces):  # type: ignore[type-var]
            yield self._chunk({"role": "assistant", "content": ""})
            piece = first
            try:
                while not isinstance(piece, Finished):
                    text = self.visible.feed(piece)
                    if text:
                        yield self._chunk({"content": text})
                    piece = await pieces.__anext__()
            except PsymeshError as exc:
                yield _sse(ApiError.of(exc).body())
                return
            rest = self.visible.flush()
            if rest and not piece.tool_calls:
                yield self._chunk({"content": rest})
            if piece.tool_calls:
                yield self._chunk({"tool_calls": piece.openai_calls(indexed=True)})
            yield self._chunk({}, piece.finish_reason)
            if self._usage:
                yield _sse({**self._head("chat.completion.chunk"), "choices": [], "usage": piece.usage()})
            yield b"data: [DONE]\n\n"


def _refused(refusal: Refusal) -> Response:
    """A request the door refused, in OpenAI's error shape (the check is the error's code)."""
    return ApiError(refusal.status, refusal.message, code=refusal.check.value).response(refusal.headers)


def _sse(data: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
