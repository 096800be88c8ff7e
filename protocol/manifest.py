"""Capability manifests: what one peer may ask of another, signed by the one that grants it.

A manifest is issued by a node (the *issuer*, e.g. the home PC) to a paired peer (the
*subject*, e.g. a phone). It lists capabilities and numeric limits and is signed with
the issuer's Ed25519 identity key, so its integrity can be checked from the issuer's
peer id alone (the key is inside the id). The issuer enforces it on every request with
`check()`, an ordered, pure checklist; anything no capability covers is denied.

Capabilities, with their CLI spelling (`parse_capability`):

    task.infer[:models=GLOB[,GLOB...][,max_tokens=N]]   run a completion on one of these models
    task.agent                                          run the agent loop (its tool calls are
                                                        checked one by one as `tool:` operations)
    tool:PATTERN                                        call a tool; PATTERN is a glob (`files.*`)
    web.fetch[:domains=PATTERN[,PATTERN...]]            fetch from these hosts (default: any)
    web.search   msg.send   msg.ask   relay
    web.relay                                           forward web queries sealed to an exit
                                                        (two-hop private web, protocol/web.py)
    mail.deposit                                        leave sealed letters here for a peer that
                                                        named this node its mailbox (protocol/mailbox.py)
    compute.rpc                                         run a share of its split model on this node
                                                        (llama.cpp RPC, protocol/compute.py; in no preset:
                                                        granted by name; its budget is `rpc_memory_mb`)

Domain patterns: `example.com` matches that host only; `*.example.com` matches every
subdomain at any depth (`a.example.com`, `a.b.example.com`) but not `example.com`
itself, so grant both when both are meant; `*` matches any host. IP literals match
only exactly or by `*`. Hosts are compared lowercase, in IDNA (punycode) form, without
a trailing dot. Whether an allowed host resolves to a private address is the fetcher's
concern, not the manifest's.

The signature covers a canonical msgpack encoding (protocol/signing.py): map keys
sorted, `None` fields left out, no floats (timestamps are integer seconds). Unknown fields are rejected
rather than ignored, since an ignored field could be a restriction.

On `/psymesh/manifest/1.0.0` the issuer hands its subject the current grant
(`ManifestPush`) and, when the owner revokes the pairing, a signed notice of that
(`ManifestRevoke`), so the subject stops using a grant that no longer holds.
"""

import fnmatch
import functools
import ipaddress
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ErrorCode, PsymeshError
from .identity import PeerId
from .limits import Limits
from .messages import Message
from .signing import Signed

MANIFEST_VERSION = 1

# Capability kinds and the parameters each accepts. `tool` is spelled `tool:PATTERN`.
_PARAMS: dict[str, frozenset[str]] = {
    "task.infer": frozenset({"models", "max_tokens"}),
    "task.agent": frozenset(),
    "tool": frozenset(),
    "web.fetch": frozenset({"domains"}),
    "web.search": frozenset(),
    "web.relay": frozenset(),
    "msg.send": frozenset(),
    "msg.ask": frozenset(),
    "relay": frozenset(),
    "mail.deposit": frozenset(),
    "compute.rpc": frozenset(),
}
KINDS: frozenset[str] = frozenset(_PARAMS)

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_TOOL_PATTERN = re.compile(r"^[A-Za-z0-9_.\-*?]{1,128}$")
_MODEL_PATTERN = re.compile(r"^[^\s,=]{1,200}$")
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


# ---------------------------------------------------------------------------- hosts


@functools.lru_cache(maxsize=256)
def normalize_host(host: str) -> str:
    """Lowercase, no trailing dot, IDNA (punycode) form; IP literals in compressed form.
    A pure function of the text, asked for every web query's host on each node it passes
    (an IP parse and an IDNA encode each): kept for the last 256 hosts (errors are not)."""
    text = host.strip().rstrip(".").lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    try:
        ascii_host = text.encode("idna").decode("ascii")
    except UnicodeError:
        raise PsymeshError(f"not a valid host name: {host[:80]!r}", code=ErrorCode.BAD_REQUEST) from None
    labels = ascii_host.split(".")
    if len(ascii_host) > 253 or not all(_LABEL.match(label) for label in labels):
        raise PsymeshError(f"not a valid host name: {host[:80]!r}", code=ErrorCode.BAD_REQUEST)
    return ascii_host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def normalize_domain_pattern(pattern: str) -> str:
    text = pattern.strip()
    if text == "*":
        return text
    if text.startswith("*."):
        suffix = normalize_host(text[2:])
        if _is_ip(suffix):
            raise PsymeshError(f"a wildcard cannot apply to an IP address: {pattern!r}", code=ErrorCode.BAD_REQUEST)
        return "*." + suffix
    if "*" in text:
        raise PsymeshError(
            f"bad domain pattern {pattern!r}: use `example.com`, `*.example.com` or `*`", code=ErrorCode.BAD_REQUEST
        )
    return normalize_host(text)


