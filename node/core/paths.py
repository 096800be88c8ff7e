"""Where a node home's files are, and the rules for touching them (what home.py says about the
home: private to its owner, mode 0700, files 0600).

    <home>/identity.key   <home>/config.toml   <home>/node.db   <home>/control.sock

Apart from home.py (the key, config.toml and its settings models) so that what only needs a
path imports no pydantic models and no cryptography: the SDK finds the control socket with
this module alone, and `psymesh status` pays for nothing else of the home (issue 22 item 13).
"""
import errno
import hashlib
import os
import socket
import stat
import struct
import sys
from pathlib import Path

from ...protocol.errors import ErrorCode, PsymeshError

# Unix socket paths are limited to 108 bytes (sun_path); leave room for the NUL.
_MAX_SOCKET_PATH = 100


def resolve_home(home: str | os.PathLike[str] | None = None) -> Path:
    if home is None:
        home = os.environ.get("PSYMESH_HOME") or _default_home()
    return Path(home).expanduser().resolve()


def is_default_home(home: Path) -> bool:
    """Whether `home` (resolved) is the platform's default home, which a command finds without
    --home (and without $PSYMESH_HOME, which a service's or another shell's commands may not have)."""
    return home == Path(_default_home()).expanduser().resolve()


def _default_home() -> str:
    """The platform's data dir for psymesh (on Linux `$XDG_DATA_HOME/psymesh`, else
    `~/.local/share/psymesh`; Termux's and the others' as platformdirs says). platformdirs is
    imported here, at the call: a command given --home or $PSYMESH_HOME does not load it."""
    import platformdirs

    return platformdirs.user_data_dir("psymesh", appauthor=False)


_HOME_ADVICE = "use a directory of your own (--home)"
# A socket dir that is not ours is in the shared runtime or temp dir: route around it.
SOCKET_DIR_ADVICE = ("remove it (it may be someone impersonating your daemon), or give the node a shorter "
                     "home path so its socket lives in the home, or set XDG_RUNTIME_DIR to a directory of your own")


_SOL_LOCAL, _LOCAL_PEERCRED = 0, 1  # macOS and the BSDs (<sys/un.h>): a struct xucred


def socket_peer(sock: socket.socket) -> tuple[int, int | None] | None:
    """(uid, pid or None) of the process at the other end of a Unix socket: Linux's
    `SO_PEERCRED`, or `LOCAL_PEERCRED` on macOS and the BSDs (what `getpeereid()` reads; it
    tells no pid); None where the OS tells neither. The client asks it of the daemon, the
    daemon of each client (node/control/server.py)."""
    if hasattr(socket, "SO_PEERCRED"):
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return uid, pid
    if sys.platform == "darwin" or "bsd" in sys.platform:
        xucred = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, struct.calcsize("IiH16i"))
        version, uid = struct.unpack_from("Ii", xucred)
        return (uid, None) if version == 0 else None
    return None


