"""Private web queries: the asking side (router, and the agent tools that use it), and the serving
side (an exit's guard, fetch, extraction in child processes, search backends, and the two-hop relay).
May import core/, net/ and door/.
"""
