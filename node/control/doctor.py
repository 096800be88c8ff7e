"""`psymesh doctor`: what stands between this node and its peers, each finding with a status
(ok, warn, fail) and, when it is not ok, one concrete next step.

    home        the home's modes and the key's (node/core/home.py's own checks, not a copy)
    disk        free space where the database lives (warn < 500 MiB, fail < 50 MiB)
    database    SQLite's quick_check of node.db, read-only
    daemon      running or not
    listen      each configured listen address: the running daemon listens there and a
                connection to it is answered by a libp2p listener; without a daemon, the
                address can be bound (the port is free, the IP is this machine's)
    exposure    who can reach the listen addresses at all (loopback only? a port that
                changes at every start?)
    peer:NAME   each paired peer: reachable now, and how (direct or relayed), round trip
    clock:NAME  its clock against ours, from the pong's time (warn > 5 s, fail > 60 s:
                grants' dates and the gate's windows are read from clocks)
    dialback:NAME  whether it could open a connection to us (protocol/dialback.py)

The daemon probes the peers (`control.doctor`, `diagnose()` below, run by node/control/owner.py);
the command checks the rest itself, so it also works while the daemon is down. Judging is
pure (`judge_*`): the numbers and what they mean are tested without a network.

An unreachable peer, or one that cannot dial back, is a warning, not a failure: a phone
that is off or on cellular is normal. Failures are what keeps this node from working: a
home it cannot use, a full disk, a broken database, a listen address it cannot have, a
clock so far off that grants are misread.
"""
from __future__ import annotations

import errno
import shutil
import socket
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

import anyio
from pydantic import BaseModel, ConfigDict

from .client import Client, DaemonNotRunning
from ..core.db import storage_error
from ..core.home import NodeConfig, NodeHome
from ..core.commands import spell_command
from ..net.ping import read_clock
from ..reach.dialback import probe_listener
from ...protocol import control as c
from ...protocol.errors import NetworkError, PsymeshError, cause_of

if TYPE_CHECKING:
    from ..door.trust import Peer, TrustStore
    from ..net.p2p import P2PNode
    from ..net.session import SessionPool
    from ..reach.dialback import Reach

Status = Literal["ok", "warn", "fail"]

MiB = 1024 * 1024
DISK_WARN_BYTES = 500 * MiB
DISK_FAIL_BYTES = 50 * MiB
SKEW_WARN_S = 5.0
SKEW_FAIL_S = 60.0
PEERS_AT_ONCE = 8
NTP_STEP = ("turn on network time on the device whose clock is wrong (Linux: timedatectl set-ntp true; "
            "Android and macOS: set date and time automatically)")


Suggest = Callable[[str, str], str]  # (command's words, its arguments) -> the command to show: spell_command


class Check(BaseModel):
    """One finding. `next_step` is set whenever `status` is not ok."""

    model_config = ConfigDict(frozen=True)

    name: str
    status: Status
    detail: str
    next_step: str = ""


def ok(name: str, detail: str) -> Check:
    return Check(name=name, status="ok", detail=detail)


def warn(name: str, detail: str, next_step: str) -> Check:
    return Check(name=name, status="warn", detail=detail, next_step=next_step)


def fail(name: str, detail: str, next_step: str) -> Check:
    return Check(name=name, status="fail", detail=detail, next_step=next_step)


# ====================================================================== pure judgments


def judge_disk(free: int, where: Path) -> Check:
    shown = f"{free / MiB:,.0f} MiB free on the disk holding {where}"
    if free < DISK_FAIL_BYTES:
        return fail("disk", shown + ": the database cannot grow much more, and a full disk stops the node",
                    f"free space on that disk (at least {DISK_WARN_BYTES // MiB} MiB), or move the home")
    if free < DISK_WARN_BYTES:
        return warn("disk", shown, f"free some space on that disk (keep at least {DISK_WARN_BYTES // MiB} MiB)")
    return ok("disk", shown)


