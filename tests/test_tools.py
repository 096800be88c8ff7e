"""Tool registry, argument validation, invocation, plugins and the built-in tools,
on real files in temporary directories."""
from __future__ import annotations

import os
import socket
import stat
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import date
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import anyio
import pytest
from pydantic import BaseModel, Field

from psymesh.agent.acting.builtin_tools import SearchLimits, default_registry, resolve_in_share, search_files
from psymesh.agent.formats.chatformat import ToolSpec, parse_reply, render_prompt
from psymesh.agent.formats.chatformat import ChatMessage as ChatTurn
from psymesh.agent.acting.tools import (
    Tool,
    ToolContext,
    ToolError,
    ToolRegistry,
    invoke,
    load_entry_points,
    tool_from_function,
)
from psymesh.protocol.errors import ErrorCode, PsymeshError

T = TypeVar("T")

class Mood(str, Enum):
    happy = "happy"
    sad = "sad"


def make_registry() -> ToolRegistry:
    reg = ToolRegistry()

    @reg.tool("notes.add")
    def add_note(
        text: Annotated[str, Field(description="the note", max_length=100)],
        tags: list[str] | None = None,
        priority: int = 1,
        mood: Mood = Mood.happy,
        kind: Literal["todo", "idea"] = "todo",
        due: date | None = None,
        ctx: ToolContext | None = None,
    ) -> dict:
        """Save a short note.

        Longer explanation that must not reach the prompt.
        """
        return {"text": text, "tags": tags, "priority": priority, "mood": mood, "kind": kind, "due": due,
                "peer": ctx.peer_id if ctx else None}

    @reg.tool("notes.wipe", irreversible=True, profiles={"home"})
    async def wipe(confirm: bool) -> str:
        """Delete every note."""
        await anyio.sleep(0)  # a checkpoint, not a wait: a truly async tool yields to the loop
        return f"wiped={confirm}"

    return reg


# --------------------------------------------------------------------------- registry and schema


def test_decorator_builds_prompt_schema_from_signature() -> None:
    reg = make_registry()
    spec = reg.get("notes.add").to_spec()
    assert isinstance(spec, ToolSpec)
    assert spec.description == "Save a short note."
    assert not spec.irreversible
    params = spec.parameters
    assert params["type"] == "object"
    assert params["required"] == ["text"]
    props = params["properties"]
    assert set(props) == {"text", "tags", "priority", "mood", "kind", "due"}  # no ctx
    assert props["text"] == {"type": "string", "description": "the note", "maxLength": 100}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}  # Optional collapsed
    assert props["priority"] == {"type": "integer", "description": "default: 1"}
    assert props["mood"]["enum"] == ["happy", "sad"] and props["mood"]["type"] == "string"  # $ref inlined
    assert props["kind"]["enum"] == ["todo", "idea"]
    assert props["due"] == {"type": "string", "description": "YYYY-MM-DD"}
    flat = repr(params)
    for noise in ("title", "$ref", "$defs", "anyOf", "additionalProperties", "'default'", "format"):
        assert noise not in flat


def test_specs_filter_by_profile_and_render_in_the_prompt() -> None:
    reg = make_registry()
    assert reg.names() == ["notes.add", "notes.wipe"]
    assert [s.name for s in reg.specs("phone")] == ["notes.add"]
    wipe = reg.specs("home")[1]
    assert wipe.irreversible and wipe.parameters["required"] == ["confirm"]
    # The specs are the chat format's own type: they render, and a call parses typed.
    prompt = render_prompt([ChatTurn.user("note this")], reg.specs("home"), thinking=False)
    assert '"name": "notes.add"' in prompt
    reply = parse_reply("<tool_call>\n<function=notes.add>\n<parameter=text>\nmilk\n</parameter>\n"
                        "<parameter=priority>\n3\n</parameter>\n</function>\n</tool_call>", reg.specs())
    assert reply.errors == [] and reply.tool_calls[0].arguments == {"text": "milk", "priority": 3}


def test_get_unknown_tool_suggests_the_closest_name() -> None:
    reg = make_registry()
    with pytest.raises(ToolError) as err:
        reg.get("notes.ad")
    assert err.value.code is ErrorCode.NOT_FOUND
    assert "did you mean 'notes.add'" in err.value.message
    with pytest.raises(ToolError) as err:
        reg.get("weather.today")
    assert "available: notes.add, notes.wipe" in err.value.message
    with pytest.raises(ToolError, match="did you mean"):  # offered on home only
        reg.get("notes.wipe", profile="phone")


