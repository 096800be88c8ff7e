"""node/core/redact.py: this machine's paths are taken out of what a peer is told, as whole paths."""
from __future__ import annotations

from pathlib import Path

from psymesh.node.core.redact import Redactor
from psymesh.protocol.errors import ErrorCode, PsymeshError


def test_paths_are_replaced_as_whole_paths_longest_first_at_any_depth() -> None:
    r = Redactor([(Path("/home/ana"), "~"), (Path("/home/ana/.psymesh"), "<node home>")])
    assert r.text("cannot read '/home/ana/.psymesh/keys/x': denied") == "cannot read '<node home>/keys/x': denied"
    assert r.text("/home/ana and /home/anabel/x and /home/ana/") == "~ and /home/anabel/x and ~/"
    assert r.data({"a": ["/home/ana/n.txt", 3, None], "/home/ana": {"b": ("/home/ana",)}}) == {
        "a": ["~/n.txt", 3, None], "~": {"b": ("~",)}}
    error = PsymeshError("no /home/ana/.psymesh/m.gguf", code=ErrorCode.NOT_FOUND, retry_after=1.0)
    said = r.error(error)
    assert (said.message, said.code, said.retry_after) == ("no <node home>/m.gguf", ErrorCode.NOT_FOUND, 1.0)
    plain = PsymeshError("nothing here", code=ErrorCode.BUSY)
    assert r.error(plain) is plain


def test_a_root_home_is_never_redacted_from_every_path() -> None:
    assert Redactor([(Path("/"), "~")]).text("/etc/hosts") == "/etc/hosts"