def judge_skew(name: str, skew_s: float | None) -> Check:
    check = f"clock:{name}"
    if skew_s is None:
        return warn(check, f"{name} did not say its time (an older psymesh)",
                    f"update psymesh on {name} to compare clocks")
    ahead = "ahead of" if skew_s > 0 else "behind"
    shown = f"{name}'s clock is {abs(skew_s):.1f} s {ahead} ours"
    if abs(skew_s) > SKEW_FAIL_S:
        return fail(check, shown + ": grants may read as expired or not yet valid", NTP_STEP)
    if abs(skew_s) > SKEW_WARN_S:
        return warn(check, shown, NTP_STEP)
    return ok(check, shown)


def judge_peer(diagnosis: c.PeerDiagnosis, me: str, suggest: Suggest = spell_command) -> Check:
    """`me`: this node's name, as the next step to run on the peer names it."""
    name = diagnosis.name
    if not diagnosis.reachable:
        return warn(f"peer:{name}", f"{name} is unreachable: {diagnosis.error}",
                    f"is {name}'s daemon running (psymesh status there)? run psymesh doctor on it; "
                    f"its addresses here: {suggest('peers', '')}")
    rtt = f", round trip {diagnosis.rtt_ms:.1f} ms" if diagnosis.rtt_ms is not None else ""
    shown = f"{name} is reachable ({diagnosis.path or 'direct'}{rtt})"
    if diagnosis.error:
        return warn(f"peer:{name}", f"{shown}, but {diagnosis.error}",
                    f"ask {name}'s owner for a grant in date: psymesh grant {me} +CAP on {name}")
    return ok(f"peer:{name}", shown)


def judge_dialback(diagnosis: c.PeerDiagnosis, me: str, suggest: Suggest = spell_command) -> Check | None:
    """None when there is nothing to judge (the peer was not reached)."""
    name, check = diagnosis.name, f"dialback:{diagnosis.name}"
    if not diagnosis.reachable:
        return None
    reply = diagnosis.dialback
    if reply is None and diagnosis.dialback_refused:
        return warn(check, f"{name} refused to dial back: {diagnosis.dialback_error}",
                    f"ask {name}'s owner for a grant in date: psymesh grant {me} +CAP on {name}")
    if reply is None:
        return warn(check, f"{name} did not dial back: {diagnosis.dialback_error or 'no answer'}",
                    f"an older psymesh on {name} cannot (update it); else try again: {suggest('doctor', '')}")
    if reply.observed is None:
        return warn(check, f"{name} reaches this node through a relay only, so it cannot try a direct connection",
                    "to be dialed directly, listen on an address it can route to (docs/deploy.md)")
    reached = [r.addr for r in reply.results if r.ok]
    if reached:
        return ok(check, f"{name} connected to this node at {', '.join(reached)}")
    why = "; ".join(f"{r.addr}: {r.error}" for r in reply.results) or "this node listens on no TCP port"
    ports = ", ".join(r.addr.rsplit("/", 1)[-1] for r in reply.results) or "the listen port"
    return warn(check, f"{name} could not connect to this node ({why}); it is reached only over connections "
                       "it opens itself",
                f"forward TCP port {ports} on your router to this machine and allow it in the firewall, or "
                "keep a relay reservation (docs/deploy.md)")


class Endpoint(NamedTuple):
    family: socket.AddressFamily
    ip: str
    port: int


def tcp_endpoint(addr: str) -> Endpoint | None:
    """/ip4/IP/tcp/PORT or /ip6/IP/tcp/PORT (anything may follow); None for other forms."""
    parts = addr.split("/")
    if len(parts) < 5 or parts[0] != "" or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        port = int(parts[4])
    except ValueError:
        return None
    return Endpoint(socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6, parts[2], port)


def _wildcard(ip: str) -> bool:
    return ip in ("0.0.0.0", "::")


def _loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"


