"""Talk to a psymesh node's agent with the official A2A client (a2a-sdk).

    psymesh serve a2a                                     # on the node (makes its key)
    export A2A_API_KEY=$(psymesh serve a2a --show-key)    # the key: from the environment, not argv
    python examples/a2a_client.py http://127.0.0.1:8081 "What is on this machine?"

It fetches the agent card (public), then sends the goal twice: once as one request
that returns the finished task, once streamed, printing each status update as it
comes (working, the tool calls, completed) and the answer artifact. Prints one JSON
object per line, so scripts (and tests/test_a2a.py) can read it.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

import httpx
from a2a.client import A2ACardResolver, ClientConfig, create_client
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import A2AError


def _message(text: str) -> a2a.SendMessageRequest:
    return a2a.SendMessageRequest(message=a2a.Message(
        role=a2a.ROLE_USER, message_id=str(uuid.uuid4()), parts=[a2a.Part(text=text)]))


def _answer(task: a2a.Task) -> str:
    return "".join(part.text for artifact in task.artifacts for part in artifact.parts)


async def main(url: str, key: str, goal: str) -> bool:
    """Send `goal` twice (whole, then streamed); False if the agent's task did not complete."""
    # The key goes on every request; the card does not need it, the JSON-RPC calls do (and
    # the A2A-Version header, which the SDK's client adds).
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        card = await A2ACardResolver(http, url).get_agent_card()
        print(json.dumps({"card": card.name, "skills": [s.name for s in card.skills],
                          "security": list(card.security_schemes)}), flush=True)

        whole = await create_client(card, client_config=ClientConfig(httpx_client=http, streaming=False))
        async for response in whole.send_message(_message(goal)):
            task = response.task
            print(json.dumps({"task": task.id, "state": a2a.TaskState.Name(task.status.state),
                              "answer": _answer(task)}), flush=True)
            if task.status.state != a2a.TASK_STATE_COMPLETED:  # failed, rejected, ...: say why, exit 1
                why = "".join(p.text for p in task.status.message.parts)
                print(f"error: the task ended {a2a.TaskState.Name(task.status.state)}: {why}", file=sys.stderr)
                return False

        streamed = await create_client(card, client_config=ClientConfig(httpx_client=http, streaming=True))
        async for response in streamed.send_message(_message(goal)):
            if response.HasField("status_update"):
                status = response.status_update.status
                print(json.dumps({"status": a2a.TaskState.Name(status.state),
                                  "text": "".join(p.text for p in status.message.parts)}), flush=True)
            elif response.HasField("artifact_update"):
                print(json.dumps({"artifact": "".join(p.text for p in response.artifact_update.artifact.parts)}),
                      flush=True)
    return True


if __name__ == "__main__":
    if len(sys.argv) != 3 or not os.environ.get("A2A_API_KEY"):
        sys.exit(__doc__)
    try:
        if not asyncio.run(main(sys.argv[1], os.environ["A2A_API_KEY"], sys.argv[2])):
            sys.exit(1)
    except (A2AError, httpx.HTTPError) as exc:  # one line, not a traceback: a wrong key is a 401
        text = str(exc) or type(exc).__name__
        hint = " (wrong or missing key? psymesh serve a2a --show-key prints it)" if "401" in text else ""
        sys.exit(f"error: {text}{hint}")
