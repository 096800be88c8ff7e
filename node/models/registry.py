"""The models this node can run: a name -> GGUF registry in the node database.

`psymesh model add` writes the registry directly (no daemon needed); a running daemon
sees the new model at its next request. Each entry may set its own `keep_alive_s` (how
long its runner stays loaded when idle); without one the profile's default applies.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.commands import Commands
from ...agent.formats.families import FAMILY_TOKENS, ToolFamily, detect_family
from ...agent.runtime.api import ModelSettings
from ..core.db import ensure_schema
from ..core.paths import ensure_private_dir, tighten
from ...protocol.errors import ConnectError, ErrorCode, PsymeshError

SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name          TEXT PRIMARY KEY,
    path          TEXT NOT NULL,
    n_ctx         INTEGER NOT NULL DEFAULT 4096,
    n_threads     INTEGER,
    chat_template TEXT,
    added_at      REAL NOT NULL
);
"""
# Columns added after the table first shipped: (name, declaration).
_ADDED_COLUMNS = (("keep_alive_s", "REAL"), ("tool_family", "TEXT"),
                  ("split", "TEXT"),            # JSON list of the workers' peer ids (node/compute/split.py)
                  ("on_worker_loss", "TEXT"))   # reload (default) or wait
GGUF_MAGIC = b"GGUF"


class ModelRegistry:
    def __init__(self, conn: sqlite3.Connection, *, commands: Commands | None = None) -> None:
        self.conn = conn
        self.commands = commands or Commands()  # how its refusals spell the command to run next
        ensure_schema(conn, SCHEMA)
        have = {r[1] for r in conn.execute("PRAGMA table_info(models)")}
        for column, decl in _ADDED_COLUMNS:
            if column not in have:
                conn.execute(f"ALTER TABLE models ADD COLUMN {column} {decl}")

    def add(self, name: str, path: str | Path, *, n_ctx: int | None = None, n_threads: int | None = None,
            chat_template: str | None = None, keep_alive_s: float | None = None,
            split: Sequence[str] = (), on_worker_loss: str | None = None) -> dict:
        """Register `path` as `name`. `n_ctx` None: the context the GGUF declares, capped so
        its KV cache takes at most a sixteenth of this machine's memory (`default_context`).
        Only the GGUF's header is read: adding a model never loads it. `split`: the peer ids of
        the workers its last layers run on (node/compute/split.py), `on_worker_loss` what a
        load does without one of them (reload, the default; wait)."""
        p = Path(path).expanduser().resolve()
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise PsymeshError(f"cannot read {p}: {exc.strerror}", code=ErrorCode.NOT_FOUND) from None
        if magic != GGUF_MAGIC:
            raise PsymeshError(f"{p} is not a GGUF file", code=ErrorCode.BAD_REQUEST)
        if n_ctx is None:
            n_ctx = default_context(p).n_ctx
        family = gguf_tool_family(p, chat_template)
        self.conn.execute(
            "INSERT INTO models (name, path, n_ctx, n_threads, chat_template, keep_alive_s, tool_family, split, "
            "on_worker_loss, added_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET path=excluded.path, n_ctx=excluded.n_ctx, n_threads=excluded.n_threads, "
            "chat_template=excluded.chat_template, keep_alive_s=excluded.keep_alive_s, "
            "tool_family=excluded.tool_family, split=excluded.split, on_worker_loss=excluded.on_worker_loss",
            (name, str(p), n_ctx, n_threads, chat_template, keep_alive_s, family.value,
             json.dumps(list(split)) if split else None, on_worker_loss, time.time()),
        )
        return self.get(name)

    def get(self, name: str) -> dict:
        row = self.conn.execute("SELECT * FROM models WHERE name = ?", (name,)).fetchone()
        if row is None:
            known = ", ".join(self.names()) or "none"
            raise PsymeshError(f"no model named {name!r} on this node (known: {known}); "
                               f"add one with: {self.commands('model add', f'{name} PATH.gguf')}", code=ErrorCode.NOT_FOUND)
        return self._with_family(dict(row))

    def names(self) -> list[str]:
        return [r["name"] for r in self.conn.execute("SELECT name FROM models ORDER BY name")]

    def list(self) -> list[dict]:
        return [self._with_family(dict(r)) for r in self.conn.execute("SELECT * FROM models ORDER BY name")]

    def _with_family(self, row: dict) -> dict:
        """`row` with its tool family, read from its GGUF once for an entry added before
        families were recorded (None while the file cannot be read)."""
        if row.get("tool_family") is None:
            try:
                row["tool_family"] = gguf_tool_family(Path(row["path"]), row["chat_template"]).value
            except PsymeshError:
                return row
            self.conn.execute("UPDATE models SET tool_family = ? WHERE name = ?", (row["tool_family"], row["name"]))
        return row

    def split_of(self, name: str) -> tuple[tuple[str, ...], str]:
        """The workers `name` is split across (peer ids; empty: it runs whole here) and what a
        load does without one (reload, wait)."""
        row = self.conn.execute("SELECT split, on_worker_loss FROM models WHERE name = ?", (name,)).fetchone()
        if row is None or not row["split"]:
            return (), "reload"
        return tuple(json.loads(row["split"])), row["on_worker_loss"] or "reload"

    def remove(self, name: str) -> None:
        if self.conn.execute("DELETE FROM models WHERE name = ?", (name,)).rowcount == 0:
            raise PsymeshError(f"no model named {name!r}", code=ErrorCode.NOT_FOUND)

    def settings(self, name: str, *, keep_alive_s: float | None = 300.0,
                 memory_limit_mb: int | None = None) -> ModelSettings:
        """How to load `name`: its entry, with the node's keep-alive where the entry sets none (an
        entry's negative keep-alive keeps the model loaded until the node stops)."""
        row = self.get(name)
        own = row["keep_alive_s"]
        return ModelSettings(path=Path(row["path"]), n_ctx=row["n_ctx"], n_threads=row["n_threads"],
                             chat_template=row["chat_template"], keep_alive_s=keep_alive_s if own is None else (None if own < 0 else own),
                             memory_limit_mb=memory_limit_mb)


