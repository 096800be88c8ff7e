"""libp2p protocol ids, `/psymesh/<name>/<major.minor.patch>`.

A node serves two: pairing (open to anyone) and the session, on which every other
request travels (tasks, ping, manifests; later messaging and web), each admitted by
the node's one door. A node MUST refuse streams for protocols it does not serve
(libp2p multistream-select does this); a breaking change gets a new major version.
"""
from __future__ import annotations

PROTOCOL_VERSION = "1.0.0"


def protocol_id(service: str, version: str = PROTOCOL_VERSION) -> str:
    return f"/psymesh/{service}/{version}"


PAIR = protocol_id("pair")
SESSION = protocol_id("session")
RPC = protocol_id("rpc")  # a split model's llama.cpp RPC bytes, owner to worker (protocol/compute.py)
