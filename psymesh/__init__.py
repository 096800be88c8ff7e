"""psymesh: a peer-to-peer mesh for small on-device AI agents.

Public API for scripts::

    import psymesh
    async with psymesh.Client(home="~/.psymesh-home") as node:
        print(await node.status())
"""
from .protocol.errors import (
    ConnectError,
    ConnectionLost,
    ErrorCode,
    NetworkError,
    NetworkTimeout,
    ProtocolError,
    PsymeshError,
    RemoteError,
)

__version__ = "0.1.0"

__all__ = ["Client", "ConnectError", "ConnectionLost", "ErrorCode", "NetworkError", "NetworkTimeout", "ProtocolError",
           "PsymeshError", "RemoteError", "__version__"]


def __getattr__(name: str):  # the SDK pulls in anyio; import it only when asked for
    if name == "Client":
        from .node.control.client import Client

        return Client
    raise AttributeError(name)
