"""The agent loop and its tools: the loop that asks a model, runs the tools it calls and feeds their
results back (loop.py); tools, their registry and invocation (tools.py); the node's built-in tools
(builtin_tools.py); the phone's device tools (device.py); and the delegation policy, run here or on a
home (policy.py).

May import formats and runtime (and protocol/); never evaluation.
"""
