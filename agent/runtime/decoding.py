"""Reading the generated text as it streams: stop strings held back until they cannot start, the
ThinkBudget's thought and the StopAfter marker count, and whether bytes are valid UTF-8.

Pure Python over text and bytes; agent/runtime/worker.py feeds it each decoded piece.
"""
from __future__ import annotations

from collections.abc import Sequence

from .api import StopAfter, ThinkBudget


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")  # strict: no surrogates, nothing above U+10FFFF, no overlongs
    except UnicodeDecodeError:
        return False
    return True


class StopScanner:
    """Streams text while holding back any tail that could start a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:k]):
                    keep = k
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Watch:
    """The generated text so far, and the two rules that read it as it grows: when a
    thought closed (for the ThinkBudget) and when the StopAfter marker count is reached."""

    def __init__(self, budget: ThinkBudget | None, stop_after: StopAfter | None) -> None:
        self.text = ""
        self.budget = budget
        self.close_marker = budget.close.strip() if budget else ""
        self.thinking = budget is not None
        self.think_tokens = 0
        self.stop_after = stop_after
        self.count_from = 0 if stop_after is not None and stop_after.after is None else -1
        self.seen = 0      # markers counted so far
        self.scanned = 0   # text before this index is counted

    def add(self, piece: str, *, sampled: bool) -> bool:
        """Take the next token's text; True when the StopAfter rule ends the generation here."""
        self.text += piece
        if self.thinking:
            if self.close_marker in self.text:
                self.thinking = False
            elif sampled:
                self.think_tokens += 1
        rule = self.stop_after
        if rule is None:
            return False
        if self.count_from < 0:
            at = self.text.find(rule.after or "")
            if at < 0:
                return False
            self.count_from = self.scanned = at + len(rule.after or "")
        while (at := self.text.find(rule.marker, max(self.scanned, self.count_from))) >= 0:
            self.seen += 1
            self.scanned = at + len(rule.marker)
        return self.seen >= rule.count

    def over_budget(self) -> bool:
        return self.budget is not None and self.thinking and self.think_tokens >= self.budget.tokens

    def closing_text(self) -> str:
        """The budget's close, without a leading newline the thought already ends with."""
        assert self.budget is not None
        close = self.budget.close
        return close[1:] if close.startswith("\n") and self.text.endswith("\n") else close
