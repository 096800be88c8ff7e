"""Lending this home's CPU to a paired peer's split model (llama.cpp's RPC backend, agent/runtime/rpc.py).

worker_child.py is the process that runs llama.cpp's RPC server, in a network namespace of its own,
reachable only through a Unix socket in a folder the node owns. May import core, net and door; the
worker process itself imports only the standard library and agent/runtime/rpc.py.
"""
