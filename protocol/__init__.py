"""psymesh wire protocol: sans-IO.

Everything here turns bytes into validated messages and back, and tracks protocol
state; nothing here opens a socket, starts a task or touches a file. The node
(`psymesh.node`) drives these objects the way httpcore drives h11. This package
imports nothing else of psymesh's (a test checks it).
"""
from psymesh.protocol.errors import ErrorCode, PsymeshError, ProtocolError, RemoteError
from psymesh.protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame
from psymesh.protocol.messages import SCHEMA_VERSION, Message, pack, unpack, message_types
from psymesh.protocol.channel import Channel
# Import every message module so unpack() knows all types, whoever imported us.
from psymesh.protocol import common, control, mailbox, messaging, pairing, session, tasks, web  # noqa: F401,E402

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
