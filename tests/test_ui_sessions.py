"""The dashboard's logins and sessions as policy (node/control/uisessions.py), on an injected
clock: a login link works once and for a minute; a session ends when idle, at its lifetime
whatever its use, at logout and at a new key; it opens only at the name it was made at; and
the door's Origin check (node/bridges/httpguard.py) holds a Host without a port to the
default one (issue 32 item 10). The same, end to end in Chromium: tests/test_ui.py."""
from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from psymesh.node.bridges.httpguard import AllowedHosts, Check, GuardRules, Refusal, admit
from psymesh.node.control.uisessions import (CODE_TTL_S, IDLE_S, LIFETIME_S, MAX_CODES, MAX_SESSIONS, Refused,
                                             Sessions, shared_name)

NAME = "ui-0123.localhost:8765"


def _signed_in(sessions: Sessions, now: float = 0.0) -> tuple[str, str]:
    login = sessions.mint(now=now)
    return sessions.redeem(login.code, f"{login.name}:8765", now=now).id, f"{login.name}:8765"


def test_a_login_link_works_once_and_for_a_minute() -> None:
    sessions = Sessions()
    login = sessions.mint(now=100.0)
    assert login.name.startswith("ui-") and login.name.endswith(".localhost")
    assert sessions.mint(now=100.0).name != login.name  # each login a name of its own
    session = sessions.redeem(login.code, login.name, now=100.0 + CODE_TTL_S - 1)
    with pytest.raises(Refused, match="used already"):
        sessions.redeem(login.code, login.name, now=100.0 + CODE_TTL_S - 1)
    late = sessions.mint(now=200.0)
    with pytest.raises(Refused, match="older than a minute"):
        sessions.redeem(late.code, late.name, now=200.0 + CODE_TTL_S)
    with pytest.raises(Refused):
        sessions.redeem("guessed", NAME, now=200.0)
    assert sessions.find(session.id, login.name, now=101.0) is session and len(sessions) == 1


def test_no_session_is_made_at_a_name_every_local_server_answers_and_the_code_survives() -> None:
    sessions = Sessions()
    login = sessions.mint(now=0.0)
    for shared in ("127.0.0.1:8765", "localhost:8765", "[::1]:8765", "LOCALHOST.", "127.5.6.7"):
        assert shared_name(shared)
        with pytest.raises(Refused, match="NAME.localhost"):
            sessions.redeem(login.code, shared, now=1.0)
    assert not shared_name(NAME) and not shared_name("desk.lan:8765")
    assert sessions.redeem(login.code, NAME, now=2.0).host == "ui-0123.localhost"


def test_a_session_opens_only_at_its_own_name() -> None:
    sessions = Sessions()
    sid, host = _signed_in(sessions)
    assert sessions.find(sid, host, now=1.0) is not None
    assert sessions.find(sid, host.upper().replace(":8765", ".:9999"), now=1.0) is not None  # the name, any case
    for elsewhere in ("127.0.0.1:8765", "localhost:8765", "ui-other.localhost:8765", ""):
        assert sessions.find(sid, elsewhere, now=1.0) is None
    assert sessions.find("not-a-session", host, now=1.0) is None


def test_a_session_ends_when_idle_and_at_its_lifetime_however_busy() -> None:
    sessions = Sessions()
    sid, host = _signed_in(sessions, now=0.0)
    assert sessions.find(sid, host, now=IDLE_S - 1) is not None      # used: idle from here
    assert sessions.find(sid, host, now=2 * IDLE_S - 2) is not None
    assert sessions.find(sid, host, now=3 * IDLE_S) is None           # unused for longer than IDLE_S
    assert sessions.find(sid, host, now=3 * IDLE_S - 1) is None       # and gone for good

    busy, host = _signed_in(sessions, now=0.0)
    t = 0.0
    while t + IDLE_S / 2 < LIFETIME_S:
        t += IDLE_S / 2
        assert sessions.find(busy, host, now=t) is not None
    assert sessions.find(busy, host, now=LIFETIME_S) is None


