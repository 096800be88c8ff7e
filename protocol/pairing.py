"""Pairing two nodes with a short code: invites, and the sans-IO `/psymesh/pair/1.0.0` exchange.

The home PC makes a one-time invite; its code (`4817-chisel-molecule`) is read aloud or
carried inside a compact invite string (`psymesh1:...`, also shown as a QR code). The
number is the *nameplate*: it picks which open invite is meant (as in magic-wormhole).
The two words are the PAKE secret, 16 bits, which is enough because the code is only
ever used as a SPAKE2 password: a guess can be tested only by running the protocol
against the inviter, and the invite dies after `MAX_ATTEMPTS` runs that fail.

Only a run that names the invite's nameplate can spend one of its attempts, so the
nameplate is drawn at random (1-9999) and the inviter gives nothing away about which
nameplates exist: a hello for a nameplate with no open invite gets a *decoy* run (a PAKE
reply for a random password) that fails at key confirmation exactly like a wrong code.
A stranger who wants to burn an invite must find its number by running whole pairing
attempts, which the node rate-limits (`psymesh.protocol.strangers`).

    joiner (A)                                   inviter (B)
    pair.hello   {nameplate, pake: X}     ->     finds the invite or a decoy; a malformed X: `error`
                                                 bad_request, nothing charged
                                          <-     pair.pake    {pake: Y}   (sending it charges one attempt,
                                                 if the invite is open)
    pair.confirm {mac_A, joiner info}     ->     wrong mac: `error` bad_code (attempt stays spent);
                                                 right mac, invite ended: `error` expired / canceled / not_found
                                          <-     pair.welcome {mac_B, inviter info, signed manifest}

SPAKE2 binds both libp2p peer ids (as idA/idB), each side using the ids its Noise
session authenticated. A relay that runs two Noise sessions sees different ids on
each side, so the keys differ and key confirmation fails: the code proves the person,
Noise proves the peer ids. The code itself never crosses the wire. The MACs cover the
PAKE transcript; the peer info and manifest travel in the same Noise session, whose
ids are bound into that transcript, so they need no second MAC.

Both sides end with the same verification words (PGP words from HKDF of the key and
transcript), which people may compare. Time is always passed in; nothing here reads
a clock, opens a socket or stores anything. The node persists `PairingInviter.invite`
after every `receive()` (attempts are charged in memory first).

One job at ~620 lines: the pairing conversation (its code and invite, its four messages, both roles'
machines and the SPAKE2/HKDF steps they must agree on byte for byte), kept side by side.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import random
import re
import secrets
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, ClassVar

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic import BaseModel, ConfigDict, Field, StrictBytes, StrictInt, StrictStr, field_validator
from spake2 import SPAKE2_A, SPAKE2_B

from . import wordlist
from .common import Error
from .errors import ErrorCode, ProtocolError, PsymeshError
from .identity import peer_id_from_public_key, public_key_from_peer_id
from .manifest import Manifest, preset, PRESETS
from .signing import canonical_encode
from .messages import Message, decode_map

PAIR_PROTOCOL = "/psymesh/pair/1.0.0"
INVITE_PREFIX = "psymesh1:"
DEFAULT_INVITE_TTL = 600.0
MAX_ATTEMPTS = 3
MAX_NAMEPLATE = 9999
# Every pairing message fits in 8 KiB (the largest: a welcome with 16 maximal addresses and
# a manifest is ~5 KiB), so a pairing stream refuses bigger frames before buffering them.
PAIR_MAX_FRAME = 8 * 1024
PAIR_STEP_TIMEOUT_S = 5.0   # each pairing message must arrive this soon after the last
PAIR_RUN_TIMEOUT_S = 15.0   # and a whole run take no longer
WRONG_CODE = f"wrong pairing code; check it (an invite is cancelled after {MAX_ATTEMPTS} wrong codes)"
VERIFY_WORDS = 4
_MAX_INVITE_TEXT = 4096
_MAX_ADDRS = 16

Entropy = Callable[[int], bytes]


# ---------------------------------------------------------------------------- codes


class PairingCode(BaseModel):
    """`4817-chisel-molecule`: a nameplate number, then an even and an odd PGP word."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nameplate: int = Field(ge=1, le=MAX_NAMEPLATE)
    words: tuple[str, str]

    @field_validator("words")
    @classmethod
    def _known_words(cls, words: tuple[str, str]) -> tuple[str, str]:
        try:
            for position, word in enumerate(words):
                wordlist.byte_for(word, position)
        except PsymeshError as exc:
            raise ValueError(exc.message) from None
        return (words[0].lower(), words[1].lower())

    def __str__(self) -> str:
        return f"{self.nameplate}-{self.words[0]}-{self.words[1]}"

    @property
    def password(self) -> bytes:
        return str(self).encode()

    @property
    def secret_bytes(self) -> bytes:
        return bytes(wordlist.byte_for(w, i) for i, w in enumerate(self.words))

    @classmethod
    def generate(cls, nameplate: int, rng: random.Random | None = None) -> "PairingCode":
        rng = rng or secrets.SystemRandom()
        return cls(nameplate=nameplate, words=wordlist.words_for(bytes(rng.randrange(256) for _ in range(2))))

    @classmethod
    def from_bytes(cls, nameplate: int, secret: bytes) -> "PairingCode":
        return cls(nameplate=nameplate, words=wordlist.words_for(secret))


