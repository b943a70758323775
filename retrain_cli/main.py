"""`retrain`: parse arguments -> config -> flow; errors -> one line and a non-zero exit.

The last line on stdout of `retrain run` is the path of the run's report.json, so scripts can do
`report=$(retrain run | tail -n1)`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from retrain_cli.parser import build_parser
from retrain_cli.temp_server import TemporaryServer, server_answers, server_is_up
from retrain_cli.tune_summary import tune_summary
from training.config import RetrainConfig, apply_overrides, load_config, validate_config
from training.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, ConfigError, Preempted, RetrainError
from training.pipeline.handoffs import LaunchPhases
from training.pipeline.reports.markdown import savings
from training.pipeline.reports.run_report import KeptReport, Phases, RunReport, read_report

if TYPE_CHECKING:
    import httpx

__all__ = ["main"]


_DB_SETTINGS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


def _say(message: str) -> None:
    print(f"retrain: {message}", file=sys.stderr, flush=True)


def _choose_server(config: RetrainConfig) -> tuple[str | None, TemporaryServer | None]:
    """Which Prefect server this run talks to: (the API URL to use, None) or, when none is
    configured or running, (its URL, the temporary server started for it). (None, None) means
    the configured one. Users' explicit settings win.

    - A configured server (PREFECT_API_URL, in the environment or the active profile) is used.
    - Else a server already running on this machine at the port `prefect server start` uses
      (PREFECT_SERVER_API_PORT, 4200 by default) is used: no start-up wait.
    - Else a temporary server for this run, with its database under the storage root's local
      folder (`<root>/prefect/server.db`), not in ~/.prefect shared with everything else: the
      run's history stays with its data.
    """
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        answer = server_answers(settings.api.url)
        if answer == "slow":
            raise ConfigError(f"PREFECT_API_URL is {settings.api.url}: a server there took the connection but did not "
                              "answer its health check within 5 s (busy, or its database is): check it, then run the "
                              "same command again")
        if answer == "no":
            raise ConfigError(f"PREFECT_API_URL is {settings.api.url}, but no Prefect server answers there: start it "
                              "(`prefect server start`), or unset PREFECT_API_URL and retrain starts a temporary "
                              "server for the run")
        _say(f"using the Prefect server at {settings.api.url}")
        return None, None
    local = f"http://127.0.0.1:{settings.server.api.port}/api"
    if server_is_up(local):
        _say(f"using the Prefect server already running at {local}")
        return local, None
    from tasks.runtime import TEMPORARY_SERVER_ENV
    from training.storage.root import local_dir_for

    state = local_dir_for(config.storage) / "prefect"
    database = next((os.environ[name] for name in _DB_SETTINGS if os.environ.get(name)),
                    f"sqlite+aiosqlite:///{state / 'server.db'}")
    _say(f"no Prefect server configured or running: starting a temporary one for this run, database "
         f"{database.split('///')[-1]} (to skip this wait, run `prefect server start` in another terminal)")
    t0 = time.perf_counter()
    server = TemporaryServer(database, state / "server.log")
    server.start()
    os.environ[TEMPORARY_SERVER_ENV] = server.api_url
    seeded = f" (its database copied from {server.seeded_from})" if server.seeded_from else ""
    _say(f"temporary Prefect server up after {time.perf_counter() - t0:.1f} s at {server.api_url}{seeded}")
    return server.api_url, server


def _quiet_expected_tracebacks() -> None:
    """Bad input (config, data, storage) is one line on the terminal: Prefect's console handlers
    print such errors without their traceback. The run logs (UI, API) keep the traceback."""
    import copy
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    def without_traceback(emit: Any) -> Any:
        def emit_record(record: logging.LogRecord) -> None:
            exc = record.exc_info[1] if record.exc_info else None
            if isinstance(exc, RetrainError):
                record = copy.copy(record)  # the same record goes on to the API handler intact
                record.exc_info, record.exc_text = None, None
            emit(record)
        return emit_record

    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                        if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not getattr(handler, "_retrain_quiet", False):
                handler.emit = without_traceback(handler.emit)  # type: ignore[method-assign]
                handler._retrain_quiet = True  # type: ignore[attr-defined]


def _server(args: argparse.Namespace) -> int:
    from retrain_cli.server import serve

    if args.slots < 1:
        raise ConfigError(f"--slots must be at least 1 (got {args.slots})")
    return serve(args.data.expanduser(), args.host, args.port, args.pool or None, args.slots, _say)


def _manifests(args: argparse.Namespace) -> int:
    import yaml

    from retrain_cli.deployment_file import deployment_config
    from training.launch.kube import launcher_rbac, volcano_job

    if args.deployment:
        path, _, name = str(args.deployment).rpartition(":")
        if not path or not name:
            raise ConfigError(f"--deployment {args.deployment}: give FILE.yaml:NAME, e.g. "
                              "deployments/multi-gpu.yaml:retrain-8x8gpu")
        config = validate_config(apply_overrides(deployment_config(Path(path), name), args.overrides),
                                 f"in {args.deployment}")
    else:
        config = _loaded(args)
    d = config.train.distributed
    if d.nnodes < 2 or d.scheduler != "kubernetes":
        raise ConfigError("retrain manifests is for multi-node runs on Kubernetes: set train.distributed.nnodes >= 2 and "
                          "train.distributed.scheduler: kubernetes")
    objects = ([] if args.only == "job" else launcher_rbac(d.kubernetes.namespace)) + (
        [] if args.only == "rbac" else [volcano_job(config)])
    print(yaml.safe_dump_all(objects, sort_keys=False), end="")
    return 0


def _automations(args: argparse.Namespace) -> int:
    from retrain_cli.automations import install_automations

    shipped = Path("deployments/automations")
    folder = args.dir or (shipped if shipped.is_dir() else _shipped(shipped, Path.is_dir)) or shipped
    install_automations(folder, lambda line: print(line, flush=True), args.notify)
    return 0


def _ui(args: argparse.Namespace) -> int:
    """The Prefect UI over the storage root's own run history: a Prefect server on its database,
    with the UI and without background services, in this process's place (Ctrl-C stops it)."""
    from retrain_cli.temp_server import free_port, port_is_free, registration_skipped
    from training.storage.root import local_dir_for

    config = _loaded(args)
    database = local_dir_for(config.storage) / "prefect" / "server.db"
    if not database.exists():
        raise ConfigError(f"no run history at {database}: `retrain run` records runs there when it starts its own "
                          "temporary Prefect server; runs on a configured server are in that server's UI")
    port = args.port or (4200 if port_is_free(4200) else free_port())
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{database}",
           "PREFECT_UI_API_URL": f"{url}/api", "PREFECT_SERVER_UI_ENABLED": "true", **registration_skipped(database)}
    env.pop("PREFECT_API_URL", None)
    _say(f"the Prefect UI over the run history in {database}: {url} (Ctrl-C stops it)")
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port), "--no-services", "--ui"], env)


