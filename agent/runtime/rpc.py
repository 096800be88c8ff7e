"""llama.cpp's RPC backend, through ctypes: one model's layers split across several processes.

llama.cpp (ggml/src/ggml-rpc) ships both halves of model splitting, and we use them as they are
(no tensor protocol of ours): a *server* (:func:`serve`) that lends its CPU to whoever connects,
and a *client* side in the process that loads the model, which registers each server as one more
device (:func:`add_servers`) so that ``Llama(n_gpu_layers=..., tensor_split=...)`` puts layers on
it. RPC devices count as GPUs, so llama.cpp offloads the model's *last* layers to them, split in
registration order; the first layers stay on the local CPU (:func:`split_layers` computes both
numbers). The output layer would go with the last ones; :func:`output_on_cpu` keeps it here, so
that a token's logits are not sent back over the network.

The protocol is TCP only (endpoint ``"host:port"``), unauthenticated and unencrypted: a server
executes whatever graph a client sends and allocates what it asks for. That is why a worker runs
it in a child process of its own, reachable only through psymesh (node/compute/worker_child.py).

What llama.cpp's client does when a server is not there or goes away (read from ggml-rpc.cpp,
protocol 7.0.0, and checked by tests/test_split_engine.py):

* ``ggml_backend_rpc_add_server`` on an endpoint that refuses the connection, or closes it before
  answering, does not return an error: it calls ``GGML_ABORT`` ("Failed to connect to ...",
  "Remote RPC server crashed or returned malformed response"), which ends the whole process
  (SIGABRT). A protocol version mismatch aborts too ("RPC handshake failed"). So
  :func:`add_servers` first has a throwaway child process make the same call
  (``python -m psymesh.agent.runtime.rpc --probe ENDPOINT``): its abort becomes a clean
  :class:`ModelLoadError` naming the endpoint, and only then does this process connect itself.
  (A server that dies between the probe and the real call still aborts this process.)
* Once loaded, every call to a server goes through one connection per endpoint; a send or
  receive that fails on it aborts the process (``RPC_STATUS_ASSERT``). A worker killed
  mid-generation therefore ends the process that owns the model with SIGABRT: run that model in
  a runner child (node/models/runner.py), where it is a clean ``ModelCrashed`` and the node lives.
* A server that cannot allocate (its memory cap) answers with a null buffer: the load fails with
  llama.cpp's "unable to allocate" error, a ``ModelLoadError``, and nothing aborts.

Servers are registered once per process and never removed (ggml has no way to), and llama.cpp
puts *every* registered RPC device into every model it loads afterwards: one process, one split
model (a runner child holds one model).
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import NoReturn

from .api import ModelLoadError

__all__ = [
    "PROBE_TIMEOUT_S",
    "add_servers",
    "engine_build",
    "layer_counts",
    "output_on_cpu",
    "rpc_available",
    "rpc_version",
    "serve",
    "split_layers",
]

# How long the probe of one endpoint may take (connect, hello, device count) before the load
# fails: a dead endpoint is refused at once; this bounds one that accepts and never answers.
PROBE_TIMEOUT_S = 30.0

_DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_CPU
_registered: set[str] = set()
_register_lock = threading.Lock()


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _soname(lib_dir: Path, stem: str) -> Path:
    """The file of `stem` that libllama links against (its SONAME, e.g. libggml.so.0).

    A wheel cannot hold symlinks, so libggml.so, libggml.so.0 and libggml.so.0.25.3 are three
    copies of one library, and dlopen loads each copy apart: registering a server in the
    libggml.so that llama_cpp's bindings opened leaves libllama's libggml.so.0 without it (the
    model then loads all on the CPU). The shortest versioned name is the SONAME."""
    versioned = sorted(lib_dir.glob(f"{stem}.so.[0-9]*"), key=lambda p: len(p.name))
    return versioned[0] if versioned else lib_dir / f"{stem}.so"


class _Ggml:
    """The few ggml entry points we call, with their C types."""

    def __init__(self, lib_dir: Path) -> None:
        # Loading libggml also loads its backends (CPU, RPC) and registers them.
        self.base = ctypes.CDLL(str(_soname(lib_dir, "libggml-base")))
        self.ggml = ctypes.CDLL(str(_soname(lib_dir, "libggml")))
        self.rpc = ctypes.CDLL(str(_soname(lib_dir, "libggml-rpc")))
        for lib, name in ((self.base, "ggml_version"), (self.base, "ggml_commit")):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_char_p, []
        self.rpc.ggml_backend_rpc_start_server.restype = None
        self.rpc.ggml_backend_rpc_start_server.argtypes = [
            ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
        self.rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
        self.rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
        self.ggml.ggml_backend_register.restype = None
        self.ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
        self.ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
        self.ggml.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
        self.ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
        self.ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
        self.ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
        self.ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]


@cache
def _ggml() -> _Ggml | None:
    pkg = _package_dir()
    if pkg is None or not (pkg / "lib" / "libggml-rpc.so").is_file():
        return None
    try:
        return _Ggml(pkg / "lib")
    except (OSError, AttributeError):  # a library missing, or built without a symbol we call
        return None


def _loaded() -> _Ggml:
    g = _ggml()
    if g is None:
        raise ModelLoadError("this llama-cpp-python was built without llama.cpp's RPC backend "
                             "(rebuild it with CMAKE_ARGS=-DGGML_RPC=ON: scripts/bootstrap.sh does)")
    return g


@cache
def rpc_version() -> tuple[int, int, int] | None:
    """The RPC protocol version this build speaks (RPC_PROTO_MAJOR/MINOR/PATCH_VERSION).

    ggml exports no function for it, so it is read from ``include/ggml-rpc.h``, which the
    llama-cpp-python wheel installs beside the package (site-packages/include/). No header, or no
    version in it: None, and :func:`rpc_available` is False (two builds must not be paired on a
    guess: llama.cpp aborts the client on a mismatch)."""
    pkg = _package_dir()
    if pkg is None:
        return None
    try:
        text = (pkg.parent / "include" / "ggml-rpc.h").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"#define\s+RPC_PROTO_{name}_VERSION\s+(\d+)", text)
        if m is None:
            return None
        parts.append(int(m.group(1)))
    return parts[0], parts[1], parts[2]


def rpc_available() -> bool:
    """Can this process serve and use RPC devices (the backend is built and its version known)?"""
    return _ggml() is not None and rpc_version() is not None


@cache
def engine_build() -> str:
    """Which engine this is, for a peer to compare: llama-cpp-python's version and ggml's
    version and commit (both exported by libggml-base), e.g.
    ``"llama-cpp-python 0.3.36; ggml 0.9.4 (abc1234)"``."""
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    build = f"llama-cpp-python {version}"
    g = _ggml()
    if g is not None:
        ggml_version = (g.base.ggml_version() or b"?").decode(errors="replace")
        commit = (g.base.ggml_commit() or b"?").decode(errors="replace")
        build += f"; ggml {ggml_version} ({commit})"
    return build


def serve(endpoint: str, *, threads: int) -> NoReturn:
    """Run llama.cpp's RPC server on `endpoint` ("host:port") on this process's CPU, forever.

    It serves one client at a time (a second waits in the listen backlog) and prints to
    stdout. No cache directory: a client must not be able to fill our disk. Returns only if
    the server cannot start (the port is taken, no CPU device): then ModelLoadError."""
    g = _loaded()
    dev = g.ggml.ggml_backend_dev_by_type(_DEVICE_TYPE_CPU)
    if not dev:
        raise ModelLoadError("ggml has no CPU device to serve")
    devices = (ctypes.c_void_p * 1)(dev)
    g.rpc.ggml_backend_rpc_start_server(endpoint.encode(), None, max(1, threads), 1, devices)
    raise ModelLoadError(f"llama.cpp's RPC server on {endpoint} could not start (see its log)")


def _probe(endpoint: str) -> None:
    """Make llama.cpp's own add_server call in a throwaway child: its abort is our error."""
    env = dict(os.environ, GGML_NO_BACKTRACE="1")  # no gdb attaching to the aborting child
    try:
        done = subprocess.run([sys.executable, "-m", "psymesh.agent.runtime.rpc", "--probe", endpoint],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ModelLoadError(f"RPC server {endpoint} did not answer within {PROBE_TIMEOUT_S:g} s",
                             details={"endpoint": endpoint}) from None
    if done.returncode == 0:
        return
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    said = next((ln.split(": ", 1)[-1] for ln in reversed(lines) if "ggml-rpc" in ln or "RPC" in ln),
                lines[-1] if lines else f"exit status {done.returncode}")
    raise ModelLoadError(f"cannot use RPC server {endpoint}: {said.strip()}", details={"endpoint": endpoint})


def add_servers(endpoints: Sequence[str]) -> None:
    """Register each RPC server at `endpoints` ("host:port") as a device of this process,
    in order, each once per process. One that cannot be reached (or speaks another protocol
    version) raises ModelLoadError naming it, before this process connects (see the module
    docstring: llama.cpp's own client would abort it)."""
    g = _loaded()
    with _register_lock:
        for endpoint in endpoints:
            if endpoint in _registered:
                continue
            _probe(endpoint)
            reg = g.rpc.ggml_backend_rpc_add_server(endpoint.encode())
            if not reg or not g.ggml.ggml_backend_reg_dev_count(reg):
                raise ModelLoadError(f"RPC server {endpoint} offers no device", details={"endpoint": endpoint})
            g.ggml.ggml_backend_register(reg)
            _registered.add(endpoint)


class _TensorOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override: a regex on tensor names, and a buffer type."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# The output norm and the output matrix (or, tied, the token embedding it duplicates).
_OUTPUT_TENSORS = rb"^(output|output_norm|token_embd)\."
_output_overrides: ctypes.Array[_TensorOverride] | None = None  # kept alive: llama.cpp reads it while loading
_params_lock = threading.Lock()


@contextmanager
def output_on_cpu() -> Iterator[None]:
    """While entered, a ``Llama`` constructed in this process keeps the model's output layer on
    the local CPU, whatever ``n_gpu_layers`` says.

    llama.cpp offloads the output layer with the last offloaded layers, so the server holding
    them computes the logits and sends all of them back every token: n_vocab floats, ~1 MB for
    BotPsy's 248k vocabulary (measured: 64 MB back for 64 tokens, against ~3 MB sent). Kept
    here, what crosses per token is the hidden state (n_embd floats, 4 KB). llama-cpp-python's
    ``Llama`` does not expose ``tensor_buft_overrides`` and loads the model in its constructor,
    so its ``llama_model_default_params`` is wrapped for the duration, under a lock."""
    global _output_overrides
    g = _loaded()
    import llama_cpp.llama_cpp as bindings  # only the process that loads a model gets here

    cpu = g.ggml.ggml_backend_dev_buffer_type(g.ggml.ggml_backend_dev_by_type(_DEVICE_TYPE_CPU))
    if _output_overrides is None:
        _output_overrides = (_TensorOverride * 2)(_TensorOverride(_OUTPUT_TENSORS, cpu), _TensorOverride(None, None))
    overrides = ctypes.cast(_output_overrides, ctypes.c_void_p).value
    with _params_lock:
        default_params = bindings.llama_model_default_params

        def with_overrides() -> bindings.llama_model_params:
            params = default_params()
            params.tensor_buft_overrides = overrides
            return params

        bindings.llama_model_default_params = with_overrides
        try:
            yield
        finally:
            bindings.llama_model_default_params = default_params


def layer_counts(n_layers: int, shares: Sequence[float]) -> tuple[int, ...]:
    """How many of the model's `n_layers` repeating layers each part holds: `shares[0]` is the
    owner's own CPU, the rest the workers in order (largest remainders round). Every worker
    holds at least one layer (ValueError otherwise: more workers than layers, or a share of 0)."""
    if n_layers < 1:
        raise ValueError("a model has at least one layer")
    if len(shares) < 1 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError("shares are non-negative and not all zero")
    total = float(sum(shares))
    exact = [n_layers * s / total for s in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:n_layers - sum(counts)]:
        counts[i] += 1
    if any(c < 1 for c in counts[1:]):
        raise ValueError(f"{len(shares) - 1} workers cannot each hold a layer of {n_layers} "
                         f"with shares {list(shares)}")
    return tuple(counts)


def split_layers(n_layers: int, shares: Sequence[float]) -> tuple[int, tuple[float, ...]]:
    """``(n_gpu_layers, tensor_split)`` for ``Llama`` so that the model's `n_layers` repeating
    layers are cut as :func:`layer_counts` says: the first ``counts[0]`` on the local CPU, then
    each worker's in registration order.

    llama.cpp counts the output layer as one more offloadable layer after the last repeating one,
    so ``n_gpu_layers`` is the offloaded layers plus one (the output's entry goes with the last
    worker; :func:`output_on_cpu`, which the engine uses, keeps the layer itself local), and it
    assigns offloaded entry ``e`` of ``A`` to the first device whose cumulative split exceeds
    ``e / A``. Cumulative splits set half a layer before each boundary land every layer where it
    belongs whatever the float rounding: 3 even parts of 24 layers give 8 local layers and
    ``(17, (7.5, 9.5))``: 8 layers for each worker. With no worker (one share) nothing is
    offloaded: ``(0, ())``."""
    counts = layer_counts(n_layers, shares)
    workers = counts[1:]
    if not workers:
        return 0, ()
    offloaded = sum(workers) + 1  # + the output layer
    bounds = []
    acc = 0
    for c in workers[:-1]:
        acc += c
        bounds.append(acc - 0.5)
    bounds.append(float(offloaded))
    split = tuple(b - a for a, b in zip([0.0, *bounds[:-1]], bounds))
    return offloaded, split


def _probe_main(endpoint: str) -> int:
    """``--probe ENDPOINT``: register the server as llama.cpp would (this process aborts if it
    cannot) and say how many devices it offers."""
    g = _loaded()
    reg = g.rpc.ggml_backend_rpc_add_server(endpoint.encode())
    n = g.ggml.ggml_backend_reg_dev_count(reg) if reg else 0
    print(f"{endpoint}: {n} device(s)")
    return 0 if n else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        sys.exit(_probe_main(sys.argv[2]))
    print("usage: python -m psymesh.agent.runtime.rpc --probe HOST:PORT", file=sys.stderr)
    sys.exit(2)