def parse_code(text: str) -> PairingCode:
    """Accept `7-chisel-molecule`, `7 Chisel Molecule`, ... A typo is caught here, before
    anything is sent, so it costs no attempt."""
    parts = [p for p in re.split(r"[\s\-_]+", text.strip()) if p]
    if len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > 6:
        raise PsymeshError(
            f"a pairing code looks like `7-chisel-molecule`, not {text[:60]!r}", code=ErrorCode.BAD_REQUEST
        )
    nameplate = int(parts[0])
    if not 1 <= nameplate <= MAX_NAMEPLATE:
        raise PsymeshError(f"no such pairing code number: {nameplate}", code=ErrorCode.BAD_REQUEST)
    secret = bytes(wordlist.byte_for(word, i) for i, word in enumerate(parts[1:]))
    return PairingCode.from_bytes(nameplate, secret)


# ---------------------------------------------------------------------------- invites


class InviteState(StrEnum):
    OPEN = "open"
    USED = "used"
    EXHAUSTED = "exhausted"
    EXPIRED = "expired"
    CANCELED = "canceled"


class Invite(BaseModel):
    """The inviter's record of one invite. Mutable: attempts and use are recorded on it,
    and the node stores it after each change."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    id: str = Field(pattern=r"^[0-9a-f]{16}$")
    code: PairingCode
    created_at: float
    expires_at: float
    attempts_left: int = Field(default=MAX_ATTEMPTS, ge=0)
    used: bool = False
    canceled: bool = False             # by its maker (e.g. Ctrl-C in a waiting `pair invite`)
    grant: str = "phone"               # manifest preset given to the joiner
    grant_ttl: int | None = Field(default=None, ge=1)  # its lifetime; None: until revoked
    name: str | None = Field(default=None, min_length=1, max_length=64)  # what we will call the joiner

    @property
    def nameplate(self) -> int:
        return self.code.nameplate

    def state(self, now: float) -> InviteState:
        if self.used:
            return InviteState.USED
        if self.canceled:
            return InviteState.CANCELED
        if now >= self.expires_at:
            return InviteState.EXPIRED
        if self.attempts_left <= 0:
            return InviteState.EXHAUSTED
        return InviteState.OPEN

    def check_usable(self, now: float, *, need_attempt: bool = True) -> None:
        """Raise unless a pairing run may use this invite now.

        `need_attempt=False` is for the end of a run whose attempt was already charged:
        the invite must still be in date and unused (a parallel run may have won)."""
        state = self.state(now)
        if state is InviteState.EXHAUSTED and not need_attempt:
            return
        if state is InviteState.USED:
            raise PsymeshError("this invite was already used; ask for a new code", code=ErrorCode.NOT_FOUND)
        if state is InviteState.CANCELED:
            raise PsymeshError("this invite was cancelled by the node that made it; ask for a new code",
                               code=ErrorCode.CANCELED)
        if state is InviteState.EXPIRED:
            raise PsymeshError("this invite has expired; ask for a new code", code=ErrorCode.EXPIRED)
        if state is InviteState.EXHAUSTED:
            raise PsymeshError(f"this invite was cancelled after {MAX_ATTEMPTS} wrong codes; ask for a new one",
                               code=ErrorCode.NOT_FOUND)

    def record_failure(self) -> None:
        """Spend one attempt. The inviter charges it when the run starts, so a joiner that
        vanishes, or runs many sessions at once, pays like a wrong code."""
        self.attempts_left = max(0, self.attempts_left - 1)

    def record_success(self) -> None:
        self.used = True

    def ticket(self, peer_id: str, addrs: Iterable[str]) -> "InviteTicket":
        """What the joiner needs: put it in an invite string with `encode_invite`."""
        return InviteTicket(code=self.code, peer_id=peer_id, addrs=tuple(addrs))


def new_invite(
    now: float,
    *,
    ttl: float = DEFAULT_INVITE_TTL,
    grant: str = "phone",
    grant_ttl: int | None = None,
    name: str | None = None,
    taken: Collection[int] = (),
    rng: random.Random | None = None,
) -> Invite:
    """A fresh invite on a random nameplate not in `taken` (the nameplates of the node's
    open invites): a number nobody can predict, so that only someone who was given the
    code can spend the invite's attempts. `rng` defaults to the OS CSPRNG; tests pass a
    seeded `random.Random`."""
    if grant not in PRESETS:
        raise PsymeshError(f"unknown grant preset {grant!r} (known: {', '.join(sorted(PRESETS))})",
                           code=ErrorCode.BAD_REQUEST)
    if ttl <= 0:
        raise PsymeshError("an invite needs a positive lifetime", code=ErrorCode.BAD_REQUEST)
    if len(set(taken)) >= MAX_NAMEPLATE:
        raise PsymeshError("too many open invites", code=ErrorCode.CONFLICT)
    rng = rng or secrets.SystemRandom()
    nameplate = rng.randint(1, MAX_NAMEPLATE)
    while nameplate in taken:
        nameplate = rng.randint(1, MAX_NAMEPLATE)
    return Invite(
        id=f"{rng.getrandbits(64):016x}",
        code=PairingCode.generate(nameplate, rng),
        created_at=now,
        expires_at=now + ttl,
        grant=grant,
        grant_ttl=grant_ttl,
        name=name,
    )


# ---------------------------------------------------------------------------- invite strings


class InviteTicket(BaseModel):
    """The joiner's side of an invite: the code and where to find the inviter.
    `peer_id` is None when only a code and a bare address were given; the node then
    learns the id from the Noise handshake."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    code: PairingCode
    peer_id: str | None = None
    addrs: tuple[str, ...] = Field(default=(), max_length=_MAX_ADDRS)


