"""psymesh.node: the daemon. libp2p host, identity, trust store, manifest enforcement,
task queues, the local control API and the CLI. Drives `psymesh.protocol`."""
