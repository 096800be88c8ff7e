"""Task ids: made by whoever submits a task (the CLI and SDK, the OpenAI bridge, the dashboard)."""
from __future__ import annotations

import secrets
import time


def new_task_id() -> str:
    """Time-ordered and unique: sorts like creation order in listings."""
    return f"t{time.time_ns():x}-{secrets.token_hex(4)}"
