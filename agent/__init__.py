"""psymesh.agent: what a node does with a model, in four rooms; it knows nothing of sockets (the node
hands it work and carries its events).

* ``formats``: chat formats: the chat data, prompt rendering, reply parsing, tool-call grammars;
* ``runtime``: the model runtime: the llama.cpp worker, the surface callers see, one way to generate;
* ``acting``: the agent loop, its tools (the phone's device among them) and the delegation policy;
* ``evaluation``: function-calling evaluation, our case format and BFCL v4.

Imports point one way: formats <- runtime <- acting <- evaluation (tests/test_node_layers.py).
"""
