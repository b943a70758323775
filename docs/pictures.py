"""The example outputs the guides show, made by the commands a user runs, on the demo:
`python docs/pictures.py` (a few minutes; starts its own temporary Prefect servers).

- `docs/img/curves.png` and `docs/img/report-example.md`: a `retrain run`'s curves and report;
- `docs/img/plan-example.txt`: a `retrain plan` table;
- `docs/img/tune_curve.png`: `retrain tune --config examples/tune.yaml`'s curve.

They are examples of what the outputs look like, from whatever machine ran this; the
benchmarks page holds the measured figures.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img"


def _retrain(*args: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "retrain_cli.main", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        sys.exit(f"retrain {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def main() -> None:
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="retrain-pictures-") as tmp:
        work = Path(tmp)
        root = work / "root"
        report_json = _retrain("run", "--set", f"storage.root={root}", cwd=work).strip().splitlines()[-1]
        run = Path(report_json).parent
        shutil.copy(run / "curves.png", OUT / "curves.png")
        # The report links its picture beside it; here the picture is beside the copy too.
        report = re.sub(r"\]\([^)]*curves\.png\)", "](curves.png)", (run / "report.md").read_text())
        (OUT / "report-example.md").write_text(report.replace(str(root), "<root>"))

        plan = _retrain("plan", "--set", f"storage.root={root}", "--instance-types",
                        "g4dn.xlarge,g5.xlarge,p3.2xlarge,p4d.24xlarge", "--calibration-steps", "20",
                        cwd=work)
        (OUT / "plan-example.txt").write_text(plan.replace(str(root), "<root>"))

        tune_root = work / "tune"
        _retrain("tune", "--config", str(ROOT / "examples" / "tune.yaml"), "--set", f"storage.root={tune_root}",
                 cwd=work)
        (curve,) = tune_root.glob("tune/*/tune_curve.png")
        shutil.copy(curve, OUT / "tune_curve.png")
    print(f"wrote {', '.join(sorted(p.name for p in OUT.iterdir()))} under {OUT}")


if __name__ == "__main__":
    main()
