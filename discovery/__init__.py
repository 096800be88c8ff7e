"""psymesh.discovery: how nodes find each other on a LAN: libp2p mDNS (off unless configured) and
static peers, and how a paired peer's stored addresses follow it (service.py). Imports only protocol/."""
