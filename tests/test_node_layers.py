"""node/'s and agent/'s subpackages import in one direction only, as protocol/'s do
(tests/test_protocol_core.py).

Each subpackage's __init__ docstring says what it may import; this test holds them to it. An import
under `if TYPE_CHECKING:` or inside a function counts too: a type is a dependency a reader has to
follow, and a deferred import is how a cycle hides.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE = ROOT / "node"
AGENT = ROOT / "agent"

# who may import whom (besides itself, protocol/, agent/ and discovery/)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "net": {"core"},
    "door": {"core", "net"},
    "reach": {"core", "net", "door"},
    "models": {"core"},
    "compute": {"core", "net", "door"},
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


def _module_imports(path: Path) -> list[tuple[int, list[str], list[str]]]:
    """(line, the module imported as a dotted list, the names taken from it) for every import
    in a file of ours, relative imports resolved."""
    rel = path.relative_to(ROOT)
    pkg = ["psymesh", *rel.parent.parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            out.append((node.lineno, target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name.split("."), []) for a in node.names)
    return out


def _imports(path: Path, package: str = "node") -> list[tuple[int, str]]:
    """(line, the psymesh.<package> room imported) for every import in the file, relative or absolute."""
    out = []
    for line, target, names in _module_imports(path):
        if target[:2] == ["psymesh", package]:
            if len(target) > 2:
                out.append((line, target[2]))
            else:
                out.extend((line, n) for n in names)
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


# agent/: who may import whom (besides itself and protocol/; never node/ or discovery/)
AGENT_ALLOWED: dict[str, set[str]] = {
    "formats": set(),
    "runtime": {"formats"},
    "acting": {"formats", "runtime"},
    "evaluation": {"formats", "runtime", "acting"},
}
# evaluation/'s modules, lowest first: each imports only those before it (bfcl.py dispatches by kind of case)
EVALUATION_ORDER = ["bfcl_categories", "bfcl_checker", "bfcl_data", "bfcl_score", "bfcl_oracle", "bfcl_format",
                    "bfcl_multiturn", "bfcl_report", "bfcl", "suite"]


def test_agent_holds_only_rooms():
    assert sorted(p.name for p in AGENT.glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in AGENT.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(AGENT_ALLOWED)
    for room in AGENT_ALLOWED:
        init = AGENT / room / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), f"agent/{room}/ says what lives there"


def test_agent_imports_point_down_only():
    wrong = []
    for path in sorted(AGENT.rglob("*.py")):
        rel = path.relative_to(AGENT)
        if len(rel.parts) == 1:
            continue
        room = rel.parts[0]
        for line, target in _imports(path, "agent"):
            if target != room and target not in AGENT_ALLOWED[room]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({room} -> {target})")
        for line, target, _ in _module_imports(path):
            if target[0] == "psymesh" and target[1:2] not in (["agent"], ["protocol"]):
                wrong.append(f"{path.relative_to(ROOT)}:{line} (agent -> {'.'.join(target)})")
    assert wrong == []


def test_evaluation_modules_import_in_one_order():
    assert sorted(EVALUATION_ORDER) == sorted(p.stem for p in (AGENT / "evaluation").glob("*.py") if p.stem != "__init__")
    wrong = []
    for i, name in enumerate(EVALUATION_ORDER):
        path = AGENT / "evaluation" / f"{name}.py"
        for line, target, _ in _module_imports(path):
            if target[:3] == ["psymesh", "agent", "evaluation"] and target[3] not in EVALUATION_ORDER[:i]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({name} -> {target[3]})")
    assert wrong == []


def test_agent_modules_take_no_private_names_from_each_other():
    wrong = [f"{path.relative_to(ROOT)}:{line} ({'.'.join(target)}.{name})"
             for path in sorted(AGENT.rglob("*.py"))
             for line, target, names in _module_imports(path) if target[:2] == ["psymesh", "agent"]
             for name in names if name.startswith("_")]
    assert wrong == []
