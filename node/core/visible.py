"""Text a peer wrote, made safe to print on a terminal or in a log line: every character that
would act instead of show is written out as its escape, visibly.

A letter, a thread or peer name, a task's result or error, an answer, an audit reason, a web
page's text: any of it may hold an ESC sequence (clear the screen, recolour, set the window
title, a hyperlink), a carriage return (overwrite what the line said so far), a newline (one
letter printed as two, the second looking like another letter) or a bidi control (text shown
in another order than it reads). `visible` shows them as `\\x1b`, `\\r`, `\\n`, `\\u202e` ...:

- C0 controls U+0000-U+001F (tab and newline included), DEL U+007F, C1 controls U+0080-U+009F
  (U+009B is a one-byte CSI on some terminals);
- the bidi controls (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), the line and
  paragraph separators U+2028 and U+2029, and lone surrogates (which stdout cannot encode).

`lines=True` is for one document printed alone (an answer, a fetched page, streamed tokens): its
line feeds and tabs stay as they are (a CRLF is a line feed), everything else is shown as above.
Anything shown in a list, a table, an error or a log line is one line: `lines=False`.

The CLI prints through node/cli/output.py's `escape` (this, then rich's markup escape); the
daemon's human log lines through node/core/logs.py. JSON output needs none of it: json.dumps
writes every control character as an escape.
"""
from __future__ import annotations

import re

_ACTS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_KEPT_IN_LINES = frozenset("\n\t")


def _written_out(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    point = ord(char)
    return f"\\x{point:02x}" if point < 0x100 else f"\\u{point:04x}"


def _shown(match: re.Match[str]) -> str:
    return _written_out(match.group())


def _shown_in_lines(match: re.Match[str]) -> str:
    char = match.group()
    return char if char in _KEPT_IN_LINES else _written_out(char)


def visible(text: str, *, lines: bool = False) -> str:
    """`text` with every character that would act on a terminal written out as its escape."""
    if lines:
        return _ACTS.sub(_shown_in_lines, text.replace("\r\n", "\n"))
    return _ACTS.sub(_shown, text)
