"""The transport: how bytes reach a peer and requests ride on them.

The libp2p host and everything libp2p touches, by job: host.py (P2PNode: the host, listening,
dialing, streams), stream.py (P2PStream), circuit.py (relay HOP/STOP), dcutr.py (hole punching),
strangers.py (what unpaired peers may cost), addrs.py, and patches.py (the libp2p 0.8.1 defect
patches, with the numbered list of the upstream defects); p2p.py is their face for callers.
libp2p is imported only inside node/net/: nothing else in psymesh sees its types or
exceptions. The conversations' decisions are protocol/'s (relay.py, circuit.py: relay HOP/STOP; dcutr.py: hole
punching rounds); the modules here drive them. Then message framing over any byte stream, sessions
(many requests over one stream, both ends), liveness of a session's peer, and ping. Decides nothing
about who may ask what: that is the door's. May import core/.
"""

from . import lean_import  # noqa: F401  (defect 27) first of all: libp2p then imports only what the host uses
