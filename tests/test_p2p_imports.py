"""libp2p defect 27 (node/net/lean_import.py): importing libp2p imports every transport and
service it has. Each test runs a fresh interpreter: what a module imports is process state."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# what libp2p 0.8.1 imports for features the node never turns on (QUIC, AutoTLS, its own mDNS,
# Prometheus, DNS resolvers), and psymesh's own mDNS while mdns is off
HEAVY = ("aioquic", "zeroconf", "prometheus_client", "dns", "httpx", "requests", "fastecdsa")


def run_fresh(code: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_a_phone_node_built_from_the_daemon_holds_none_of_the_unused_packages() -> None:
    got = run_fresh(f"""
        import json, sys, tempfile
        from pathlib import Path
        from psymesh.node.core.home import NodeHome
        from psymesh.node.daemon import Node
        from psymesh.node.net.lean_import import _StandIn

        with tempfile.TemporaryDirectory() as tmp:
            home = NodeHome(Path(tmp) / "phone")
            home.init(profile="phone")
            node = Node(home, wake_commands=None)  # the host, its swarm and every service built
            node.db.close()
        held = [m for m in {HEAVY!r} if m in sys.modules and not isinstance(sys.modules[m], _StandIn)]
        print(json.dumps({{"held": held, "peer_id": node.p2p.peer_id}}))
    """)
    assert got["held"] == []
    assert str(got["peer_id"]).startswith("12D3")


def test_every_deferred_name_is_in_the_real_module_and_a_stand_in_becomes_it_at_first_use() -> None:
    got = run_fresh("""
        import json, sys
        import psymesh.node.net.p2p  # installs the finder, imports libp2p
        from psymesh.node.net import lean_import
        from multiaddr.resolvers import DNSResolver  # a stand-in until used

        resolver = DNSResolver()  # libp2p's Swarm makes one whether or not it dials a /dns address
        before = isinstance(object(), DNSResolver), isinstance(resolver, DNSResolver), "dns" in sys.modules
        resolve = resolver.resolve  # first use: the real module, the real class, the real instance
        real_cls = lean_import.real("multiaddr.resolvers").DNSResolver
        after = type(resolve.__self__) is real_cls, isinstance(resolver, DNSResolver), "dns" in sys.modules
        missing = [f"{m}.{n}" for m, names in lean_import.DEFERRED.items() for n in names
                   if not hasattr(lean_import.real(m), n)]
        print(json.dumps({"before": before, "after": after, "missing": missing}))
    """)
    assert got["before"] == [False, True, False]
    assert got["after"] == [True, True, True]
    assert got["missing"] == []


def test_full_libp2p_still_imports_after_the_lean_one() -> None:
    """A test or a tool that asks libp2p for more (its QUIC transport, `new_host` with defaults)
    gets it: the deferred modules load then."""
    got = run_fresh("""
        import json
        import psymesh.node.net.p2p
        from libp2p.transport.quic.transport import QUICTransport
        from libp2p.crypto.ed25519 import create_new_key_pair
        from psymesh.node.net import lean_import

        transport = QUICTransport(create_new_key_pair().private_key)
        print(json.dumps({"quic": type(transport).__module__,
                          "loaded": lean_import.loaded("libp2p.transport.quic.transport")}))
    """)
    assert got == {"quic": "libp2p.transport.quic.transport", "loaded": True}
