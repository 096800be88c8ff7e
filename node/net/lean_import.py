"""libp2p defect 27: importing libp2p imports every transport and service it has.

`import libp2p` (and any `libp2p.x`, whose package `__init__` runs first) imports the QUIC
transport (aioquic), WebSocket, AutoTLS's ACME client (httpx, requests, rich), its own mDNS
(zeroconf), the Prometheus exporter (prometheus_client) and multiaddr's DNS resolvers
(dnspython, httpx2, h2), whether or not the host uses them: ~25 MB of an idle phone's RSS
and ~0.5 s of start, for features psymesh never turns on (the host is TCP + Noise + yamux,
`enable_mDNS=False`: node/net/host.py).

Contained here, not patched: importing this module (node/net/__init__.py does, before
any libp2p import) puts a finder first on `sys.meta_path` that answers each module of
`DEFERRED` with a stand-in. Each name the rest of libp2p imports from it is a stand-in class:

- calling it (a class or a function alike) imports the real module then and calls the real
  name, so a feature turned on later still works, only paid for when used;
- `isinstance(x, StandIn)` is False while the real module is not loaded (nothing of it can
  exist yet), and the real check once it is;
- any other attribute of the stand-in module, or a submodule of it, loads the real module.

A name libp2p starts importing from a deferred module that is not listed fails loudly at
import (tests/test_p2p_imports.py imports the daemon in a fresh interpreter and checks that
none of the heavy packages is loaded, and that each listed name exists in the real module).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

# module -> the names libp2p 0.8.1 (and multiaddr) import from it at their own import time (a
# package listed with no names is one whose submodules are deferred too, or whose attributes are
# read only when a feature is on)
DEFERRED: dict[str, tuple[str, ...]] = {
    "libp2p.transport.quic.stream": ("QUICStream",),                                  # aioquic
    "libp2p.transport.quic.transport": ("QUICTransport",),
    "libp2p.transport.quic.config": ("QUICTransportConfig",),
    "libp2p.transport.quic.utils": ("is_quic_multiaddr",),
    "libp2p.security.secio.transport": (),                                           # fastecdsa
    "libp2p.rcmgr.prometheus_exporter": ("PrometheusExporter", "create_prometheus_exporter"),
    "prometheus_client": ("Counter", "Histogram", "start_http_server"),              # libp2p.metrics.*
    "libp2p.security.tls.autotls.acme": ("ACMEClient", "compute_b36_peer_id"),         # httpx, requests
    "libp2p.security.tls.autotls.broker": ("BrokerClient",),                         # dnspython
    "libp2p.discovery.mdns": (),                                                     # zeroconf
    "libp2p.discovery.mdns.mdns": ("MDNSDiscovery", "create_mdns_discovery"),
    "libp2p.discovery.bootstrap": (),                              # a DNSResolver made at import
    "libp2p.discovery.bootstrap.bootstrap": ("BootstrapDiscovery",),
    "multiaddr.resolvers": ("DNSResolver",),                                         # dnspython
}
# classes libp2p instantiates whether or not it uses them (Swarm.__init__ makes a DNSResolver; it is
# used only to dial a /dns address): a call returns a stand-in instance, made real at first use
LAZY_INSTANCES = frozenset({("multiaddr.resolvers", "DNSResolver")})
PACKAGES = frozenset({"libp2p.discovery.mdns", "libp2p.discovery.bootstrap", "multiaddr.resolvers",
                      "prometheus_client"})  # deferred packages: a submodule's import loads them

_lock = threading.RLock()
_loaded: set[str] = set()  # deferred modules whose real module has been imported


def real(name: str) -> types.ModuleType:
    """The real module `name`, imported now if only its stand-in was (its deferred parents first)."""
    with _lock:
        module = sys.modules.get(name)
        if module is not None and not isinstance(module, _StandIn):
            return module
        _loaded.add(name)
        parent, _, child = name.rpartition(".")
        if isinstance(sys.modules.get(parent), _StandIn):
            real(parent)  # its __init__ may import `name` itself
        module = sys.modules.get(name)
        if module is None or isinstance(module, _StandIn):
            sys.modules.pop(name, None)
            module = importlib.import_module(name)
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)
        return module


def loaded(name: str) -> bool:
    return name in _loaded


class _Deferred(type):
    """The type of each stand-in name: calls, class attributes and isinstance reach the real one."""

    _module: str
    _name: str

    def _real(cls) -> Any:
        return getattr(real(cls._module), cls._name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if (cls._module, cls._name) in LAZY_INSTANCES:
            return _LazyInstance(cls, args, kwargs)
        return cls._real()(*args, **kwargs)

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(cls._real(), attr)

    def __instancecheck__(cls, obj: object) -> bool:
        if type(obj) is _LazyInstance:
            return object.__getattribute__(obj, "_cls") is cls
        return loaded(cls._module) and isinstance(obj, cls._real())

    def __subclasscheck__(cls, sub: type) -> bool:
        return loaded(cls._module) and issubclass(sub, cls._real())


class _LazyInstance:
    """What a LAZY_INSTANCES class returns: the real instance is made (and its module imported)
    at the first attribute asked of it, with the arguments of the call."""

    def __init__(self, cls: _Deferred, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_call", (args, kwargs))
        object.__setattr__(self, "_made", None)

    def _real(self) -> Any:
        with _lock:
            made = object.__getattribute__(self, "_made")
            if made is None:
                args, kwargs = object.__getattribute__(self, "_call")
                made = object.__getattribute__(self, "_cls")._real()(*args, **kwargs)
                object.__setattr__(self, "_made", made)
            return made

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real(), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._real(), attr, value)


class _StandIn(types.ModuleType):
    """A deferred module before its first use: its listed names, and the real module behind."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(real(self.__name__), attr)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandIn(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = f"psymesh stand-in for {module.__name__}: loaded at first use (node/net/lean_import.py)"
        if module.__name__ in PACKAGES:
            module.__path__ = []  # submodules are found by _Finder, which loads the real package first
        for name in DEFERRED[module.__name__]:
            setattr(module, name, _Deferred(name, (), {"_module": module.__name__, "_name": name,
                                                      "__module__": module.__name__}))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in DEFERRED and fullname not in _loaded:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=fullname in PACKAGES)
        parent = fullname.rpartition(".")[0]
        if parent in PACKAGES and isinstance(sys.modules.get(parent), _StandIn):
            module = real(fullname)  # a submodule asked for: the real package, then its module
            return importlib.util.spec_from_loader(fullname, _Imported(module))
        return None


class _Imported(importlib.abc.Loader):
    """Hands the import system a module `real()` has imported already."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


FINDER = _Finder()


def install() -> None:
    """Put the finder first (once). A deferred module already imported stays as it is."""
    with _lock:
        if FINDER not in sys.meta_path:
            _loaded.update(name for name in DEFERRED if name in sys.modules)
            sys.meta_path.insert(0, FINDER)


install()
