"""A web page's readable text, extracted in child processes the exit can lose.

trafilatura (over lxml) is the best readable-text extractor we have, and the costliest
thing a page can make the exit do: 2 MiB of `<p>a</p>` repeated took 12 s of CPU and
~480 MB in the daemon, six such pages at once 2.64 GB, kept after they were done (issue
20). No size cap makes that safe (256 KiB of it still costs ~1.2 s and ~90 MB), so the
work leaves the daemon:

    Extractors(settings)          at most `extractions` children at once, each started
        .text(body, type, charset)    on first use and kept for the next page; a page waits
                                      for a free child inside the caller's deadline
    child (python -m psymesh.node.web.extractor)
        imports trafilatura, then caps its own address space at what it uses plus
        `extract_memory_bytes` (RLIMIT_AS); reads one request, answers, reads the next

A child that runs out of memory (a MemoryError, or its peak address space at the cap:
libxml2 fails quietly there) answers with an error and exits; one that overruns the
deadline is killed; one that grew past `extract_memory_bytes / 2` and kept it is retired
after its answer. Each way the page costs a child, the daemon keeps its memory, and the
asker gets a clean error (`too_large`, `timeout`). HTML over `max_html_bytes` is cut
there before it is handed over (the body cap, `max_body_bytes`, is what is read), and the
page then says so (`too_large`); HTML nested deeper than libxml2 follows (256 levels
without XML_PARSE_HUGE, which the child does not lift) stops the parse there, and the page
says that too (`too_deep`): an asker is told what it did not see.

Frames on the child's stdin and stdout: a 4-byte big-endian length, then msgpack:
request {body: bin, media_type: str, charset: str | nil}, answer {title, text, cut: [str]}
(cut: protocol/web.py `Truncation` values) or {error: str, memory: bool}; then one more
frame, {rss: int}, the bytes the child's resident size grew by since it started (past
`extract_memory_bytes / 2` it is retired).
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import BinaryIO

import anyio
import anyio.abc
import msgpack
from anyio.streams.buffered import BufferedByteReceiveStream

from .search import MAX_TITLE_CHARS
from ...protocol.errors import ErrorCode, PsymeshError
from ...protocol.web import Truncation

log = logging.getLogger("psymesh.web.extract")

HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_LENGTH = struct.Struct(">I")
MAX_ANSWER = 64 * 1024 * 1024  # a child's answer frame (the text of a page cut at max_html_bytes)
CAP_MARGIN = 4 * 1024 * 1024    # a child whose address space came this close to its cap met it
PARSER_MAX_DEPTH = 256          # libxml2's nesting limit without XML_PARSE_HUGE: the parse stops there


@dataclass(frozen=True)
class Readable:
    """A page's title and text, and why the text is not all of the page (`Truncation`s)."""

    title: str
    text: str
    cut: tuple[Truncation, ...] = ()


def readable_text(body: bytes, media_type: str, charset: str | None) -> Readable:
    """The title and text of a body: HTML reduced to its readable text by trafilatura (or,
    when it finds no main text, every text node outside scripts and styles); other types as
    text. Blocking and CPU-bound, without bound on a hostile page: the exit runs it in an
    `Extractors` child. (Public for bench/web.py, whose baseline does exactly this work.)"""
    if media_type not in HTML_TYPES:
        return Readable("", body.decode(charset or "utf-8", errors="replace"))
    import trafilatura  # imported when used: heavy

    source: str | bytes = body.decode(charset, errors="replace") if charset else body   # else sniff <meta charset>
    tree = trafilatura.load_html(source)
    if tree is None:
        return Readable("", "")
    # the parse stopped where the page nests past libxml2's limit (a page that reaches it
    # exactly, and no deeper, is said to be cut too: rare, and only an over-cautious word)
    cut = (Truncation.TOO_DEEP,) if _deepest(tree) >= PARSER_MAX_DEPTH else ()
    title = " ".join((tree.findtext(".//title") or "").split())[:MAX_TITLE_CHARS]
    text = trafilatura.extract(tree, include_comments=False, include_links=False, include_images=False)
    if text is None:
        for element in tree.xpath("//script|//style|//noscript|//template|//head"):
            element.drop_tree()
        lines = (" ".join(line.split()) for line in tree.text_content().splitlines())
        text = "\n".join(line for line in lines if line)
    return Readable(title, text, cut)


def _deepest(tree: object) -> int:
    """How many levels the parsed tree nests (the root is 1), in one walk."""
    from lxml import etree

    depth = deepest = 0
    for event, _ in etree.iterwalk(tree, events=("start", "end")):
        depth += 1 if event == "start" else -1
        deepest = max(deepest, depth)
    return deepest


def cut_html(body: bytes, media_type: str, limit: int) -> bytes:
    """An HTML body cut at `limit` bytes (lxml parses a cut document like any broken one);
    other types as they are."""
    return body[:limit] if media_type in HTML_TYPES and len(body) > limit else body