def _as_value_error(fn: Any, value: str) -> str:
    """Run a normalizer inside a pydantic validator, where errors must be ValueError."""
    try:
        return fn(value)
    except PsymeshError as exc:
        raise ValueError(exc.message) from None


def domain_matches(pattern: str, host: str) -> bool:
    """`host` must already be normalized (see `normalize_host`)."""
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return not _is_ip(host) and host.endswith(pattern[1:])
    return host == pattern


# ---------------------------------------------------------------------------- operations


class Operation(BaseModel):
    """One request, described by what the manifest needs to judge it.

    `name` is a capability kind (`tool` for tool calls). For `task.infer` the node
    should pass the model it will actually run and the `max_tokens` it was asked for
    (None: the node's default, capped by the grant; see `Decision.max_tokens`).
    """

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    name: str
    tool: str | None = None
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    domain: str | None = None
    payload_bytes: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _shape(self) -> "Operation":
        if self.name not in KINDS:
            raise ValueError(f"unknown operation {self.name!r}")
        if (self.tool is not None) != (self.name == "tool"):
            raise ValueError("`tool` is required for, and only for, tool operations")
        if self.tool is not None and not _TOOL_NAME.match(self.tool):
            raise ValueError(f"bad tool name {self.tool!r}")
        if (self.domain is not None) != (self.name == "web.fetch"):
            raise ValueError("`domain` is required for, and only for, web.fetch")
        return self

    @field_validator("domain")
    @classmethod
    def _host(cls, value: str | None) -> str | None:
        return None if value is None else _as_value_error(normalize_host, value)

    @classmethod
    def tool_call(cls, tool: str, payload_bytes: int = 0) -> "Operation":
        return cls(name="tool", tool=tool, payload_bytes=payload_bytes)

    @classmethod
    def infer(cls, model: str | None, max_tokens: int | None = None, payload_bytes: int = 0) -> "Operation":
        return cls(name="task.infer", model=model, max_tokens=max_tokens, payload_bytes=payload_bytes)

    @classmethod
    def fetch(cls, url: str, payload_bytes: int = 0) -> "Operation":
        """A web.fetch of `url` (only its host matters to the manifest)."""
        return _fetch_operation(url, payload_bytes)

    def required(self) -> str:
        """The narrowest capability that would allow this request, in CLI spelling."""
        if self.name == "tool":
            return f"tool:{self.tool}"
        if self.name == "task.infer":
            parts = [f"models={self.model}"] if self.model else []
            if self.max_tokens is not None:
                parts.append(f"max_tokens={self.max_tokens}")
            return "task.infer" + (":" + ",".join(parts) if parts else "")
        if self.name == "web.fetch":
            return f"web.fetch:domains={self.domain}"
        return self.name


