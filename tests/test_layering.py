"""The import direction: training/ never imports Prefect or the layers above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "training": {"prefect", "tasks", "flows", "retrain_cli"},
    "tasks": {"flows", "retrain_cli"},
    "flows": {"retrain_cli"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downwards(layer: str) -> None:
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imports(p) & FORBIDDEN[layer]) for p in (ROOT / layer).rglob("*.py")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}


def test_flows_import_only_tasks_and_the_config_model() -> None:
    for path in (ROOT / "flows").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("training"):
                assert node.module == "training.config", f"{path.name} imports {node.module}"


def test_training_runs_without_prefect_importable() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['prefect'] = None\n"
        "import training.pipeline.train_stage, training.pipeline.report_stage, training.trainer.run, training.launch.process, training.worker.train, training.worker.stage\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "ok"


# -- torch: the process boundary, computed from the import graph --------------------------------
#
# Prefect's side (flows/, tasks/, retrain_cli/ and whatever they import when they load) must not
# import torch: it pays 2-3 s and hundreds of MB for nothing, and a flow on a CPU-only worker
# would need the wheel. Only the training child's modules may: the trainer, the torch parts of
# the model, and the loader that feeds it.
PACKAGES = ("training", "tasks", "flows", "retrain_cli")
TORCH = {"torch", "torchvision", "lightning", "pytorch_lightning", "rtdl_num_embeddings"}
CHILD_SIDE = ("training.trainer.", "training.worker.", "training.model.", "training.data.load.")
# One stage still does torch work in its task's own process (batch scoring, which streams the
# rows through the model): its task imports it only when it runs, so loading Prefect's side
# never reaches it.
TORCH_IN_TASK = {"training.pipeline.predict_stage"}


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _loaded_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """What importing the module imports: module level, class bodies, if/try/with blocks;
    not function bodies (imported when called) nor `if TYPE_CHECKING:` (never at run time)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
            for block in ("body", "orelse", "finalbody"):
                visit(getattr(node, block, None) or [])
            for handler in getattr(node, "handlers", None) or []:
                visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    # Importing a.b.c runs a/__init__ and a/b/__init__ first.
    return {".".join(m.split(".")[:i + 1]) for m in found for i in range(len(m.split(".")))}


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _loaded_imports(path, name, set(modules)) for name, path in modules.items()}


def _path_to_torch(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The chain of imports by which loading `start` loads torch, or None."""
    came_from: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for imported in sorted(graph.get(module, ())):
            if imported.split(".")[0] in TORCH:
                chain = [imported, module]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])  # type: ignore[arg-type]
                return chain[::-1]
            if imported in graph and imported not in came_from:
                came_from[imported] = module
                queue.append(imported)
    return None


def test_nothing_prefect_loads_imports_torch() -> None:
    graph = _import_graph()
    entries = [m for m in graph if m.split(".")[0] in ("flows", "tasks", "retrain_cli")]
    chains = {m: " -> ".join(chain) for m in entries if (chain := _path_to_torch(graph, m)) is not None}
    assert chains == {}


def test_only_the_training_childs_modules_import_torch_when_loaded() -> None:
    graph = _import_graph()
    importing = {m for m, imported in graph.items() if any(i.split(".")[0] in TORCH for i in imported)}
    assert importing and {m for m in importing if not m.startswith(CHILD_SIDE)} == set()
    chains = {m: " -> ".join(chain) for m in graph
              if not m.startswith(CHILD_SIDE) and m not in TORCH_IN_TASK and (chain := _path_to_torch(graph, m)) is not None}
    assert chains == {}


def test_the_rule_sees_an_import_of_torch_through_the_graph(tmp_path: Path) -> None:
    graph = {"flows.x": {"training", "training.a"}, "training": set(), "training.a": {"training.b"},
             "training.b": {"torch", "torch.nn"}}
    assert _path_to_torch(graph, "flows.x") == ["flows.x", "training.a", "training.b", "torch"]
    module = tmp_path / "m.py"
    module.write_text("import json\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
                      "def f():\n    import torch\ntry:\n    from . import sibling\nexcept ImportError:\n    pass\n")
    assert _loaded_imports(module, "training.data.m", {"training.data.sibling"}) == {
        "json", "typing", "training", "training.data", "training.data.sibling"}


# The static rule is checked against the interpreter where it matters most: each flow module and
# the CLI, imported in a fresh one.
@pytest.mark.parametrize("module", sorted(m for m in _modules() if m.startswith("flows.")) + ["retrain_cli.main"])
def test_the_flows_and_the_cli_import_without_torch(module: str) -> None:
    import subprocess
    import sys

    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
