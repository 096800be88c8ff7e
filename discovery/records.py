"""The libp2p mDNS record, sans-IO: what a node puts in its TXT record and what it reads
out of other nodes' records.

libp2p mDNS (github.com/libp2p/specs, discovery/mdns.md) announces a node as one DNS-SD
instance of `_p2p._udp.local.` named by a random label of 32-63 lowercase letters and
digits (not the peer id, which a future key type could make longer than the 63 bytes a
DNS label holds), whose TXT strings are `dnsaddr=<multiaddr ending /p2p/<peer id>>`, one
string per address.

Implementations put those strings in different places, so a reader takes every TXT
string of the instance, from every TXT record: rust-libp2p and js-libp2p send one TXT
record per address (one string each), zeroconf-based ones (psymesh) one record holding
them all. py-libp2p 0.8.1 writes its first address as `dnsaddr=` and the others under
the keys `dnsaddr2`, `dnsaddr3`, ..., which no other implementation reads: we read its
first address, and ignore the others, as rust and js do. A string that is not a
`dnsaddr`, is not text, or names another peer than the first valid one is skipped,
never an error: anyone on the LAN may send anything.

Loopback and unspecified addresses are never sent (they mean nothing to another host;
the spec's open issue says so too) and are dropped on receipt.
"""
from __future__ import annotations

import ipaddress
import secrets
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import base58

SERVICE_TYPE = "_p2p._udp.local."
KEY = "dnsaddr"
MAX_TXT_STRING = 255  # RFC 1035: one length byte per character-string
MAX_ADDRS = 16        # addresses kept from one announcement: anyone may send a long list
_LABEL_CHARS = string.ascii_lowercase + string.digits
_P2P = ("p2p", "ipfs")  # `/ipfs/` is the older name of the same component


@dataclass(frozen=True)
class Announcement:
    """What one instance's TXT strings say: a peer id and its addresses (each ends /p2p/<id>)."""

    peer_id: str
    addrs: tuple[str, ...]


def instance_label() -> str:
    """A fresh random instance name, as the spec asks: 32 to 63 lowercase letters and digits."""
    return "".join(secrets.choice(_LABEL_CHARS) for _ in range(32 + secrets.randbelow(32)))


def advertised(addrs: Iterable[str], peer_id: str) -> list[str]:
    """Which of our listen addresses go into the record: dialable ones (IPv4 or IPv6, TCP),
    neither loopback nor unspecified, each ending /p2p/<our id>, short enough for one TXT
    string. `addrs` are P2PNode.addrs() (a wildcard already expanded to each local address)."""
    out: list[str] = []
    for addr in addrs:
        base = addr.removesuffix(f"/p2p/{peer_id}")
        full = f"{base}/p2p/{peer_id}"
        if dialable(full) and len(KEY) + 1 + len(full) <= MAX_TXT_STRING and full not in out:
            out.append(full)
    return out


def encode_txt(addrs: Sequence[str]) -> bytes:
    """The TXT record data for `addrs` (from `advertised`): one `dnsaddr=` character-string each."""
    out = bytearray()
    for addr in addrs:
        item = f"{KEY}={addr}".encode("ascii")
        if len(item) > MAX_TXT_STRING:
            raise ValueError(f"{addr!r} does not fit in one TXT string")
        out += bytes([len(item)]) + item
    return bytes(out)


def txt_strings(rdata: bytes) -> list[bytes]:
    """The character-strings of one TXT record's data (RFC 1035 3.3.14). A length byte that
    runs past the end ends the list: the strings before it are still good."""
    strings, i = [], 0
    while i < len(rdata):
        n = rdata[i]
        if i + 1 + n > len(rdata):
            break
        strings.append(rdata[i + 1:i + 1 + n])
        i += 1 + n
    return strings


def parse_announcement(records: Iterable[bytes]) -> Announcement | None:
    """The announcement in an instance's TXT records (each one record's data), or None if
    no string in them is a usable `dnsaddr`. Keys compare case-insensitively (RFC 6763 6.4)."""
    peer_id: str | None = None
    addrs: list[str] = []
    for record in records:
        for item in txt_strings(record):
            key, sep, value = item.partition(b"=")
            if not sep or key.lower() != KEY.encode():
                continue  # another key: py-libp2p's dnsaddr2..., DNS-SD's empty string, ...
            try:
                addr = value.decode("ascii")
            except UnicodeDecodeError:
                continue
            owner = addr_peer_id(addr)
            if owner is None or _is_local(addr) or (peer_id is not None and owner != peer_id):
                continue
            peer_id = owner
            if addr not in addrs and len(addrs) < MAX_ADDRS:
                addrs.append(addr)
    return Announcement(peer_id, tuple(addrs)) if peer_id is not None else None


def addr_peer_id(addr: str) -> str | None:
    """The peer id a multiaddr ends with (`.../p2p/<id>`), if it is a plausible one: base58btc
    of 2 to 128 characters. Other implementations' ids (RSA `Qm...`, secp256k1) count too."""
    parts = addr.split("/")
    if len(parts) < 4 or parts[0] != "" or parts[-2] not in _P2P:
        return None
    candidate = parts[-1]
    if not 2 <= len(candidate) <= 128:
        return None
    try:
        base58.b58decode(candidate)
    except ValueError:
        return None
    return candidate


def dialable(addr: str) -> bool:
    """Whether psymesh can dial `addr`: `/ip4|ip6/<address>/tcp/<port>/p2p/<id>`, the address
    neither loopback, unspecified nor multicast. Only such addresses reach the trust store."""
    parts = addr.split("/")
    if len(parts) != 7 or parts[0] != "" or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return False
    if parts[5] not in _P2P or addr_peer_id(addr) is None or not parts[4].isdigit() or not 0 < int(parts[4]) < 65536:
        return False
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return False
    return ip.version == (4 if parts[1] == "ip4" else 6) and not (ip.is_loopback or ip.is_unspecified or ip.is_multicast)


def _is_local(addr: str) -> bool:
    """A loopback or unspecified IP address: meaningless to anyone but its own host."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return True  # not even an address
    return ip.is_loopback or ip.is_unspecified


def without_peer_id(addr: str) -> str:
    """`addr` without its trailing `/p2p/<id>`: how addresses of one peer compare."""
    parts = addr.split("/")
    return "/".join(parts[:-2]) if len(parts) >= 4 and parts[-2] in _P2P else addr