def judge_bind(addr: str, error: OSError | None, config_path: Path) -> Check:
    """The daemon is down: could it listen on `addr`? (`error`: what binding it raised)"""
    end = tcp_endpoint(addr)
    assert end is not None
    if error is None:
        return ok("listen", f"{addr} can be bound" + (" (a free port is picked at start)" if end.port == 0 else ""))
    if error.errno == errno.EADDRINUSE:
        return fail("listen", f"port {end.port} is taken on {end.ip}: another program (or another node) listens there",
                    f"find it: ss -ltnp 'sport = :{end.port}' (macOS: lsof -nP -iTCP:{end.port} -sTCP:LISTEN); "
                    f"stop it, or set another port in listen in {config_path}")
    if error.errno == errno.EADDRNOTAVAIL:
        return fail("listen", f"{end.ip} is not an address of this machine (the network changed?)",
                    f"listen on /ip4/0.0.0.0/tcp/{end.port or 4001} in {config_path}, or on this machine's "
                    "address now (ip addr)")
    if error.errno == errno.EACCES:
        return fail("listen", f"no permission to listen on port {end.port}",
                    f"use a port above 1023 in listen in {config_path}")
    return fail("listen", f"cannot listen on {addr}: {error.strerror or error}",
                f"fix listen in {config_path}")


def judge_exposure(listen: list[str], config_path: Path, profile: str = "home") -> list[Check]:
    """Who can reach the listen addresses. A phone is not told to listen beyond loopback: it
    dials out (to home, through a relay), and an open port on a phone's network helps no one."""
    ends = [e for e in map(tcp_endpoint, listen) if e is not None]
    checks = []
    if profile == "phone":
        checks.append(ok("exposure", "a phone dials its peers (and relays) itself: it needs no address they dial"))
    elif ends and all(_loopback(e.ip) for e in ends):
        port = next((e.port for e in ends if e.port), 4001)  # its own port, if it has a fixed one
        checks.append(warn("exposure", "the node listens on loopback only: only this machine can connect to it",
                           f'to be reached from the LAN (and, forwarded, from outside): listen = '
                           f'["/ip4/0.0.0.0/tcp/{port}"] in {config_path}'))
    elif any(e.port == 0 for e in ends):
        checks.append(warn("exposure", "the listen port is picked anew at every start, so addresses peers stored "
                                       "go stale and no router can forward it",
                           f"set a fixed port, e.g. listen = [\"/ip4/0.0.0.0/tcp/4001\"] in {config_path}"))
    else:
        checks.append(ok("exposure", "listening beyond this machine on " + ", ".join(listen)))
    return checks


def listening_match(configured: str, addrs: list[str]) -> str | None:
    """The address the daemon listens on that answers to `configured` (its IP or any for a
    wildcard; its port, or any for port 0), or None."""
    want = tcp_endpoint(configured)
    if want is None:
        return None
    for addr in addrs:
        have = tcp_endpoint(addr)
        if (have is not None and have.family == want.family and "/p2p-circuit" not in addr
                and (want.port == 0 or have.port == want.port) and (_wildcard(want.ip) or have.ip == want.ip)):
            return addr
    return None


# ====================================================================== the daemon's side


@dataclass(frozen=True)
class DoctorParts:
    """What diagnose() uses of the daemon (wired by node/control/owner.py): the paired peers,
    the addresses it was told to listen on, the host, the sessions to peers and the reach view."""

    trust: TrustStore
    listen: list[str]
    p2p: P2PNode
    sessions: SessionPool
    reach: Reach


async def diagnose(node: DoctorParts, request: c.DoctorRequest) -> c.DoctorReply:
    """Probe every paired peer at once (at most PEERS_AT_ONCE in flight), each within the
    request's timeout: reaching it and its ping first, then its dial-back in what is left."""
    peers = node.trust.list(include_revoked=False)
    found: dict[str, c.PeerDiagnosis] = {}
    limiter = anyio.CapacityLimiter(PEERS_AT_ONCE)

    async def one(peer: Peer) -> None:
        async with limiter:
            found[peer.peer_id] = await _diagnose_peer(node, peer, request)

    async with anyio.create_task_group() as tg:
        for peer in peers:
            tg.start_soon(one, peer)
    return c.DoctorReply(listen=list(node.listen), addrs=node.p2p.addrs(), reachability=node.reach.view(),
                         peers=[found[p.peer_id] for p in peers])