def _plan(args: argparse.Namespace) -> int:
    from training.pipeline.plan_stage import plan_run

    config = _checked(args)
    types = args.instance_types.split(",") if args.instance_types else sorted(config.cost.prices)
    plan = plan_run(config, [t.strip() for t in types if t.strip()], args.deadline_hours, args.calibration_steps)
    if args.json:  # for machines: the plan alone, on stdout
        print(plan.model_dump_json(include={"cheapest", "deadline_hours", "rows", "why"}))
        return 0 if plan.cheapest is not None else 1
    c, count = plan.calibration, plan.calibration.step_costs.as_run
    print(f"calibration: {c.steps} steps here, {c.here.seconds_per_step * 1000:.2f} ms/step; the whole run here "
          f"~{c.estimated_run_hours_here * 3600:.0f} s; one step at micro-batch {count.micro_batch}: "
          f"{count.flops / 1e9:.3g} GFLOP, {(count.matmul_bytes + count.other_bytes) / 1e6:.3g} MB moved, "
          f"{count.kernels} kernels, {count.parameters:,} parameters")
    for line in plan_table(plan.rows, wide=args.wide):
        print(line)
    for refused in dict.fromkeys(f"{r.instance_type}: {r.refused}" for r in plan.rows if r.refused):
        print(f"refused {refused}")
    unbanded = sorted({r.instance_type for r in plan.rows if r.market == "spot" and r.fits and not r.interruption_band
                       and config.cost.prices[r.instance_type].gpus})
    if unbanded:
        print(f"spot without a published interruption band in {config.cost.region} ({', '.join(unbanded)}): "
              "priced at train.checkpoint.mean_seconds_between_preemptions; set interruption_band to override")
    print(f"recommended: {plan.why}")
    if plan.cheapest is not None and plan.cheapest.set:
        print("  set: " + " ".join(f"--set {k}={v}" for k, v in plan.cheapest.set.items()))
    return 0 if plan.cheapest is not None else 1