def test_registration_rules() -> None:
    reg = make_registry()
    with pytest.raises(PsymeshError) as err:
        reg.tool("notes.add")(lambda: None)
    assert err.value.code is ErrorCode.CONFLICT
    for bad in ("Notes.add", "notes..add", "notes.", "1notes", "notes-add", "a" * 65):
        with pytest.raises(ValueError, match="bad tool name"):
            reg.tool(bad)(lambda: None)

    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(TypeError, match="needs a type hint"):
        tool_from_function(untyped, "x.untyped")

    def star(*args: int) -> None: ...

    with pytest.raises(TypeError, match="named parameter"):
        tool_from_function(star, "x.star")


def test_explicit_tool_with_its_own_model() -> None:
    class Args(BaseModel):
        a: int
        b: int = 2

    reg = ToolRegistry([Tool("math.add", "Add two numbers.", Args, lambda a, b: a + b)])
    assert reg.get("math.add").parameters_schema()["required"] == ["a"]


# --------------------------------------------------------------------------- validation and invoke


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        ({}, ["text: missing required argument"]),
        ({"text": "x", "priority": "high"}, ["priority: Input should be a valid integer", "'high'"]),
        ({"text": "x", "colour": "red"}, ["colour: unknown argument", "allowed: text, tags, priority"]),
        ({"text": "x", "mood": "angry"}, ["mood: Input should be 'happy' or 'sad'"]),
        ({"text": ["a"], "tags": "solo", "extra": 1}, ["text:", "tags:", "extra: unknown argument"]),
        ({"text": "x" * 101}, ["text: String should have at most 100 characters"]),
        (["text"], ["must be a JSON object"]),
    ],
)
@pytest.mark.anyio
async def test_invalid_arguments_are_rejected_before_running(args: object, fragments: list[str]) -> None:
    ran = []
    reg = ToolRegistry()

    @reg.tool("notes.add")
    def add(text: Annotated[str, Field(max_length=100)], tags: list[str] | None = None, priority: int = 1,
            mood: Mood = Mood.happy) -> None:
        ran.append(text)

    with pytest.raises(ToolError) as err:
        await reg.invoke("notes.add", args)  # type: ignore[arg-type]
    assert err.value.code is ErrorCode.BAD_REQUEST
    assert err.value.message.startswith("invalid arguments for notes.add") or "JSON object" in err.value.message
    for fragment in fragments:
        assert fragment in err.value.message
    assert ran == []


@pytest.mark.anyio
async def test_invoke_sync_tool_runs_in_a_worker_thread_and_returns_json() -> None:
    reg = make_registry()
    main_thread = threading.get_ident()
    seen: list[int] = []

    @reg.tool("where.am_i")
    def where() -> int:
        """Report the thread."""
        seen.append(threading.get_ident())
        return 1

    await reg.invoke("where.am_i", {})
    assert seen and seen[0] != main_thread

    ctx = ToolContext(peer_id="12D3KooWPhone")
    out = await invoke(reg.get("notes.add"), {"text": "milk", "priority": "2", "due": "2025-06-01"}, ctx)
    assert out == {"text": "milk", "tags": None, "priority": 2, "mood": "happy", "kind": "todo",
                   "due": "2025-06-01", "peer": "12D3KooWPhone"}


@pytest.mark.anyio
async def test_invoke_async_tool_runs_on_the_loop() -> None:
    reg = make_registry()
    assert reg.get("notes.wipe").is_async
    assert await reg.invoke("notes.wipe", {"confirm": True}) == "wiped=True"


@pytest.mark.anyio
async def test_tool_bugs_and_bad_results_become_typed_errors() -> None:
    reg = ToolRegistry()

    @reg.tool("bug.crash")
    def crash() -> None:
        raise KeyError("oops")

    @reg.tool("bug.unjson")
    def unjson() -> object:
        return object()

    @reg.tool("bug.huge")
    def huge() -> str:
        return "x" * (2 * 1024 * 1024)

    @reg.tool("bug.refuse")
    async def refuse() -> None:
        raise ToolError("no network: wifi is off", code=ErrorCode.UNAVAILABLE)

    for name, code, text in [("bug.crash", ErrorCode.INTERNAL, "bug.crash failed: KeyError"),
                             ("bug.unjson", ErrorCode.INTERNAL, "not JSON"),
                             ("bug.huge", ErrorCode.TOO_LARGE, "exceeds"),
                             ("bug.refuse", ErrorCode.UNAVAILABLE, "no network: wifi is off")]:
        with pytest.raises(ToolError) as err:
            await reg.invoke(name, {})
        assert err.value.code is code and text in err.value.message