class _InviteBlob(BaseModel):
    """The msgpack map inside `psymesh1:`: short keys keep the QR code small."""

    model_config = ConfigDict(extra="ignore")

    c: tuple[StrictInt, Annotated[StrictBytes, Field(min_length=2, max_length=2)]]  # nameplate, secret
    k: Annotated[StrictBytes, Field(min_length=32, max_length=32)]  # inviter's Ed25519 public key
    a: tuple[StrictStr, ...] = Field(default=(), max_length=_MAX_ADDRS)


def encode_invite(ticket: InviteTicket) -> str:
    """`psymesh1:` + unpadded base32 (lowercase) of a msgpack map. Base32 is what QR
    codes encode densely: upper-case it for the QR, `parse_invite` takes either case."""
    if ticket.peer_id is None:
        raise ValueError("an invite string needs the inviter's peer id")
    blob = canonical_encode(
        {"c": [ticket.code.nameplate, ticket.code.secret_bytes], "k": public_key_from_peer_id(ticket.peer_id),
         "a": list(ticket.addrs)}
    )
    return INVITE_PREFIX + base64.b32encode(blob).decode().rstrip("=").lower()


def parse_invite(text: str, address: str | None = None) -> InviteTicket:
    """Parse `psymesh1:...`, or a bare code plus the inviter's `address` (a multiaddr, or
    `host:port`; a `/p2p/<id>` suffix pins the peer id). Only PsymeshError escapes."""
    text = text.strip()
    if len(text) > _MAX_INVITE_TEXT:
        raise PsymeshError("invite text is too long", code=ErrorCode.BAD_REQUEST)
    extra = [normalize_address(address)] if address else []
    if not text.lower().startswith(INVITE_PREFIX):
        if not extra:
            raise PsymeshError("a bare pairing code needs the inviter's address too", code=ErrorCode.BAD_REQUEST)
        (addr, peer_id), = extra
        return InviteTicket(code=parse_code(text), peer_id=peer_id, addrs=(addr,))
    body = text[len(INVITE_PREFIX):].upper()
    try:
        raw = base64.b32decode(body + "=" * (-len(body) % 8))
    except (binascii.Error, ValueError):
        raise ProtocolError("not a psymesh invite: bad base32", code=ErrorCode.BAD_REQUEST) from None
    try:
        blob = _InviteBlob.model_validate(decode_map(raw))
        code = PairingCode.from_bytes(blob.c[0], blob.c[1])
        peer_id = peer_id_from_public_key(blob.k)
        addrs = tuple(normalize_address(a)[0] for a in blob.a)
    except (PsymeshError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise ProtocolError(f"not a valid psymesh invite ({type(exc).__name__})", code=ErrorCode.BAD_REQUEST) from None
    addrs += tuple(a for a, _ in extra if a not in addrs)
    return InviteTicket(code=code, peer_id=peer_id, addrs=addrs[:_MAX_ADDRS])


def normalize_address(address: str) -> tuple[str, str | None]:
    """A multiaddr (or `host:port`, turned into one) without any `/p2p/<id>` suffix, and
    that id. Only shape is checked here; the node's dialer parses it fully. An address
    through a relay (`<relay>/p2p/<relay id>/p2p-circuit/p2p/<id>`) keeps the relay's id:
    the suffix is the last `/p2p/<id>`, the target's."""
    text = address.strip()
    if not text or len(text) > 256 or not text.isprintable() or any(c.isspace() for c in text):
        raise PsymeshError(f"not an address: {address[:80]!r}", code=ErrorCode.BAD_REQUEST)
    if not text.startswith("/"):
        text = _host_port_to_multiaddr(text)
    parts = text.split("/")
    peer_id = None
    last = len(parts) - 1 - parts[::-1].index("p2p") if "p2p" in parts else None
    if last is not None and "p2p-circuit" not in parts[last:]:  # (a relay's id, before /p2p-circuit, stays)
        if last + 1 >= len(parts):
            raise PsymeshError(f"{address!r} ends in /p2p/ without a peer id", code=ErrorCode.BAD_REQUEST)
        peer_id = parts[last + 1]
        public_key_from_peer_id(peer_id)
        text = "/".join(parts[:last])
    if len(text) < 2:
        raise PsymeshError(f"{address!r} has no transport address", code=ErrorCode.BAD_REQUEST)
    return text, peer_id


def _host_port_to_multiaddr(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise PsymeshError(f"expected host:port or a multiaddr, not {text[:80]!r}", code=ErrorCode.BAD_REQUEST)
    host = host.removeprefix("[").removesuffix("]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9.\-]{1,253}", host):
            raise PsymeshError(f"not a host name: {host[:80]!r}", code=ErrorCode.BAD_REQUEST) from None
        return f"/dns/{host}/tcp/{int(port)}"
    return f"/ip{ip.version}/{ip}/tcp/{int(port)}"


# ---------------------------------------------------------------------------- wire messages


class PeerInfo(BaseModel):
    """How a node introduces itself when pairing."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    role: str = Field(default="node", pattern=r"^[a-z][a-z0-9_-]{0,31}$")  # phone, home, node...
    addrs: tuple[str, ...] = Field(default=(), max_length=_MAX_ADDRS)

    @field_validator("addrs")
    @classmethod
    def _addr_shape(cls, addrs: tuple[str, ...]) -> tuple[str, ...]:
        for addr in addrs:
            if not addr.startswith("/") or len(addr) > 256 or not addr.isprintable():
                raise ValueError(f"not a multiaddr: {addr[:80]!r}")
        return addrs


_Pake = Annotated[bytes, Field(min_length=1, max_length=128)]
_Mac = Annotated[bytes, Field(min_length=32, max_length=32)]


class PairHello(Message):
    type = "pair.hello"
    nameplate: int = Field(ge=1, le=MAX_NAMEPLATE)
    pake: _Pake


class PairPake(Message):
    type = "pair.pake"
    pake: _Pake


class PairConfirm(Message):
    type = "pair.confirm"
    mac: _Mac
    info: PeerInfo


class PairWelcome(Message):
    type = "pair.welcome"
    mac: _Mac
    info: PeerInfo
    manifest: Manifest
    # the name the inviter keeps the joiner under, when not the joiner's own (taken there: `phone-2`;
    # or the invite's --name); nil otherwise
    known_as: str | None = Field(default=None, min_length=1, max_length=64)


# ---------------------------------------------------------------------------- key schedule


@dataclass(frozen=True, slots=True)
class _Keys:
    joiner_mac: bytes
    inviter_mac: bytes
    session_key: bytes
    words: tuple[str, ...]


def _schedule(pake_key: bytes, nameplate: int, joiner: str, inviter: str, msg_a: bytes, msg_b: bytes) -> _Keys:
    """Derive the confirmation MACs, session key and verification words from the SPAKE2
    key, salted with a hash of the transcript (both peer ids and both PAKE messages)."""
    transcript = hashlib.sha256(canonical_encode([PAIR_PROTOCOL, nameplate, joiner, inviter, msg_a, msg_b])).digest()
    okm = HKDF(algorithm=hashes.SHA256(), length=32 * 4, salt=transcript, info=b"psymesh/pair/v1").derive(pake_key)
    k_joiner, k_inviter, session_key, words_key = (okm[i:i + 32] for i in range(0, 128, 32))
    return _Keys(
        joiner_mac=hmac.digest(k_joiner, b"joiner" + transcript, "sha256"),
        inviter_mac=hmac.digest(k_inviter, b"inviter" + transcript, "sha256"),
        session_key=session_key,
        words=wordlist.words_for(words_key[:VERIFY_WORDS]),
    )


def _finish(spake: Any, inbound: bytes) -> bytes:
    try:
        return spake.finish(inbound)
    except Exception as exc:  # spake2 raises its own errors, ValueError, ... for bad elements
        raise ProtocolError(f"bad PAKE message ({type(exc).__name__})", code=ErrorCode.BAD_REQUEST) from None


# ---------------------------------------------------------------------------- state machines


class PairState(StrEnum):
    """joiner:  IDLE -start()-> AWAIT_PAKE -pair.pake / send pair.confirm-> AWAIT_WELCOME -pair.welcome-> DONE
    inviter: AWAIT_HELLO -pair.hello / send pair.pake-> AWAIT_CONFIRM -pair.confirm / send pair.welcome-> DONE
    Any PsymeshError (wrong code, an `error` from the peer, a message out of order) -> FAILED."""

    IDLE = "idle"                      # joiner: start() not called yet
    AWAIT_HELLO = "await_hello"        # inviter
    AWAIT_PAKE = "await_pake"          # joiner
    AWAIT_CONFIRM = "await_confirm"    # inviter
    AWAIT_WELCOME = "await_welcome"    # joiner
    DONE = "done"
    FAILED = "failed"


class PairingResult(BaseModel):
    """What each side learned. `manifest` is the grant to the joiner on both sides (the
    inviter stores it to enforce; the joiner keeps it to know what it may ask)."""

    model_config = ConfigDict(frozen=True)

    peer_id: str
    name: str
    role: str
    addrs: tuple[str, ...]
    manifest: Manifest
    session_key: bytes = Field(repr=False)
    verification_words: tuple[str, ...]
    # the joiner: the name the inviter keeps it under (when not its own); the inviter: the name the
    # joiner is to be stored under (`name` made unique among its peers), or None to store `name`
    known_as: str | None = None

    @property
    def verification(self) -> str:
        return " ".join(self.verification_words)


class _PairingMachine:
    """h11-style driver: feed each received message to `receive`, send what it returns.

    Any PsymeshError puts the machine in FAILED for good and is re-raised on further
    use; the node answers it with `Error.from_exception(exc)` so the peer fails too. An
    `error` message from the peer raises RemoteError."""

    # state -> the one message type accepted in it
    EXPECTS: ClassVar[dict[PairState, type[Message]]] = {}

    def __init__(self, local_peer_id: str, remote_peer_id: str, info: PeerInfo, entropy: Entropy | None) -> None:
        for pid in (local_peer_id, remote_peer_id):
            public_key_from_peer_id(pid)
        if local_peer_id == remote_peer_id:
            raise PsymeshError("a node cannot pair with itself", code=ErrorCode.BAD_REQUEST)
        self.local_peer_id = local_peer_id
        self.remote_peer_id = remote_peer_id
        self.info = info
        self._entropy = entropy
        self.state = PairState.IDLE
        self.error: PsymeshError | None = None
        self.result: PairingResult | None = None
        self._keys: _Keys | None = None

    def _spake_kwargs(self) -> dict[str, Any]:
        return {"entropy_f": self._entropy} if self._entropy is not None else {}

    def _step(self, message: Message, handler: Callable[[Any], list[Message]]) -> list[Message]:
        if self.state is PairState.FAILED:
            assert self.error is not None
            raise self.error
        if self.state is PairState.DONE:  # the pairing stands; just refuse the extra message
            raise ProtocolError(f"pairing already finished; got {message.type!r}", code=ErrorCode.BAD_REQUEST)
        try:
            if isinstance(message, Error):
                raise message.to_exception()
            expected = self.EXPECTS.get(self.state)
            if expected is None or not isinstance(message, expected):
                wanted = expected.type if expected else "nothing"
                raise ProtocolError(f"pairing: got {message.type!r} while expecting {wanted}",
                                    code=ErrorCode.BAD_REQUEST)
            return handler(message)
        except PsymeshError as exc:
            self.state, self.error = PairState.FAILED, exc
            raise


class PairingJoiner(_PairingMachine):
    """The side that has the code (the phone).

        j = PairingJoiner(code, local_peer_id=me, remote_peer_id=noise_remote, info=PeerInfo(...))
        send(j.start())
        for msg in incoming: for out in j.receive(msg): send(out)   # until j.state is DONE
    """

    EXPECTS = {PairState.AWAIT_PAKE: PairPake, PairState.AWAIT_WELCOME: PairWelcome}

    def __init__(self, code: PairingCode | str, *, local_peer_id: str, remote_peer_id: str, info: PeerInfo,
                 entropy: Entropy | None = None) -> None:
        super().__init__(local_peer_id, remote_peer_id, info, entropy)
        self.code = parse_code(code) if isinstance(code, str) else code
        self._spake = SPAKE2_A(self.code.password, idA=local_peer_id.encode(), idB=remote_peer_id.encode(),
                               **self._spake_kwargs())
        self._msg_a = b""

    def start(self) -> PairHello:
        if self.state is not PairState.IDLE:
            raise ProtocolError("start() was already called", code=ErrorCode.BAD_REQUEST)
        self._msg_a = self._spake.start()
        self.state = PairState.AWAIT_PAKE
        return PairHello(nameplate=self.code.nameplate, pake=self._msg_a)

    def receive(self, message: Message) -> list[Message]:
        return self._step(message, self._on_pake if self.state is PairState.AWAIT_PAKE else self._on_welcome)

    def _on_pake(self, msg: PairPake) -> list[Message]:
        key = _finish(self._spake, msg.pake)
        self._keys = _schedule(key, self.code.nameplate, self.local_peer_id, self.remote_peer_id, self._msg_a,
                               msg.pake)
        self.state = PairState.AWAIT_WELCOME
        return [PairConfirm(mac=self._keys.joiner_mac, info=self.info)]

    def _on_welcome(self, msg: PairWelcome) -> list[Message]:
        assert self._keys is not None
        if not hmac.compare_digest(msg.mac, self._keys.inviter_mac):
            raise ProtocolError("the inviter failed key confirmation", code=ErrorCode.BAD_CODE)
        manifest = msg.manifest
        if manifest.issuer != self.remote_peer_id or manifest.subject != self.local_peer_id:
            raise ProtocolError("the inviter sent a grant for other peers", code=ErrorCode.BAD_REQUEST)
        if not manifest.signature_valid():
            raise ProtocolError("the inviter's grant is not validly signed", code=ErrorCode.BAD_REQUEST)
        self.result = PairingResult(
            peer_id=self.remote_peer_id, name=msg.info.name, role=msg.info.role, addrs=msg.info.addrs,
            manifest=manifest, session_key=self._keys.session_key, verification_words=self._keys.words,
            known_as=msg.known_as if msg.known_as != self.info.name else None,
        )
        self.state = PairState.DONE
        return []


class PairingInviter(_PairingMachine):
    """The side that made the invite (the home PC).

        i = PairingInviter(local_peer_id=me, remote_peer_id=noise_remote, info=PeerInfo(...),
                           signing_key=identity_key, find_invite=store.invite_by_nameplate)
        for msg in incoming: for out in i.receive(msg, now): send(out)   # until DONE
        # after every receive(): store i.invite (an attempt may have been charged)
    """

    EXPECTS = {PairState.AWAIT_HELLO: PairHello, PairState.AWAIT_CONFIRM: PairConfirm}

    def __init__(self, *, local_peer_id: str, remote_peer_id: str, info: PeerInfo, signing_key: Ed25519PrivateKey,
                 find_invite: Callable[[int], Invite | None], entropy: Entropy | None = None,
                 name_for: Callable[[str, str], str] | None = None) -> None:
        """`find_invite(nameplate)`: the invite with that number, open or ended not long ago
        (so that a joiner with its code is told it expired or was cancelled), or None (a decoy).
        `name_for(name, peer_id)`: the name the joiner will be stored under here (the trust
        store makes a taken name unique); the joiner is told it in the welcome."""
        super().__init__(local_peer_id, remote_peer_id, info, entropy)
        self._name_for = name_for or (lambda name, _: name)
        if peer_id_from_public_key(signing_key.public_key().public_bytes_raw()) != local_peer_id:
            raise ValueError("signing_key is not the local node's identity key")
        self._signing_key = signing_key
        self._find_invite = find_invite
        self.invite: Invite | None = None
        self._charged = False  # this run spent one of the invite's attempts
        self.state = PairState.AWAIT_HELLO
        self._spake: Any = None

    def receive(self, message: Message, now: float) -> list[Message]:
        if self.state is PairState.AWAIT_HELLO:
            return self._step(message, lambda m: self._on_hello(m, now))
        return self._step(message, lambda m: self._on_confirm(m, now))

    def _on_hello(self, msg: PairHello, now: float) -> list[Message]:
        """An attempt is charged only as `pair.pake` is about to be sent: a hello whose `pake`
        is malformed (wrong side byte, not a point of the group, ...) is refused `bad_request`
        and spends nothing, since it tested no code."""
        invite = self._find_invite(msg.nameplate)
        if invite is not None:
            password = invite.code.password
        else:  # a decoy: no invite has this number, and the joiner must not learn that here
            password = b"decoy " + (self._entropy or secrets.token_bytes)(16)
        self._spake = SPAKE2_B(password, idA=self.remote_peer_id.encode(),
                               idB=self.local_peer_id.encode(), **self._spake_kwargs())
        msg_b = self._spake.start()
        key = _finish(self._spake, msg.pake)
        self._keys = _schedule(key, msg.nameplate, self.remote_peer_id, self.local_peer_id, msg.pake, msg_b)
        if invite is not None:
            # The run now tests a code: it counts, whatever comes next. An invite that ended
            # (expired, used, cancelled, out of attempts) still runs with its own code, charging
            # nothing: whoever proves the code learns why it cannot pair (`_on_confirm`), anyone
            # else gets `bad_code` as from a decoy.
            self._charged = invite.state(now) is InviteState.OPEN
            if self._charged:
                invite.record_failure()
            self.invite = invite
        self.state = PairState.AWAIT_CONFIRM
        return [PairPake(pake=msg_b)]

    def _on_confirm(self, msg: PairConfirm, now: float) -> list[Message]:
        assert self._keys is not None
        if not hmac.compare_digest(msg.mac, self._keys.joiner_mac) or self.invite is None:
            # the same words for a wrong code and for a decoy: nothing says which it was
            raise PsymeshError(WRONG_CODE, code=ErrorCode.BAD_CODE)
        self.invite.check_usable(now, need_attempt=not self._charged)
        self.invite.record_success()
        manifest = preset(self.invite.grant, self.local_peer_id, self.remote_peer_id, now,
                          self.invite.grant_ttl).sign(self._signing_key)
        name = self.invite.name or msg.info.name
        stored = self._name_for(name, self.remote_peer_id)
        self.result = PairingResult(
            peer_id=self.remote_peer_id, name=name, role=msg.info.role,
            addrs=msg.info.addrs, manifest=manifest, session_key=self._keys.session_key,
            verification_words=self._keys.words, known_as=stored if stored != name else None,
        )
        self.state = PairState.DONE
        return [PairWelcome(mac=self._keys.inviter_mac, info=self.info, manifest=manifest,
                            known_as=stored if stored != msg.info.name else None)]