def check_private_dir(path: Path, what: str, advice: str = _HOME_ADVICE) -> None:
    """Refuse `path` unless it is a real directory (not a symlink) that we own and only we
    may write; tighten it to owner-only if others may merely read or enter it.

    Owned by us, and by nobody else, root included: psymesh never runs as one user for
    another user's home, so a directory that belongs to someone else is not one we made.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise os_error(exc, path) from None
    if not stat.S_ISDIR(st.st_mode):
        raise PsymeshError(f"{what} {path} is not a directory (a symlink or a file?); {advice}",
                           code=ErrorCode.FORBIDDEN)
    if st.st_uid != os.geteuid():
        raise PsymeshError(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); "
                           f"{advice}", code=ErrorCode.FORBIDDEN)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise PsymeshError(f"{what} {path} can be written by other users (mode {mode:o}), who could have "
                           f"replaced what is in it; check its contents, then run: chmod 700 {path}",
                           code=ErrorCode.FORBIDDEN)
    if mode & 0o077:
        tighten(path, st)


def ensure_private_dir(path: Path, what: str, advice: str = _HOME_ADVICE) -> None:
    """Create `path` (mode 0700) if missing, then `check_private_dir` it: a directory
    someone else created first under the name we wanted is refused, never used."""
    try:
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # exactly: an odd umask (say 0277) must not leave it unwritable
    except FileExistsError:
        pass
    except OSError as exc:
        raise os_error(exc, path) from None
    check_private_dir(path, what, advice)


def tighten(path: Path, st: os.stat_result | None = None) -> None:
    """Drop every group and other permission bit of `path` (never adds one)."""
    try:
        st = st or os.lstat(path)
        if stat.S_IMODE(st.st_mode) & 0o077 and not stat.S_ISLNK(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise os_error(exc, path) from None


def private_opener(path: str | os.PathLike[str], flags: int) -> int:
    """`open(..., opener=private_opener)`: a file we create is born 0600, whatever the umask
    (os.open's mode is masked by the umask, which only ever removes bits)."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)


def read_secret_file(path: Path) -> bytes:
    """The bytes of a key file, refused (one line with the `chmod 600` to run) if others may
    read it: a key they could read may already be copied, so it is not quietly tightened.
    The mode is checked on the open file, so a file swapped after the check is not read.
    FileNotFoundError passes through (callers create the file); other OSErrors too."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PsymeshError(f"{path} is not a regular file", code=ErrorCode.BAD_REQUEST)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise PsymeshError(f"{path} is readable by others (mode {mode:o}); run: chmod 600 {path}",
                               code=ErrorCode.FORBIDDEN)
        return f.read()


def os_error(exc: OSError, path: Path) -> PsymeshError:
    """An OSError on a home's file as one clear sentence: what failed and what to do."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return PsymeshError(f"the disk holding {path} is full ({reason}); free some space, then retry",
                            code=ErrorCode.UNAVAILABLE)
    if exc.errno == errno.EROFS:
        return PsymeshError(f"{path} is on a read-only file system; remount it read-write or use another "
                            "home (--home)", code=ErrorCode.UNAVAILABLE)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PsymeshError(f"no permission to use {path} ({reason}); it must belong to you and be writable "
                            f"by you: ls -ld {path}", code=ErrorCode.FORBIDDEN)
    return PsymeshError(f"cannot use {path}: {reason}", code=ErrorCode.UNAVAILABLE)


def _socket_runtime_dir() -> Path:
    """Where the sockets of homes with long paths live: a directory only this user may
    enter. $XDG_RUNTIME_DIR/psymesh when the session has a usable one (owned by us, not
    writable by others, short enough), else psymesh-<uid> in the temp dir. The latter
    has a predictable name, so whoever uses it (daemon or client) first verifies that
    we own it and that only we may enter it: a squatter's directory is refused."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        candidate = Path(xdg) / "psymesh"
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if (st is not None and st.st_uid == os.geteuid() and not st.st_mode & 0o022
                and len(str(candidate).encode()) + 22 <= _MAX_SOCKET_PATH):
            return candidate
    import tempfile  # here: it (and the shutil and random it imports) is for long home paths only

    return Path(tempfile.gettempdir()) / f"psymesh-{os.geteuid()}"


class HomePaths:
    """Where one node's files are. Creating one does not touch the disk."""

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
        """The control socket: in the home, or (when that path is too long for AF_UNIX)
        named by a hash of the home in a per-user runtime dir. Either way its directory
        is one only the owner may enter (the daemon creates and checks it; the client
        checks it before connecting)."""
        return self._socket("control.sock", "")

    @property
    def rpc_socket_path(self) -> Path:
        """The lent worker's socket (node/compute/worker.py): llama.cpp's RPC server is reached
        through it only, in a directory only the owner may enter, as the control socket."""
        return self._socket("rpc.sock", "-rpc")

    def _socket(self, name: str, suffix: str) -> Path:
        direct = self.path / name
        if len(str(direct).encode()) <= _MAX_SOCKET_PATH:
            return direct
        digest = hashlib.sha256(str(self.path).encode()).hexdigest()[:16]
        return _socket_runtime_dir() / f"{digest}{suffix}.sock"

    @property
    def models_dir(self) -> Path:
        return self.path / "models"

    @property
    def logs_dir(self) -> Path:
        """Model runners' logs (what llama.cpp printed, its last words when it aborted)."""
        return self.path / "logs"

    def exists(self) -> bool:
        return self.key_path.exists()
