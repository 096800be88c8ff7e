"""libp2p protocol ids: one per service, `/psymesh/<service>/<major.minor.patch>`.

A node MUST refuse streams for services it does not serve (libp2p multistream-select
does this); a breaking change to a service's messages gets a new major version.
"""
from __future__ import annotations

PROTOCOL_VERSION = "1.0.0"


def protocol_id(service: str, version: str = PROTOCOL_VERSION) -> str:
    return f"/psymesh/{service}/{version}"


PING = protocol_id("ping")
PAIR = protocol_id("pair")
TASK = protocol_id("task")
MSG = protocol_id("msg")
WEB = protocol_id("web")
MANIFEST = protocol_id("manifest")
SESSION = protocol_id("session")
