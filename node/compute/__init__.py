"""Lending and borrowing compute: one model split across several homes, on llama.cpp's RPC.

worker.py (a home lending its CPU and memory: llama.cpp's RPC server, in worker_child.py's
process, reached only through the door's `compute.rpc`), worker_child.py (that process: its own
network namespace, a Unix socket in a folder the node owns, only the standard library and
agent/runtime/rpc.py imported), link.py (the owner's side: each worker as a loopback port its
runner dials, carried on `/psymesh/rpc/1.0.0`), split.py (which layers go where, decided at
each load). The wire is protocol/compute.py.

Imports core, net, door and models (a split model's runner takes its `Placement` from here).
"""
