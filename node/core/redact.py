"""This machine's own paths, taken out of what the node tells a peer.

An error a tool or a library raises often names a file (`[Errno 13] Permission denied:
'/home/ana/.psymesh/share/x'`), and an agent repeats what its tools said. Said to a peer, that
tells it the owner's user name and where the node keeps its keys. Everything the node sends a
peer that it did not take from that peer is passed through one `Redactor` first: task events
(node/tasks/executor.py), the answers to asks (node/messaging/answering.py) and the `error` of a
refused or failed request (the daemon's door). The node's home directory becomes `<node home>`,
the user's home directory `~`; the local log keeps the paths (the owner may read them).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from ...protocol.errors import PsymeshError

NODE_HOME = "<node home>"
USER_HOME = "~"
T = TypeVar("T")
_END = r"(?![^/\\\s'\"`:;,)\]}>])"  # a whole path component ends here: /home/ana, never /home/anabel


class Redactor:
    """Replaces each of `paths` (path -> what it reads as) wherever it appears in text,
    longest first, as a whole path (`/home/ana` in `/home/ana/x`, not in `/home/anabel`)."""

    def __init__(self, paths: Iterable[tuple[Path | str, str]] = ()) -> None:
        spelled: dict[str, str] = {}
        for path, placeholder in paths:
            for form in {str(path), str(Path(path).expanduser().resolve(strict=False))}:
                form = form.rstrip("/")
                if len(form) > 1 and form not in spelled:  # never "/" (a root home): it is in every path
                    spelled[form] = placeholder
        self._subs = sorted(spelled.items(), key=lambda item: -len(item[0]))
        self._pattern = re.compile("|".join(f"(?:{re.escape(form)}){_END}" for form, _ in self._subs)) \
            if self._subs else None
        self._by_form = dict(self._subs)

    @classmethod
    def for_node(cls, node_home: Path) -> "Redactor":
        return cls([(node_home, NODE_HOME), (Path.home(), USER_HOME)])

    def text(self, text: str) -> str:
        if self._pattern is None or not text:
            return text
        return self._pattern.sub(lambda m: self._by_form[m.group(0)], text)

    def data(self, value: T) -> T:
        """`value` with every string in it (map keys too, at any depth) redacted."""
        if isinstance(value, str):
            return self.text(value)  # type: ignore[return-value]
        if isinstance(value, dict):
            return {self.data(k): self.data(v) for k, v in value.items()}  # type: ignore[return-value]
        if isinstance(value, (list, tuple)):
            return type(value)(self.data(v) for v in value)  # type: ignore[return-value]
        return value

    def error(self, exc: PsymeshError) -> PsymeshError:
        """`exc` with its message and details redacted (the same object when nothing changes)."""
        message, details = self.text(exc.message), self.data(exc.details)
        if message == exc.message and details == exc.details:
            return exc
        return PsymeshError(message, code=exc.code, retry_after=exc.retry_after, details=details)
