"""Delegate work from a script to your home PC, through your own (running, paired) phone node.

    psymesh model add botpsy ~/models/botpsy.gguf --home ~/home    # on the home PC, once
    python examples/delegate_from_script.py --home ~/phone
    python examples/delegate_from_script.py --home ~/phone --model botpsy --prompt "Plan my week."

It hands the home PC two tasks, a tool call (`system.info`) and a chat completion,
and prints their events as they arrive. Tasks are durable: if this script, the phone
node or the home PC stops midway, the work is still done, and
`--resume TASK_ID` picks the task up again from its first event.

Plain asyncio: the SDK runs under asyncio or trio alike.
"""
from __future__ import annotations

import argparse
import asyncio
from typing import Any

import psymesh
from psymesh.node.control.client import TaskHandle
from psymesh.protocol.errors import PsymeshError
from psymesh.protocol.tasks import EventKind, InferResult


async def follow(task: TaskHandle[Any]) -> None:
    """Print a task's events as they come, then its result (or why it failed)."""
    print(f"task {task.id} -> {task.target_name or 'its target'}")
    async for ev in task.events():
        if ev.kind is EventKind.TOKEN:
            print(ev.data["text"], end="", flush=True)  # streamed model output
        elif ev.kind is EventKind.REQUEUED:
            print(f"\n  [{ev.seq}] the home PC restarted; the task runs again from the start")
        elif not ev.state.terminal:
            print(f"  [{ev.seq}] {ev.kind.value}: {ev.state.value}")
    try:
        result = await task.result()
    except PsymeshError as exc:  # a RemoteError with a stable code: canceled, timeout, forbidden ...
        print(f"\n  failed ({exc.code.value}): {exc.message}")
        return
    if isinstance(result, InferResult):  # typed by the task's kind (a tool task's: the tool's own output)
        print(f"\n  done: {len(result.text)} characters, {result.usage.completion_tokens} tokens ({result.finish_reason})")
    else:
        print(f"  result: {result}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", required=True, help="your phone node's home directory")
    ap.add_argument("--to", default=None, help="paired node (name or peer id); default: the best one")
    ap.add_argument("--model", default="botpsy", help="model name registered on the home PC")
    ap.add_argument("--prompt", default="In one sentence: why delegate heavy work to a home PC?")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--resume", metavar="TASK_ID", help="follow a task delegated earlier instead")
    args = ap.parse_args()

    async with psymesh.Client(home=args.home) as node:
        if args.resume:
            await follow(node.task(args.resume))
            return
        info = await node.delegate(args.to, tool="system.info", deadline_s=30)  # fails if not done 30 s after home took it
        await follow(info)
        chat = await node.delegate(args.to, infer=args.prompt, model=args.model, max_tokens=args.max_tokens,
                                   params={"temperature": 0.7})
        await follow(chat)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except PsymeshError as exc:  # e.g. the node is not running, or no paired node offers the task
        raise SystemExit(f"psymesh: {exc}") from None
    except KeyboardInterrupt:
        raise SystemExit("stopped (the tasks carry on; see: psymesh task list)") from None
