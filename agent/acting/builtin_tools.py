"""Built-in tools: `system.info` and read-only `files.*` confined to the share dir.

The files tools are what a trusted phone may ask a home PC for, so their one hard
rule is containment: every path is relative to the configured ``share_dir`` and is
checked *after* symlinks are resolved. Absolute paths and ``..`` are refused
outright (FORBIDDEN), and so is any path, or symlink, that lands outside the share.
Entries of the share that resolve outside it are left out of listings and searches.
There is deliberately no shell tool and nothing that writes.

Their second rule: only regular files and directories are served. A FIFO would block
a read forever (and a worker thread cannot be interrupted), and opening a device can
have effects of its own, so the type is decided by stat, without opening anything;
a file is then opened with O_NONBLOCK | O_NOFOLLOW and fstat'ed again, so one swapped
for a FIFO or a symlink since the stat is refused instead of followed or waited on.
Listings show such entries with their type; searches pass over them.
"""
from __future__ import annotations

import codecs
import fnmatch
import importlib.metadata
import os
import platform
import shutil
import stat
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, BinaryIO

from pydantic import Field

from .device import Phone, register_device_tools
from .tools import ToolContext, ToolError, ToolRegistry
from ...protocol.errors import ErrorCode

__all__ = [
    "FILE_PROFILES",
    "SearchLimits",
    "default_registry",
    "read_text",
    "register_builtin_tools",
    "resolve_in_share",
    "search_files",
    "system_info",
]

FILE_PROFILES = frozenset({"home"})
MAX_READ_BYTES = 256 * 1024        # one files.read result stays well under the 1 MiB event limit
MAX_LIST_ENTRIES = 1000
_SNIFF_BYTES = 8192                # a NUL in the first 8 KiB means binary (as git and grep decide)
_SNIPPET_CHARS = 200


# --------------------------------------------------------------------------- containment


def share_root(ctx: ToolContext) -> Path:
    """The resolved share dir, or ToolError UNAVAILABLE when there is none."""
    if ctx.share_dir is None:
        raise ToolError("no share dir is configured: set share_dir in config.toml", code=ErrorCode.UNAVAILABLE)
    root = Path(ctx.share_dir).expanduser().resolve()
    if not root.is_dir():
        raise ToolError(f"the share dir {str(root)!r} does not exist or is not a directory",
                        code=ErrorCode.UNAVAILABLE)
    return root


def _inside(root: Path, path: Path) -> bool:
    return path == root or path.is_relative_to(root)


def resolve_in_share(ctx: ToolContext, path: str) -> tuple[Path, Path]:
    """(share root, resolved target) for a share-relative `path`, refusing every escape.

    The containment check runs on the fully resolved path, so a symlink inside the
    share that points elsewhere is refused, while one that stays inside is followed.
    """
    root = share_root(ctx)
    if "\x00" in path:
        raise ToolError("path contains a NUL byte", code=ErrorCode.BAD_REQUEST)
    pure = Path(path)
    if pure.is_absolute() or pure.anchor:
        raise ToolError(f"absolute paths are not allowed ({path!r}); give a path relative to the share dir",
                        code=ErrorCode.FORBIDDEN)
    if ".." in pure.parts:
        raise ToolError(f"'..' is not allowed in paths ({path!r}); paths stay inside the share dir",
                        code=ErrorCode.FORBIDDEN)
    target = (root / pure).resolve()
    if not _inside(root, target):
        raise ToolError(f"{path!r} resolves outside the share dir (a symlink?); access refused",
                        code=ErrorCode.FORBIDDEN)
    return root, target


_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def _kind(st: os.stat_result) -> str:
    return next((name for test, name in _KINDS if test(st.st_mode)), "special file")


