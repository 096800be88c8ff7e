"""How this node is reached: dial-back (protocol/dialback.py) on both sides, and what the
node knows of its own addresses (`psymesh status`, `psymesh doctor`).

    Reach.serve(call)     a peer's `reach.dialback` (the door admitted it): connect to each
                          port at the IP its connection comes from, say what answered
    Reach.ask(peer_id)    ours: ask a peer to dial us back on the ports we listen on; the
                          addresses it reached are remembered as confirmed
    Reach.view()          the `Reachability` that `status` and `doctor` show
    Reach.path(peer_id)   how the connection to a peer goes (direct or relayed)
"""
from __future__ import annotations

import time

import anyio

from ..net.p2p import P2PNode
from ..net.session import Call, SessionPool
from ..door.trust import TrustStore
from ...protocol import control as c
from ...protocol.dialback import (
    DIAL_TIMEOUT_S,
    MULTISTREAM_HEADER,
    DialBack,
    DialBackReply,
    DialBackResult,
    MAX_PORTS,
    dial_target,
    looks_like_libp2p,
)
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.messages import Message

DIALBACKS_AT_ONCE = 2  # peers' dial-back requests this node works on at a time (the rest wait)
CIRCUIT = "/p2p-circuit"


async def probe_listener(host: str, port: int, timeout: float = DIAL_TIMEOUT_S) -> str:
    """Connect to host:port and read what it says first: "" if a libp2p listener answered,
    else why not, in words. Used for peers' dial-backs and for the doctor's own check."""
    greeting = b""
    with anyio.move_on_after(timeout):
        try:
            stream = await anyio.connect_tcp(host, port)
        except OSError as exc:
            return exc.strerror or str(exc) or type(exc).__name__
        async with stream:
            while len(greeting) < len(MULTISTREAM_HEADER):
                try:
                    greeting += await stream.receive(len(MULTISTREAM_HEADER) - len(greeting))
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    break
            return "" if looks_like_libp2p(greeting) else "something answered that is not a libp2p node"
    return f"no answer within {timeout:g} s" if not greeting else "it answered too slowly"


def tcp_ports(addrs: list[str]) -> list[int]:
    """The TCP ports of our direct addresses, in order, each once."""
    ports = []
    for addr in addrs:
        parts = addr.split("/")
        if CIRCUIT not in addr and "tcp" in parts and parts.index("tcp") + 1 < len(parts):
            ports.append(int(parts[parts.index("tcp") + 1]))
    return list(dict.fromkeys(ports))


class Reach:
    def __init__(self, p2p: P2PNode, sessions: SessionPool, trust: TrustStore) -> None:
        self.p2p = p2p
        self.sessions = sessions
        self.trust = trust
        self._limiter = anyio.CapacityLimiter(DIALBACKS_AT_ONCE)
        self._confirmed: dict[str, c.ConfirmedAddr] = {}  # address -> the latest peer that reached it

    # -- serving a peer's request ----------------------------------------------------------
    async def serve(self, call: Call) -> Message:
        request = call.request
        assert isinstance(request, DialBack)
        ip = None if self.path(call.peer_id) == "relayed" else self.p2p.remote_ip(call.peer_id)
        if ip is None:  # relayed (or gone): there is no address of its to dial
            return DialBackReply(observed=None)
        results: list[DialBackResult] = []
        async with self._limiter:
            async def dial(port: int) -> None:
                host, addr = dial_target(ip, port)
                error = await probe_listener(host, port)
                results.append(DialBackResult(addr=addr, ok=not error, error=error))

            async with anyio.create_task_group() as tg:
                for port in dict.fromkeys(request.ports):
                    tg.start_soon(dial, port)
        return DialBackReply(observed=ip, results=sorted(results, key=lambda r: r.addr))

    # -- asking a peer ------------------------------------------------------------------------
    async def ask(self, peer_id: str) -> DialBackReply:
        """Ask `peer_id` to dial us back on the ports we listen on (NetworkError, RemoteError
        as any request). What it reached is remembered, with it, as a confirmed address."""
        ports = tcp_ports(self.direct())[:MAX_PORTS]
        if not ports:
            raise PsymeshError("this node listens on no TCP port a peer could dial", code=ErrorCode.UNAVAILABLE)
        reply = await self.sessions.request(peer_id, DialBack(ports=ports), DialBackReply,
                                            timeout=DIAL_TIMEOUT_S + 10)
        peer = self.trust.get(peer_id)
        for result in reply.results:
            if result.ok:
                self._confirmed[result.addr] = c.ConfirmedAddr(addr=f"{result.addr}/p2p/{self.p2p.peer_id}",
                                                               by=peer_id, by_name=peer.name if peer else peer_id,
                                                               at=time.time())
            else:
                self._confirmed.pop(result.addr, None)  # it no longer gets through there
        return reply

    # -- what we know ------------------------------------------------------------------------
    def direct(self) -> list[str]:
        return [a for a in self.p2p.addrs() if CIRCUIT not in a]

    def relayed(self) -> list[str]:
        """Our addresses through relays that hold a reservation for us (node/reach/relaying.py keeps them)."""
        return self.p2p.relayed_addrs()

    def path(self, peer_id: str) -> c.ConnectionPath | None:
        """How the connection to `peer_id` goes now (direct if any open one is); None without one."""
        return self.p2p.path(peer_id)

    def view(self) -> c.Reachability:
        return c.Reachability(direct=self.direct(), relayed=self.relayed(),
                              confirmed=sorted(self._confirmed.values(), key=lambda a: -a.at))