@dataclass(frozen=True)
class ContextChoice:
    """The context `model add` gives a model: what its GGUF declares, and the memory cap."""

    n_ctx: int
    declared: int | None     # `<arch>.context_length` (None: the GGUF does not say)
    memory_cap: int          # the most whose KV cache fits in a sixteenth of this machine's RAM (<= 32768)


FALLBACK_CTX = 4096          # a GGUF that declares no context length
MIN_CTX = 2048
MAX_DEFAULT_CTX = 32768      # more only when asked (--ctx): prompt processing grows with it


def default_context(path: Path, *, memory_bytes: int | None = None) -> ContextChoice:
    """The GGUF's declared context length, capped by memory: its f16 KV cache (attention
    layers x KV heads x (key + value length) x 2 bytes a token; a hybrid model such as
    qwen35 has attention in every `full_attention_interval`-th layer only) may take a
    sixteenth of `memory_bytes` (default: this machine's RAM), and at most 32768 tokens
    unless asked. Never below 2048 tokens, nor above what the GGUF declares."""
    from .ggufheader import GgufHeaderError, read_gguf_header

    try:
        header = read_gguf_header(path)  # the key-value section only: never the tensors (see ggufheader)
    except OSError as exc:
        raise PsymeshError(f"cannot read {path}: {exc.strerror}", code=ErrorCode.NOT_FOUND
                           if isinstance(exc, FileNotFoundError) else ErrorCode.BAD_REQUEST) from None
    except GgufHeaderError as exc:
        raise PsymeshError(f"cannot read the GGUF metadata of {path}: {exc.message}",
                           code=ErrorCode.BAD_REQUEST) from None
    arch = header.architecture
    field = header.int
    declared = field(f"{arch}.context_length")
    layers = field(f"{arch}.block_count") or 0
    interval = field(f"{arch}.full_attention_interval") or 1
    kv_heads = field(f"{arch}.attention.head_count_kv") or field(f"{arch}.attention.head_count") or 0
    head_dim = (field(f"{arch}.embedding_length") or 0) // max(1, field(f"{arch}.attention.head_count") or 1)
    per_token = (max(1, layers // interval) * kv_heads * ((field(f"{arch}.attention.key_length") or head_dim)
                                                          + (field(f"{arch}.attention.value_length") or head_dim)) * 2)
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cap = min(MAX_DEFAULT_CTX, max(MIN_CTX, (memory_bytes // 16 // per_token) // 1024 * 1024)) if per_token \
        else FALLBACK_CTX
    n_ctx = min(declared, cap) if declared else min(FALLBACK_CTX, cap)
    return ContextChoice(n_ctx=max(min(MIN_CTX, declared or MIN_CTX), n_ctx), declared=declared, memory_cap=cap)


def gguf_tool_family(path: Path, chat_template: str | None = None) -> ToolFamily:
    """How the model in the GGUF at `path` calls tools (agent/formats/families.py): from its
    chat template (or `chat_template`, the entry's override) and the family tokens its
    vocabulary has, as the runner reports them once the model is loaded. Its header only
    (ggufheader), as default_context reads it."""
    from .ggufheader import GgufHeaderError, read_gguf_header

    try:
        header = read_gguf_header(path, find=FAMILY_TOKENS)
    except (OSError, GgufHeaderError) as exc:
        raise PsymeshError(f"cannot read the GGUF metadata of {path}: {exc}", code=ErrorCode.BAD_REQUEST) from None
    return detect_family(chat_template or header.str("tokenizer.chat_template"), header.found)


def pull_model(repo_id: str, quant: str, dest: Path, *,
               add_command: str = "psymesh model add NAME /path/to/that.gguf") -> Path:
    """Download the GGUF of `repo_id` whose name contains `quant` (e.g. Q8_0) into `dest`.

    Offline (as on machines without access to the hub) this fails with a message that
    names the file to fetch by hand, and the command to register it afterwards (`add_command`,
    as the CLI spells it for the home it was given).
    """
    import fnmatch
    import os
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import hf_hub_download, list_repo_files

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    page = f"{endpoint}/{repo_id}/tree/main"
    manual = f"download the *{quant}*.gguf file from {page} by hand, then run: {add_command}"
    url = urlsplit(endpoint)
    try:  # fail in seconds, not after the hub client's minute of retries
        socket.create_connection((url.hostname or "", url.port or 443), timeout=5).close()
    except OSError as exc:
        raise ConnectError(f"cannot reach the model hub at {endpoint} ({exc.strerror or exc}); {manual}") from None
    try:
        files = list_repo_files(repo_id)
    except Exception as exc:  # the hub client raises many types (HTTP, offline mode, auth)
        raise PsymeshError(f"cannot list {repo_id} on the hub ({type(exc).__name__}: {exc}); {manual}",
                           code=ErrorCode.UNAVAILABLE) from None
    matches = sorted(f for f in files if f.endswith(".gguf") and fnmatch.fnmatch(f.lower(), f"*{quant.lower()}*"))
    if not matches:
        ggufs = ", ".join(f for f in files if f.endswith(".gguf")) or "none"
        raise PsymeshError(f"{repo_id} has no GGUF matching {quant!r} (it has: {ggufs})", code=ErrorCode.NOT_FOUND)
    for d in (dest.parent, dest):  # models/ and models/<repo>: owner-only, like the rest of the home
        ensure_private_dir(d, "the model directory")
    try:
        path = Path(hf_hub_download(repo_id, matches[0], local_dir=dest))
    except Exception as exc:
        raise PsymeshError(f"download of {matches[0]} failed ({type(exc).__name__}); {manual}",
                           code=ErrorCode.UNAVAILABLE) from None
    tighten(path)
    return path