async def _diagnose_peer(node: DoctorParts, peer: Peer, request: c.DoctorRequest) -> c.PeerDiagnosis:
    deadline = anyio.current_time() + request.timeout_s
    late = f"no answer within {request.timeout_s:g} s"
    diagnosis = c.PeerDiagnosis(peer_id=peer.peer_id, name=peer.name, reachable=False, error=late)
    with anyio.move_on_at(deadline):
        try:
            session = await node.sessions.session(peer.peer_id)  # dials if no session is open
            path = node.reach.path(peer.peer_id)
            reading = await read_clock(session)
        except NetworkError as exc:
            return diagnosis.model_copy(update={"error": cause_of(exc), "path": node.reach.path(peer.peer_id)})
        except PsymeshError as exc:  # it answered, with a refusal (no grant of its to us in date)
            return diagnosis.model_copy(update={"reachable": True, "path": node.reach.path(peer.peer_id),
                                                "error": f"it refused a ping: {exc.message}",
                                                "dialback_refused": True, "dialback_error": exc.message})
        diagnosis = c.PeerDiagnosis(peer_id=peer.peer_id, name=peer.name, reachable=True, path=path,
                                    rtt_ms=reading.rtt_ms, clock_skew_s=reading.skew_s)
    if not diagnosis.reachable or not request.dialback:
        return diagnosis
    with anyio.move_on_at(deadline):
        try:
            return diagnosis.model_copy(update={"dialback": await node.reach.ask(peer.peer_id)})
        except NetworkError as exc:
            return diagnosis.model_copy(update={"dialback_error": exc.message})
        except PsymeshError as exc:  # it answered: a refusal, with its reason
            return diagnosis.model_copy(update={"dialback_error": exc.message, "dialback_refused": True})
    return diagnosis.model_copy(update={"dialback_error": late})


# ====================================================================== the command's side

class DiskSpace(Protocol):
    @property
    def free(self) -> int: ...


DiskUsage = Callable[[Path], DiskSpace]  # shutil.disk_usage, or a test's


def check_home(home: NodeHome) -> Check:
    """node/core/home.py's checks, as every command runs them: the home private (a looser one is
    tightened, one others may write is refused) and the key readable by us alone."""
    if not home.key_path.exists():
        return fail("home", f"no node at {home.path} (no identity key)",
                    f"start one there: {spell_command('node start', home=str(home.path))}")
    try:
        home.secure()
        home.load_or_create_identity()
    except PsymeshError as exc:
        detail, _, step = exc.message.rpartition("; ")
        return fail("home", detail or exc.message, step if detail else "fix it as the message says")
    return ok("home", f"{home.path} and its key are yours alone")


def check_disk(home: NodeHome, disk_usage: DiskUsage) -> Check:
    try:
        free = disk_usage(home.path).free
    except OSError as exc:
        return fail("disk", f"cannot read the free space at {home.path}: {exc.strerror or exc}",
                    f"check that {home.path} is mounted and readable")
    return judge_disk(free, home.path)


def check_database(home: NodeHome) -> Check:
    path = home.db_path
    if not path.exists():
        return ok("database", f"no database yet at {path} (the daemon makes it at its first start)")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
        try:
            rows = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
        finally:
            conn.close()
    except sqlite3.Error as exc:
        error = storage_error(exc, path)
        detail, _, step = error.message.rpartition("; ")
        return fail("database", detail or error.message, step or "see the message")
    if rows != ["ok"]:
        return fail("database", f"{path} is damaged: {'; '.join(rows[:3])}",
                    f"stop the daemon, keep a copy (cp {path} {path}.bak), then try: "
                    f"sqlite3 {path} '.recover' | sqlite3 {path}.recovered")
    return ok("database", f"{path} passed SQLite's quick_check")


