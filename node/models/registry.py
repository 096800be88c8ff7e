"""The models this node can run: a name -> GGUF registry in the node database.

`psymesh model add` writes the registry directly (no daemon needed); a running daemon
sees the new model at its next request. Each entry may set its own `keep_alive_s` (how
long its runner stays loaded when idle); without one the profile's default applies.
"""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from psymesh.agent.inference import ModelSettings
from psymesh.node.db import ensure_schema
from psymesh.node.home import ensure_private_dir, tighten
from psymesh.protocol.errors import ConnectError, ErrorCode, PsymeshError

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
_ADDED_COLUMNS = (("keep_alive_s", "REAL"),)
GGUF_MAGIC = b"GGUF"


class ModelRegistry:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        ensure_schema(conn, SCHEMA)
        have = {r[1] for r in conn.execute("PRAGMA table_info(models)")}
        for column, decl in _ADDED_COLUMNS:
            if column not in have:
                conn.execute(f"ALTER TABLE models ADD COLUMN {column} {decl}")

    def add(self, name: str, path: str | Path, *, n_ctx: int = 4096, n_threads: int | None = None,
            chat_template: str | None = None, keep_alive_s: float | None = None) -> dict:
        p = Path(path).expanduser().resolve()
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise PsymeshError(f"cannot read {p}: {exc.strerror}", code=ErrorCode.NOT_FOUND) from None
        if magic != GGUF_MAGIC:
            raise PsymeshError(f"{p} is not a GGUF file", code=ErrorCode.BAD_REQUEST)
        self.conn.execute(
            "INSERT INTO models (name, path, n_ctx, n_threads, chat_template, keep_alive_s, added_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET path=excluded.path, n_ctx=excluded.n_ctx, n_threads=excluded.n_threads, "
            "chat_template=excluded.chat_template, keep_alive_s=excluded.keep_alive_s",
            (name, str(p), n_ctx, n_threads, chat_template, keep_alive_s, time.time()),
        )
        return self.get(name)

    def get(self, name: str) -> dict:
        row = self.conn.execute("SELECT * FROM models WHERE name = ?", (name,)).fetchone()
        if row is None:
            known = ", ".join(self.names()) or "none"
            raise PsymeshError(f"no model named {name!r} on this node (known: {known}); "
                               f"add one with: psymesh model add {name} PATH.gguf", code=ErrorCode.NOT_FOUND)
        return dict(row)

    def names(self) -> list[str]:
        return [r["name"] for r in self.conn.execute("SELECT name FROM models ORDER BY name")]

    def list(self) -> list[dict]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM models ORDER BY name")]

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


def pull_model(repo_id: str, quant: str, dest: Path) -> Path:
    """Download the GGUF of `repo_id` whose name contains `quant` (e.g. Q8_0) into `dest`.

    Offline (as on machines without access to the hub) this fails with a message that
    names the file to fetch by hand, and the command to register it afterwards.
    """
    import fnmatch
    import os
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import hf_hub_download, list_repo_files

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    page = f"{endpoint}/{repo_id}/tree/main"
    manual = (f"download the *{quant}*.gguf file from {page} by hand, then run: "
              f"psymesh model add NAME /path/to/that.gguf")
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