@functools.lru_cache(maxsize=256)
def _fetch_operation(url: str, payload_bytes: int) -> Operation:
    """`Operation.fetch`, kept per URL (a frozen model, so one can be shared): the phone's route
    and the exit's door judge each web.fetch by it, and parsed the same URL each time."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    if not host:
        raise PsymeshError(f"not a URL with a host: {url[:120]!r}", code=ErrorCode.BAD_REQUEST)
    return Operation(name="web.fetch", domain=normalize_host(host), payload_bytes=payload_bytes)


# ---------------------------------------------------------------------------- capabilities


class Capability(BaseModel):
    """One grant. `name` is a kind, or `tool:PATTERN`; parameters narrow it (None: any)."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    name: str = Field(max_length=140)
    models: tuple[str, ...] | None = Field(default=None, min_length=1, max_length=32)
    max_tokens: int | None = Field(default=None, ge=1)
    domains: tuple[str, ...] | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _shape(self) -> "Capability":
        kind = self.kind
        if kind not in KINDS or (kind == "tool") != self.name.startswith("tool:"):
            raise ValueError(f"unknown capability {self.name!r} (known: {', '.join(sorted(KINDS - {'tool'}))}, tool:NAME)")
        if kind == "tool" and not _TOOL_PATTERN.match(self.name[5:]):
            raise ValueError(f"bad tool pattern {self.name[5:]!r}: letters, digits, `_.-` and globs `*?`")
        present = {p for p in ("models", "max_tokens", "domains") if getattr(self, p) is not None}
        extra = present - _PARAMS[kind]
        if extra:
            raise ValueError(f"{kind} takes no {', '.join(sorted(extra))}")
        for glob in self.models or ():
            if not _MODEL_PATTERN.match(glob):
                raise ValueError(f"bad model pattern {glob!r}")
        return self

    @field_validator("domains")
    @classmethod
    def _domain_patterns(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if value is None else tuple(_as_value_error(normalize_domain_pattern, d) for d in value)

    @property
    def kind(self) -> str:
        return "tool" if self.name.startswith("tool:") else self.name

    def covers(self, op: Operation) -> bool:
        """Does this grant allow `op`? (Numeric limits are checked separately.)"""
        if op.name != self.kind:
            return False
        if self.kind == "tool":
            return fnmatch.fnmatchcase(op.tool or "", self.name[5:])
        if self.kind == "task.infer":
            if self.models is not None and (
                op.model is None or not any(fnmatch.fnmatchcase(op.model, g) for g in self.models)
            ):
                return False
            return self.max_tokens is None or op.max_tokens is None or op.max_tokens <= self.max_tokens
        if self.kind == "web.fetch":
            return self.domains is None or any(domain_matches(p, op.domain or "") for p in self.domains)
        return True

    def __str__(self) -> str:
        params = []
        if self.models is not None:
            params.append("models=" + ",".join(self.models))
        if self.max_tokens is not None:
            params.append(f"max_tokens={self.max_tokens}")
        if self.domains is not None:
            params.append("domains=" + ",".join(self.domains))
        return self.name + (":" + ",".join(params) if params else "")


def parse_capability(text: str) -> Capability:
    """`task.infer:models=botpsy*,qwen*,max_tokens=2048` -> Capability (BAD_REQUEST if not).

    After the kind, comma-separated tokens; a token with `=` starts a parameter and the
    tokens after it without `=` add more values to it.
    """
    text = text.strip()
    if len(text) > 4096:
        raise PsymeshError("capability string too long", code=ErrorCode.BAD_REQUEST)
    if text.startswith("tool:"):
        return _capability(name=text)
    kind, _, rest = text.partition(":")
    params: dict[str, list[str]] = {}
    current: list[str] | None = None
    for token in (t.strip() for t in rest.split(",")) if rest else ():
        if "=" in token:
            key, _, value = token.partition("=")
            key = key.strip()
            if key in params:
                raise PsymeshError(f"{key!r} given twice in {text!r}", code=ErrorCode.BAD_REQUEST)
            current = params[key] = []
            token = value.strip()
        if current is None:
            raise PsymeshError(f"expected key=value after {kind!r} in {text!r}", code=ErrorCode.BAD_REQUEST)
        if not token:
            raise PsymeshError(f"empty value in {text!r}", code=ErrorCode.BAD_REQUEST)
        current.append(token)
    fields: dict[str, Any] = {"name": kind.strip()}
    for key, values in params.items():
        if key in ("models", "domains"):
            fields[key] = tuple(values)
        elif key == "max_tokens" and len(values) == 1 and values[0].isdigit():
            fields[key] = int(values[0])
        elif key == "max_tokens":
            raise PsymeshError(f"max_tokens must be one whole number, not {','.join(values)!r}", code=ErrorCode.BAD_REQUEST)
        else:
            raise PsymeshError(f"unknown parameter {key!r} in {text!r}", code=ErrorCode.BAD_REQUEST)
    return _capability(**fields)


def _capability(**fields: Any) -> Capability:
    try:
        return Capability(**fields)
    except ValidationError as exc:
        raise PsymeshError(f"bad capability: {exc.errors()[0]['msg'].removeprefix('Value error, ')}",
                           code=ErrorCode.BAD_REQUEST) from None


# ---------------------------------------------------------------------------- manifest


class Manifest(Signed, BaseModel):
    """A signed grant from `issuer` to `subject`. Timestamps are integer Unix seconds;
    `expires=None` means valid until the pairing is revoked. `serial` lets a newer
    grant for the same subject replace an older one."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    signing_context: ClassVar[bytes] = b"psymesh/manifest/v1\x00"
    signer_field: ClassVar[str] = "issuer"
    signer_role: ClassVar[str] = "issuer"

    v: Literal[1] = MANIFEST_VERSION
    issuer: PeerId
    subject: PeerId
    capabilities: tuple[Capability, ...] = Field(max_length=128)
    limits: Limits = Limits()
    not_before: int = Field(ge=0)
    expires: int | None = Field(default=None, ge=0)
    serial: int = Field(ge=0, lt=2**63)
    signature: bytes = Field(default=b"", max_length=64)


    @model_validator(mode="after")
    def _dates(self) -> "Manifest":
        if self.expires is not None and self.expires <= self.not_before:
            raise ValueError("expires must be after not_before")
        return self

    def grants(self) -> list[str]:
        return [str(c) for c in self.capabilities]



def new_manifest(
    issuer: str,
    subject: str,
    capabilities: Iterable[Capability | str],
    *,
    now: float,
    ttl: float | None = None,
    limits: Limits | None = None,
    serial: int | None = None,
) -> Manifest:
    """An unsigned manifest valid from `now` for `ttl` seconds (None: until revoked).
    The default serial is `now` in milliseconds, so a later grant has a larger one."""
    caps = tuple(parse_capability(c) if isinstance(c, str) else c for c in capabilities)
    start = int(now)
    try:
        return Manifest(
            issuer=issuer,
            subject=subject,
            capabilities=caps,
            limits=limits or Limits(),
            not_before=start,
            expires=None if ttl is None else start + max(1, int(ttl)),
            serial=int(now * 1000) if serial is None else serial,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise PsymeshError(f"bad manifest: {first['msg']}", code=ErrorCode.BAD_REQUEST) from None


# What a paired device may ask of the node that issued the grant.
PRESETS: dict[str, tuple[tuple[str, ...], Limits]] = {
    "phone": (
        ("task.infer", "task.agent", "tool:system.info", "tool:files.*", "web.fetch", "web.search",
         "msg.send", "msg.ask", "mail.deposit"),
        Limits(requests_per_minute=60, concurrent_tasks=2, max_runtime_s=600, max_payload_bytes=1024 * 1024),
    ),
    "messaging": (
        ("msg.send", "msg.ask"),
        Limits(requests_per_minute=30, concurrent_tasks=1, max_runtime_s=120, max_payload_bytes=64 * 1024),
    ),
}


_EXPLAINED = {
    "task.infer": "run a chat completion on this node's model(s)",
    "task.agent": "run this node's agent on a goal (each tool it calls is checked as tool:NAME)",
    "web.fetch": "fetch web pages through this node, its exit to the web (`web fetch --via`), "
                 "outside any task; not the tool:web.fetch of a task",
    "web.search": "search the web through this node, its exit to the web (`web search --via`), "
                  "outside any task; not the tool:web.search of a task",
    "web.relay": "pass its sealed web queries on to another exit (two hops; this node sees no query)",
    "msg.send": "send letters to this node's inbox",
    "msg.ask": "ask this node's agent a question by letter, and get its answer",
    "relay": "reserve a slot on this node's circuit relay, to be reached through it",
    "mail.deposit": "leave sealed letters here for a peer that named this node its mailbox",
    "compute.rpc": "run layers of its split model on this node's CPU and memory, through llama.cpp's RPC "
                   "(up to the limit rpc_memory_mb); it can run any computation there",
}


def explain_capability(text: str) -> str:
    """What granting `text` (CLI spelling) lets the peer do, in a few words for a person
    ticking it: `tool:web.fetch` (a tool its tasks may call here) reads apart from
    `web.fetch` (this node fetching for the peer as its web exit)."""
    try:
        cap = parse_capability(text)
    except PsymeshError:
        return ""
    if cap.kind == "tool":
        pattern = cap.name[5:]
        tool = "any tool" if pattern == "*" else f"the tools {pattern}" if "*" in pattern else f"the tool {pattern}"
        return f"call {tool} on this node inside a task it sends (a task's step, run here)"
    explained = _EXPLAINED.get(cap.kind, "")
    if cap.domains is not None:
        explained += f"; only from {', '.join(cap.domains)}"
    if cap.models is not None:
        explained += f"; only {', '.join(cap.models)}"
    return explained


def limits_for(capabilities: Iterable[str]) -> Limits:
    """The limits of a new grant told none (e.g. `grant PEER +msg.send` to a peer granted
    nothing yet): those of the first preset, fewest capabilities first, whose kinds cover
    every one of `capabilities`; else the `phone` preset's. A grant never starts unlimited
    unless its owner says so (`--limits` with no limit)."""
    kinds = {parse_capability(c).kind for c in capabilities}
    for caps, limits in sorted(PRESETS.values(), key=lambda p: len(p[0])):
        if kinds <= {parse_capability(c).kind for c in caps}:
            return limits
    return PRESETS["phone"][1]


def edit_capabilities(current: Iterable[str], add: Iterable[str] = (), remove: Iterable[str] = ()) -> list[str]:
    """`current` with `remove` taken out and `add` put in (each in CLI spelling, compared
    as parsed, so `tool:files.*` and ` tool:files.* ` are one). Removing one that is not
    there is a BAD_REQUEST naming what is; adding one already there changes nothing."""
    out = [str(parse_capability(c)) for c in current]
    for text in remove:
        cap = str(parse_capability(text))
        if cap not in out:
            raise PsymeshError(f"the grant has no {cap} to remove (it has: {', '.join(out) or 'nothing'})",
                               code=ErrorCode.BAD_REQUEST)
        out.remove(cap)
    for text in add:
        if (cap := str(parse_capability(text))) not in out:
            out.append(cap)
    return out


def preset(name: str, issuer: str, subject: str, now: float, ttl: float | None = None,
           *, serial: int | None = None) -> Manifest:
    """The unsigned manifest for a named preset (`phone`, `messaging`)."""
    if name not in PRESETS:
        raise PsymeshError(f"unknown grant preset {name!r} (known: {', '.join(sorted(PRESETS))})",
                           code=ErrorCode.BAD_REQUEST)
    caps, limits = PRESETS[name]
    return new_manifest(issuer, subject, caps, now=now, ttl=ttl, limits=limits, serial=serial)


# ---------------------------------------------------------------------------- the checklist


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of `check()`. When allowed, `capability` is the grant that covered the
    request and `max_tokens` the ceiling the node must apply (None: no ceiling)."""

    allowed: bool
    code: ErrorCode | None = None
    reason: str = ""
    capability: Capability | None = None
    max_tokens: int | None = None
    details: dict[str, Any] | None = None

    def error(self) -> PsymeshError | None:
        if self.allowed:
            return None
        return PsymeshError(self.reason, code=self.code, details=dict(self.details or {}))

    def raise_if_denied(self) -> None:
        exc = self.error()
        if exc is not None:
            raise exc


def _deny(code: ErrorCode, reason: str, **details: Any) -> Decision:
    return Decision(False, code, reason, details=details)


def verify_grant(manifest: Manifest, *, local_peer_id: str, remote_peer_id: str, now: float,
                 signature_verified: bool = False) -> Decision:
    """Steps 1-2 of `check()` alone: is this a grant we issued to this peer, signed and in
    date? For peer-level requests that need a valid grant but no particular capability.
    `signature_verified`: the caller verified this very object's signature before (the
    door, per peer and stored grant: a Manifest is frozen); the rest is checked as ever."""
    if manifest.issuer != local_peer_id:
        return _deny(ErrorCode.FORBIDDEN, "the grant was not issued by this node", issuer=manifest.issuer)
    if manifest.subject != remote_peer_id:
        return _deny(ErrorCode.FORBIDDEN, "the grant was issued to another peer", subject=manifest.subject)
    if not signature_verified and not manifest.signature_valid():
        return _deny(ErrorCode.FORBIDDEN, "the grant's signature does not verify")
    if now < manifest.not_before:
        return _deny(ErrorCode.EXPIRED, "the grant is not valid yet", not_before=manifest.not_before)
    if manifest.expires is not None and now >= manifest.expires:
        return _deny(ErrorCode.EXPIRED, "the grant has expired", expires=manifest.expires)
    return Decision(True)


def grants_kind(manifest: Manifest, kind: str, *, local_peer_id: str, remote_peer_id: str, now: float) -> bool:
    """Does this valid, in-date grant hold any capability of `kind`, whatever narrows it? For
    a question asked before the exact request is known (which peers to ask for their models:
    `task.infer:models=botpsy*` allows no `Operation.infer(None)`, yet some of its models)."""
    return (verify_grant(manifest, local_peer_id=local_peer_id, remote_peer_id=remote_peer_id, now=now).allowed
            and any(c.kind == kind for c in manifest.capabilities))


def check(manifest: Manifest, operation: Operation, *, local_peer_id: str, remote_peer_id: str,
          now: float, signature_verified: bool = False) -> Decision:
    """May `remote_peer_id` do `operation` here? Checked in order, first failure wins:

    1. the manifest is ours, for this peer, and its signature holds   (FORBIDDEN)
    2. it is in date                                                  (EXPIRED)
    3. a capability covers this exact request                         (FORBIDDEN, names the missing one)
    4. the payload is within the limit                                (TOO_LARGE)

    Rate and queue limits need state: the gate applies them (`node/door/gate.py`).
    `signature_verified`: as for `verify_grant`.
    """
    valid = verify_grant(manifest, local_peer_id=local_peer_id, remote_peer_id=remote_peer_id, now=now,
                         signature_verified=signature_verified)
    if not valid.allowed:
        return valid

    covering = [c for c in manifest.capabilities if c.covers(operation)]
    if not covering:
        same_kind = [str(c) for c in manifest.capabilities if c.kind == operation.name]
        missing = operation.required()
        granted = f"; granted: {', '.join(same_kind)}" if same_kind else ""
        return _deny(ErrorCode.FORBIDDEN, f"not allowed: {missing}{granted}", missing=missing, granted=same_kind)

    limit = manifest.limits.max_payload_bytes
    if limit is not None and operation.payload_bytes > limit:
        return _deny(ErrorCode.TOO_LARGE, f"payload of {operation.payload_bytes} bytes exceeds the {limit}-byte limit",
                     limit=limit)

    # Several grants may cover the request: the most generous ceiling applies.
    best = max(covering, key=lambda c: float("inf") if c.max_tokens is None else c.max_tokens)
    ceiling = best.max_tokens if operation.name == "task.infer" else None
    return Decision(True, capability=best, max_tokens=ceiling)


# ---------------------------------------------------------------------------- wire


class ManifestPush(Message):
    """`/psymesh/manifest/1.0.0`: an issuer hands its subject the current grant (at pairing
    and whenever it changes), so the subject can show what it may do. Reply: `manifest.ok`."""

    type = "manifest.push"
    manifest: Manifest


class ManifestOk(Message):
    type = "manifest.ok"
    serial: int


class ManifestRevoke(Signed, Message):
    """`/psymesh/manifest/1.0.0`: an issuer tells its subject that it revoked the pairing, so the
    subject stops following the tasks it delegated there and stops submitting new ones at once,
    instead of learning it request by request (or never, once the issuer refuses it during the
    handshake, where no error reply can be sent). Reply: `manifest.ok` with the same serial.

    It voids every grant the issuer gave the subject with a serial up to `serial` (that of the
    last grant issued, 0 if none), so an old notice replayed after the two paired again, which
    gives the subject a grant with a larger serial, changes nothing. Signed by the issuer like a
    manifest, over its own context, so the notice stands on its own and cannot be passed off
    as, or made from, a grant."""

    type = "manifest.revoke"
    signing_context: ClassVar[bytes] = b"psymesh/revoke/v1\x00"
    signer_field: ClassVar[str] = "issuer"
    signer_role: ClassVar[str] = "issuer"
    issuer: PeerId
    subject: PeerId
    serial: int = Field(ge=0, lt=2**63)
    at: int = Field(ge=0)              # when the issuer revoked, integer Unix seconds
    signature: bytes = Field(default=b"", max_length=64)

    def voids(self, held: Manifest | None) -> bool:
        """Does this notice end the grant the subject holds from the issuer (None: it holds none)?"""
        return held is None or held.serial <= self.serial


def revocation(issuer: str, subject: str, last_grant: Manifest | None, *, now: float) -> ManifestRevoke:
    """The unsigned notice that `issuer` revoked `subject`, voiding `last_grant` and all before it."""
    return ManifestRevoke(issuer=issuer, subject=subject, serial=last_grant.serial if last_grant else 0,
                          at=int(now))


def verify_from_issuer(signed: Manifest | ManifestRevoke, *, sender: str, local_peer_id: str) -> None:
    """What a subject checks of a grant or a revocation it is handed (on `/psymesh/manifest`):
    issued by the peer that sent it, as the Noise session authenticated that peer, to us, and
    validly signed. FORBIDDEN if not."""
    what = "a manifest" if isinstance(signed, Manifest) else "a revocation"
    if signed.issuer != sender or signed.subject != local_peer_id or not signed.signature_valid():
        raise PsymeshError(f"{what} must be issued by the sender, to us, and validly signed",
                           code=ErrorCode.FORBIDDEN)
