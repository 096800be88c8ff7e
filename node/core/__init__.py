"""The node's own state and settings, below everything else in the daemon.

The node home (where its files are and how to touch them safely, paths.py; identity, config.toml and
its sections, including the bridges' and the web's settings, which home.py parses), the SQLite database every store shares, logging, the notifier that wakes
waiters, the rotating key rings on disk, the wake lock, and how a command for a home is spelled for a
person to run next (commands.py). Imports nothing else of psymesh.node.
"""
