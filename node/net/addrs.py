"""Addresses as the host reads and writes them: multiaddrs and peer ids parsed into psymesh
errors, circuit addresses (`<relay>/p2p-circuit/p2p/<target>`) taken apart, plain TCP
endpoints, the listen-port check (defect 12 of net/patches.py), and this machine's own IPv4
addresses, with a watcher that says when they change (26)."""
from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence

import anyio
import multiaddr
from libp2p.abc import IMuxedConn, INetConn
from libp2p.connection_types import ConnectionType
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from ...protocol.errors import ErrorCode, PsymeshError

log = logging.getLogger(__name__)


def _is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr


def _relay_of(addr: str) -> str | None:
    """The relay's peer id in a circuit address (None for any other address)."""
    if not _is_circuit(addr):
        return None
    parts = addr.partition("/p2p-circuit")[0].split("/")
    return parts[-1] if len(parts) >= 3 and parts[-2] in ("p2p", "ipfs") else None


def _with_peer_id(addr: str, peer_id: str) -> str:
    """`addr` ending in /p2p/<peer id>: as it is if it names one (a circuit address names the
    relay first, then its target), else with `peer_id`'s."""
    parts = addr.rstrip("/").split("/")
    return addr if len(parts) >= 3 and parts[-2] in ("p2p", "ipfs") else f"{addr}/p2p/{peer_id}"


def _is_relayed(conn: INetConn | IMuxedConn) -> bool:
    try:
        return conn.get_connection_type() == ConnectionType.RELAYED
    except Exception:
        return False


def _bytes_to_addr(data: bytes) -> str | None:
    try:
        return str(multiaddr.Multiaddr(bytes(data)))
    except Exception:
        return None


def _tcp_endpoint(addr: str) -> tuple[str, int] | None:
    """(ip, port) of a plain TCP multiaddr (`/ip4|ip6/IP/tcp/PORT`, optionally `/p2p/ID`); None
    for anything else (circuits, DNS, other transports)."""
    parts = addr.split("/")
    if len(parts) not in (5, 7) or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    if len(parts) == 7 and parts[5] not in ("p2p", "ipfs"):
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if ip.version != (4 if parts[1] == "ip4" else 6) or not 0 < port < 65536:
        return None
    return parts[2], port


def _is_loopback(addr: str) -> bool:
    endpoint = _tcp_endpoint(addr)
    return endpoint is not None and ipaddress.ip_address(endpoint[0]).is_loopback


def _parse_multiaddr(addr: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(addr)
    except Exception as exc:
        raise PsymeshError(f"not a multiaddr: {addr!r} ({exc})", code=ErrorCode.BAD_REQUEST) from None


def _peer_info(addr: str) -> PeerInfo:
    maddr = _parse_multiaddr(addr)
    try:
        return info_from_p2p_addr(maddr)
    except Exception:
        raise PsymeshError(f"{addr!r} does not end in /p2p/<peer id>", code=ErrorCode.BAD_REQUEST) from None


def _parse_peer_id(peer_id: str) -> ID:
    try:
        return ID.from_base58(peer_id)
    except Exception:
        raise PsymeshError(f"not a peer id: {peer_id[:64]!r}", code=ErrorCode.BAD_REQUEST) from None


def _check_port_free(addr: multiaddr.Multiaddr) -> None:
    """(12) Refuse a fixed TCP port that something already listens on. libp2p binds with
    SO_REUSEPORT, so a second node would get the same port and the kernel would split the
    incoming connections between the two. Our probe binds without it (SO_REUSEADDR only
    tolerates TIME_WAIT leftovers), which fails while any socket listens there."""
    protocols = {p.name for p in addr.protocols()}
    if "tcp" not in protocols or not ({"ip4", "ip6"} & protocols):
        return
    port = int(addr.value_for_protocol("tcp"))
    if port == 0:
        return
    family, ip = ((socket.AF_INET6, addr.value_for_protocol("ip6")) if "ip6" in protocols
                  else (socket.AF_INET, addr.value_for_protocol("ip4")))
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError as exc:
            raise PsymeshError(f"cannot listen on {addr}: {exc.strerror or exc}", code=ErrorCode.UNAVAILABLE) from None


ADDRESS_POLL_S = 60.0  # where the kernel cannot tell us (no netlink): how often addresses are looked at
_RTMGRP_IPV4_IFADDR, _RTMGRP_IPV6_IFADDR = 0x10, 0x100


def _is_wildcard(addr: multiaddr.Multiaddr) -> bool:
    return str(addr).startswith(("/ip4/0.0.0.0/", "/ip6/::/"))


async def _watch_local_addresses(changed: Callable[[], None]) -> None:
    """(26) Call `changed()` when this machine's IP addresses change (a Wi-Fi network joined,
    a link up): told by the kernel (a netlink socket, Linux and Android), so nothing wakes
    while they stay the same; where that socket cannot be had, looked at every ADDRESS_POLL_S."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        sock.bind((0, _RTMGRP_IPV4_IFADDR | _RTMGRP_IPV6_IFADDR))
        sock.setblocking(False)
    except (OSError, AttributeError) as exc:
        log.debug("no netlink socket (%s): local addresses are looked at every %.0f s", exc, ADDRESS_POLL_S)
        seen = local_ipv4_addresses()
        while True:
            await anyio.sleep(ADDRESS_POLL_S)
            if (now := local_ipv4_addresses()) != seen:
                seen = now
                changed()
    with sock:
        while True:
            await anyio.wait_socket_readable(sock)
            try:
                while sock.recv(65536):
                    pass
            except BlockingIOError:
                pass
            changed()


def local_ipv4_addresses() -> list[str]:
    """This machine's IPv4 addresses, non-loopback first."""
    import ifaddr

    found = {ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips if isinstance(ip.ip, str)}
    return sorted(found, key=lambda a: (a.startswith("127."), a))


def expand_wildcard(addrs: Sequence[str], local: Sequence[str]) -> list[str]:
    """Replace each `/ip4/0.0.0.0/...` with one address per local IPv4 address."""
    out: list[str] = []
    for addr in addrs:
        if addr.startswith("/ip4/0.0.0.0/"):
            out += [addr.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in local]
        else:
            out.append(addr)
    return list(dict.fromkeys(out))
