"""The API key of a local HTTP face of the node (`[serve.openai]`, `[serve.a2a]`; the
dashboard's later). There is always one: a face with no key would serve any program of
any local user, and any web page the owner opens (docs/security.md, "A web page").

Where it comes from, the first that is there:

    $PSYMESH_OPENAI_API_KEY      the environment (the face's KEY_ENV): another user cannot
    $PSYMESH_A2A_API_KEY         read a process's environment (/proc/PID/environ is 0400)
    api_key_file = "..."         a file the owner names
    <home>/openai.key            else in the node home (the face's KEY_FILE), created 0600
    <home>/a2a.key               with a random key the first time the face is enabled

Never the command line: /proc/PID/cmdline is readable by every local user. A key file is
read like identity.key (paths.read_secret_file): one that others may read is refused with
the `chmod 600` to run, not quietly tightened, since the key may already be copied.
`psymesh serve openai --show-key` (or `a2a`) prints the key and where it lives.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..core.bridgeconfig import KeyedServe
from ..core.home import NodeHome
from ..core.paths import os_error, read_secret_file
from ...protocol.errors import ErrorCode, PsymeshError

MIN_KEY_CHARS = 16   # a key another local user could guess by trying is no key
NEW_KEY_BYTES = 32   # a created key: 256 random bits, URL-safe base64 (43 characters)


@dataclass(frozen=True)
class ApiKey:
    """The key clients must send (`Authorization: Bearer VALUE`), and where it was found
    (the variable's name or the file's path). Its repr shows the source only."""

    value: str
    source: str

    def __repr__(self) -> str:
        return f"ApiKey(source={self.source!r})"


def load_api_key(settings: KeyedServe, home: NodeHome, environ: Mapping[str, str]) -> ApiKey:
    """The face's key: from `environ`, its api_key_file, or its file in `home` (created
    when missing). One PsymeshError line if a key is unreadable, empty, too short, or in a
    file others may read."""
    given = environ.get(settings.KEY_ENV)
    if given is not None:
        return _checked(given.strip(), f"${settings.KEY_ENV}", settings)
    if settings.api_key_file is not None:
        path = Path(settings.api_key_file).expanduser()
        return _checked(_read(path, settings), str(path), settings)
    path = home.path / settings.KEY_FILE
    try:
        return _checked(_read(path, settings), str(path), settings)
    except FileNotFoundError:
        pass
    key = secrets.token_urlsafe(NEW_KEY_BYTES)
    try:  # O_EXCL: of two processes enabling the face at once, one writes and both use its key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        try:
            return _checked(_read(path, settings), str(path), settings)
        except FileNotFoundError:  # there, yet not readable as a file: a symlink to nowhere
            raise PsymeshError(f"[{settings.SECTION}] key file {path} is a link to nothing; remove it to have a "
                               "key made", code=ErrorCode.BAD_REQUEST) from None
    except OSError as exc:
        raise os_error(exc, path) from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # exactly, whatever the umask
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    return ApiKey(key, str(path))


def _read(path: Path, settings: KeyedServe) -> str:
    """A key file's text. FileNotFoundError passes through only for the home's own file."""
    try:
        return read_secret_file(path).decode().strip()
    except FileNotFoundError:
        if settings.api_key_file is None:
            raise
        raise PsymeshError(f"[{settings.SECTION}] api_key_file {path} does not exist",
                           code=ErrorCode.BAD_REQUEST) from None
    except UnicodeDecodeError:
        raise PsymeshError(f"[{settings.SECTION}] key file {path} is not text", code=ErrorCode.BAD_REQUEST) from None
    except OSError as exc:
        raise PsymeshError(f"[{settings.SECTION}] key file {path}: {exc.strerror or exc}",
                           code=ErrorCode.BAD_REQUEST) from None


def _checked(key: str, source: str, settings: KeyedServe) -> ApiKey:
    if not key:
        raise PsymeshError(f"[{settings.SECTION}] the key in {source} is empty", code=ErrorCode.BAD_REQUEST)
    if len(key) < MIN_KEY_CHARS or not (key.isascii() and key.isprintable()) or " " in key:
        raise PsymeshError(f"[{settings.SECTION}] the key in {source} must be at least {MIN_KEY_CHARS} printable "
                           "ASCII characters without spaces", code=ErrorCode.BAD_REQUEST)
    return ApiKey(key, source)
