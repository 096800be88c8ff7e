"""The official `openai` Python client, pointed at a psymesh node: an app written for
OpenAI's API runs on your own models, and on your paired home PC's, unchanged.

    psymesh model add botpsy ~/models/botpsy.gguf
    psymesh serve openai                                  # in another terminal (makes its key)
    export OPENAI_API_KEY=$(psymesh serve openai --show-key)
    python examples/openai_client.py                      # the first model the endpoint lists
    python examples/openai_client.py --model home/botpsy  # the paired home's model

It lists the models, asks for a completion, streams one, and asks for a tool call
(`tool_choice="required"`: decoding is constrained, so the call is well formed) and
sends the tool's result back for the final answer. A refusal (a model the home has not
granted, a wrong key) is one line and exit status 1, as the endpoint said it.
"""
from __future__ import annotations

import argparse
import json
import os

import sys

from openai import APIConnectionError, APIStatusError, OpenAI

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                       "required": ["city"]},
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--model", default=None,
                        help="a model of the node, or PEER/MODEL (default: the first GET /v1/models lists)")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    # The key: $OPENAI_API_KEY, as for OpenAI itself (the endpoint always asks for one).
    key = os.environ.get("OPENAI_API_KEY")
    if not key:
        parser.exit(1, "set OPENAI_API_KEY to the endpoint's key: psymesh serve openai --show-key prints it\n")
    client = OpenAI(base_url=args.base_url, api_key=key)
    try:
        run(client, args.model, args.max_tokens)
    except APIStatusError as exc:  # the endpoint's own words: {"error": {"message", ...}}
        body = exc.body if isinstance(exc.body, dict) else {}
        sys.exit(f"error {exc.status_code}: {body.get('message') or exc.message}")
    except APIConnectionError as exc:
        sys.exit(f"cannot reach {args.base_url} ({exc.__cause__ or exc}); is `psymesh serve openai` running?")


def run(client: OpenAI, model: str | None, max_tokens: int) -> None:
    # ban_bytes is a psymesh extension for random-weight test models (ASCII only); harmless otherwise.
    extra = {"ban_bytes": True}

    models = [m.id for m in client.models.list()]
    print("models:", ", ".join(models) or "none")
    if model is None:
        if not models:
            sys.exit("the endpoint lists no model: add one (psymesh model add NAME PATH.gguf), or pair with a "
                     "home whose grant to this node covers task.infer")
        model = models[0]
        print(f"model: {model} (the first listed; --model picks another)")

    question = [{"role": "user", "content": "Say hello in five words."}]
    reply = client.chat.completions.create(model=model, messages=question, max_tokens=max_tokens,
                                           extra_body=extra)
    print("answer:", repr(reply.choices[0].message.content))
    print("finish_reason:", reply.choices[0].finish_reason, "usage:", reply.usage.model_dump(exclude_none=True))

    print("streamed: ", end="", flush=True)
    for chunk in client.chat.completions.create(model=model, messages=question, max_tokens=max_tokens,
                                                stream=True, extra_body=extra):
        if chunk.choices and chunk.choices[0].delta.content:
            print(repr(chunk.choices[0].delta.content), end=" ", flush=True)
    print()

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    asked = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                           tool_choice="required", max_tokens=400, extra_body=extra)
    call = asked.choices[0].message.tool_calls[0]
    print("tool call:", call.function.name, json.loads(call.function.arguments))
    # Run the tool (here: made up), hand its result back, get the final answer.
    messages += [asked.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                           max_tokens=max_tokens, extra_body=extra)
    print("final:", repr(final.choices[0].message.content))


if __name__ == "__main__":
    main()
