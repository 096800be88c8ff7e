"""The transport: how bytes reach a peer and requests ride on them.

The libp2p host and everything libp2p touches (p2p.py: the only module that imports libp2p, with the
numbered list of the upstream defects it contains), message framing over any byte stream, sessions
(many requests over one stream, both ends), liveness of a session's peer, and ping. Decides nothing
about who may ask what: that is the door's. May import core/.
"""
