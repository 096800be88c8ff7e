"""The node home: one directory holding a node's identity, config, state and control socket.

    <home>/identity.key   32-byte Ed25519 seed, mode 0600, created on first start
    <home>/config.toml    human-editable settings (written with defaults on first start)
    <home>/node.db        SQLite (WAL): trust store, tasks, audit log
    <home>/control.sock   local control API (Unix socket, mode 0600), while the daemon runs

Resolution order: an explicit `--home`, then $PSYMESH_HOME, then the platform's
user data dir (platformdirs).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import platformdirs
import tomli_w
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from psymesh.protocol.errors import ErrorCode, PsymeshError
from psymesh.protocol.framing import DEFAULT_MAX_FRAME_SIZE
from psymesh.protocol.identity import fingerprint, peer_id_from_public_key

Profile = Literal["home", "phone"]
# Unix socket paths are limited to 108 bytes (sun_path); leave room for the NUL.
_MAX_SOCKET_PATH = 100


def resolve_home(home: str | os.PathLike[str] | None = None) -> Path:
    if home is None:
        home = os.environ.get("PSYMESH_HOME") or platformdirs.user_data_dir("psymesh", appauthor=False)
    return Path(home).expanduser().resolve()


class NodeConfig(BaseModel):
    """config.toml. Unknown keys are an error: a typo should not silently do nothing."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="psymesh-node", max_length=64)
    profile: Profile = "home"
    # Loopback by default: a node is reachable from the LAN only once its owner says so
    # (listen = ["/ip4/0.0.0.0/tcp/4001"]). Port 0 picks a free port at start.
    listen: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    max_frame_size: int = Field(default=DEFAULT_MAX_FRAME_SIZE, ge=1024, le=64 * 1024 * 1024)
    mdns: bool = False  # never on unless turned on: multicast leaves the machine
    static_peers: list[str] = Field(default_factory=list)
    share_dir: str | None = None  # files.* tools serve only inside this directory
    agent_model: str | None = None  # model for agent runs and agent tasks (default: the first registered)
    # Marks the delegation policy reads on a phone: hand agent goals to the home PC while set.
    battery_low: bool = False
    memory_low: bool = False
    log_json: bool = False
    # Seconds without news on a delegated task before its executor is pinged (and, if silent
    # as long again, its connection dropped and redialed): bounds how long a home PC that
    # lost power can stall a phone. Longer saves a phone's battery.
    liveness_probe_s: float = Field(default=20.0, ge=1.0, le=3600.0)


@dataclass(frozen=True)
class Identity:
    """A node's Ed25519 key. The peer id and fingerprint are derived from the public key."""

    seed: bytes

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


class NodeHome:
    """Paths and on-disk state of one node. Creating one does not touch the disk; `init()` does."""

    def __init__(self, home: str | os.PathLike[str] | None = None) -> None:
        self.path = resolve_home(home)

    @property
    def key_path(self) -> Path:
        return self.path / "identity.key"

    @property
    def config_path(self) -> Path:
        return self.path / "config.toml"

    @property
    def db_path(self) -> Path:
        return self.path / "node.db"

    @property
    def socket_path(self) -> Path:
        """The control socket; hashed into the temp dir when the home path is too long for AF_UNIX."""
        direct = self.path / "control.sock"
        if len(str(direct).encode()) <= _MAX_SOCKET_PATH:
            return direct
        digest = hashlib.sha256(str(self.path).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"psymesh-{digest}.sock"

    @property
    def models_dir(self) -> Path:
        return self.path / "models"

    def exists(self) -> bool:
        return self.key_path.exists()

    def init(self, *, profile: Profile | None = None, name: str | None = None) -> Identity:
        """Create the home, key and config on first use; later calls just load them."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        identity = self.load_or_create_identity()
        if not self.config_path.exists():
            cfg = NodeConfig(profile=profile or "home", name=name or f"{profile or 'home'}-{identity.fingerprint[:4].lower()}")
            self.save_config(cfg)
        return identity

    def load_or_create_identity(self) -> Identity:
        try:
            seed = self.key_path.read_bytes()
        except FileNotFoundError:
            seed = Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
            )
            # O_EXCL: two processes starting at once must not both write a key.
            try:
                fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return self.load_or_create_identity()
            with os.fdopen(fd, "wb") as f:
                f.write(seed)
                f.flush()
                os.fsync(f.fileno())
            return Identity(seed)
        if len(seed) != 32:
            raise PsymeshError(f"{self.key_path} is not a 32-byte Ed25519 seed", code=ErrorCode.BAD_REQUEST)
        mode = self.key_path.stat().st_mode & 0o777
        if mode & 0o077:
            raise PsymeshError(
                f"{self.key_path} is readable by others (mode {mode:o}); run: chmod 600 {self.key_path}",
                code=ErrorCode.FORBIDDEN,
            )
        return Identity(seed)

    def load_config(self) -> NodeConfig:
        if not self.config_path.exists():
            return NodeConfig()
        try:
            return NodeConfig.model_validate(tomllib.loads(self.config_path.read_text()))
        except (tomllib.TOMLDecodeError, ValidationError) as exc:
            raise PsymeshError(f"{self.config_path}: {exc}", code=ErrorCode.BAD_REQUEST) from None

    def save_config(self, config: NodeConfig) -> None:
        data = config.model_dump(exclude_none=True)
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(tomli_w.dumps(data))
        os.replace(tmp, self.config_path)
