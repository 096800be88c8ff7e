"""One model split across processes on llama.cpp's own RPC backend: the engine half.

Real components: worker children (node/compute/worker_child.py) running llama.cpp's RPC server in
network namespaces of their own, reached through their Unix sockets; the model's owner is a real
runner process (node/models/runner.py) holding the generated tiny qwen35 GGUF with some of its
layers on the workers. The owner's llama.cpp speaks TCP only, so a small TCP->Unix forwarder here
stands in for the node's proxy (which carries the bytes over psymesh streams).
"""
from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from waiting import wait_until
from psymesh.agent.runtime import rpc
from psymesh.agent.runtime.api import ModelCrashed, ModelLoadError, ModelSettings
from psymesh.node.compute.worker_child import pump
from psymesh.node.models import ModelRunner

pytestmark = pytest.mark.skipif(not rpc.rpc_available(),
                                reason="llama-cpp-python built without -DGGML_RPC=ON (run scripts/bootstrap.sh)")

PROMPT = "<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n"
N_LAYERS = 6
READY_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from psymesh.agent.runtime.testmodel import tiny_model_path

    return tiny_model_path(tmp_path_factory.getbasetemp() / "models", n_layer=N_LAYERS)


# --------------------------------------------------------------------------- helpers


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    socket: Path
    ready: dict[str, object]
    log: Path


def _read_line(proc: subprocess.Popen[bytes], deadline_s: float) -> bytes:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(deadline_s):
            raise AssertionError(f"no line from the worker within {deadline_s} s")
        return proc.stdout.readline()
    finally:
        sel.close()


@contextmanager
def worker(tmp_path: Path, name: str, *args: str, without_namespaces: bool = False) -> Iterator[Worker]:
    """A worker child on `tmp_path/name/rpc.sock` (a 0700 folder), stopped by closing its stdin;
    `without_namespaces`: on what looks to it like a machine that refuses namespaces."""
    folder = tmp_path / name
    folder.mkdir(mode=0o700)
    sock = folder / "rpc.sock"
    log = folder / "worker.log"
    with open(log, "wb") as err:
        command = [sys.executable, "-m", "psymesh.node.compute.worker_child", "--socket", str(sock), "--threads", "1",
                   *args]
        if without_namespaces:
            command = [sys.executable, "-c", NO_NAMESPACES, *command[1:]]
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    try:
        line = _read_line(proc, READY_DEADLINE_S)
        yield Worker(proc, sock, json.loads(line) if line else {}, log)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


