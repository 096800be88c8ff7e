"""Dial-back: can a paired peer open a connection to us, or only we to it?

A node behind a NAT reaches its peers by dialing out, and they answer on that connection;
nothing tells it whether they could dial *it*. `psymesh doctor` asks each reachable peer:

    reach.dialback {ports}          "open a TCP connection to me, on each of these ports"
    reach.dialback_reply {observed, results}

The peer dials only the IP address it sees our connection come from (`observed`), never
one we name: a peer may make us connect to its own address only, as libp2p's AutoNAT does,
so the request cannot point our node at a third party. A peer reached through a relay
sees no address of ours (`observed` is None) and dials nothing. At most `MAX_PORTS` ports,
each tried once within `DIAL_TIMEOUT_S`; the request is charged to the asker's grant rate
like a ping (protocol/admission.py), and a node runs at most a few at once.

A dial succeeds when whatever answers the port speaks first the way a libp2p listener does
(multistream-select's header): a port forwarded to another program is not ours. It does
not prove the key (no Noise handshake is made): it is a reachability check, and pairing
and every later connection prove who is there.
"""

import ipaddress
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from .messages import Message

MAX_PORTS = 4
DIAL_TIMEOUT_S = 5.0
# What a libp2p listener sends first on a new TCP connection: multistream-select's header,
# length-prefixed (a varint: 19).
MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"

Port = Annotated[int, Field(ge=1, le=65535)]


class DialBack(Message):
    """Dial me back on `ports`, at the address you see me at."""

    type = "reach.dialback"
    ports: list[Port] = Field(min_length=1, max_length=MAX_PORTS)


class DialBackResult(BaseModel):
    """One port tried: `addr` is the multiaddr dialed (the observed IP and the port)."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="ignore")

    addr: str
    ok: bool
    error: str = ""  # why not: refused, no answer within the timeout, not a libp2p listener


class DialBackReply(Message):
    type = "reach.dialback_reply"
    observed: str | None = None  # the IP the asker's connection comes from; None: relayed, nothing dialed
    results: list[DialBackResult] = Field(default_factory=list, max_length=MAX_PORTS)


def dial_target(observed_ip: str, port: int) -> tuple[str, str]:
    """(host to connect to, multiaddr naming it) for `port` at `observed_ip`."""
    ip = ipaddress.ip_address(observed_ip)
    proto = "ip4" if ip.version == 4 else "ip6"
    return str(ip), f"/{proto}/{ip}/tcp/{port}"


def looks_like_libp2p(first_bytes: bytes) -> bool:
    """Whether what a port sent first is a libp2p listener's greeting."""
    return first_bytes.startswith(MULTISTREAM_HEADER)