def _existing(ctx: ToolContext, path: str) -> tuple[Path, Path, os.stat_result]:
    """(root, target, its stat) for an existing regular file or directory of the share.
    Anything else (FIFO, socket, device) is refused here, by stat alone: never opened."""
    root, target = resolve_in_share(ctx, path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        raise ToolError(f"{path!r} does not exist in the share dir", code=ErrorCode.NOT_FOUND) from None
    except OSError as exc:
        raise ToolError(f"cannot access {path!r}: {exc.strerror}", code=ErrorCode.FORBIDDEN) from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise ToolError(f"{path!r} is a {_kind(st)}, not a regular file or a directory; the files tools "
                        "serve only those", code=ErrorCode.BAD_REQUEST)
    return root, target, st


def _open_regular(file: Path, expected: os.stat_result) -> BinaryIO:
    """Open `file`, stat'ed as a regular file, without blocking or following a symlink, and
    prove by fstat that what was opened is that same regular file."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
            raise ToolError("the file was replaced while it was being opened; try again", code=ErrorCode.CONFLICT)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix() if path != root else "."


def _mtime(stat: os.stat_result) -> str:
    return datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat(timespec="seconds")


def _looks_binary(head: bytes) -> bool:
    return b"\x00" in head


# --------------------------------------------------------------------------- files.*


def list_files(
    path: Annotated[str, Field(description="directory, relative to the share dir")] = ".",
    pattern: Annotated[str, Field(max_length=256, description="glob matched against entry names")] = "*",
    *,
    ctx: ToolContext,
) -> dict[str, Any]:
    """List the files and folders in a directory of the shared folder."""
    root, target, st = _existing(ctx, path)
    if not stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{path!r} is not a directory; use files.read to read a file", code=ErrorCode.BAD_REQUEST)
    entries: list[dict[str, Any]] = []
    truncated = False
    try:
        children = sorted(target.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        raise ToolError(f"cannot list {path!r}: {exc.strerror}", code=ErrorCode.FORBIDDEN) from None
    for child in children:
        if not fnmatch.fnmatch(child.name, pattern):
            continue
        resolved = child.resolve()
        if not _inside(root, resolved):
            continue  # a symlink leading out of the share is not part of it
        if len(entries) >= MAX_LIST_ENTRIES:
            truncated = True
            break
        try:
            st = resolved.stat()
        except OSError:
            continue  # dangling symlink or vanished file
        entry: dict[str, Any] = {"name": child.name, "type": _kind(st), "modified": _mtime(st)}
        if stat.S_ISREG(st.st_mode):
            entry["size"] = st.st_size
        entries.append(entry)
    return {"path": _rel(root, target), "entries": entries, "truncated": truncated}


def read_text(f: BinaryIO, offset: int, max_bytes: int) -> dict[str, Any]:
    """Read up to `max_bytes` of UTF-8 text from byte `offset` of the open file `f`, on
    character boundaries.

    A chunk never ends inside a character (the incomplete tail is left for the next
    read: `next_offset` says where to continue), and an `offset` inside a character
    moves forward to the next one. Files with a NUL byte, or that are not UTF-8,
    are reported as binary instead of returned.
    """
    size = os.fstat(f.fileno()).st_size
    head = f.read(_SNIFF_BYTES)
    if _looks_binary(head):
        return {"size": size, "binary": True, "text": None,
                "message": f"binary file ({size} bytes); its content is not shown"}
    f.seek(offset)
    data = f.read(max_bytes)
    skipped = 0
    while skipped < min(3, len(data)) and data[skipped] & 0xC0 == 0x80:
        skipped += 1  # started inside a multi-byte character
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    try:
        text = decoder.decode(data[skipped:], final=offset + len(data) >= size)
    except UnicodeDecodeError:
        return {"size": size, "binary": True, "text": None,
                "message": f"not a UTF-8 text file ({size} bytes); its content is not shown"}
    pending = len(decoder.getstate()[0])
    next_offset = offset + len(data) - pending
    eof = next_offset >= size
    return {"size": size, "offset": offset + skipped, "text": text,
            "next_offset": None if eof else next_offset, "eof": eof}


def read_file(
    path: Annotated[str, Field(description="file, relative to the share dir")],
    offset: Annotated[int, Field(ge=0, description="byte offset to start at")] = 0,
    max_bytes: Annotated[int, Field(ge=1, le=MAX_READ_BYTES, description="most bytes to return")] = 65536,
    *,
    ctx: ToolContext,
) -> dict[str, Any]:
    """Read a text file from the shared folder (binary files are reported, not shown)."""
    root, target, st = _existing(ctx, path)
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{path!r} is a directory; use files.list to see its contents", code=ErrorCode.BAD_REQUEST)
    try:
        with _open_regular(target, st) as f:
            result = read_text(f, offset, max_bytes)
    except OSError as exc:
        raise ToolError(f"cannot read {path!r}: {exc.strerror}", code=ErrorCode.FORBIDDEN) from None
    return {"path": _rel(root, target), **result}


@dataclass(frozen=True)
class SearchLimits:
    """Bounds on one files.search, so a query over a huge tree answers promptly."""

    max_files: int = 5000              # files looked at (by name or content)
    max_file_bytes: int = 1024 * 1024  # larger files are matched by name only
    max_total_bytes: int = 64 * 1024 * 1024
    max_seconds: float = 5.0
    max_hits_per_file: int = 5


DEFAULT_SEARCH_LIMITS = SearchLimits()


def search_files(
    root: Path,
    start: Path,
    query: str,
    max_results: int,
    limits: SearchLimits = DEFAULT_SEARCH_LIMITS,
    ctx: ToolContext | None = None,
) -> dict[str, Any]:
    """Case-insensitive substring search of names and text contents under `start`.

    Walks without following directory symlinks; file symlinks are followed only
    while they stay inside `root`. Only regular files are read (FIFOs, sockets and
    devices can match by name, never by content). Stops at the first exhausted bound
    and says which (`stopped`), so the model knows the answer may be partial.
    """
    needle = query.casefold()
    results: list[dict[str, Any]] = []
    scanned = 0
    read_bytes = 0
    stopped: str | None = None
    give_up_at = time.monotonic() + limits.max_seconds

    def walk_error(exc: OSError) -> None:  # unreadable directories are skipped
        return None

    for dirpath, dirnames, filenames in os.walk(start, onerror=walk_error):
        dirnames.sort()
        here = Path(dirpath)
        for name in sorted(dirnames) + sorted(filenames):
            if ctx is not None:
                ctx.check()
            if len(results) >= max_results:
                stopped = "max_results"
            elif scanned >= limits.max_files:
                stopped = "max_files"
            elif time.monotonic() >= give_up_at:
                stopped = "time"
            elif read_bytes >= limits.max_total_bytes:
                stopped = "max_total_bytes"
            if stopped:
                break
            entry = here / name
            resolved = entry.resolve()
            if not _inside(root, resolved):
                continue
            rel = _rel(root, entry)
            if needle in name.casefold():
                results.append({"path": rel, "match": "name"})
            if name in dirnames:
                continue
            try:
                st = os.stat(resolved)
            except OSError:
                continue  # dangling symlink or vanished file
            if not stat.S_ISREG(st.st_mode):
                continue
            scanned += 1
            hits, used = _search_content(resolved, st, needle, limits)
            read_bytes += used
            for line_no, line in hits:
                if len(results) >= max_results:
                    break
                results.append({"path": rel, "match": "content", "line": line_no, "text": line})
        if stopped:
            break
    return {"query": query, "results": results[:max_results], "files_scanned": scanned,
            "truncated": stopped is not None, "stopped": stopped}


def _search_content(file: Path, st: os.stat_result, needle: str,
                    limits: SearchLimits) -> tuple[list[tuple[int, str]], int]:
    if st.st_size > limits.max_file_bytes:
        return [], 0
    try:
        with _open_regular(file, st) as f:
            data = f.read(limits.max_file_bytes)
    except (OSError, ToolError):
        return [], 0
    if _looks_binary(data[:_SNIFF_BYTES]):
        return [], len(data)
    hits: list[tuple[int, str]] = []
    for line_no, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if needle in line.casefold():
            line = line.strip()
            hits.append((line_no, line if len(line) <= _SNIPPET_CHARS else line[:_SNIPPET_CHARS] + "..."))
            if len(hits) >= limits.max_hits_per_file:
                break
    return hits, len(data)


def search(
    query: Annotated[str, Field(min_length=1, max_length=256, description="text to look for (case-insensitive)")],
    path: Annotated[str, Field(description="directory to search, relative to the share dir")] = ".",
    max_results: Annotated[int, Field(ge=1, le=500)] = 50,
    *,
    ctx: ToolContext,
) -> dict[str, Any]:
    """Find files in the shared folder whose name or text contains the query."""
    root, target, st = _existing(ctx, path)
    if not stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{path!r} is not a directory", code=ErrorCode.BAD_REQUEST)
    return search_files(root, target, query, max_results, DEFAULT_SEARCH_LIMITS, ctx)


# --------------------------------------------------------------------------- system.info


def _memory() -> dict[str, int] | None:
    try:
        import psutil  # optional: not every platform has /proc
    except ImportError:
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        return {"total_bytes": int(vm.total), "available_bytes": int(vm.available)}
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if k in ("MemTotal", "MemAvailable")}
        return {"total_bytes": kib["MemTotal"], "available_bytes": kib.get("MemAvailable", 0)}
    except (OSError, ValueError, KeyError, IndexError):
        return None


def _psymesh_version() -> str | None:
    try:
        return importlib.metadata.version("psymesh")
    except importlib.metadata.PackageNotFoundError:
        return None


def system_info(ctx: ToolContext) -> dict[str, Any]:
    """Describe this machine: OS, CPU, memory, load and free space in the shared folder."""
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    share: dict[str, Any] = {"configured": ctx.share_dir is not None}
    if ctx.share_dir is not None:
        try:
            usage = shutil.disk_usage(Path(ctx.share_dir).expanduser())
            share.update(total_bytes=usage.total, free_bytes=usage.free)
        except OSError:
            share["available"] = False
    # Deliberately absent: hostname, user names, paths, environment variables.
    return {
        "os": platform.system(),
        "os_release": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "memory": _memory(),
        "load_avg": load,
        "share_dir": share,
        "profile": ctx.profile,
        "psymesh_version": _psymesh_version(),
    }


# --------------------------------------------------------------------------- registries


def register_builtin_tools(registry: ToolRegistry) -> None:
    """Add system.info (every profile) and the read-only files.* tools (home)."""
    registry.tool("system.info")(system_info)
    registry.tool("files.list", profiles=FILE_PROFILES)(list_files)
    registry.tool("files.read", profiles=FILE_PROFILES)(read_file)
    registry.tool("files.search", profiles=FILE_PROFILES)(search)


def default_registry(profile: str = "home", *, phone: Phone | None = None) -> ToolRegistry:
    """The tools a node of `profile` offers: the built-ins for it, plus the phone's tools
    when `profile` is "phone" and a :class:`Phone` is given (``Phone.simulated(device)``, or
    ``device_commands.detect_phone``). Tools of other profiles are not registered at all."""
    everything = ToolRegistry()
    register_builtin_tools(everything)
    if phone is not None:
        register_device_tools(everything, phone)
    return ToolRegistry(t for t in everything if t.offered_on(profile))