class Forwarder:
    """127.0.0.1:PORT -> a Unix socket, each connection spliced (the node's proxy stands here)."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.received = 0  # bytes from the worker to the owner
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._splice, args=(conn,), daemon=True).start()

    def _splice(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                unix.connect(str(self.target))
            except OSError:
                return
            with unix:
                back = threading.Thread(target=self._back, args=(unix, conn), daemon=True)
                back.start()
                pump(conn, unix)
                back.join()

    def _back(self, src: socket.socket, dst: socket.socket) -> None:
        """pump(), counting."""
        try:
            while chunk := src.recv(1 << 20):
                self.received += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


def _settings(model: Path, endpoints: list[str], **kw: object) -> ModelSettings:
    n_gpu_layers, split = rpc.split_layers(N_LAYERS, [1.0] * (len(endpoints) + 1))
    return ModelSettings(path=model, n_ctx=1024, n_threads=1, rpc_servers=tuple(endpoints), n_gpu_layers=n_gpu_layers,
                         tensor_split=split, keep_alive_s=None, **kw)  # type: ignore[arg-type]


def _endless(runner: ModelRunner) -> dict[int, float]:
    """No end-of-generation and no stray bytes: the random-weight model keeps writing text."""
    return {t: -100.0 for t in [*range(128, 256), *runner.info.eog_token_ids]}


async def _greedy(settings: ModelSettings, max_tokens: int = 40) -> str:
    async with ModelRunner(settings) as runner:
        done = await runner.complete(PROMPT, max_tokens=max_tokens, temperature=0, logit_bias=_endless(runner))
        assert done.tokens == max_tokens
        return done.text


# --------------------------------------------------------------------------- the split itself


def test_split_layers_puts_each_layer_where_its_share_says() -> None:
    assert rpc.layer_counts(24, [1, 1, 1]) == (8, 8, 8)
    assert rpc.split_layers(24, [1, 1, 1]) == (17, (7.5, 9.5))  # 16 layers + the output layer offloaded
    assert rpc.split_layers(24, [1]) == (0, ())
    assert rpc.layer_counts(7, [0, 1, 1]) == (0, 4, 3)
    with pytest.raises(ValueError, match="cannot each hold a layer"):
        rpc.split_layers(2, [1, 1, 1])


def test_a_worker_says_what_it_speaks_and_how_it_is_isolated(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the namespace worker test runs as root (an unprivileged user namespace may be refused)")
    with worker(tmp_path, "w", "--memory-mb", "2048") as w:
        assert w.ready == {"rpc": list(rpc.rpc_version() or ()), "build": rpc.engine_build(), "isolation": "netns",
                           "port": 50052, "memory_mb": 2048, "threads": 1}
        assert w.socket.is_socket() and (w.socket.stat().st_mode & 0o077) == 0
        status = Path(f"/proc/{w.proc.pid}/status").read_text()
        uids = next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1:]
        assert uids == ["65534"] * 4  # root only to make the namespace and the socket
        # Its RPC port is in its own namespace: nothing listens on it here.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", 50052), timeout=5).close()


@pytest.mark.anyio
@pytest.mark.parametrize("workers", [1, 2])
async def test_a_model_split_across_workers_writes_what_the_whole_model_writes(
        six_layers: Path, tmp_path: Path, workers: int) -> None:
    whole = await _greedy(ModelSettings(path=six_layers, n_ctx=1024, n_threads=1, keep_alive_s=None))
    assert len(set(whole)) > 3, whole  # a real sequence, not one token repeated
    with worker(tmp_path, "a") as a, worker(tmp_path, "b") as b:
        forwarders = [Forwarder(w.socket) for w in (a, b)[:workers]]
        try:
            split = await _greedy(_settings(six_layers, [f.endpoint for f in forwarders]))
        finally:
            for f in forwarders:
                f.close()
        assert split == whole
        for w in (a, b)[:workers]:  # the layers really went there
            assert "Accepted client connection" in w.log.read_text()


@pytest.mark.anyio
async def test_the_logits_stay_with_the_owner(tmp_path: Path) -> None:
    """llama.cpp would put the output layer on the last worker and fetch every token's logits
    from it (n_vocab floats: 256 KB a token here, ~1 MB for BotPsy); the owner keeps that layer,
    so what comes back per token is about a hidden state (n_embd floats: 256 bytes here)."""
    from psymesh.agent.runtime.testmodel import make_tiny_gguf

    (tmp_path / "models").mkdir()
    wide = make_tiny_gguf(tmp_path / "models", n_layer=N_LAYERS, vocab_size=65536)
    with worker(tmp_path, "a") as a:
        fwd = Forwarder(a.socket)
        try:
            async with ModelRunner(_settings(wide, [fwd.endpoint])) as runner:
                loaded = fwd.received
                done = await runner.complete(PROMPT, max_tokens=20, temperature=0, logit_bias=_endless(runner))
                per_token = (fwd.received - loaded) / (done.prompt_tokens + done.tokens)
        finally:
            fwd.close()
    assert per_token < 65536 * 4 / 16, per_token


@pytest.mark.anyio
async def test_a_worker_killed_mid_generation_fails_that_generation_as_a_crash(
        six_layers: Path, tmp_path: Path) -> None:
    """llama.cpp's RPC client aborts its process when a server goes away (RPC_STATUS_ASSERT):
    the runner that owns the model dies with SIGABRT, the request fails `model_crashed`
    with llama.cpp's last words, and this process lives on. The next load, with the worker
    gone, is a clean ModelLoadError naming it."""
    with worker(tmp_path, "a") as a:
        fwd = Forwarder(a.socket)
        try:
            async with ModelRunner(_settings(six_layers, [fwd.endpoint])) as runner:
                await runner.start()
                crashed: ModelCrashed | None = None

                async def kill_when_running() -> None:
                    await wait_until(lambda: runner.running, "the generation running")
                    a.proc.kill()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(kill_when_running)
                    with pytest.raises(ModelCrashed) as err:
                        await runner.complete(PROMPT, max_tokens=900, temperature=0, logit_bias=_endless(runner))
                    crashed = err.value
                assert crashed.details["signal"] == "SIGABRT"
                assert "RPC server crashed" in str(crashed.details.get("log", ""))
                with pytest.raises(ModelLoadError, match=fwd.endpoint):
                    await runner.complete(PROMPT, max_tokens=4, temperature=0)
        finally:
            fwd.close()


def test_an_unreachable_server_is_a_load_error_naming_it_not_an_abort() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ModelLoadError, match=f"{dead}.*Failed to connect"):
        rpc.add_servers([dead])


@pytest.mark.anyio
async def test_a_worker_past_its_memory_cap_fails_the_load_not_the_owner_nor_itself(tmp_path: Path) -> None:
    """llama.cpp's server answers an allocation it cannot make with a null buffer: the owner's
    load fails cleanly (its runner says so and exits), the worker serves on."""
    from psymesh.agent.runtime.testmodel import make_tiny_gguf

    (tmp_path / "models").mkdir()
    big = make_tiny_gguf(tmp_path / "models", n_layer=4, n_embd=1024, n_ff=8192)  # ~50 MB a layer
    n_gpu_layers, split = rpc.split_layers(4, [1, 1])  # ~100 MB on the worker
    for cap, fits in (("320", False), ("2048", True)):  # the worker process alone maps ~260 MB
        with worker(tmp_path, f"cap{cap}", "--memory-mb", cap) as a:
            fwd = Forwarder(a.socket)
            try:
                settings = ModelSettings(path=big, n_ctx=256, n_threads=1, rpc_servers=(fwd.endpoint,),
                                         n_gpu_layers=n_gpu_layers, tensor_split=split, keep_alive_s=None)
                runner = ModelRunner(settings)
                try:
                    if fits:
                        await runner.start()
                    else:
                        with pytest.raises(ModelLoadError, match="RPC server"):
                            await runner.start()
                finally:
                    await runner.aclose()
            finally:
                fwd.close()
            assert a.proc.poll() is None
            if not fits:
                assert "failed to allocate buffer" in a.log.read_text()


# --------------------------------------------------------------------------- isolation


# Run before the worker, in a process of its own (single-threaded, so it may make a user namespace):
# a user namespace with no uid mapped (so no capabilities after exec) that may create no other one:
# a machine that refuses namespaces. Then it becomes the worker.
NO_NAMESPACES = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
    sys.exit("unshare(CLONE_NEWUSER): " + os.strerror(ctypes.get_errno()))
with open("/proc/sys/user/max_user_namespaces", "w") as f:
    f.write("0")
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def test_a_worker_that_cannot_have_a_namespace_refuses_to_start_saying_why(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the test makes a namespace-less child from root")
    with worker(tmp_path, "w", without_namespaces=True) as w:
        assert w.proc.wait(timeout=30) == 2
        assert "cannot make a private network namespace" in str(w.ready["error"])
        assert "--allow-shared-loopback" in str(w.ready["error"])
        assert not w.socket.exists()


def test_with_shared_loopback_allowed_it_serves_and_says_so(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the test makes a namespace-less child from root")
    tmp_path.chmod(0o777)  # the child runs as an unmapped (nobody) uid
    with worker(tmp_path, "w", "--allow-shared-loopback", without_namespaces=True) as w:
        assert w.ready["isolation"] == "shared-loopback"
        port = int(str(w.ready["port"]))
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # there for any local process


def test_a_second_connection_waits_and_a_third_is_turned_away_at_once(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the namespace worker test runs as root")
    with worker(tmp_path, "w") as w:
        first = socket.socket(socket.AF_UNIX)
        first.connect(str(w.socket))
        second = socket.socket(socket.AF_UNIX)
        second.connect(str(w.socket))
        third = socket.socket(socket.AF_UNIX)
        third.connect(str(w.socket))
        third.settimeout(10)
        assert third.recv(1) == b""  # closed with nothing sent: busy
        first.close()
        # The second gets the server once the first is gone: llama.cpp answers a HELLO.
        second.settimeout(10)
        second.sendall(bytes([14]) + (24).to_bytes(8, "little") + bytes(24))  # RPC_CMD_HELLO, no capabilities
        answer = b""
        while len(answer) < 11 and (chunk := second.recv(64)):  # its size (8 bytes), then major, minor, patch
            answer += chunk
        assert answer[:8] == (28).to_bytes(8, "little") and list(answer[8:11]) == list(rpc.rpc_version() or ())
        second.close()
        third.close()


def test_the_worker_process_imports_no_daemon_and_no_network_stack() -> None:
    code = ("import sys, psymesh.node.compute.worker_child, psymesh.agent.runtime.rpc; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'anyio', 'libp2p', 'llama_cpp') "
            "or m.startswith('psymesh.node.') and not m.startswith('psymesh.node.compute')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_worker_exits_when_its_stdin_closes(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the namespace worker test runs as root")
    with worker(tmp_path, "w") as w:
        assert w.proc.stdin is not None
        w.proc.stdin.close()
        assert w.proc.wait(timeout=10) == 0
        with pytest.raises(OSError):  # nothing listens there any more (the node removes the file)
            socket.socket(socket.AF_UNIX).connect(str(w.socket))
