"""Who is on the other end of a loopback TCP connection: the user owning its socket.

llama.cpp's RPC client speaks TCP only, so the owner of a split model hands its runner a
loopback port (node/compute/link.py). Any local user could connect to that port; the kernel
says whose socket did, in /proc/net/tcp (the client socket's row: local = its address,
remote = ours, and its uid), and the link serves only this user's. Where /proc/net/tcp
cannot be read (Android hides it from apps) the answer is None and the link refuses.
"""
from __future__ import annotations

import socket
from pathlib import Path

PROC_TCP = Path("/proc/net/tcp")


def _hex_endpoint(host: str, port: int) -> str:
    """`127.0.0.1`, 5000 -> `0100007F:1388`, as the kernel writes an IPv4 endpoint there."""
    packed = socket.inet_aton(host)
    return f"{int.from_bytes(packed, 'little'):08X}:{port:04X}"


def loopback_peer_uid(ours: tuple[str, int], theirs: tuple[str, int], *, table: Path = PROC_TCP) -> int | None:
    """The uid owning the socket at `theirs` that is connected to our `ours`, or None."""
    want_local, want_remote = _hex_endpoint(*theirs), _hex_endpoint(*ours)
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) > 7 and parts[1] == want_local and parts[2] == want_remote:
            try:
                return int(parts[7])
            except ValueError:
                return None
    return None
