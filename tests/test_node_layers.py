"""node/'s subpackages import in one direction only, as protocol/'s do (tests/test_protocol_core.py).

Each subpackage's __init__ docstring says what it may import; this test holds them to it. An import
under `if TYPE_CHECKING:` counts too: a type is a dependency a reader has to follow.
"""
from __future__ import annotations

import ast
from pathlib import Path

NODE = Path(__file__).resolve().parent.parent / "node"

# who may import whom (besides itself, protocol/, agent/ and discovery/)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "net": {"core"},
    "door": {"core", "net"},
    "reach": {"core", "net", "door"},
    "models": {"core"},
    "tasks": {"core", "net", "door", "models"},
    "messaging": {"core", "net", "door", "models"},
    "web": {"core", "net", "door"},
    "bridges": {"core", "net", "door", "models", "tasks"},
    "control": {"core", "net", "door", "reach", "models", "tasks", "messaging", "web", "bridges"},
    "cli": {"core", "net", "door", "reach", "models", "tasks", "messaging", "web", "bridges", "control", "daemon"},
    "daemon": {"core", "net", "door", "reach", "models", "tasks", "messaging", "web", "bridges", "control"},
}


def _room(path: Path) -> str:
    rel = path.relative_to(NODE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, the psymesh.node room imported) for every import in the file, relative or absolute."""
    tree = ast.parse(path.read_text())
    pkg = ["psymesh", "node", *path.relative_to(NODE).parent.parts]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            names = [a.name for a in node.names]
            if target[:2] == ["psymesh", "node"]:
                if len(target) > 2:
                    out.append((node.lineno, target[2]))
                else:
                    out.extend((node.lineno, n) for n in names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[:2] == ["psymesh", "node"] and len(parts) > 2:
                    out.append((node.lineno, parts[2]))
    return out


def test_top_level_holds_only_the_root_and_rooms():
    loose = sorted(p.name for p in NODE.glob("*.py") if p.name not in ("__init__.py", "daemon.py"))
    assert loose == []
    for room in ALLOWED:
        if room != "daemon":
            init = NODE / room / "__init__.py"
            assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), f"{room}/ says what lives there"


def test_imports_point_down_only():
    wrong = []
    for path in sorted(NODE.rglob("*.py")):
        room = _room(path)
        if room == "__init__":
            continue
        for line, target in _imports(path):
            if target != room and target not in ALLOWED[room]:
                wrong.append(f"{path.relative_to(NODE.parent)}:{line} ({room} -> {target})")
    assert wrong == []
