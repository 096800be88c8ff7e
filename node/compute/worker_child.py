"""A compute worker process: `python -m psymesh.node.compute.worker_child --socket PATH`.

It lends this machine's CPU to one split model at a time: llama.cpp's own RPC server
(agent/runtime/rpc.py's `serve`), which executes any graph a client sends and allocates what it
asks for, with no authentication. So nothing of it may be reachable except through psymesh:

1. Before anything else (a new user namespace needs a single-threaded process) it enters a
   private network namespace: ``unshare(CLONE_NEWNET)`` as root, else
   ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` mapping our own uid and gid. Its loopback is
   brought up there (ioctl SIOCSIFFLAGS, no `ip` binary) and the RPC server listens on
   127.0.0.1:RPC_PORT inside it, where no other process on the machine can connect. If no
   namespace can be made it refuses to start, saying why, unless ``--allow-shared-loopback``
   (the RPC port is then on the machine's loopback, and the ready line says so).
2. Started as root, it becomes nobody (uid and gid 65534, no supplementary groups, no new
   privileges) once the namespace and its socket are made, before the server starts.
   ``--memory-mb`` caps its address space (RLIMIT_AS), so a peer's allocations past the budget
   fail in this process (llama.cpp answers a failed allocation with a null buffer: the peer's
   load fails) or end it, never the node.
3. It listens on the Unix socket PATH (in a 0700 folder the node owns; pathname sockets are
   reachable across network namespaces through the file system) and splices each connection
   to the RPC port, one at a time. llama.cpp's client opens consecutive connections during a
   load (a device count, then the model's), each closed just before the next opens, and through
   a proxy the previous one's end reaches us after the next one's start: a connection that
   arrives while one is served waits up to HANDOVER_GRACE_S for it to end. One more arriving
   meanwhile, or one still waiting after that, is closed at once with nothing sent (busy).

stdout carries one JSON line: ``{"rpc": [7, 0, 0], "build": "...", "isolation": "netns" |
"shared-loopback", "port": N, "memory_mb": N | null, "threads": N}`` once it serves, or ``{"error": "..."}``
when it will not (exit status 2). Everything else, llama.cpp's own prints to stdout included,
goes to stderr. It exits when its stdin closes (the node stopped or died: no orphan).

Only the standard library and agent/runtime/rpc.py are imported: no libp2p, no trio.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["HANDOVER_GRACE_S", "RPC_PORT", "main", "pump"]

RPC_PORT = 50052          # inside our own namespace nothing else listens: llama.cpp's default port
HANDOVER_GRACE_S = 5.0    # how long a second connection waits for the one being served to end
START_DEADLINE_S = 30.0   # the RPC server must listen within this
_COPY_CHUNK = 1 << 20

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_PR_SET_NO_NEW_PRIVS = 38
NOBODY = 65534  # the uid and gid a worker started as root serves as
_IFREQ = struct.Struct("16sH22x")  # struct ifreq: the name, then ifr_flags in the union (40 bytes)


class Refused(Exception):
    """The worker will not start (the message says why and what to do)."""


def _unshare(libc: ctypes.CDLL, flags: int) -> None:
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _private_network() -> None:
    """Move this (still single-threaded) process into a network namespace of its own, loopback up."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    try:
        _unshare(libc, _CLONE_NEWNET)
    except OSError as as_root:
        try:
            _unshare(libc, _CLONE_NEWUSER | _CLONE_NEWNET)
        except OSError as as_user:
            raise Refused(
                "cannot make a private network namespace for the RPC server "
                f"(unshare(CLONE_NEWNET): {as_root.strerror}; unshare(CLONE_NEWUSER|CLONE_NEWNET): "
                f"{as_user.strerror}); run the node as root, enable unprivileged user namespaces "
                "(sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone), or pass "
                "--allow-shared-loopback to put the RPC port on this machine's loopback") from None
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            Path(f"/proc/self/{name}").write_text(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0))
        flags = _IFREQ.unpack(got)[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))


