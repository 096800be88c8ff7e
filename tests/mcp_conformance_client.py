"""The node's MCP client, as the MCP conformance suite runs a client: `python
tests/mcp_conformance_client.py URL` (the suite appends the URL of its scenario's server and
names the scenario in MCP_CONFORMANCE_SCENARIO; MCP_CONFORMANCE_CONTEXT may list the tool
calls to make).

What runs is the daemon's own mount (node/bridges/mcp.py McpServer, on trio, through the
official `mcp` SDK): it connects, lists the tools, publishes those it can offer, and each
call goes through ToolRegistry.invoke (McpTool.validate, then McpServer.call), as a peer's
tool task's does. The
calls: the context's, else each offered tool once, its required arguments made from its
schema. Exit 0 once the calls were made (a tool's refusal is the server's answer, printed).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

from psymesh.agent.acting.tools import ToolError, ToolRegistry
from psymesh.node.bridges.mcp import McpServer, McpTool
from psymesh.node.core.bridgeconfig import McpServerConfig

SAMPLES: dict[str, Any] = {"number": 2, "integer": 3, "string": "x", "boolean": True, "array": [], "object": {}}


def sample_arguments(tool: McpTool) -> dict[str, Any]:
    props = tool.input_schema.get("properties", {})
    required = tool.input_schema.get("required", [])
    return {name: SAMPLES.get(str(props.get(name, {}).get("type")), "x") for name in required}


async def main(url: str) -> int:
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    registry = ToolRegistry()
    server = McpServer(McpServerConfig(name="conf", url=url, call_timeout_s=20, restart_min_s=30),
                       registry, Path(tempfile.gettempdir()))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run)
        with anyio.fail_after(25):
            await server.settled.wait()
        print("up" if server.up else f"down: {server.problem}", sorted(server.tools), flush=True)
        by_remote = {t.remote_name: t for t in server.tools.values()}
        calls = [(c["name"], c.get("arguments", {})) for c in context.get("toolCalls", [])] or \
                [(remote, sample_arguments(tool)) for remote, tool in sorted(by_remote.items())]
        for remote, arguments in calls:
            tool = by_remote.get(remote)
            try:
                if tool is None:
                    raise ToolError(f"{remote} is not offered here")
                result = await registry.invoke(tool.name, arguments)  # validated, then called, as a task's
                print(remote, "->", json.dumps(result)[:300], flush=True)
            except ToolError as exc:
                print(remote, "refused:", exc, flush=True)
        tg.cancel_scope.cancel()
    return 0 if server.tools or not calls else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main, sys.argv[1], backend="trio"))