def plan_table(rows: list[Any], wide: bool = False) -> list[str]:
    """The ranked table a person reads, each column as wide as its widest cell and two spaces
    apart, so no two cells ever run together: at most 100 characters (`PlanRow.brief`), or every
    column with `wide` (`PlanRow.cells`)."""
    cells = [row.cells() if wide else row.brief() for row in rows]
    keys = list(cells[0]) if cells else (["instance", "market", "variant", "ms/step", "fits", "hours", "cost $",
                                          "P(deadline)", "interruptions", "step time"] if wide else
                                         ["instance", "market", "ms/step", "hours", "$", "why"])
    widths = {k: max([len(k), *(len(c.get(k, "")) for c in cells)]) for k in keys}
    line = lambda values: "  ".join(f"{values.get(k, ''):<{widths[k]}}" for k in keys).rstrip()  # noqa: E731
    return [line({k: k for k in keys}), *(line(c) for c in cells)]


_PHASES = {"imports": "imports", "server_start": "server", "flow_start": "flow start", "pack": "pack",
           "preprocess": "preprocess", "train": "train", "child_start": "of which child start-up",
           "evaluate": "evaluate", "report": "report", "flow_finish": "flow finish", "teardown": "teardown"}


def _phases_line(phases: Phases, flow_seconds: float, teardown: float) -> str:
    """report.json's phases, then what followed the report (Prefect finishing the flow run, the
    server's stop), in seconds: where a run's time went."""
    recorded = phases.model_dump()
    inside = ("flow_start", "pack", "preprocess", "train", "evaluate", "report")
    shown = {**recorded, "flow_finish": flow_seconds - sum(recorded[k] or 0.0 for k in inside), "teardown": teardown}
    parts = [f"{label} {shown[k]:.1f}" for k, label in _PHASES.items() if shown.get(k) is not None]
    total = sum(v or 0.0 for k, v in shown.items() if k in _PHASES and k != "child_start")
    return ", ".join(parts) + f" s; {total:.1f} s in all"


def _summary(report: RunReport, path: str, clock: _Clock | None = None, ui: str | None = None) -> str:
    m, metric, stages = report.metrics, report.metric, report.stages
    train = stages.train
    lines = [
        f"run {report.run_key}: {report.status} after {report.steps} steps",
        f"  pack        {stages.pack.state or '':<10} dataset {stages.pack.dataset}"
        f" ({'reused' if stages.pack.reused else 'packed'}, {sum(stages.pack.rows.values())} rows)",
        f"  preprocess  {stages.preprocess.state or '':<10} stats {stages.preprocess.key}",
        f"  train       {train.state or '':<10} "
        + ("already complete" if train.already_complete else
           f"best step {train.best_step}, val {metric} {train.best or float('nan'):.4f}, "
           f"{train.precision} on {train.device}"),
        "  evaluate    test " + "  ".join(f"{k} {m[k]:.4f}" for k in [metric, *sorted(set(m) - {metric})]),
    ]
    if report.bayes_auc is not None and report.task == "binary":  # a property of the click label
        lines.append(f"              (Bayes-optimal AUC of the demo generator: {report.bayes_auc:.4f})")
    if report.resumed_from_steps:
        lines.append(f"  resumed from steps {report.resumed_from_steps}, {report.steps_lost} steps lost")
    cost, util = report.cost, report.utilization
    lines.append(
        f"  cost        ${cost.total_usd:.4f} on {cost.where()}, "
        f"{cost.gpu_hours:.3f} GPU-h; naive on-demand run ${cost.naive.total_usd:.4f}, "
        f"{savings(cost.savings_usd, 'it')}"
    )
    lines.append(f"  bottleneck  {util.verdict} (data stall {util.data_stall_fraction:.1%})")
    if report.stop_reason:
        lines.append(f"  stopped     {report.stop_reason}")
    if clock is not None:
        lines.append(f"  phases      {_phases_line(report.phases, clock.flow, clock.teardown)}")
    promo = report.promotion
    lines.append(f"  champion    {'PROMOTED' if promo.promoted else 'kept'}: {promo.reason}")
    lines.append(f"  model       {report.model.sha256[:16]}  {report.model.uri}")
    shown = [p for p in (Path(path).with_name("report.md"), Path(path).with_name("curves.png")) if p.exists()]
    if shown:
        lines.append(f"  report      {'  '.join(map(str, shown))}")
    if ui is not None:
        lines.append(f"  ui          {ui}")
    lines.append(path)
    return "\n".join(lines)


