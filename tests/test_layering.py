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
        "import training.pipeline.train_stage, training.pipeline.report_stage, training.trainer.run, training.launch.process, training.trainer.worker\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "ok"


# The parent side of the training process boundary is a folder: every module in it, present and
# future, is checked. Outside it, the modules the parent side and the stages read it through.
_LAUNCH = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for p in (ROOT / "training" / "launch").glob("*.py"))


@pytest.mark.parametrize("module", [*_LAUNCH, "training.storage.root", "training.model.model_ref",
                                    "training.model.package_meta", "training.pipeline.run_report",
                                    "training.pipeline.handoffs", "training.pipeline.train_stage",
                                    "training.pipeline.champion", "training.pipeline.evaluate_stage",
                                    "training.pipeline.stage_child", "training.model.task_metrics",
                                    "training.model.compatibility", "flows.retrain", "flows.tune", "flows.plan",
                                    "flows.predict", "flows.watch"])
def test_the_job_description_and_the_launcher_do_not_import_torch(module: str) -> None:
    """The launcher and whoever reads a job must not pay for the training loop's imports."""
    import subprocess
    import sys

    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_launch_folder_is_the_parent_side() -> None:
    assert {"training.launch.process", "training.launch.job", "training.launch.runs"} <= set(_LAUNCH)
