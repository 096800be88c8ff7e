"""Who may come in, decided in one place.

The trust store (who is paired, and each one's grant), pairing (the only protocol a stranger may use),
the gate every inbound request passes, and the audit log of its decisions. May import core/ and net/.
"""
