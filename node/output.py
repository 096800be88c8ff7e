"""CLI output: data to stdout (JSON with --json, rich tables otherwise); everything else to stderr.

Scripts can always parse stdout of a `--json` command: it holds exactly one JSON
document (an object, a list — `[]` when empty — or {"error": {...}} on failure).
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from psymesh.protocol.errors import PsymeshError


def to_data(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, list):
        return [to_data(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj


class Output:
    def __init__(self, json_mode: bool = False) -> None:
        self.json_mode = json_mode
        self.out = Console(highlight=False, soft_wrap=True)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)

    def data(self, obj: Any, human: Callable[[Console], None] | None = None) -> None:
        if self.json_mode or human is None:
            sys.stdout.write(json.dumps(to_data(obj), indent=None if self.json_mode else 2) + "\n")
            sys.stdout.flush()
        else:
            human(self.out)

    def hint(self, message: str) -> None:
        self.err.print(f"[dim]{escape(message)}[/dim]")

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {escape(message)}")

    def error(self, exc: PsymeshError) -> None:
        if self.json_mode:
            self.data({"error": {"code": exc.code.value, "message": exc.message}})
        code = escape(f"[{exc.code.value}]")
        self.err.print(f"[red]error[/red] {code}: {escape(exc.message)}")
