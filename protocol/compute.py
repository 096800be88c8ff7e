"""Lending compute: one model split across nodes, on llama.cpp's own RPC protocol, sans-IO.

A node that owns a model too big for it (the *owner*) runs some of its layers on other
homes (the *workers*), through llama.cpp's RPC backend (`ggml-rpc`): the owner's llama.cpp
is the RPC client, each worker's llama.cpp RPC server holds and computes its share. psymesh
adds no tensor protocol of its own; it carries llama.cpp's bytes, unchanged, on a stream of
its own protocol, `/psymesh/rpc/1.0.0`, between two paired nodes, and only after the door
admitted it (capability `compute.rpc`, granted by name, in no preset):

    owner                                          worker
    rpc.offer {rpc, build, probe}      ──►         (the door: paired, granted compute.rpc)
                                       ◄──         rpc.accept {rpc, build, memory_mb, threads}
                                                   or error {code, message}, then the stream closes
    llama.cpp RPC bytes                ◄─►         (raw, both ways, until either end closes)

One offer per stream. With `probe: true` the worker answers and closes: the owner learns the
worker's version and budget before it splits a model. Otherwise the bytes after `rpc.accept`
are llama.cpp's RPC conversation; the opener MUST NOT send any before it has read
`rpc.accept`.

A worker serves one owner's stream at a time (llama.cpp's server is sequential): a second is
refused `busy`. The versions MUST be equal in all three parts (`RPC_PROTO_MAJOR/MINOR/PATCH`:
the patch counts ggml's operations, so a graph from another patch may hold an op the server
cannot run); a mismatch is refused `unsupported_version` naming both.

`RpcGate` reads the owner's bytes as they pass the worker's node (llama.cpp frames a command
as `cmd:u8, size:u64 little-endian, payload[size]`) and holds them to the grant's memory
budget: the buffers allocated over one stream (`ALLOC_BUFFER`'s `size`) sum to at most the
budget, and no command's payload is larger than it. Past either the stream is cut
(`too_large`), before the worker's server sees the command.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from .errors import ErrorCode, PsymeshError
from .messages import Message

__all__ = ["RPC_MAX_FRAME", "RpcAccept", "RpcGate", "RpcOffer", "check_versions", "version_text"]

RPC_MAX_FRAME = 4096  # the offer and its answer are small; a larger frame is refused before it is read

# llama.cpp's RPC command numbers (ggml-rpc.cpp `enum rpc_cmd`, protocol 7.x) that the gate reads.
CMD_ALLOC_BUFFER = 0
CMD_HELLO = 14
CMD_COUNT = 19  # RPC_CMD_COUNT: a command byte at or past it is not llama.cpp's
_HEADER = struct.Struct("<BQ")  # cmd, payload size
_ALLOC = struct.Struct("<I4xQ")  # rpc_msg_alloc_buffer_req {uint32 device; (pad) uint64 size}

Version = tuple[int, int, int]


class RpcOffer(Message):
    """The owner's first frame on `/psymesh/rpc/1.0.0`: its llama.cpp RPC protocol version,
    its engine's build (for people: shown in a refusal), and whether it only asks."""

    type = "rpc.offer"
    rpc: tuple[int, int, int]
    build: str = Field("", max_length=200)
    probe: bool = False


class RpcAccept(Message):
    """The worker's answer: its version and build, and what the owner may use there:
    `memory_mb`, the buffers it may allocate over this stream (the grant's `rpc_memory_mb`,
    or the worker's own cap, whichever is less; None: no cap), and the threads it computes on."""

    type = "rpc.accept"
    rpc: tuple[int, int, int]
    build: str = Field("", max_length=200)
    memory_mb: int | None = Field(None, ge=1)
    threads: int = Field(1, ge=1)


def version_text(v: Version) -> str:
    return ".".join(str(x) for x in v)


def check_versions(ours: Version, theirs: Version, *, ours_build: str, theirs_build: str, who: str) -> None:
    """Raise `unsupported_version` unless the two llama.cpp RPC versions are equal."""
    if tuple(ours) != tuple(theirs):
        raise PsymeshError(
            f"{who} speaks llama.cpp RPC {version_text(theirs)} ({theirs_build or 'build unknown'}), this node "
            f"{version_text(ours)} ({ours_build or 'build unknown'}): the same llama-cpp-python build is needed "
            "on both (psymesh's bootstrap builds it with -DGGML_RPC=ON)",
            code=ErrorCode.UNSUPPORTED_VERSION)


@dataclass
class RpcGate:
    """The owner's byte stream, read as it passes: commands well-formed, allocations within
    `budget_bytes` (None: none). Sans-IO: `feed()` the bytes in order; it raises
    `PsymeshError(too_large | bad_frame)` at the first byte past the budget, before those
    bytes are forwarded. Payload bytes are skipped by count, never buffered: it keeps at most
    one header or one ALLOC_BUFFER request (16 bytes)."""

    budget_bytes: int | None
    allocated: int = 0
    commands: int = 0
    _state: Literal["header", "alloc", "skip"] = "header"
    _want: int = _HEADER.size
    _buf: bytes = b""

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._state == "skip":
                n = min(self._want, len(view))
                self._want -= n
                view = view[n:]
                if self._want == 0:
                    self._next_header()
                continue
            n = min(self._want - len(self._buf), len(view))
            self._buf += bytes(view[:n])
            view = view[n:]
            if len(self._buf) < self._want:
                return
            if self._state == "header":
                self._on_header(*_HEADER.unpack(self._buf))
            else:
                self._on_alloc(_ALLOC.unpack(self._buf)[1])

    def _next_header(self) -> None:
        self._state, self._want, self._buf = "header", _HEADER.size, b""

    def _on_header(self, cmd: int, size: int) -> None:
        if cmd >= CMD_COUNT:
            raise PsymeshError(f"not a llama.cpp RPC command: {cmd}", code=ErrorCode.BAD_FRAME)
        if self.budget_bytes is not None and size > self.budget_bytes:
            raise PsymeshError(f"an RPC command of {size} bytes is over the memory budget of "
                               f"{self.budget_bytes // 2**20} MB", code=ErrorCode.TOO_LARGE)
        self.commands += 1
        if cmd == CMD_ALLOC_BUFFER and size == _ALLOC.size:
            self._state, self._want, self._buf = "alloc", _ALLOC.size, b""
        elif size:
            self._state, self._want, self._buf = "skip", size, b""
        else:
            self._next_header()

    def _on_alloc(self, size: int) -> None:
        if self.budget_bytes is not None and self.allocated + size > self.budget_bytes:
            raise PsymeshError(
                f"allocating {size // 2**20} MB more would pass the memory budget of {self.budget_bytes // 2**20} MB "
                f"({self.allocated // 2**20} MB allocated)", code=ErrorCode.TOO_LARGE)
        self.allocated += size
        self._next_header()