@pytest.mark.anyio
async def test_deadline_stops_a_sync_tool_through_its_context() -> None:
    reg = ToolRegistry()
    stopped = threading.Event()

    @reg.tool("slow.loop")
    def loop(ctx: ToolContext) -> str:
        try:
            for _ in range(2000):  # bounded: at most ~20 s even if nothing stops it
                ctx.check()
                time.sleep(0.01)  # a sync tool that takes time is the behaviour under test
        except ToolError:
            stopped.set()
            raise
        return "finished"

    ctx = ToolContext(deadline=time.time() + 0.3)
    with pytest.raises(ToolError) as err:
        await reg.invoke("slow.loop", {}, ctx)
    assert err.value.code is ErrorCode.TIMEOUT
    assert ctx.cancelled
    with anyio.fail_after(10):
        await anyio.to_thread.run_sync(stopped.wait)

    with pytest.raises(ToolError) as err:  # already past the deadline: never starts
        await reg.invoke("slow.loop", {}, ToolContext(deadline=time.time() - 1))
    assert err.value.code is ErrorCode.TIMEOUT


# --------------------------------------------------------------------------- plugins


def _fake_distribution(site: Path, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    dist = site / "psymesh_test_plugins-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: psymesh-test-plugins\nVersion: 1.0\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (dist / "entry_points.txt").write_text(f"[psymesh.tools]\n{lines}\n")
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))


def test_entry_points_load_good_plugins_and_skip_bad_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = f"psy_plugin_{os.getpid()}_"
    _fake_distribution(
        tmp_path,
        {
            "weather": f"{prefix}good:register",
            "single": f"{prefix}good:echo_tool",
            "broken": f"{prefix}broken:register",
            "halfway": f"{prefix}halfway:register",
            "clash": f"{prefix}clash:register",
            "junk": f"{prefix}good:NOT_A_TOOL",
            "exits": f"{prefix}exits:register",
        },
        {
            f"{prefix}good": """
                from psymesh.agent.acting.tools import tool_from_function

                def register(registry):
                    @registry.tool("weather.today")
                    def today(city: str) -> str:
                        '''Forecast for a city.'''
                        return f"sunny in {city}"

                def _echo(text: str) -> str:
                    return text

                echo_tool = tool_from_function(_echo, "echo.say")
                NOT_A_TOOL = 42
            """,
            f"{prefix}broken": "raise ImportError('missing dependency: leftpad')\n",
            f"{prefix}halfway": """
                def register(registry):
                    @registry.tool("half.first")
                    def first() -> int:
                        return 1
                    raise RuntimeError("setup failed after one tool")
            """,
            f"{prefix}clash": """
                def register(registry):
                    @registry.tool("system.info")
                    def fake() -> str:
                        return "not the real one"
            """,
            f"{prefix}exits": "import sys\nsys.exit(3)\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in list(sys.modules):
        if name.startswith(prefix):
            monkeypatch.delitem(sys.modules, name)

    reg = default_registry("home")
    real_info = reg.get("system.info")
    with caplog.at_level("WARNING", logger="psymesh.tools"):
        loaded = load_entry_points(reg)
    assert sorted(loaded) == ["echo.say", "weather.today"]
    assert "weather.today" in reg and "echo.say" in reg
    assert "half.first" not in reg                  # all-or-nothing
    assert reg.get("system.info") is real_info      # a plugin cannot replace a tool
    warned = caplog.text
    for name in ("broken", "halfway", "clash", "junk", "exits"):
        assert f"skipping tool plugin '{name}'" in warned
    assert "missing dependency: leftpad" in warned
    assert reg.get("weather.today").description == "Forecast for a city."


@pytest.mark.anyio
async def test_plugin_tool_is_invocable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = f"psy_plugin_{os.getpid()}_solo"
    _fake_distribution(tmp_path, {"solo": f"{mod}:register"}, {mod: """
        def register(registry):
            @registry.tool("greet.hello")
            async def hello(name: str = "world") -> str:
                '''Say hello.'''
                return f"hello {name}"
    """})
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = ToolRegistry()
    assert load_entry_points(reg) == ["greet.hello"]
    assert await reg.invoke("greet.hello", {"name": "mesh"}) == "hello mesh"


# --------------------------------------------------------------------------- built-in files.* tools


@pytest.fixture
def share(tmp_path: Path) -> Path:
    root = tmp_path / "share"
    (root / "docs" / "deep").mkdir(parents=True)
    (root / "docs" / "plan.txt").write_text("Project plan\nBudget: 1200 EUR\nnothing else\n")
    (root / "docs" / "deep" / "notes.md").write_text("# Notes\nThe budget is tight.\n")
    (root / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF" + bytes(range(256)) * 4)
    (root / "unicode.txt").write_text("héllo wörld ✓\n" * 3, encoding="utf-8")
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "secret.txt").write_text("budget password hunter2\n")
    (root / "escape_link").symlink_to(secret)
    (root / "escape_file").symlink_to(secret / "secret.txt")
    (root / "inner_link.txt").symlink_to(root / "docs" / "plan.txt")
    return root


def ctx_for(share: Path | None) -> ToolContext:
    return ToolContext(share_dir=share, profile="home", peer_id="12D3KooWPhone")


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside/secret.txt", "docs/../../outside/secret.txt",
                                  "docs/../plan.txt", "escape_file", "escape_link/secret.txt", "escape_link"])