def bind_error(end: Endpoint) -> OSError | None:
    """Bind `end` as the daemon would (without SO_REUSEPORT, as node/net/host.py's start check (node/net/patches.py defect 12))."""
    with socket.socket(end.family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((end.ip, end.port))
        except OSError as exc:
            return exc
    return None


async def check_listening(config: NodeConfig, reply: c.DoctorReply, config_path: Path,
                          suggest: Suggest = spell_command) -> list[Check]:
    """The daemon runs: it listens on each configured address, and a libp2p listener answers there."""
    checks = []
    for addr in config.listen:
        if tcp_endpoint(addr) is None:
            checks.append(warn("listen", f"cannot check {addr} (not /ip4 or /ip6 with /tcp)",
                               f"use /ip4/0.0.0.0/tcp/4001 style addresses in {config_path}"))
            continue
        have = listening_match(addr, reply.addrs)
        if have is None:
            checks.append(warn("listen", f"the daemon does not listen on {addr}; it listens on "
                                         f"{', '.join(reply.addrs) or 'nothing'} (started with --listen?)",
                               f"restart it to use the configured addresses: {suggest('node stop', '')}, then "
                               f"{suggest('node start', '')}"))
            continue
        end = tcp_endpoint(have)
        assert end is not None
        error = await probe_listener(end.ip, end.port)
        if error:
            checks.append(fail("listen", f"the daemon listens on {have}, but connecting to it failed: {error}",
                               "is a firewall on this machine dropping it? is the daemon stuck (see its log)?"))
        else:
            checks.append(ok("listen", f"the daemon listens on {have} and answers there"))
    return checks


def check_bindable(config: NodeConfig, config_path: Path) -> list[Check]:
    checks = []
    for addr in config.listen:
        end = tcp_endpoint(addr)
        if end is None:
            checks.append(warn("listen", f"cannot check {addr} (not /ip4 or /ip6 with /tcp)",
                               f"use /ip4/0.0.0.0/tcp/4001 style addresses in {config_path}"))
        else:
            checks.append(judge_bind(addr, bind_error(end), config_path))
    return checks


def peer_checks(reply: c.DoctorReply, me: str, suggest: Suggest = spell_command) -> list[Check]:
    if not reply.peers:
        return [ok("peers", f"no paired peers yet (pair one: {suggest('pair invite', '')})")]
    checks = []
    for diagnosis in reply.peers:
        checks.append(judge_peer(diagnosis, me, suggest))
        if diagnosis.reachable and not diagnosis.error:
            checks.append(judge_skew(diagnosis.name, diagnosis.clock_skew_s))
        if (dialback := judge_dialback(diagnosis, me, suggest)) is not None:
            checks.append(dialback)
    return checks


async def run_checks(home: NodeHome, *, disk_usage: DiskUsage = shutil.disk_usage,
                     timeout_s: float = 10.0, suggest: Suggest = spell_command) -> list[Check]:
    """Every check, in order; the daemon's part only when it runs. `suggest` spells the
    commands its next steps name (the CLI's repeats the --home it was given)."""
    checks = [check_home(home)]
    if checks[0].status == "fail" and not home.path.is_dir():
        return checks
    checks += [check_disk(home, disk_usage), check_database(home)]
    try:
        config = home.load_config()
    except PsymeshError as exc:
        return checks + [fail("config", exc.message, f"fix {home.config_path} (or move it aside for defaults)")]
    try:
        async with Client(home.path) as client:
            reply = await client.doctor(timeout_s)
    except DaemonNotRunning:
        checks.append(warn("daemon", "the daemon is not running, so peers were not probed",
                           f"start it: {spell_command('node start', home=str(home.path))} "
                           f"(or at boot: {suggest('node install', '')})"))
        return checks + check_bindable(config, home.config_path) + judge_exposure(config.listen, home.config_path,
                                                                                  config.profile)
    except PsymeshError as exc:  # e.g. a control socket that is not our daemon's
        detail, _, step = exc.message.rpartition("; ")
        return checks + [fail("daemon", detail or exc.message, step or "see the message")]
    checks.append(ok("daemon", f"running, listening on {', '.join(reply.addrs) or 'nothing'}"))
    checks += await check_listening(config, reply, home.config_path, suggest)
    checks += judge_exposure(config.listen, home.config_path, config.profile)
    return checks + peer_checks(reply, config.name, suggest)


def failed(checks: list[Check]) -> bool:
    return any(check.status == "fail" for check in checks)


