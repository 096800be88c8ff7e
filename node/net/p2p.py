"""The face of the libp2p host for its callers: `P2PNode` (net/host.py), `P2PStream`
(net/stream.py), and the few names callers and tests use. The host is split by job:
net/host.py (the host, listening, dialing, streams), net/stream.py, net/circuit.py (relay
HOP/STOP), net/dcutr.py (hole punching), net/strangers.py (what unpaired peers may cost),
net/addrs.py, and net/patches.py (the libp2p 0.8.1 defect patches with their numbered list)."""
from .addrs import expand_wildcard, local_ipv4_addresses
from .circuit import RelayAdmit
from .host import P2PNode, Path
from .patches import MAX_NEGOTIATION_MESSAGE, MAX_PROPOSALS
from .stream import Handler, P2PStream
from .strangers import HANDSHAKE_BYTES, PeerFilter, StreamFilter

__all__ = [
    "HANDSHAKE_BYTES", "MAX_NEGOTIATION_MESSAGE", "MAX_PROPOSALS", "Handler", "P2PNode", "P2PStream", "Path",
    "PeerFilter", "RelayAdmit", "StreamFilter", "expand_wildcard", "local_ipv4_addresses",
]
