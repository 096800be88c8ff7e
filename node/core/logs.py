"""Daemon logging: human lines by default, one JSON object per line with --log-json.

To stderr, where a terminal, journald (systemd) or a test's log file takes it; or, with
`--log-file`, to a file rotated by size (5 MiB, 3 old ones kept): for service managers
that keep stderr in a file that only grows (launchd) or nowhere (Termux:Boot).

A human line is one line: a peer's name or text in a message is shown with its control
characters escaped (node/core/visible.py), so it can neither forge a log line nor act on the
terminal reading the log; a traceback follows on lines of its own.
"""
from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path

from .visible import visible

LOG_FILE_BYTES = 5 * 1024 * 1024
LOG_FILE_KEEP = 3


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class HumanFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, "fields", {})
        extra = "".join(f" {k}={visible(str(v))}" for k, v in fields.items())
        line = f"{ts} {record.levelname:<5} {record.name}: {visible(record.getMessage())}{extra}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(*, json_lines: bool = False, level: int = logging.INFO, log_file: Path | None = None) -> None:
    handler: logging.Handler = (logging.handlers.RotatingFileHandler(log_file, maxBytes=LOG_FILE_BYTES,
                                                                     backupCount=LOG_FILE_KEEP)
                                if log_file is not None else logging.StreamHandler(sys.stderr))
    handler.setFormatter(JsonFormatter() if json_lines else HumanFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # libraries stay quiet unless something is wrong
    # libp2p 0.8.1 logs expected events (a dial that failed, identify racing a disconnect) at
    # ERROR with multi-line dumps; node/net/ reports what matters as psymesh errors.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    logging.getLogger("psymesh").setLevel(level)


def fields(**kw: object) -> dict[str, dict[str, object]]:
    """`log.info("paired", extra=fields(peer=pid))` — structured fields for both formats."""
    return {"fields": kw}
