"""The import direction inside training/: each subpackage imports only the floors below it, and
no module imports itself back through another (checked on every import, deferred ones too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINING = ROOT / "training"
# The ground floor: training/*.py (errors, metrics, the search space's syntax), config/ and cost/.
FLOORS = {"ground": 0, "config": 0, "cost": 0, "storage": 1, "data": 2, "model": 3, "protocol": 4, "registry": 4,
          "launch": 5, "trainer": 5, "pipeline": 6, "worker": 7, "tune": 7}
# The training child's folders: the parent's side (launch/) and what both sides share (protocol/)
# never import them, not even when a function runs.
CHILD = ("training.trainer", "training.worker", "training.data.load")
PARENT_AND_SHARED = ("training.protocol", "training.launch")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (TRAINING / parts[1]).is_dir() else "ground"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("training.") and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("training."))
    return found


GRAPH = {_module(p): _imports(p) for p in TRAINING.rglob("*.py")}


def test_every_subpackage_has_a_floor() -> None:
    assert {p.name for p in TRAINING.iterdir() if p.is_dir() and p.name != "__pycache__"} <= set(FLOORS)


def test_each_floor_imports_only_the_floors_below() -> None:
    upward = sorted(
        f"{module} -> {target}" for module, targets in GRAPH.items() for target in targets
        if FLOORS[_floor(target)] > FLOORS[_floor(module)]
    )
    assert upward == []


def test_no_module_imports_itself_back() -> None:
    cycles = []
    for start in GRAPH:
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for target in GRAPH.get(module, ()):
                if target == start:
                    cycles.append(" -> ".join([*path, start]))
                elif target not in seen and target in GRAPH:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert cycles == []


def _imports_torch(module: str) -> bool:
    path = ROOT / (module.replace(".", "/") + ".py")
    return path.is_file() and any(isinstance(node, (ast.Import, ast.ImportFrom)) and any(
        name.split(".")[0] == "torch" for name in ([a.name for a in node.names] if isinstance(node, ast.Import)
                                                   else [node.module or ""]))
        for node in ast.walk(ast.parse(path.read_text())))


def test_the_protocol_and_the_launcher_never_import_the_childs_modules() -> None:
    child = {m for m in GRAPH if m.startswith(CHILD) or (m.startswith("training.model.") and _imports_torch(m))}
    assert child
    found = sorted(f"{module} -> {target}" for module, targets in GRAPH.items() if module.startswith(PARENT_AND_SHARED)
                   for target in targets if target in child or target.startswith(CHILD))
    assert found == []