def test_logout_and_a_new_key_end_sessions_and_codes() -> None:
    sessions = Sessions()
    a, host_a = _signed_in(sessions)
    b, host_b = _signed_in(sessions)
    assert sessions.end(a) and not sessions.end(a)
    assert sessions.find(a, host_a, now=1.0) is None and sessions.find(b, host_b, now=1.0) is not None
    waiting = sessions.mint(now=1.0)
    sessions.end_all()
    assert sessions.find(b, host_b, now=2.0) is None
    with pytest.raises(Refused):
        sessions.redeem(waiting.code, waiting.name, now=2.0)


def test_codes_and_sessions_held_are_bounded_oldest_first() -> None:
    sessions = Sessions()
    codes = [sessions.mint(now=float(i)) for i in range(MAX_CODES + 3)]
    with pytest.raises(Refused):
        sessions.redeem(codes[0].code, NAME, now=30.0)
    assert sessions.redeem(codes[-1].code, NAME, now=30.0) is not None

    sessions = Sessions()
    made = [_signed_in(sessions, now=float(i)) for i in range(MAX_SESSIONS + 2)]
    assert len(sessions) == MAX_SESSIONS
    assert sessions.find(*made[0], now=40.0) is None and sessions.find(*made[-1], now=40.0) is not None


def _origin_check(host: str, origin: str) -> Refusal | None:
    rules = GuardRules(key="k" * 32, hosts=AllowedHosts.of(["127.0.0.1", "desk.lan"]))
    decision = admit(rules, "GET", "/", Headers({"host": host, "origin": origin, "authorization": "Bearer " + "k" * 32}))
    return decision if isinstance(decision, Refusal) else None


def test_a_host_without_a_port_is_the_default_port_for_the_origin_check() -> None:
    """Behind a reverse proxy (or on port 80) the Host names no port: another port of the
    same name is another origin (item 10: it was let through)."""
    for foreign in ("http://desk.lan:19999", "http://desk.lan:8080", "https://desk.lan:8443"):
        refusal = _origin_check("desk.lan", foreign)
        assert refusal is not None and refusal.check is Check.ORIGIN, foreign
    for own in ("http://desk.lan", "https://desk.lan", "http://desk.lan:80"):
        assert _origin_check("desk.lan", own) is None, own
    assert _origin_check("desk.lan:8765", "http://desk.lan:8765") is None
    assert _origin_check("desk.lan:8765", "http://desk.lan:8766").check is Check.ORIGIN  # type: ignore[union-attr]


def test_a_link_may_open_the_login_page_from_elsewhere_and_nothing_else() -> None:
    """The launch file's redirect is a cross-site top-level GET: the login path takes it (its
    code is its credential); no other path, and no other method or mode, does."""
    rules = GuardRules(key="k" * 32, hosts=AllowedHosts.of(["127.0.0.1", "*.localhost"]), public=frozenset({"/login"}),
                       links=frozenset({"/login"}))
    link = {"host": NAME, "sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate"}
    assert not isinstance(admit(rules, "GET", "/login", Headers(link)), Refusal)
    for method, path, mode in (("GET", "/", "navigate"), ("POST", "/login", "navigate"), ("GET", "/login", "cors")):
        refusal = admit(rules, method, path, Headers({**link, "sec-fetch-mode": mode}))
        assert isinstance(refusal, Refusal) and refusal.check is Check.ORIGIN, (method, path, mode)


def test_the_dashboard_answers_every_name_under_localhost_and_other_faces_do_not() -> None:
    dashboard = AllowedHosts.of(["127.0.0.1", "*.localhost"])
    assert dashboard.allows("ui-0123.localhost") and dashboard.allows("UI-0123.LOCALHOST.")
    assert not dashboard.allows("localhost.evil.example") and not dashboard.allows("evil.example")
    assert not AllowedHosts.of(["127.0.0.1"]).allows("ui-0123.localhost")
