"""Fixed cost of `retrain run`, against a baseline commit in the same benchmark run.

The baseline (BASELINE below) ran every rerun as a whole flow on a freshly started server; it is
checked out with `git worktree` beside this one and run with the same interpreter and packages. Both sides run the demo on their own storage root:
- the first run (this side's phases from its report.json);
- a no-op rerun (everything finished, nothing changed), with no Prefect server running (the CLI
  starts a temporary one, as a newcomer's does) and then with `prefect server start` running;
- this side's `--force` rerun, which runs the flow with every stage done;
- `import flows.retrain`, which the CLI does before the flow starts.

Interleaved rounds, medians with every round listed. Wall time of the whole CLI process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from retrain_cli.temp_server import free_port, server_is_up

REPO = Path(__file__).resolve().parents[1]
BASELINE = "0f26a6c"  # the code before the unchanged-rerun shortcut and the lazy torch import
ROUNDS = 3


def _checkout(work: Path) -> Path:
    target = work / "baseline"
    out = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(target), BASELINE],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the startup benchmark needs this repository's git history ({BASELINE}): {out.stderr}")
    return target


def _cli(code: Path, args: list[str], env: dict[str, str]) -> tuple[float, str, str]:
    """(wall seconds, stdout, stderr) of `retrain` run from the checkout `code`."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "retrain_cli.main", *args], cwd=code, env=env, capture_output=True,
                         text=True, timeout=900)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"retrain {' '.join(args)} in {code} failed: {out.stderr[-2000:]}")
    return seconds, out.stdout, out.stderr


def _import_seconds(code: Path, env: dict[str, str]) -> float:
    probe = "import time; t = time.perf_counter(); import flows.retrain; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=code, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


class _Server:
    """`prefect server start` on a free loopback port, as a user keeps one for repeated runs."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = {**env, "PREFECT_HOME": str(home)}
        self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                      "--port", str(self.port)], env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def wait(self) -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            if server_is_up(self.url, timeout=2):
                return
            time.sleep(0.5)
        raise RuntimeError("prefect server start did not answer /api/health within 120 s")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _median(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 2), "rounds": [round(v, 2) for v in values]}


def run(work: Path) -> dict[str, Any]:
    baseline = _checkout(work)
    try:
        return _measure(work, {"baseline": baseline, "current": REPO})
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], capture_output=True)


def _measure(work: Path, sides: dict[str, Path]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    # No server at the default port: each CLI run without one starts its temporary server.
    env.update(PREFECT_HOME=str(work / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_API_PORT=str(free_port()))
    roots = {side: ["run", "--set", f"storage.root={work / side}"] for side in sides}
    first: dict[str, Any] = {}
    for side, code in sides.items():
        seconds, stdout, _ = _cli(code, roots[side], env)
        report = json.loads(Path(stdout.strip().splitlines()[-1]).read_text())
        first[side] = {"seconds": round(seconds, 2), "phases": report.get("phases")}
    times: dict[str, list[float]] = {k: [] for k in (
        "baseline_noop_no_server", "current_noop_no_server", "current_force_no_server",
        "baseline_noop_server", "current_noop_server", "current_force_server",
        "baseline_import", "current_import")}
    for _ in range(ROUNDS):
        times["baseline_noop_no_server"].append(_cli(sides["baseline"], roots["baseline"], env)[0])
        times["current_noop_no_server"].append(_cli(sides["current"], roots["current"], env)[0])
        times["current_force_no_server"].append(_cli(sides["current"], [*roots["current"], "--force"], env)[0])
        for side, code in sides.items():
            times[f"{side}_import"].append(_import_seconds(code, env))
    server = _Server(work / "server-home", env)
    try:
        server.wait()
        with_server = {**env, "PREFECT_API_URL": server.url}
        for _ in range(ROUNDS):
            times["baseline_noop_server"].append(_cli(sides["baseline"], roots["baseline"], with_server)[0])
            times["current_noop_server"].append(_cli(sides["current"], roots["current"], with_server)[0])
            times["current_force_server"].append(_cli(sides["current"], [*roots["current"], "--force"], with_server)[0])
    finally:
        server.stop()
    return _result(first, {k: _median(v) for k, v in times.items()})


def _result(first: dict[str, Any], med: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base = med["baseline_noop_no_server"]["median"]

    def ratio(key: str, over: float) -> float:
        return round(med[key]["median"] / over, 3)

    return {
        "baseline_commit": BASELINE,
        "first_run": first,
        "seconds": med,
        "noop_no_server_ratio": ratio("current_noop_no_server", base),
        "noop_no_server_target": 0.25,
        "noop_with_server_ratio": ratio("current_noop_server", base),
        "noop_with_server_target": 0.10,
        "forced_flow_with_server_vs_baseline_with_server": ratio("current_force_server",
                                                                 med["baseline_noop_server"]["median"]),
        "forced_flow_no_server_vs_baseline": ratio("current_force_no_server", base),
        "import_ratio": ratio("current_import", med["baseline_import"]["median"]),
        "note": "wall seconds of the whole `retrain run` process, medians of interleaved rounds; ratios over the "
                "baseline's no-op rerun with no server running unless named otherwise",
    }
