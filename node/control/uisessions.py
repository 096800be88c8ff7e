"""The dashboard's logins and sessions, as policy: no IO, time passed in as `now=`
(node/control/dashboard.py drives it; docs/ui.md, "Security", says why each rule is there).

    mint(now)                 -> Login     `psymesh ui` asked (over the owner's control socket):
                                           a one-use code and a fresh name NAME.localhost
    redeem(code, host, now)   -> Session   the browser opened the link: the code is gone
                                           (used, or older than CODE_TTL_S: either way forgotten)
    find(sid, host, now)      -> Session   each request: the cookie's session, if it is live
                                           and the request came to the name it was made at
    end(sid) / end_all()                   logout; a new ui.key

A session is a random id (the cookie), a random CSRF token (the pages' forms) and the host
name it was made at. It ends after IDLE_S without a request, after LIFETIME_S whatever
happens, at logout, and when the key changes. Nothing in it is derived from ui.key: a
session's cookie says nothing about the key, nor about another session.

Codes and ids are kept by their SHA-256, so a lookup's timing says nothing about a stored
value, and at most MAX_CODES codes and MAX_SESSIONS sessions are held (the oldest go first).
"""
from __future__ import annotations

import hashlib
import ipaddress
import secrets
from dataclasses import dataclass, field

from ..bridges.httpguard import split_host

CODE_TTL_S = 60.0            # a login link works once, within this
IDLE_S = 30 * 60.0           # a session unused this long is over
LIFETIME_S = 12 * 3600.0     # and any session after this
MAX_CODES = 16               # codes not yet used: `psymesh ui` run this often within a minute
MAX_SESSIONS = 32            # browsers signed in at once
NAME_SUFFIX = ".localhost"   # browsers resolve every NAME.localhost to loopback themselves


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _bare(host: str) -> str:
    """A Host header's name: lowercase, without its port or the root's trailing dot."""
    split = split_host(host)
    return (split[0] if split else host).strip().lower().removesuffix(".")


def shared_name(host: str) -> bool:
    """Whether every local server answers to this name (127.0.0.1, ::1, localhost): a cookie
    set for it reaches all of them, whatever their port, so no session is made there."""
    name = _bare(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Login:
    """What `psymesh ui` gets: the one-use code and the name its link opens."""

    code: str = field(repr=False)
    name: str  # NAME.localhost: this login's own host name


@dataclass
class Session:
    id: str = field(repr=False)     # the cookie's value
    csrf: str = field(repr=False)   # the token its pages' forms carry
    host: str                       # the name it was made at; a request to another is not its
    created: float
    seen: float                     # its last request

    def live(self, now: float) -> bool:
        return now - self.seen < IDLE_S and now - self.created < LIFETIME_S


class Refused(Exception):
    """Why a code did not sign in (the login page says it)."""


@dataclass
class Sessions:
    """The logins waiting for their browser, and the sessions made from them."""

    _codes: dict[bytes, float] = field(default_factory=dict)           # digest of a code -> when minted
    _sessions: dict[bytes, Session] = field(default_factory=dict)          # digest of id -> session

    def mint(self, *, now: float) -> Login:
        self._codes = {d: t for d, t in self._codes.items() if now - t < CODE_TTL_S}
        while len(self._codes) >= MAX_CODES:
            del self._codes[next(iter(self._codes))]
        code, name = secrets.token_urlsafe(16), f"ui-{secrets.token_hex(16)}{NAME_SUFFIX}"
        self._codes[_digest(code)] = now
        return Login(code, name)

    def redeem(self, code: str, host: str, *, now: float) -> Session:
        """The session the code opens at `host`; the code is used up, whatever the answer,
        unless the host is one every local server shares (nothing is made there)."""
        if shared_name(host):
            raise Refused("open the link psymesh ui prints as it is: its name (NAME.localhost) is this "
                          "dashboard's alone, so its cookie reaches no other local server")
        minted = self._codes.pop(_digest(code), None)
        if minted is None or now - minted >= CODE_TTL_S:
            raise Refused("that link was used already or is older than a minute: run psymesh ui for a new one")
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[min(self._sessions, key=lambda d: self._sessions[d].seen)]
        session = Session(id=secrets.token_urlsafe(32), csrf=secrets.token_urlsafe(32), host=_bare(host), created=now, seen=now)
        self._sessions[_digest(session.id)] = session
        return session

    def find(self, sid: str, host: str, *, now: float) -> Session | None:
        """The live session whose cookie this is, made at this host; it counts as used now."""
        digest = _digest(sid)
        session = self._sessions.get(digest)
        if session is None:
            return None
        if not session.live(now):
            del self._sessions[digest]
            return None
        if session.host != _bare(host):
            return None
        session.seen = now
        return session

    def alive(self, sid: str, *, now: float) -> bool:
        """Whether the session still stands (an open live stream asks), without using it."""
        session = self._sessions.get(_digest(sid))
        return session is not None and session.live(now)

    def end(self, sid: str) -> bool:
        return self._sessions.pop(_digest(sid), None) is not None

    def end_all(self) -> None:
        """A new key: every session and every code not yet used is over."""
        self._sessions.clear()
        self._codes.clear()

    def __len__(self) -> int:
        return len(self._sessions)
