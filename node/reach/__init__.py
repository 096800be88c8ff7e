"""How this node is reached and reaches its peers beyond the first dial.

Dial-back probes (what a peer sees of our ports), circuit relays chosen from paired peers, and our
addresses pushed to the peers that follow them. May import core/, net/ and door/.
"""
