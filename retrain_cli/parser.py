"""The `retrain` command line: every subcommand, its options, one example and its exit codes."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["build_parser"]

_EXIT_CODES = """exit codes:
  0    success{extra}
  2    bad input (config, data, storage, checkpoint): one line naming the file, column or key
  75   preempted more often than train.retry.max_retries allows, or SIGTERM: run it again to resume
  130  Ctrl-C: run it again to resume"""

_COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run the pipeline: pack -> preprocess -> train -> evaluate -> report",
            "retrain run --set data.source=/data/clicks/ --set train.max_steps=5000"),
    "tune": ("search tune.space with pruned trials within tune.max_usd, max_gpu_hours or max_wall_seconds; "
             "run it again to resume", "retrain tune --config examples/tune.yaml"),
    "plan": ("estimate time and cost per instance type from a short calibration run",
             "retrain plan --instance-types g4dn.xlarge,g5.xlarge --deadline-hours 2"),
    "predict": ("score Parquet rows with the champion (or --model) into a Parquet file",
                "retrain predict --input new_rows.parquet --output scores.parquet --keys user_id"),
    "automations": ("install the shipped Prefect automations on the server PREFECT_API_URL names "
                    "(reschedule crashed spot runs, mark silent ones crashed; with --notify, notify on failed, "
                    "crashed and budget-stopped runs and promotions); idempotent",
                    "retrain automations --notify slack-webhook/ml-alerts"),
    "ui": ("open the Prefect UI over the storage root's own run history (the runs `retrain run` recorded on "
           "its temporary servers, <root>/prefect/server.db); Ctrl-C stops it",
           "retrain ui --set storage.root=.retrain"),
    "server": ("run a production Prefect server on PostgreSQL (kept under --data), with the shipped work pool, "
               "its concurrency limit and its training and light queues; Ctrl-C stops it",
               "retrain server --data /var/lib/retrain --pool retrain-process --slots 4"),
    "manifests": ("print the Kubernetes objects of a multi-node deployment (train.distributed.nnodes > 1, scheduler "
                  "kubernetes): the flow-run pod's service account and RBAC to apply once, and the Volcano job each "
                  "run submits, for review",
                  "retrain manifests --deployment deployments/multi-gpu.yaml:retrain-8x8gpu --only rbac"),
}
_EXTRA_EXIT = {"plan": "\n  1    no instance type fits the model and meets --deadline-hours"}  # after 0 in the list


def _version() -> str:
    try:
        return version("retrain-pipeline")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _config_options(parser: argparse.ArgumentParser, config_help: str) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE.yaml", help=config_help)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.batch_size=256 (the value is YAML); repeatable")


def _subcommand(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    summary, example = _COMMANDS[name]
    epilog = f"example:\n  {example}\n\n{_EXIT_CODES.format(extra=_EXTRA_EXIT.get(name, ''))}"
    parser: argparse.ArgumentParser = sub.add_parser(name, help=summary, description=summary, epilog=epilog,
                                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retrain", description="Cheap, preemption-safe retraining of PyTorch models, orchestrated by Prefect.",
        epilog=f"example:\n  retrain run\n\n{_EXIT_CODES.format(extra='')}", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"retrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = _subcommand(sub, "run")
    _config_options(run, "YAML config file (default: the built-in demo)")
    run.add_argument("--force", action="store_true",
                     help="run the flow even when a finished run's config, code, source data and champion are unchanged")

    tune = _subcommand(sub, "tune")
    _config_options(tune, "YAML config file with a tune: section")

    plan = _subcommand(sub, "plan")
    _config_options(plan, "YAML config file (default: the built-in demo)")
    plan.add_argument("--instance-types", default=None, metavar="A,B",
                      help="comma-separated keys of cost.prices to compare (default: all)")
    plan.add_argument("--deadline-hours", type=float, default=None, metavar="H", help="the run must finish within this")
    plan.add_argument("--calibration-steps", type=int, default=50, metavar="N",
                      help="optimizer steps to time (default: 50)")
    plan.add_argument("--wide", action="store_true",
                      help="every column of the table (variant, fit, ranges, deadline, interruptions)")
    plan.add_argument("--json", action="store_true",
                      help="print the plan as one JSON object (the pick, every row, why) instead of the table")

    predict = _subcommand(sub, "predict")
    predict.add_argument("--input", required=True, metavar="FILES",
                         help="a Parquet or CSV file, a folder of them, or an s3:// prefix")
    predict.add_argument("--output", required=True, metavar="FILE",
                         help="the file to write (a local path or an s3:// key): Parquet, or CSV/TSV for a name ending "
                         ".csv/.tsv (a multiclass score's probabilities then one column per class)")
    predict.add_argument("--model", default="champion",
                         help="'champion' (default), a promoted model's sha256, or a model package folder")
    predict.add_argument("--keys", default=None, metavar="A,B",
                         help="comma-separated input columns to copy into the output (default: all)")
    predict.add_argument("--flow", action="store_true",
                         help="run it as the Prefect flow `predict` (recorded on the server, like a deployed run) "
                              "instead of scoring in this process")
    _config_options(predict, "YAML config file: its storage.root holds the champion")

    automations = _subcommand(sub, "automations")
    automations.add_argument("--dir", type=Path, default=None, metavar="FOLDER",
                             help="folder of automation YAML files (default: the shipped deployments/automations)")
    automations.add_argument("--notify", default=None, metavar="TYPE/NAME",
                             help="the notification block (e.g. slack-webhook/ml-alerts, or its id) for the "
                                  "automations that notify: failed, crashed and budget-stopped runs, promotions; "
                                  "without it they are skipped")

    ui = _subcommand(sub, "ui")
    _config_options(ui, "YAML config file: its storage.root holds the run history (default: the demo's root)")
    ui.add_argument("--port", type=int, default=None, metavar="N",
                    help="the UI's port on 127.0.0.1 (default: 4200 when free, else any free port)")

    server = _subcommand(sub, "server")
    server.add_argument("--data", type=Path, default=Path("~/.retrain/server"), metavar="FOLDER",
                        help="where the PostgreSQL cluster and its password are kept (default: ~/.retrain/server)")
    server.add_argument("--host", default="127.0.0.1", help="the API's address (default: 127.0.0.1; 0.0.0.0 for "
                                                            "workers on other machines)")
    server.add_argument("--port", type=int, default=4200, metavar="N", help="the API's port (default: 4200)")
    server.add_argument("--pool", default="retrain-process", metavar="NAME",
                        help="the process work pool to make or update (default: retrain-process, as the shipped "
                             "deployments name it); --pool '' makes none")
    server.add_argument("--slots", type=int, default=4, metavar="N",
                        help="flow runs the pool runs at once (default: 4); training takes at most N-1")

    manifests = _subcommand(sub, "manifests")
    _config_options(manifests, "YAML config of the deployment's runs")
    manifests.add_argument("--deployment", metavar="FILE.yaml:NAME",
                           help="take the config from this deployment's parameters in a prefect.yaml (--set still "
                                "applies on top)")
    manifests.add_argument("--only", choices=("rbac", "job"),
                           help="rbac: only the service account, Role and RoleBinding (to apply); job: only the Volcano job "
                                "(to review); default: both")
    return parser