class _Child:
    """One extractor process and its pipes."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self.stdin = process.stdin
        self.stdout = BufferedByteReceiveStream(process.stdout)
        self.retire = False  # set when it must not serve another page

    async def ask(self, request: dict[str, object]) -> tuple[dict[str, object], int]:
        data = msgpack.packb(request, use_bin_type=True)
        await self.stdin.send(_LENGTH.pack(len(data)) + data)
        answer = await self._frame()
        rss = (await self._frame()).get("rss")
        return answer, rss if isinstance(rss, int) else 0

    async def _frame(self) -> dict[str, object]:
        (length,) = _LENGTH.unpack(await self.stdout.receive_exactly(_LENGTH.size))
        if length > MAX_ANSWER:
            raise ValueError(f"an extractor answered {length} bytes")
        return msgpack.unpackb(await self.stdout.receive_exactly(length), raw=False)

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            with contextlib.suppress(Exception):
                await self.process.aclose()


class Extractors:
    """At most `limit` extractor children, kept between pages. Use as an async context
    manager (closing kills the children)."""

    def __init__(self, limit: int, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self._slots = anyio.Semaphore(limit)
        self._idle: list[_Child] = []
        self._all: set[_Child] = set()

    async def __aenter__(self) -> Extractors:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for child in list(self._all):
            await child.kill()
        self._all.clear()
        self._idle.clear()

    def children(self) -> list[int]:
        """The pids of the children alive now (tests look)."""
        return [child.process.pid for child in self._all]

    async def text(self, body: bytes, media_type: str, charset: str | None) -> Readable:
        """The title and text of `body`, from a child. Cancel it (a deadline) and the child is killed.
        Raises PsymeshError: TOO_LARGE (the page needs more memory than a child has),
        INTERNAL (the child failed otherwise)."""
        async with self._slots, self._child() as child:
            try:
                answer, rss = await child.ask({"body": body, "media_type": media_type, "charset": charset})
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead, ValueError) as exc:
                child.retire = True
                raise PsymeshError(f"the page's text extractor died ({exc!r})", code=ErrorCode.INTERNAL) from None
            if rss > self.memory_bytes // 2:
                child.retire = True  # it grew and kept it: start afresh
            if "error" in answer:
                child.retire = True
                if answer.get("memory"):
                    raise PsymeshError(f"refused: the page needs more than {self.memory_bytes >> 20} MiB to extract "
                                       "([web.exit] extract_memory_bytes)", code=ErrorCode.TOO_LARGE)
                raise PsymeshError(f"the page's text could not be extracted: {answer['error']}",
                                   code=ErrorCode.INTERNAL)
            cut = answer.get("cut")
            return Readable(str(answer["title"]), str(answer["text"]),
                            tuple(Truncation(why) for why in cut) if isinstance(cut, list) else ())

    @contextlib.asynccontextmanager
    async def _child(self) -> AsyncIterator[_Child]:
        child = self._idle.pop() if self._idle else await self._start()
        child.retire = False
        ok = False
        try:
            yield child
            ok = True
        finally:
            if ok and not child.retire:
                self._idle.append(child)
            else:  # cancelled mid-page, failed or retired: the child goes
                self._all.discard(child)
                await child.kill()

    async def _start(self) -> _Child:
        process = await anyio.open_process(
            [sys.executable, "-m", "psymesh.node.web.extractor", str(self.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        child = _Child(process)
        self._all.add(child)
        return child


# ----------------------------------------------------------------------------- the child

def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _address_space() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def _peak_address_space() -> int | None:
    """The most address space this process has held (VmPeak): libxml2 meeting the cap fails
    quietly (a cut tree, an empty text) rather than raising, so reaching it is the sign."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmPeak:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read(stream: BinaryIO, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _write(stream: BinaryIO, obj: dict[str, object]) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def main(argv: list[str]) -> int:
    """The child: cap memory, then answer requests until stdin ends."""
    memory_bytes = int(argv[1])
    import trafilatura  # noqa: F401  (loaded before the cap, which is on what pages add)

    base, resident = _address_space(), _resident_bytes()
    cap = None if base is None else base + memory_bytes
    if cap is not None:  # Linux; elsewhere RLIMIT_AS is not enforced and the deadline stands alone
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = _read(stdin, _LENGTH.size)
        if header is None:
            return 0
        data = _read(stdin, _LENGTH.unpack(header)[0])
        if data is None:
            return 0
        try:
            request = msgpack.unpackb(data, raw=False)
            readable = readable_text(request["body"], request["media_type"], request["charset"])
            peak = _peak_address_space()
            if cap is not None and peak is not None and peak >= cap - CAP_MARGIN:
                raise MemoryError  # it met the cap: what came back may be cut short
            answer: dict[str, object] = {"title": readable.title, "text": readable.text,
                                         "cut": [str(why) for why in readable.cut]}
        except MemoryError:
            answer = {"error": "out of memory", "memory": True}
        except Exception as exc:  # a page that breaks the parser: its asker's error, not ours
            answer = {"error": repr(exc)[:300], "memory": False}
        try:
            _write(stdout, answer)
            _write(stdout, {"rss": _resident_bytes() - resident})
        except MemoryError:
            return 1
        if "error" in answer:
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
