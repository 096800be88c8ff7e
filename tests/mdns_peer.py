"""Another libp2p implementation on the LAN, as far as mDNS goes: its packets byte for byte.

rust-libp2p (protocols/mdns, dns.rs) asks `_p2p._udp.local PTR` with a plain query, and
answers with the PTR in the answer section and one TXT record per address, each holding
one `dnsaddr=` string, in the *additional* section (with the cache-flush bit), under a new
random instance name per response. js-libp2p (@libp2p/mdns, query.ts) puts the PTR and its
TXT records (one per address, TTL 120) all in the *answer* section. Each reads TXT strings
the way `read_peers` below does: rust only from the additional section, js from both.

Run inside a test's network namespace (never on a real interface):

    python tests/mdns_peer.py announce rust|js PEER_NAME ADDR...   # one response, then exit
    python tests/mdns_peer.py query SECONDS                        # rust's query; print what it learns (JSON)
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import sys
import time

GROUP, PORT = "224.0.0.251", 5353
SERVICE = "_p2p._udp.local"
PTR, TXT = 12, 16
IN, CACHE_FLUSH = 1, 0x8000


def name(text: str) -> bytes:
    out = b""
    for label in text.strip(".").split("."):
        out += bytes([len(label)]) + label.encode()
    return out + b"\x00"


def record(owner: str, rtype: int, rclass: int, ttl: int, rdata: bytes) -> bytes:
    return name(owner) + struct.pack("!HHIH", rtype, rclass, ttl, len(rdata)) + rdata


def txt(*strings: str) -> bytes:
    return b"".join(bytes([len(s)]) + s.encode() for s in strings)


def rust_response(peer_name: str, addrs: list[str], ttl: int = 360) -> bytes:
    """rust-libp2p's `build_query_response`: id 0, flags 0x8400, 1 answer, N additionals."""
    instance = f"{peer_name}.{SERVICE}"
    header = struct.pack("!HHHHHH", 0, 0x8400, 0, 1, 0, len(addrs))
    answer = record(SERVICE, PTR, IN, ttl, name(instance))
    return header + answer + b"".join(record(instance, TXT, IN | CACHE_FLUSH, ttl, txt(f"dnsaddr={a}"))
                                      for a in addrs)


def js_response(peer_name: str, addrs: list[str]) -> bytes:
    """js-libp2p's `gotQuery` answer (multicast-dns): the PTR and every TXT as answers, TTL 120."""
    instance = f"{peer_name}.{SERVICE}"
    answers = [record(SERVICE, PTR, IN, 120, name(instance))]
    answers += [record(instance, TXT, IN, 120, txt(f"dnsaddr={a}")) for a in addrs]
    return struct.pack("!HHHHHH", 0, 0x8400, 0, len(answers), 0, 0) + b"".join(answers)


def py_libp2p_txt(addrs: list[str], peer_id: str) -> bytes:
    """py-libp2p 0.8.1's TXT data (zeroconf properties): dnsaddr=, then dnsaddr2=, dnsaddr3=..."""
    keys = ["dnsaddr"] + [f"dnsaddr{i + 1}" for i in range(1, len(addrs))]
    return txt(*(f"{k}={a}" for k, a in zip(keys, addrs)), f"id={peer_id}")


def rust_query() -> bytes:
    """rust-libp2p's `build_query`: a random id, flags 0, one question `_p2p._udp.local PTR IN`."""
    return struct.pack("!HHHHHH", secrets.randbits(16), 0, 1, 0, 0, 0) + name(SERVICE) + struct.pack("!HH", PTR, IN)


# -- reading packets by section ---------------------------------------------------------------


def _read_name(data: bytes, i: int) -> tuple[str, int]:
    labels, end, hops = [], None, 0
    while True:
        n = data[i]
        if n & 0xC0 == 0xC0:  # compression pointer
            if end is None:
                end = i + 2
            i = ((n & 0x3F) << 8) | data[i + 1]
            hops += 1
            if hops > 32:
                raise ValueError("compression loop")
            continue
        if n == 0:
            return ".".join(labels), (end if end is not None else i + 1)
        labels.append(data[i + 1:i + 1 + n].decode(errors="replace"))
        i += 1 + n


def sections(data: bytes) -> dict[str, list[tuple[str, int, bytes, int]]]:
    """{"answer"|"authority"|"additional": [(owner, type, rdata, rdata offset)]} of one packet."""
    _, _, qd, an, ns, ar = struct.unpack("!HHHHHH", data[:12])
    i = 12
    for _ in range(qd):
        _, i = _read_name(data, i)
        i += 4
    out: dict[str, list[tuple[str, int, bytes, int]]] = {"answer": [], "authority": [], "additional": []}
    for section, count in (("answer", an), ("authority", ns), ("additional", ar)):
        for _ in range(count):
            owner, i = _read_name(data, i)
            rtype, _, _, rdlen = struct.unpack("!HHIH", data[i:i + 10])
            i += 10
            out[section].append((owner, rtype, data[i:i + rdlen], i))
            i += rdlen
    return out


def read_peers(data: bytes, *, rust: bool) -> dict[str, list[str]]:
    """{instance: [dnsaddr values]} from one response, read as rust-libp2p (TXT from the
    additional section only) or js-libp2p (answers and additionals) reads it."""
    parts = sections(data)
    instances = [_read_name(data, offset)[0] for owner, rtype, _, offset in parts["answer"]
                 if rtype == PTR and owner.lower() == SERVICE]
    pool = parts["additional"] if rust else parts["answer"] + parts["additional"]
    found: dict[str, list[str]] = {}
    for instance in instances:
        values = []
        for owner, rtype, rdata, _ in pool:
            if rtype != TXT or owner.lower() != instance.lower():
                continue
            j = 0
            while j < len(rdata):
                n = rdata[j]
                item = rdata[j + 1:j + 1 + n].decode(errors="replace")
                if item.startswith("dnsaddr="):
                    values.append(item[len("dnsaddr="):])
                j += 1 + n
        found[instance] = values
    return found


# -- as a program, inside a namespace -------------------------------------------------------------


def _socket(ip: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("", PORT))  # mDNS responses must come from port 5353 (RFC 6762 11)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(ip))
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(GROUP) + socket.inet_aton(ip))
    return s


def main(argv: list[str]) -> None:
    ip = os.environ["MDNS_PEER_IP"]  # the namespace's own address
    with _socket(ip) as s:
        if argv[0] == "announce":
            build = rust_response if argv[1] == "rust" else js_response
            s.sendto(build(argv[2], argv[3:]), (GROUP, PORT))
            return
        s.sendto(rust_query(), (GROUP, PORT))
        deadline = time.monotonic() + float(argv[1])
        heard: dict[str, dict[str, list[str]]] = {"rust": {}, "js": {}}
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                data, _ = s.recvfrom(9000)
            except TimeoutError:
                break
            if struct.unpack("!H", data[2:4])[0] & 0x8000:  # a response
                heard["rust"].update(read_peers(data, rust=True))
                heard["js"].update(read_peers(data, rust=False))
        print(json.dumps(heard))


if __name__ == "__main__":
    main(sys.argv[1:])
