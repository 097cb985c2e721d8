"""``rltune profile``: time each stage of a job's step and diagnose what limits it.

A thin command over :mod:`rltune.profile`: it parses arguments, calls ``profile_job`` or
``stage_table_from_logs`` + ``diagnose``, writes the run directory, and prints a rich summary on
stderr (``--json``: a machine-readable summary on stdout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Time each stage of a job's step and diagnose what limits it.

Runs JOB.yaml through its launcher for --steps steps (warm-up steps kept but marked) and writes
stages.parquet, diagnosis.yaml and the resolved job.yaml into the run directory; or, with
--from-logs, reads an existing log of verl, prime-rl, slime, OpenRLHF, TRL, NeMo-RL, SkyRL,
ms-swift, AReaL, vLLM /metrics or the reference workload without running anything.

Example:

\b
  rltune profile presets/cpu-demo.yaml --steps 6
  rltune profile job.yaml --set micro_batch_size=8 --out runs/mbs8
  rltune profile job.yaml --vllm-metrics http://127.0.0.1:8000/metrics
  rltune profile --from-logs verl.log --format auto --rl-mode sync --out runs/verl-7b
"""

FORMAT_CHOICES = ("auto", "rltune", "verl", "prime-rl", "slime", "openrlhf", "trl", "nemo-rl", "skyrl", "ms-swift",
                  "areal", "vllm")
SUMMARY_COLUMNS = ("step_s", "rollout_s", "training_s", "old_logprob_s", "weight_sync_s", "wait_s",
                   "engine_queue_s", "engine_prefill_s", "engine_decode_s", "sandbox_setup_s", "sandbox_exec_s",
                   "trainer_busy_frac", "padding_frac", "kv_cache_usage", "reward")


