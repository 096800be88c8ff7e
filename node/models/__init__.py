"""Models on a node: the registry of GGUF files (registry.py), and each loaded model in a
runner process of its own (runner.py: the node's handle; child.py: the process; the
frames between them are protocol/runner.py), kept by name in a pool (pool.py).

Nothing here loads llama.cpp into the node's own process: a C++ exception, a fault or
the OOM killer in a model ends one request, never the node. May import agent/ and
protocol/, and node/ helpers of the home and database; nothing imports the daemon.
"""
from .pool import ModelPool
from .registry import GGUF_MAGIC, ContextChoice, ModelRegistry, default_context, pull_model
from .runner import ModelRunner, RunnerStatus

__all__ = ["GGUF_MAGIC", "ContextChoice", "ModelPool", "ModelRegistry", "ModelRunner", "RunnerStatus",
           "default_context", "pull_model"]
