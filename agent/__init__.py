"""psymesh.agent: the model runtime, chat format, agent loop, tools and delegation policy.
Knows nothing of sockets: the node hands it work and carries its events."""