def _drop_root() -> None:
    """As root, become nobody once what needs root is done (the namespace, the socket in the
    node's 0700 folder): llama.cpp's RPC server parses whatever a peer sends, and a bug in it
    should not hand that peer root. No new privileges after that (no setuid binaries)."""
    if os.geteuid() != 0:
        return
    import encodings.idna  # noqa: F401  (what connecting to "127.0.0.1" imports: nobody may not read our Python)

    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _limit_memory(limit_mb: int | None) -> None:
    if limit_mb is None:
        return
    import resource

    cap = limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    """llama.cpp's RPC server on a thread of its own (it never returns unless it cannot start)."""

    def __init__(self, port: int, threads: int) -> None:
        self.port = port
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, args=(threads,), name="rpc-server", daemon=True)

    def _run(self, threads: int) -> None:
        from ...agent.runtime.rpc import serve

        try:
            serve(f"127.0.0.1:{self.port}", threads=threads)
        except Exception as exc:  # serve only returns by raising: the server could not start
            self.error = str(exc)

    def start(self) -> None:
        """Start it and wait until it listens (or say why it did not)."""
        self.thread.start()
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise Refused(self.error or "llama.cpp's RPC server stopped")
            try:  # an empty connection: the server reads no command, closes it, and accepts the next
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.01)
        raise Refused(f"llama.cpp's RPC server did not listen within {START_DEADLINE_S:g} s")


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until src ends, then end dst's writing half."""
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    try:
        while n := src.recv_into(buf):
            dst.sendall(view[:n])
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class _Splicer:
    """Unix-socket connections to the RPC port, one at a time (see the module docstring)."""

    def __init__(self, listener: socket.socket, port: int) -> None:
        self.listener = listener
        self.port = port
        self.serving = threading.Semaphore(1)
        self.waiting = threading.Semaphore(1)

    def run(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            threading.Thread(target=self._admit, args=(conn,), name="rpc-splice", daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        if not self.serving.acquire(blocking=False):
            if not self.waiting.acquire(blocking=False):
                conn.close()
                return
            try:
                admitted = self.serving.acquire(timeout=HANDOVER_GRACE_S)
            finally:
                self.waiting.release()
            if not admitted:
                conn.close()
                return
        try:
            self._splice(conn)
        finally:
            self.serving.release()

    def _splice(self, conn: socket.socket) -> None:
        with conn:
            try:
                rpc = socket.create_connection(("127.0.0.1", self.port))
            except OSError:
                return
            with rpc:
                rpc.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                back = threading.Thread(target=pump, args=(rpc, conn), name="rpc-splice-back", daemon=True)
                back.start()
                pump(conn, rpc)
                back.join()


def _listen(path: Path) -> socket.socket:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()  # a previous worker's, left behind by a kill
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(8)
    return listener


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m psymesh.node.compute.worker_child",
                                description="llama.cpp's RPC server, reachable only through a Unix socket")
    p.add_argument("--socket", required=True, type=Path, help="the Unix socket to listen on")
    p.add_argument("--memory-mb", type=int, default=None, help="cap this process's address space (MiB)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the server (default: all but one)")
    p.add_argument("--allow-shared-loopback", action="store_true",
                   help="if no private network namespace can be made, listen on this machine's loopback")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    # stdout is for our one JSON line; llama.cpp prints to fd 1, which now goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort says why and ends; no gdb attaching to us

    def say(line: dict[str, object]) -> None:
        out.write(json.dumps(line) + "\n")
        out.flush()

    try:
        try:
            _private_network()
            isolation, port = "netns", RPC_PORT
        except Refused as why:
            if not args.allow_shared_loopback:
                raise
            print(f"worker: {why}; listening on the shared loopback instead (--allow-shared-loopback)",
                  file=sys.stderr)
            isolation, port = "shared-loopback", _free_loopback_port()
        _limit_memory(args.memory_mb)
        from ...agent.runtime.api import default_threads
        from ...agent.runtime.rpc import engine_build, rpc_available, rpc_version

        version = rpc_version()
        if not rpc_available() or version is None:
            raise Refused("this llama-cpp-python has no RPC backend (rebuild it with -DGGML_RPC=ON: "
                          "scripts/bootstrap.sh)")
        build = engine_build()
        listener = _listen(args.socket)
        _drop_root()
        threads = args.threads or default_threads()
        server = _Server(port, threads)
        server.start()
    except (Refused, OSError) as exc:
        print(f"worker: {exc}", file=sys.stderr)
        say({"error": str(exc)})
        return 2
    threading.Thread(target=_Splicer(listener, port).run, name="rpc-accept", daemon=True).start()
    say({"rpc": list(version), "build": build, "isolation": isolation, "port": port,
         "memory_mb": args.memory_mb, "threads": threads})
    try:
        while sys.stdin.buffer.read1(65536):  # until the node closes our stdin
            pass
    finally:
        try:
            args.socket.unlink()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    # The server and splice threads never return by themselves: leave without joining them.
    code = main()
    sys.stdout.flush()
    os._exit(code)
