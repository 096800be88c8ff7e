"""psymesh.discovery: how nodes find each other: static peers, mDNS (namespaced tests only), relays."""