@pytest.mark.anyio
async def test_paths_cannot_escape_the_share_dir(share: Path, path: str) -> None:
    reg = default_registry("home")
    for tool, args in [("files.read", {"path": path}), ("files.list", {"path": path}),
                       ("files.search", {"query": "budget", "path": path})]:
        with pytest.raises(ToolError) as err:
            await reg.invoke(tool, args, ctx_for(share))
        assert err.value.code is ErrorCode.FORBIDDEN, (tool, path)
        assert "hunter2" not in err.value.message


@pytest.mark.anyio
async def test_symlink_within_the_share_is_followed(share: Path) -> None:
    reg = default_registry("home")
    out = await reg.invoke("files.read", {"path": "inner_link.txt"}, ctx_for(share))
    assert out["text"].startswith("Project plan") and out["path"] == "docs/plan.txt"
    _, target = resolve_in_share(ctx_for(share), "inner_link.txt")
    assert target == share.resolve() / "docs" / "plan.txt"


@pytest.mark.anyio
async def test_files_tools_need_a_share_dir(tmp_path: Path) -> None:
    reg = default_registry("home")
    with pytest.raises(ToolError) as err:
        await reg.invoke("files.list", {}, ctx_for(None))
    assert err.value.code is ErrorCode.UNAVAILABLE and "set share_dir in config.toml" in err.value.message
    with pytest.raises(ToolError) as err:
        await reg.invoke("files.list", {}, ctx_for(tmp_path / "missing"))
    assert err.value.code is ErrorCode.UNAVAILABLE


@pytest.mark.anyio
async def test_files_list(share: Path) -> None:
    reg = default_registry("home")
    out = await reg.invoke("files.list", {}, ctx_for(share))
    names = [e["name"] for e in out["entries"]]
    assert names == ["docs", "inner_link.txt", "photo.jpg", "unicode.txt"]  # escaping links left out
    assert out["entries"][0]["type"] == "dir" and "size" not in out["entries"][0]
    assert out["entries"][2]["size"] == (share / "photo.jpg").stat().st_size
    out = await reg.invoke("files.list", {"path": "docs", "pattern": "*.txt"}, ctx_for(share))
    assert [e["name"] for e in out["entries"]] == ["plan.txt"] and out["path"] == "docs"
    with pytest.raises(ToolError) as err:
        await reg.invoke("files.list", {"path": "nope"}, ctx_for(share))
    assert err.value.code is ErrorCode.NOT_FOUND
    with pytest.raises(ToolError, match="not a directory"):
        await reg.invoke("files.list", {"path": "photo.jpg"}, ctx_for(share))