_Phase = Literal["config", "imports", "server", "flow", "teardown"]


class _Clock:
    """The CLI's own phases (see `LaunchPhases`), and the teardown after the flow returns: the
    seconds spent in each, summed over its marks."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.last = self.started
        self.config = self.imports = self.server = self.flow = self.teardown = 0.0

    def mark(self, phase: _Phase) -> None:
        """The seconds since the last mark, added to `phase`."""
        now = time.perf_counter()
        setattr(self, phase, getattr(self, phase) + now - self.last)
        self.last = now

    def launch(self) -> LaunchPhases:
        return LaunchPhases(config_seconds=self.config, imports_seconds=self.imports, server_seconds=self.server,
                            flow_called_at=time.time())


def _call_flow(config: RetrainConfig, clock: _Clock, load: Callable[[], Callable[[RetrainConfig], str]],
               what: str) -> str | int:
    """Run a flow on the chosen Prefect server: the path it returns, or an exit code when it was
    interrupted (Ctrl-C, SIGTERM)."""
    _say("loading Prefect and the pipeline")
    clock.mark("config")
    import httpx
    from prefect.exceptions import TerminationSignal

    api_url, server = None, None
    try:
        clock.mark("imports")
        api_url, server = _choose_server(config)
        clock.mark("server")
        from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

        flow = load()
        _quiet_expected_tracebacks()
        clock.mark("imports")
        _say(f"ready after {time.perf_counter() - clock.started:.1f} s; running the flow ({what})")
        os.environ[LaunchPhases.ENV] = clock.launch().model_dump_json()
        # Prefect reads its settings once, at import: an API URL chosen here must be applied.
        # A temporary server serves no UI and stops with the run: no "View at" link that dies
        # (the summary says how to open the UI over the run history instead).
        updates: dict[Any, Any] = {PREFECT_API_URL: api_url, **({PREFECT_UI_URL: ""} if server is not None else {})}
        with temporary_settings(updates=updates) if api_url else contextlib.nullcontext():
            return flow(config)
    except (KeyboardInterrupt, _Terminated, TerminationSignal) as err:  # the last: Prefect's, inside the flow run
        return _interrupted(config, err)
    except httpx.HTTPError as err:
        raise RetrainError(_server_failure(err, api_url, server)) from None
    finally:
        os.environ.pop(LaunchPhases.ENV, None)
        clock.mark("flow")
        _drain_logs()
        if server is not None:
            server.stop()


def _server_failure(err: httpx.HTTPError, api_url: str | None, server: TemporaryServer | None) -> str:
    """The Prefect server failed the run (a timeout, a refused connection, an error status):
    what happened, in one line, and what to do. A temporary server's own log says why it failed
    (its database is under the storage root: a full disk there fails the server too)."""
    import httpx

    from prefect.settings import get_current_settings

    where = api_url or get_current_settings().api.url or "the Prefect server"
    if isinstance(err, httpx.HTTPStatusError):
        what = f"answered HTTP {err.response.status_code} to {err.request.method} {err.request.url.path}"
    elif isinstance(err, httpx.TimeoutException):
        what = f"did not answer in time ({type(err).__name__}): it is up but too busy"
    else:
        what = f"could not be reached ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'})"
    if server is not None:
        lines = [line.strip() for line in _log_tail(server.log_path).splitlines() if line.strip()]
        why = f"; its log {server.log_path} ends: {lines[-1][:300]}" if lines else f"; its log is {server.log_path}"
        return (f"the temporary Prefect server at {where} {what}{why}. Its database is under the storage root: "
                "check that disk has room, then run the same command again (it resumes)")
    return (f"the Prefect server at {where} {what}; check the server (its log, its database, its disk), then run "
            "the same command again (the run resumes from its last checkpoint)")


def _log_tail(path: Path, size: int = 4096) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(max(0, path.stat().st_size - size))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def _config_path(path: Path | None) -> Path | None:
    """`--config`, or for a relative `examples/...` path that is not here, the shipped example of
    that name (the README's commands then work from any folder)."""
    if path is None or path.exists() or path.is_absolute() or path.parts[:1] != ("examples",):
        return path
    return _shipped(path, Path.is_file) or path


def _shipped(rel: Path, kind: Callable[[Path], bool]) -> Path | None:
    """A file or folder the project ships, by its path in the repository: the checkout's, or the
    one pip installed under <prefix>/share/retrain-pipeline."""
    for shipped in (Path(__file__).resolve().parents[1] / rel, Path(sys.prefix) / "share" / "retrain-pipeline" / rel):
        if kind(shipped):
            return shipped
    return None


def _loaded(args: argparse.Namespace) -> RetrainConfig:
    config = load_config(_config_path(args.config), args.overrides)
    if not config.storage.is_s3:
        config.storage.root = str(Path(config.storage.root).expanduser().resolve())
    return config


def _checked(args: argparse.Namespace) -> RetrainConfig:
    """The config, its source checked before any server starts (a wrong path, label or column is
    one line in about a second), with the feature columns and the task inferred when not given."""
    from training.data.ingest.source_check import checked_source

    config, inferred = checked_source(_loaded(args))
    if inferred is not None:
        if inferred.task:
            _say(f"data.task {inferred.task}: inferred from label '{config.data.label}', {inferred.task_why}")
        _say("inferred from the source (put them in a config to fix them): "
             + " ".join(f"--set {o}" for o in inferred.overrides()))
        for column, why in inferred.left_out.items():
            _say(f"left out column '{column}': {why}")
        for note in inferred.notes:
            _say(note)
    return config


def _run(args: argparse.Namespace) -> int:
    clock = _Clock()
    config = _checked(args)
    if not args.force:
        from training.pipeline.unchanged import find_unchanged

        unchanged = find_unchanged(config)
        if unchanged is not None:
            _say(f"run {unchanged.run_key} is finished and nothing it depends on changed (config, code, source "
                 f"data, champion): its report, without running the flow (`--force` runs it); "
                 f"{time.perf_counter() - clock.started:.2f} s")
            print(_summary(unchanged.content, str(unchanged.report)), flush=True)
            return 0

    def load() -> Callable[[RetrainConfig], str]:
        from flows.retrain import retrain

        return retrain

    report_path = _call_flow(config, clock, load, "pack -> preprocess -> train -> evaluate -> report")
    if isinstance(report_path, int):
        return report_path
    report = read_report(Path(report_path))
    clock.mark("teardown")
    sys.stderr.flush()
    summary = (_summary(report, report_path, clock, _ui_command(config)) if isinstance(report, RunReport)
               else _kept(report, report_path))
    print(summary, flush=True)
    return 0


def _ui_command(config: RetrainConfig) -> str | None:
    """How to see this run in the Prefect UI once its temporary server is gone (None: the run
    was on a server that stays, whose UI shows it)."""
    from tasks.runtime import TEMPORARY_SERVER_ENV

    if not os.environ.get(TEMPORARY_SERVER_ENV):
        return None
    return f"retrain ui --set storage.root={config.storage.root}   (this run in the Prefect UI)"


def _kept(report: KeptReport, path: str) -> str:
    """The summary of a run that kept the champion (train.retrain_when)."""
    d = report.decision
    lines = [f"champion kept: {d.reason}",
             f"  pack        dataset {report.dataset} ({sum(report.rows.values())} rows, {d.new_rows} new in "
             f"{d.new_segments} segment(s))"]
    if d.drift:
        top = sorted(d.drift.items(), key=lambda kv: -kv[1])[:3]
        lines.append("  drift       PSI " + ", ".join(f"{k} {v:.3f}" for k, v in top) + f" (threshold {d.threshold:g})")
    if report.champion is not None:
        lines.append(f"  model       {report.champion.sha256[:16]}  {report.champion.uri}")
    lines.append(f"  cost        ${report.compute.usd:.4f} ({report.compute.billed_seconds:.1f} s of compute)")
    lines.append(path)
    return "\n".join(lines)


def _tune(args: argparse.Namespace) -> int:
    clock = _Clock()
    config = _checked(args)
    if not config.tune.space:
        raise ConfigError("tune.space is empty: add a tune: section to the config, e.g. tune: {space: "
                          "{train.optim.lr: 'loguniform(1e-4, 1e-2)'}, max_trials: 20, max_usd: 10}")
    if config.train.eval_every != "auto":  # auto: checked once the data is packed
        from training.search_space import SpaceError
        from training.tune.rungs import check_rungs

        try:
            check_rungs(config)
        except SpaceError as err:
            raise ConfigError(str(err)) from None

    def load() -> Callable[[RetrainConfig], str]:
        from flows.tune import tune

        return tune

    report_path = _call_flow(config, clock, load, "pack -> preprocess -> trials -> report")
    if isinstance(report_path, int):
        return report_path
    sys.stderr.flush()
    from training.tune.study_report import TuneReport

    print(tune_summary(TuneReport.read(Path(report_path)), report_path), flush=True)
    return 0


def _predict(args: argparse.Namespace) -> int:
    clock = _Clock()
    config = _loaded(args)
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys is not None else None
    # Scoring needs no orchestration: without --flow it runs here, with no Prefect server to wait
    # for. A credentials block lives on the server, so it takes the flow path.
    if not args.flow and not (config.storage.is_s3 and config.storage.credentials_block):
        return _predict_here(config, args, keys, clock)

    def load() -> Callable[[RetrainConfig], str]:
        from flows.predict import predict

        return lambda c: predict(input=args.input, output=args.output, model=args.model, key_columns=keys,
                                 config=c)

    output = _call_flow(config, clock, load, f"score {args.input} with {args.model}")
    if isinstance(output, int):
        return output
    sys.stderr.flush()
    print(output, flush=True)
    return 0


def _predict_here(config: RetrainConfig, args: argparse.Namespace, keys: list[str] | None, clock: _Clock) -> int:
    from training.pipeline.predict_stage import predict_stage

    try:
        result = predict_stage(config, args.input, args.output, args.model, keys)
    except (KeyboardInterrupt, _Terminated) as err:
        # The output is written under a temporary name and renamed: nothing partial is left.
        how = "Ctrl-C" if isinstance(err, KeyboardInterrupt) else "SIGTERM"
        print(f"retrain: interrupted ({how}); no output was written; run the same command again",
              file=sys.stderr, flush=True)
        return 130 if isinstance(err, KeyboardInterrupt) else EXIT_PREEMPTED
    done = "already scored (output unchanged):" if result.skipped else "scored"
    _say(f"{done} {result.rows} rows with model {result.model_sha256[:12]} on {result.torch_threads} torch thread(s) in "
         f"{result.seconds:.2f} s ({time.perf_counter() - clock.started:.2f} s in all)")
    print(result.output, flush=True)
    return 0


class _Terminated(Exception):
    """SIGTERM outside the flow run (Prefect handles it inside): unwind and clean up."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signal.Signals(signum).name)


def _interrupted(config: RetrainConfig, err: BaseException) -> int:
    from training.protocol.runs import step_of
    from training.storage.root import local_dir_for

    ctrl_c = isinstance(err, KeyboardInterrupt)
    newest = max(local_dir_for(config.storage).glob("runs/*/checkpoints/step-*[0-9]"),
                 key=lambda p: p.stat().st_mtime, default=None)
    if newest is not None and (newest / "manifest.json").exists():
        where = f"at step {step_of(newest.name)}; checkpoint saved"
    else:
        where = "before any checkpoint; nothing to lose"
    print(f"retrain: interrupted ({'Ctrl-C' if ctrl_c else 'SIGTERM'}) {where}; run the same command again to resume",
          file=sys.stderr, flush=True)
    return 130 if ctrl_c else EXIT_PREEMPTED


def _drain_logs() -> None:
    # Send the run's logs while the server is still up, so the error line or the report path
    # really is the last thing printed.
    if "prefect.logging.handlers" not in sys.modules:
        return
    try:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)
    except Exception:  # noqa: BLE001 - best effort
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_terminated)  # unwind (stop the training child, the server)
    try:
        commands = {"plan": _plan, "manifests": _manifests, "run": _run, "tune": _tune, "predict": _predict,
                    "automations": _automations, "ui": _ui, "server": _server}
        return commands[args.command](args)
    except Preempted as err:
        print(f"retrain: preempted, retries exhausted: {err}; run the same command again to resume", file=sys.stderr)
        return EXIT_PREEMPTED
    except RetrainError as err:
        print(f"retrain: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
