"""A stand-in for the worker child (node/compute/worker_child.py) in the door's tests: the same
command line and ready line, and a Unix socket that echoes what it is sent, so the tests of
the door, the budget and revocation see bytes cross without llama.cpp. The real child is
tested in tests/test_split_engine.py and, through real daemons, in tests/test_split.py."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--memory-mb", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--allow-shared-loopback", action="store_true")
    ap.add_argument("--rpc", default="7.0.0")
    args = ap.parse_args()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(args.socket)
    server.listen(4)
    rpc = [int(x) for x in os.environ.get("ECHO_RPC", args.rpc).split(".")]
    print(json.dumps({"rpc": rpc, "build": "echo", "isolation": "netns", "port": 0,
                      "memory_mb": args.memory_mb, "threads": args.threads}), flush=True)

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            while data := conn.recv(65536):
                conn.sendall(data)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    sys.stdin.read()  # until the node closes our stdin


if __name__ == "__main__":
    main()