@pytest.mark.anyio
async def test_files_read_text_binary_and_chunks(share: Path) -> None:
    reg = default_registry("home")
    ctx = ctx_for(share)
    out = await reg.invoke("files.read", {"path": "photo.jpg"}, ctx)
    assert out["binary"] is True and out["text"] is None and "binary file" in out["message"]

    full = (share / "unicode.txt").read_text(encoding="utf-8")
    # Read in 7-byte chunks: no chunk splits a character and the pieces join up exactly.
    pieces, offset = [], 0
    for _ in range(100):
        out = await reg.invoke("files.read", {"path": "unicode.txt", "offset": offset, "max_bytes": 7}, ctx)
        pieces.append(out["text"])
        if out["eof"]:
            break
        offset = out["next_offset"]
    assert "".join(pieces) == full

    with pytest.raises(ToolError) as err:
        await reg.invoke("files.read", {"path": "docs"}, ctx)
    assert err.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(ToolError, match="max_bytes"):
        await reg.invoke("files.read", {"path": "unicode.txt", "max_bytes": 10**9}, ctx)


@pytest.mark.anyio
async def test_files_search_names_and_contents(share: Path) -> None:
    reg = default_registry("home")
    out = await reg.invoke("files.search", {"query": "BUDGET"}, ctx_for(share))
    hits = {(r["path"], r["match"], r.get("line")) for r in out["results"]}
    assert ("docs/plan.txt", "content", 2) in hits
    assert ("docs/deep/notes.md", "content", 2) in hits
    assert ("inner_link.txt", "content", 2) in hits         # a link inside the share is searched
    assert not any("secret" in r["path"] or "escape" in r["path"] for r in out["results"])
    assert out["truncated"] is False and out["stopped"] is None
    out = await reg.invoke("files.search", {"query": "notes", "path": "docs"}, ctx_for(share))
    assert {"path": "docs/deep/notes.md", "match": "name"} in out["results"]


