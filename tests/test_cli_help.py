"""The CLI explains itself: a version, help for every option, and each command's help ends with
an example and the exit codes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

from retrain_cli.parser import build_parser

PARSER = build_parser()
COMMANDS = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "retrain_cli.main", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"retrain {version('retrain-pipeline')}"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_and_the_help_ends_with_an_example_and_the_exit_codes(name: str) -> None:
    command = COMMANDS[name]
    undocumented = [a.option_strings for a in command._actions if a.option_strings and not a.help]
    assert undocumented == []
    text = command.format_help()
    assert f"example:\n  retrain {name}" in text
    tail = text.rstrip().split("exit codes:")[-1]
    for code in ("0", "2", "75", "130"):
        assert f"\n  {code} " in tail, f"exit code {code} missing from `retrain {name} --help`"


def test_each_command_example_parses() -> None:
    for name, command in COMMANDS.items():
        example = command.epilog.split("example:\n  ", 1)[1].splitlines()[0]
        args = PARSER.parse_args(example.split()[1:])
        assert args.command == name


def test_the_plan_table_never_runs_two_columns_together() -> None:
    from retrain_cli.main import plan_table
    from training.cost.planner import PlanRow

    rows = [PlanRow(instance_type="g4dn.xlarge", market="spot", rate_per_hour=0.19, step_seconds=(0.01, 0.02, 0.03),
                    interruptions=0.5, lost_hours=0.1, interruption_band="15-20%", step_source="predicted: T4 fp16, "
                    "launch-bound"),
            PlanRow(instance_type="tiny", market="on_demand", rate_per_hour=0.01, fits=False,
                    refused="needs 30 GB, has 16 GB")]
    header, *lines = plan_table(rows, wide=True)
    starts = [header.index(name) for name in ("instance", "interruptions", "step time")]
    for line in lines:
        for start in starts[1:]:
            assert line[start - 2:start] == "  ", line  # every cell ends before the next column begins
    assert "(15-20%/month)  predicted: T4 fp16" in lines[0]


def test_the_tune_table_keeps_its_columns_and_names_the_budget() -> None:
    from retrain_cli.tune_summary import tune_summary
    from training.tune.study_report import BestTrial, Spend, StudyBudget, TrialRow, TuneReport

    def trial(number: int, state: str, lr: float, value: float | None) -> TrialRow:
        return TrialRow(number=number, params={"train.optim.lr": lr}, state=state, rung=0, steps=40, value=value,
                        rung_values={}, billed_seconds=1.0, usd=0.000123, gpu_hours=0.0, steps_lost=0,
                        preemptions=0, run_key=None)

    spend = Spend(seconds=3.0, usd=0.0004, gpu_hours=0.0, setup_seconds={})
    report = TuneReport(study="s", status="complete", stop_reason=None, metric="auc", direction="maximize",
                        rungs=[40, 120], instance_type="local-cpu", market="on_demand", rate_per_hour=0.1,
                        trials=[trial(0, "completed", 0.001234, 0.81), trial(12, "early_stopped", 0.03, None)],
                        spend=spend, budget=StudyBudget(max_usd=1.0, max_wall_seconds=600), naive=spend,
                        saved_fraction=0.5, best=BestTrial(trial=0, value=0.81, params={"train.optim.lr": 0.001234},
                                                           run_key=None, config="best_config.yaml"))
    lines = tune_summary(report, "tune_report.json").splitlines()
    header, rows = lines[1], lines[2:4]
    for name in ("state", "steps", "train.optim.lr"):
        column = header.index(name)
        assert all(row[column - 2:column] == "  " for row in rows), (header, rows)
    assert "budget $1, 600 s wall" in lines[4] and "{" not in "\n".join(lines)