def _print_summary(diagnosis, report, run_dir: Path, warnings: list[str]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(stderr=True)
    if report is not None:
        console.print(f"[bold]{report.path}[/]: format [cyan]{report.format}[/], {report.steps} steps, "
                      f"{report.lines_used} lines used, {report.lines_skipped} skipped")
    for line in warnings:
        # Warnings quote log text ('trainer.logger=[console]'); rich must not read it as markup.
        console.print(f"[yellow]warning:[/] {escape(line)}")
    if diagnosis is None:
        console.print(f"stage table written to {run_dir}", markup=False, highlight=False, soft_wrap=True)
        return
    # the run id and paths go on plain lines: inside a table title rich would wrap them mid-word
    console.print(f"run {diagnosis.run_id} ({diagnosis.rl_mode}, {len(diagnosis.steps_used)} steps)", markup=False,
                  highlight=False)
    table = Table()
    for name in ("column", "median", "p10", "p90"):
        table.add_column(name, justify="left" if name == "column" else "right")
    for column in SUMMARY_COLUMNS:
        s = diagnosis.stages.get(column)
        if s is not None:
            table.add_row(column, f"{s.median_s:.4g}", f"{s.p10_s:.4g}", f"{s.p90_s:.4g}")
    console.print(table)
    mean = f"step mean [bold]{diagnosis.step_mean_s:.4g} s[/], " if diagnosis.step_mean_s is not None else ""
    console.print(f"{mean}step median {diagnosis.step_median_s:.4g} s, RL-mode rule "
                  f"{diagnosis.step_model_s:.4g} s, limiting stage: [bold red]{diagnosis.limiting_stage}[/]")
    for note in diagnosis.notes:
        console.print(f"  note: {note}")
    if diagnosis.problems:
        problems = Table(title="problems (worst first)")
        for name in ("id", "stage", "costs s/step", "summary"):
            problems.add_column(name)
        for p in diagnosis.problems:
            problems.add_row(p.id, p.stage, f"{p.severity:.3g}", p.summary)
        console.print(problems)
    else:
        console.print("no problems found by the detectors")
    console.print(f"written: {run_dir}", markup=False, highlight=False, soft_wrap=True)


def _summary_json(diagnosis, report, run_dir: Path, warnings: list[str]) -> str:
    import json

    data = {
        "run_dir": str(run_dir),
        "report": report.to_dict() if report is not None else None,
        "warnings": warnings,
        "diagnosis": None,
    }
    if diagnosis is not None:
        data["diagnosis"] = {
            "run_id": diagnosis.run_id,
            "rl_mode": diagnosis.rl_mode,
            "steps_used": diagnosis.steps_used,
            "step_mean_s": diagnosis.step_mean_s,
            "step_median_s": diagnosis.step_median_s,
            "step_model_s": diagnosis.step_model_s,
            "limiting_stage": diagnosis.limiting_stage,
            "stage_medians_s": diagnosis.stage_medians_s,
            "problems": [{"id": p.id, "stage": p.stage, "severity": p.severity, "summary": p.summary}
                         for p in diagnosis.problems],
        }
    return json.dumps(data, indent=2)


def register(app: typer.Typer) -> None:
    @app.command(name="profile", help=HELP)
    def profile_cmd(
        job: Optional[Path] = typer.Argument(None, help="job.yaml to run (omit with --from-logs)"),  # noqa: UP045 (typer)
        steps: Optional[int] = typer.Option(None, "--steps", help="steps to run, 1 to 1000000 (default: the job's limits.steps)"),  # noqa: UP045
        out: Optional[Path] = typer.Option(None, "--out", help="run directory (default: runs/<new id>); refused if it holds another run"),  # noqa: UP045
        force: bool = typer.Option(False, "--force", help="let --out replace the run already in that directory"),
        sets: list[str] = typer.Option([], "--set", help="knob=value override of an abstract knob (repeatable)"),
        library: Optional[Path] = typer.Option(None, "--library", help="record the run as a case in this case library (created if absent)"),  # noqa: UP045
        from_logs: Optional[Path] = typer.Option(None, "--from-logs", help="read this log file or folder instead of running"),  # noqa: UP045
        log_format: Optional[str] = typer.Option(None, "--format", help="with --from-logs: log format: " + ", ".join(FORMAT_CHOICES) + " (default auto)"),  # noqa: UP045
        rl_mode: Optional[str] = typer.Option(None, "--rl-mode", help="with --from-logs: sync | one_step_async | fully_async (default: from the log, else sync)"),  # noqa: UP045
        run_id: Optional[str] = typer.Option(None, "--run-id", help="with --from-logs: the run to diagnose when the logs hold several"),  # noqa: UP045
        warmup: Optional[int] = typer.Option(None, "--warmup", help="with --from-logs: first steps marked warm-up and left out of medians (default 1)"),  # noqa: UP045
        as_json: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
        vllm_metrics: Optional[str] = typer.Option(None, "--vllm-metrics", help="a vLLM /metrics URL to scrape once per step while the job runs; its engine figures fill the engine columns the job's own metrics leave empty (sets the job's metrics.vllm_metrics_url)"),  # noqa: UP045
    ) -> None:
        from rltune.cli.options import check_at_least, check_steps, parse_sets, refuse_unused
        from rltune.contracts.outputs import check_output
        from rltune.errors import RltuneError

        if (job is None) == (from_logs is None):
            raise RltuneError("give either JOB.yaml or --from-logs PATH (not both); see 'rltune profile --help'")
        if from_logs is None:
            mode = "without --from-logs (it applies to reading logs)"
            refuse_unused("--warmup", warmup is not None, mode)
            refuse_unused("--run-id", run_id is not None, mode)
            refuse_unused("--format", log_format is not None, mode)
            refuse_unused("--rl-mode", rl_mode is not None, mode)
        else:
            mode = "with --from-logs (nothing runs; the log has the steps it has)"
            refuse_unused("--steps", steps is not None, mode)
            refuse_unused("--set", bool(sets), "with --from-logs (nothing runs, so no knob can change)")
            from rltune.contracts.job import RL_MODES

            if rl_mode is not None and rl_mode not in RL_MODES:
                raise RltuneError(f"--rl-mode {rl_mode!r}: expected one of {', '.join(RL_MODES)}")
            if library is not None:
                raise RltuneError("--library records runs rltune launched; a log read with --from-logs has no job.yaml "
                                  "to make a case from")
        log_format = log_format or "auto"
        if log_format not in FORMAT_CHOICES:
            raise RltuneError(f"--format {log_format!r}: expected one of {', '.join(FORMAT_CHOICES)}")
        check_steps(steps)
        check_at_least(warmup, 0, "--warmup", "the warm-up step count")
        if vllm_metrics is not None:
            if from_logs is not None:
                raise RltuneError("--vllm-metrics scrapes a live engine while rltune runs the job; a log read with "
                                  "--from-logs has no run to scrape alongside (read a saved /metrics file with "
                                  "--from-logs FILE --format vllm)")
            if not vllm_metrics.startswith(("http://", "https://")):
                raise RltuneError(f"--vllm-metrics {vllm_metrics!r}: expected an http(s) URL, e.g. "
                                  "http://127.0.0.1:8000/metrics")
        source = job if job is not None else from_logs
        if out is not None:
            check_output(out, inputs=[source], expect="run_dir", force=force,
                         writes=("stages.parquet", "diagnosis.yaml", "job.yaml", "launch.log", "launch.json",
                                 "parse_report.json"))
        if library is not None:
            check_output(library, inputs=[source], expect="dir", flag="--library")
        if job is not None:
            run = _run_job(job, steps, out, parse_sets(sets), library, vllm_metrics)
        else:
            run = _from_logs(from_logs, log_format, rl_mode, run_id, 1 if warmup is None else warmup, out)
        if as_json:
            print(_summary_json(run.diagnosis, run.report if from_logs else None, run.run_dir, run.warnings))
        _print_summary(run.diagnosis, run.report if from_logs else None, run.run_dir, run.warnings)


def _run_job(job_path: Path, steps, out, sets: list, library: Path | None, vllm_metrics: str | None = None):
    import sys

    from rltune.contracts.job import check_knob_overrides, load_job
    from rltune.launch import new_run_dir
    from rltune.profile import profile_job

    job = load_job(job_path)
    overrides = check_knob_overrides(job, sets, f"--set (job {job_path})")
    if vllm_metrics is not None:
        job.metrics.vllm_metrics_url = vllm_metrics  # recorded in the run's resolved job.yaml
    run_dir = out if out is not None else new_run_dir(job.name)

    def echo(line: str) -> None:
        print(f"  | {line}", file=sys.stderr)

    run = profile_job(job_path, run_dir, steps=steps, overrides=overrides or None, on_output=echo, job=job)
    if library is not None:
        from rltune.predict.library import CaseLibrary
        from rltune.tune.trial import record_case

        record_case(CaseLibrary(library), job, run, None)
        run.warnings.append(f"recorded as case {run.run_id} in {library}")
    return run


def _from_logs(path: Path, log_format: str, rl_mode, run_id, warmup: int, out):
    from rltune.launch import new_run_id
    from rltune.profile import record_logs

    run_dir = out if out is not None else Path("runs") / new_run_id(path.stem)
    return record_logs(path, run_dir, log_format=log_format, rl_mode=rl_mode, run_id=run_id, warmup=warmup)
