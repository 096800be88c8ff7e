"""The node home: one directory holding a node's identity, config, state and control socket.

    <home>/identity.key   32-byte Ed25519 seed, mode 0600, created on first start
    <home>/config.toml    human-editable settings (written with defaults on first start)
    <home>/node.db        SQLite (WAL): trust store, tasks, audit log
    <home>/control.sock   local control API (Unix socket, mode 0600), while the daemon runs

Resolution order: an explicit `--home`, then $PSYMESH_HOME, then the platform's
user data dir (platformdirs). Where each file is, and the helpers that touch them
safely, are paths.py's (`HomePaths`, which `NodeHome` extends with the key and config).

Everything in a home is private to its owner: grants, the audit log and task
arguments and results are as sensitive as the key. So the home is mode 0700 (one
that others may write is refused, since they could have swapped its contents; one
they may only read is tightened), psymesh creates its files 0600 and directories
0700 whatever the umask, and `init()` tightens the files psymesh keeps there if an
older version or another tool left them looser. The key is the exception: one that
others could read may already be copied, so it is refused, not quietly fixed.
"""

import functools
import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tomli_w
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .bridgeconfig import McpServerConfig, ServeSettings, UiServe
from .paths import HomePaths, ensure_private_dir, os_error, private_opener, read_secret_file, tighten
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.framing import DEFAULT_MAX_FRAME_SIZE
from ...protocol.identity import fingerprint, peer_id_from_public_key
from ...protocol.mailbox import MailSettings
from ...protocol.messaging import InboxSettings
from ...protocol.relay import RelaySettings
from ...protocol.strangers import StrangerLimits
from .websettings import WebSettings

Profile = Literal["home", "phone"]
# What psymesh itself keeps in a home. `init()` tightens these and no others, so a home
# that also holds the owner's own files (say `--home ~`) keeps their modes.
_STATE_FILES = ("config.toml", "config.tmp", "control.sock", "rpc.sock", "daemon.log", "mail.key",
                "node.db", "node.db-wal", "node.db-shm", "node.db-journal",
                "device.db", "device.db-wal", "device.db-shm", "device.db-journal")
_STATE_TREES = ("models", "logs")


