"""A small MCP server (the official `mcp` SDK) to mount on a psymesh node: read-only
access to the notes in one directory.

Mount it on your home PC by adding to its config.toml, then restart the daemon:

    [[mcp]]
    name = "notes"
    command = ["python", "/path/to/examples/mcp_server.py", "/home/me/notes"]

Its tools join the node's as `mcp.notes.list_notes`, `mcp.notes.read_note` and
`mcp.notes.count_words`. Grant them to your phone (the door checks the grant on every
call), and call one from it:

    psymesh grant phone task.agent "tool:mcp.notes.*"                     # on the home PC
    psymesh task send --to home --tool mcp.notes.list_notes --wait         # on the phone

Each tool is annotated read-only, so an agent on the home PC calls it without asking
first (an unannotated MCP tool counts as irreversible). What it returns reaches the
caller marked `"untrusted": true`: it is file content, not instructions.

    python examples/mcp_server.py DIR                          # stdio (what [[mcp]] command runs)
    python examples/mcp_server.py DIR --http --port 8000       # streamable HTTP: [[mcp]] url = "http://127.0.0.1:8000/mcp"
"""
from __future__ import annotations

import argparse
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False)
MAX_CHARS = 20_000


def build(root: Path) -> MCPServer:
    server = MCPServer("notes")
    root = root.resolve()

    def inside(name: str) -> Path:
        path = (root / name).resolve()
        if root not in path.parents or not path.is_file():
            raise ValueError(f"no note named {name!r}")
        return path

    @server.tool(annotations=READ_ONLY)
    def list_notes() -> list[str]:
        """List the notes (file names) in the notes directory."""
        return sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.startswith("."))

    @server.tool(annotations=READ_ONLY)
    def read_note(name: str) -> str:
        """Read one note by its file name."""
        return inside(name).read_text(errors="replace")[:MAX_CHARS]

    @server.tool(name="countWords", annotations=READ_ONLY)
    def count_words(text: str) -> int:
        """Count the words in a text."""
        return len(text.split())

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve a notes directory over MCP (read-only).")
    parser.add_argument("root", type=Path, help="the notes directory")
    parser.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    server = build(args.root)
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