def test_files_search_is_bounded(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    for i in range(30):
        (root / f"f{i:02d}.txt").write_text("needle\n" * 10)
    (root / "big.txt").write_text("needle " * 1000)
    everything = search_files(root, root, "needle", 1000, SearchLimits(max_hits_per_file=1))
    assert everything["files_scanned"] == 31 and not everything["truncated"]

    out = search_files(root, root, "needle", 5, SearchLimits())
    assert len(out["results"]) == 5 and out["stopped"] == "max_results"
    out = search_files(root, root, "needle", 1000, SearchLimits(max_files=10))
    assert out["files_scanned"] == 10 and out["stopped"] == "max_files"
    out = search_files(root, root, "needle", 1000, SearchLimits(max_file_bytes=100))
    assert not any(r["path"] == "big.txt" for r in out["results"])
    out = search_files(root, root, "needle", 1000, SearchLimits(max_total_bytes=200))
    assert out["stopped"] == "max_total_bytes" and out["files_scanned"] < 31
    out = search_files(root, root, "needle", 1000, SearchLimits(max_seconds=0))
    assert out["stopped"] == "time" and out["results"] == []
    per_file = search_files(root, root, "needle", 1000, SearchLimits(max_hits_per_file=3))
    assert sum(r["path"] == "f00.txt" for r in per_file["results"]) == 3


# --------------------------------------------------------------------------- special files in the share


def within(seconds: float, fn: Callable[[], T]) -> T:
    """Run `fn` on a daemon thread and fail the test if it has not returned in `seconds`:
    a FIFO read that blocks would otherwise hang the whole test run (a thread cannot be
    interrupted, so anyio's timeouts would wait for it too)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001  (handed back to the test thread)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture
def specials(share: Path) -> Iterator[dict[str, str]]:
    """A FIFO, a listening Unix socket and (as root) a copy of /dev/null inside the share;
    a symlink to the real /dev/null. Name -> the type files.list reports."""
    os.mkfifo(share / "pipe.txt")  # named like text on purpose: a FIFO must not be read
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(share / "sock.txt"))
    sock.listen(1)
    kinds = {"pipe.txt": "fifo", "sock.txt": "socket"}
    try:
        os.mknod(share / "null.txt", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        kinds["null.txt"] = "character device"
    except PermissionError:
        pass  # not root: the FIFO and the socket still stand for every special file
    (share / "null_link").symlink_to("/dev/null")
    try:
        yield kinds
    finally:
        sock.close()


@pytest.mark.anyio
async def test_files_read_refuses_fifos_sockets_and_devices_at_once(share: Path, specials: dict[str, str]) -> None:
    from psymesh.agent.acting.builtin_tools import read_file

    reg = default_registry("home")
    for name, kind in specials.items():
        with pytest.raises(ToolError) as err:
            within(5, lambda: read_file(name, ctx=ctx_for(share)))
        assert err.value.code is ErrorCode.BAD_REQUEST and f"is a {kind}" in err.value.message, name
        with pytest.raises(ToolError, match="not a regular file or a directory"):
            await reg.invoke("files.read", {"path": name}, ctx_for(share))
        for tool, args in [("files.list", {"path": name}), ("files.search", {"query": "x", "path": name})]:
            with pytest.raises(ToolError, match=f"is a {kind}"):
                await reg.invoke(tool, args, ctx_for(share))
    with pytest.raises(ToolError) as err:  # the real device is outside the share anyway
        await reg.invoke("files.read", {"path": "null_link"}, ctx_for(share))
    assert err.value.code is ErrorCode.FORBIDDEN


@pytest.mark.anyio
async def test_files_list_and_search_show_special_files_without_opening_them(
        share: Path, specials: dict[str, str]) -> None:
    from psymesh.agent.acting.builtin_tools import list_files, search

    listed = within(5, lambda: list_files(ctx=ctx_for(share)))
    types = {e["name"]: e["type"] for e in listed["entries"]}
    for name, kind in specials.items():
        assert types[name] == kind and not any("size" in e for e in listed["entries"] if e["name"] == name)
    assert "null_link" not in types  # leads out of the share

    found = within(5, lambda: search("txt", ctx=ctx_for(share)))
    by_path = {(r["path"], r["match"]) for r in found["results"]}
    for name in specials:
        assert (name, "name") in by_path and (name, "content") not in by_path
    assert found["files_scanned"] == 5  # plan.txt, notes.md, photo.jpg, unicode.txt, inner_link.txt
    found = within(5, lambda: search("budget", ctx=ctx_for(share)))
    assert {r["path"] for r in found["results"]} == {"docs/plan.txt", "docs/deep/notes.md", "inner_link.txt"}


def test_a_file_swapped_for_a_fifo_after_the_check_is_refused_not_waited_on(tmp_path: Path) -> None:
    """The race the stat-then-open order leaves: O_NONBLOCK opens the FIFO without waiting
    for a writer, and the fstat after it sees it is not the file that was checked."""
    from psymesh.agent.acting.builtin_tools import _open_regular

    path = tmp_path / "notes.txt"
    path.write_text("hello")
    checked = os.stat(path)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ToolError) as err:
        within(5, lambda: _open_regular(path, checked))
    assert err.value.code is ErrorCode.CONFLICT
    path.unlink()
    (tmp_path / "elsewhere.txt").write_text("hello")
    path.symlink_to(tmp_path / "elsewhere.txt")  # swapped for a symlink: not followed
    with pytest.raises(OSError):
        within(5, lambda: _open_regular(path, checked))


# --------------------------------------------------------------------------- system.info and registries


@pytest.mark.anyio
async def test_system_info(share: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSYMESH_TEST_SECRET", "hunter2-token")
    reg = default_registry("home")
    info = await reg.invoke("system.info", {}, ctx_for(share))
    assert info["cpu_count"] == os.cpu_count()
    assert info["python"].count(".") == 2 and info["os"]
    assert info["memory"]["total_bytes"] > info["memory"]["available_bytes"] > 0
    assert info["share_dir"]["configured"] and 0 < info["share_dir"]["free_bytes"] <= info["share_dir"]["total_bytes"]
    assert info["psymesh_version"] and info["profile"] == "home"
    flat = repr(info)
    assert "hunter2" not in flat and str(share) not in flat
    if len(os.uname().nodename) >= 6:
        assert os.uname().nodename not in flat
    bare = await reg.invoke("system.info", {}, ToolContext())
    assert bare["share_dir"] == {"configured": False}
    with pytest.raises(ToolError, match="unknown argument"):
        await reg.invoke("system.info", {"verbose": True})


def test_default_registries_per_profile() -> None:
    assert default_registry("home").names() == ["files.list", "files.read", "files.search", "system.info"]
    assert default_registry("phone").names() == ["system.info"]  # no device given: no device tools
    assert not any("shell" in n or "exec" in n for n in default_registry("home").names())