class ModelTable(BaseModel):
    """[models.NAME]: a registered model's settings kept in config.toml. `split`: the paired
    homes (names or peer ids) its last layers run on (as `model add --split`; this wins over the
    registry's), `on_worker_loss`: a load without one of them leaves it out (reload) or fails
    `unavailable` until it is back (wait). node/compute/split.py."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    split: list[str] = Field(default_factory=list)
    on_worker_loss: Literal["reload", "wait"] = "reload"


class ModelsSettings(BaseModel):
    """[models]: how this node's model runner processes live (node/models/runner.py).

    `keep_alive_s`: how long a model stays loaded with nothing to do before its runner
    exits and its memory goes back (None: the profile's default, 300 s on a home PC as
    Ollama's, 60 s on a phone; negative: until the node stops). A model's own entry
    (`model add --keep-alive`) wins. `memory_limit_mb`: the most address space a runner
    may map (RLIMIT_AS); past it the runner dies and its request fails `model_crashed`."""

    model_config = ConfigDict(defer_build=True, extra="allow")

    keep_alive_s: float | None = None
    memory_limit_mb: int | None = Field(default=None, ge=64)
    # [models.NAME]: one model's own table (ModelTable); any other key is one.
    __pydantic_extra__: dict[str, ModelTable] = Field(init=False)

    def tables(self) -> dict[str, ModelTable]:
        """The [models.NAME] tables, by model name."""
        return dict(self.model_extra or {})

    def keep_alive_for(self, profile: Profile) -> float | None:
        if self.keep_alive_s is None:
            return PROFILE_KEEP_ALIVE_S[profile]
        return None if self.keep_alive_s < 0 else self.keep_alive_s


PROFILE_KEEP_ALIVE_S: dict[str, float] = {"home": 300.0, "phone": 60.0}


class WorkerSettings(BaseModel):
    """[worker]: lending this node's CPU and memory to paired peers' split models (node/compute/).

    `enabled`: start llama.cpp's RPC server (a child process) with the node; `psymesh worker
    start|stop` turns it on and off while the node runs. `memory_mb`: the most the server may
    map (RLIMIT_AS) and allocate for all owners; each owner's grant may say less
    (`rpc_memory_mb`). `threads`: its compute threads (None: all cores but one).
    `allow_shared_loopback`: where no private network namespace can be made (no root, no user
    namespaces), serve on the machine's loopback anyway, reachable by its other local users."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    enabled: bool = False
    memory_mb: int | None = Field(default=None, ge=64)
    threads: int | None = Field(default=None, ge=1)
    allow_shared_loopback: bool = False
class StorageSettings(BaseModel):
    """config.toml `[storage]`: what the node's database may take on disk, and how the audit
    log is written (docs/security.md, "Resource budget")."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")

    # the WAL (node.db-wal): past this a checkpoint truncates it, and a reset WAL is cut back to it
    wal_max_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=1024 ** 3)
    # a checkpoint runs once writes pause this long (at most checkpoint_max_defer_s after the first)
    checkpoint_settle_s: float = Field(default=1.0, ge=0.01, le=600.0)
    checkpoint_max_defer_s: float = Field(default=5.0, ge=0.01, le=3600.0)
    # audit rows are written in batches: at most this long after their decision, or once this many wait
    audit_flush_ms: int = Field(default=200, ge=1, le=60_000)
    audit_batch_rows: int = Field(default=256, ge=1, le=100_000)
    # identical refusals (peer, service, operation, code) within this window are one row with a count
    audit_coalesce_s: float = Field(default=60.0, ge=0.0, le=86_400.0)
    # oldest audit rows beyond this many are deleted
    audit_max_rows: int = Field(default=200_000, ge=1000, le=100_000_000)
    # refusals one peer may cost per minute (a separate budget from its grant's rate, so refusals
    # never lock it out of what it may do); past it a refusal is `rate_limited` and one audit row a window
    refusals_per_minute: int = Field(default=120, ge=1, le=1_000_000)


class NodeConfig(BaseModel):
    """config.toml. Unknown keys are an error: a typo should not silently do nothing."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    name: str = Field(default="psymesh-node", max_length=64)
    profile: Profile = "home"
    # Loopback by default: a node is reachable from the LAN only once its owner says so
    # (listen = ["/ip4/0.0.0.0/tcp/4001"]). Port 0 picks a free port at start.
    listen: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    max_frame_size: int = Field(default=DEFAULT_MAX_FRAME_SIZE, ge=1024, le=64 * 1024 * 1024)
    # What peers this node has not paired with may make it hold or try ([strangers] table):
    # connections, streams, unread bytes, pairing runs and hellos. docs/security.md.
    strangers: StrangerLimits = Field(default_factory=StrangerLimits)
    mdns: bool = False  # never on unless turned on: multicast leaves the machine
    static_peers: list[str] = Field(default_factory=list)
    share_dir: str | None = None  # files.* tools serve only inside this directory
    agent_model: str | None = None  # model for agent runs and agent tasks (default: the first registered)
    # A phone's tools: "auto" drives this machine's own commands where they are on PATH at start
    # (Termux:API; nmcli, notify-send), "simulated" keeps every one on the simulated phone in device.db.
    device: Literal["auto", "simulated"] = "auto"
    # Marks the delegation policy reads on a phone: hand agent goals to the home PC while set.
    battery_low: bool = False
    memory_low: bool = False
    log_json: bool = False
    # Seconds without news on a delegated task before its executor is pinged (and, if silent
    # as long again, its connection dropped and redialed): bounds how long a home PC that
    # lost power can stall a phone. Longer saves a phone's battery.
    liveness_probe_s: float = Field(default=20.0, ge=1.0, le=3600.0)
    # A connection to a peer this node keeps connected (a phone's home PCs, the mailbox:
    # node/reach/keep.py) that carried nothing this long gets one ping, so a carrier's NAT
    # keeps its binding. 0: never (a NAT that drops the binding leaves the phone unreachable).
    keep_alive_s: float = Field(default=1500.0, ge=0.0, le=86400.0)
    # The paired peer (name or id) that holds this node's letters while it is offline
    # (protocol/mailbox.py): a phone names its home PC. None: senders keep them.
    mailbox: str | None = None
    # [mail]: how long a sender waits before using a recipient's mailbox; what this node,
    # as a mailbox, holds for each sender and for how long.
    mail: MailSettings = Field(default_factory=MailSettings)
    # [inbox]: what each sender's letters may take of this node's inbox (held behind a gap,
    # released), and how long a gap is waited for (protocol/messaging.py).
    inbox: InboxSettings = Field(default_factory=InboxSettings)
    # [relay]: relay for paired peers granted `relay` (off by default), and the relays this
    # node keeps a reservation at, to be reached from anywhere (protocol/relay.py).
    relay: RelaySettings = Field(default_factory=RelaySettings)
    # [serve.openai]: an OpenAI-compatible endpoint; [[mcp]]: MCP servers whose tools join
    # this node's (node/core/bridgeconfig.py, docs/bridges.md).
    serve: ServeSettings = Field(default_factory=ServeSettings)
    # [ui]: the local dashboard in a browser (node/control/dashboard.py, docs/ui.md).
    ui: UiServe = Field(default_factory=UiServe)
    mcp: list[McpServerConfig] = Field(default_factory=list)
    # [web]: where this node's web queries go (a trusted exit, one or two hops); [web.exit]:
    # serving other peers' queries, with the exit's address and size policy (node/web/exit.py).
    web: WebSettings = Field(default_factory=WebSettings)
    # [models]: model runners' keep-alive and memory cap (ModelsSettings).
    models: ModelsSettings = Field(default_factory=ModelsSettings)
    # [worker]: llama.cpp's RPC server for paired peers granted compute.rpc (off by default).
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    # [storage]: the database's WAL and checkpoints, the audit log's batches and refusal budget.
    storage: StorageSettings = Field(default_factory=StorageSettings)


def config_error(path: Path, text: str, exc: ValidationError) -> str:
    """One line for a config.toml that parses but does not validate: file, line, key, why
    (`config.toml:7: mcp[0].command: ...`), not pydantic's paragraphs and URL."""
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"]]
    key = ".".join(f"[{p}]" if p.isdigit() else p for p in loc).replace(".[", "[")
    line = _line_of(text, [p for p in loc if not p.isdigit()])
    more = len(exc.errors()) - 1
    msg = first["msg"].removeprefix("Value error, ")
    return (f"{path}{f':{line}' if line else ''}: {key or '(top level)'}: {msg}"
            + (f" (and {more} more)" if more else ""))


def _line_of(text: str, keys: list[str]) -> int | None:
    """The line where the innermost of `keys` is set or opened as a table (best effort)."""
    lines = text.splitlines()
    for key in reversed(keys):
        for number, line in enumerate(lines, 1):
            stripped = line.strip()
            if stripped.startswith(f"{key} ") or stripped.startswith(f"{key}=") or \
                    (stripped.startswith("[") and stripped.strip("[]").split(".")[-1].strip() == key):
                return number
    return None


@dataclass(frozen=True)
class Identity:
    """A node's Ed25519 key. The peer id and fingerprint are derived from the public key.
    Its repr names the peer id only: a traceback that prints locals must not print the seed."""

    seed: bytes

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"

    # Derived once: every letter signed or checked reads them (a key load and a base58
    # encode each time cost a tenth of a daemon's time in bench/messaging.py).
    @functools.cached_property
    def private_key(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @functools.cached_property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @functools.cached_property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


class NodeHome(HomePaths):
    """Paths and on-disk state of one node. Creating one does not touch the disk; `init()` does."""

    def init(self, *, profile: Profile | None = None, name: str | None = None) -> Identity:
        """Create the home, key and config on first use; later calls just load them.
        Either way the home is checked and tightened first (see the module docstring)."""
        self.secure()
        identity = self.load_or_create_identity()
        if not self.config_path.exists():
            cfg = NodeConfig(profile=profile or "home", name=name or f"{profile or 'home'}-{identity.fingerprint[:4].lower()}")
            self.save_config(cfg)
        return identity

    def secure(self) -> None:
        """Create the home 0700 if missing; refuse one others may write; tighten one others
        may read, and every file and directory psymesh keeps in it, to owner-only."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, self.path.parent) from None
        ensure_private_dir(self.path, "the node home")
        for name in _STATE_FILES:
            tighten(self.path / name)
        for name in _STATE_TREES:
            self._tighten_tree(self.path / name)

    def _tighten_tree(self, top: Path) -> None:
        """`tighten` top and everything below it, without following symlinks."""
        try:
            st = os.lstat(top)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise os_error(exc, top) from None
        tighten(top, st)
        if stat.S_ISDIR(st.st_mode):
            for child in sorted(os.listdir(top)):
                self._tighten_tree(top / child)

    def private_file(self, name: str) -> Path:
        """The path of state file `name` in the home, created empty with mode 0600 if missing
        (for SQLite files made by others: SQLite gives the -wal, -shm and -journal files the
        mode of the database itself, so the whole family is born private)."""
        path = self.path / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            tighten(path)
            return path
        except OSError as exc:
            raise os_error(exc, path) from None
        try:
            os.fchmod(fd, 0o600)  # exactly, whatever the umask
        finally:
            os.close(fd)
        return path

    def load_or_create_identity(self) -> Identity:
        try:
            seed = read_secret_file(self.key_path)
        except FileNotFoundError:
            seed = Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
            )
            # O_EXCL: two processes starting at once must not both write a key.
            try:
                fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                return self.load_or_create_identity()
            except OSError as exc:
                raise os_error(exc, self.key_path) from None
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(seed)
                f.flush()
                os.fsync(f.fileno())
            return Identity(seed)
        except OSError as exc:
            raise os_error(exc, self.key_path) from None
        if len(seed) != 32:
            raise PsymeshError(f"{self.key_path} is not a 32-byte Ed25519 seed", code=ErrorCode.BAD_REQUEST)
        return Identity(seed)

    def load_config(self) -> NodeConfig:
        try:
            text = self.config_path.read_text()
        except FileNotFoundError:
            return NodeConfig()
        except OSError as exc:
            raise os_error(exc, self.config_path) from None
        try:
            return NodeConfig.model_validate(tomllib.loads(text))
        except tomllib.TOMLDecodeError as exc:  # its message ends "(at line N, column M)"
            raise PsymeshError(f"{self.config_path}: {exc}", code=ErrorCode.BAD_REQUEST) from None
        except ValidationError as exc:
            raise PsymeshError(config_error(self.config_path, text, exc), code=ErrorCode.BAD_REQUEST) from None

    def save_config(self, config: NodeConfig) -> None:
        """Write config.toml (via config.tmp and a rename), mode 0600 like everything here.
        Only what differs from the defaults is written, so a section the docs tell people to
        append (`[[mcp]]`, `[web.exit]`, `[serve.openai]`) is never there already, empty."""
        changed = config.model_dump(exclude_none=True, exclude_defaults=True)
        data = tomli_w.dumps({"name": config.name, "profile": config.profile, **changed}).encode()
        tmp = self.config_path.with_suffix(".tmp")
        try:
            with open(tmp, "wb", opener=private_opener) as f:
                os.fchmod(f.fileno(), 0o600)  # a config.tmp left over from before may be looser
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.config_path)
        except OSError as exc:
            raise os_error(exc, self.config_path) from None
