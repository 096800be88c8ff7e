"""The exit's address guard: which addresses and ports a fetch may connect to (`AddressPolicy`),
and the httpcore network backend that resolves names itself and connects only to allowed IPs,
checking the socket's peer address again (`GuardedBackend`). The threat model is node/web/exit.py's.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import anyio
import httpcore
import ifaddr

from ..core.websettings import ExitSettings
from ...protocol.errors import ErrorCode, PsymeshError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[Sequence[IPAddress]]]
"""(host, port) -> the addresses `host` resolves to, in the order to try them."""
LocalAddresses = Callable[[], frozenset[IPAddress]]
HostAllowed = Callable[[str], bool]
"""Whether the asker's grant lets it fetch from this host (called for every hop)."""


# ------------------------------------------------------------------------- addresses


def interface_addresses() -> frozenset[IPAddress]:
    """This machine's own addresses, now (a laptop's change as it moves, so ask each time)."""
    found: set[IPAddress] = set()
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            text = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            try:
                found.add(ipaddress.ip_address(text.split("%", 1)[0]))
            except ValueError:
                continue
    return frozenset(found)


async def resolve_host(host: str, port: int) -> Sequence[IPAddress]:
    """The system resolver's answer for `host` (an IP literal is its own answer)."""
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        pass
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise PsymeshError(f"could not resolve {host}: {exc}", code=ErrorCode.UNAVAILABLE) from None
    found: dict[IPAddress, None] = {}
    for *_, sockaddr in infos:
        found.setdefault(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]), None)
    return tuple(found)


_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NEVER = "the exit never fetches from these"
_HINTS = {
    "allow_loopback": "the exit does not fetch from loopback unless [web.exit] allow_loopback = true",
    "allow_private": "the exit does not fetch from private networks unless [web.exit] allow_private = true",
}


def _embedded_v4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64): it is where a socket may
    really go, so it is the one judged."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _kind(ip: IPAddress) -> tuple[str, str | None] | None:
    """What non-public kind of address `ip` is, and the setting that opens it (None: none
    does); None for a public address. Order matters: Python calls ff02::1 'global'."""
    if ip.is_unspecified or (isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_NETWORK):
        return "an unspecified address", None
    if ip.is_loopback:
        return "a loopback address", "allow_loopback"
    if ip.is_link_local:
        return "a link-local address", None
    if ip.is_multicast:
        return "a multicast address", None
    if ip.is_reserved:
        return "a reserved address", None
    if ip.is_private or not ip.is_global or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local):
        return "a private address", "allow_private"
    return None


@dataclass(frozen=True)
class AddressPolicy:
    """Which addresses and ports the exit may connect to for a fetch."""

    allow_loopback: bool = False
    allow_private: bool = False
    ports: frozenset[int] | None = None
    local_addresses: LocalAddresses = interface_addresses

    @classmethod
    def of(cls, settings: ExitSettings, local_addresses: LocalAddresses = interface_addresses) -> "AddressPolicy":
        ports = None if settings.ports is None else frozenset(settings.ports)
        return cls(settings.allow_loopback, settings.allow_private, ports, local_addresses)

    def port_refusal(self, port: int) -> str | None:
        if self.ports is None or port in self.ports:
            return None
        return f"refused: port {port} is not open on this exit ([web.exit] ports = {sorted(self.ports)})"

    def refusal(self, address: IPAddress) -> str | None:
        """Why the exit must not connect to `address`, as the end of a sentence about it
        ("is a loopback address (...)"); None when it may."""
        inner = _embedded_v4(address)
        judged = inner or address
        prefix = f"embeds {inner}, which " if inner is not None else ""
        kind = _kind(judged)
        if kind is not None:
            what, setting = kind
            if setting is None or not getattr(self, setting):
                return f"{prefix}is {what} ({_HINTS[setting] if setting else _NEVER})"
        if not self.allow_loopback and judged in self.local_addresses():
            return (f"{prefix}is an address of this machine "
                    "(the exit does not fetch from itself unless [web.exit] allow_loopback = true)")
        return None

    def refused(self, host: str, address: IPAddress, why: str) -> PsymeshError:
        subject = str(address) if host == str(address) else f"{host} resolves to {address}, which"
        return PsymeshError(f"refused: {subject} {why}", code=ErrorCode.FORBIDDEN)


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the address policy in it: the one place a fetch
    connects, so the one place its address is judged. It resolves `host` itself and connects
    to an allowed IP, so there is no second lookup an attacker's DNS could answer
    differently (rebinding), and it checks the connected socket's peer address again."""

    def __init__(self, policy: AddressPolicy, *, resolve: Resolver = resolve_host,
                 inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.policy = policy
        self.resolve = resolve
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.AsyncNetworkStream:
        refused_port = self.policy.port_refusal(port)
        if refused_port is not None:
            raise PsymeshError(refused_port, code=ErrorCode.FORBIDDEN)
        addresses = await self.resolve(host, port)
        if not addresses:
            raise PsymeshError(f"could not resolve {host}: no addresses", code=ErrorCode.UNAVAILABLE)
        allowed = [ip for ip in addresses if self.policy.refusal(ip) is None]
        if not allowed:
            first = addresses[0]
            raise self.policy.refused(host, first, self.policy.refusal(first) or "")
        failure: Exception | None = None
        for ip in allowed:
            try:
                stream = await self.inner.connect_tcp(str(ip), port, timeout=timeout, local_address=local_address,
                                                      socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
                continue
            await self._check_peer(host, stream)
            return stream
        assert failure is not None
        raise failure

    async def _check_peer(self, host: str, stream: httpcore.AsyncNetworkStream) -> None:
        """The address the socket is really connected to passes the policy too."""
        peer = stream.get_extra_info("server_addr")
        try:
            address = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
        except (TypeError, IndexError, ValueError):
            await stream.aclose()
            raise PsymeshError(f"refused: could not confirm the address connected to for {host}",
                               code=ErrorCode.FORBIDDEN) from None
        why = self.policy.refusal(address)
        if why is not None:
            await stream.aclose()
            raise PsymeshError(f"refused: the connection for {host} reached {address}, which {why}",
                               code=ErrorCode.FORBIDDEN)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.AsyncNetworkStream:
        raise PsymeshError("refused: the exit never connects to unix sockets", code=ErrorCode.FORBIDDEN)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)
