"""psymesh wire protocol: sans-IO.

Everything here turns bytes into validated messages and back, and tracks protocol
state; nothing here opens a socket, starts a task or touches a file. The node
(`psymesh.node`) drives these objects the way httpcore drives h11. This package
imports nothing else of psymesh's (a test checks it).
"""
from importlib import import_module
from typing import Any

# What each name is imported from, on first use: `import psymesh` (every CLI command) must
# not pay for building every message class (issue 22 item 13). unpack() loads the message
# modules it lacks itself when it meets a type it does not know (protocol/messages.py).
_LAZY = {
    "ErrorCode": "errors", "PsymeshError": "errors", "ProtocolError": "errors", "RemoteError": "errors",
    "DEFAULT_MAX_FRAME_SIZE": "framing", "FrameDecoder": "framing", "encode_frame": "framing",
    "SCHEMA_VERSION": "messages", "Message": "messages", "pack": "messages", "unpack": "messages",
    "message_types": "messages", "Channel": "channel",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psymesh.protocol' has no attribute {name!r}")
    return getattr(import_module(f"psymesh.protocol.{module}"), name)


__all__ = [
    "Channel",
    "DEFAULT_MAX_FRAME_SIZE",
    "ErrorCode",
    "FrameDecoder",
    "Message",
    "ProtocolError",
    "PsymeshError",
    "RemoteError",
    "SCHEMA_VERSION",
    "encode_frame",
    "message_types",
    "pack",
    "unpack",
]
