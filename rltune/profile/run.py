"""The one run recorder: launch a job (or read the logs of a run someone else made), build its stage
table, diagnose it and write the run directory.

``rltune profile JOB``, ``rltune profile --from-logs``, every trial and every baseline of
``rltune auto`` go through here, so launch, metrics path, warm-up and diagnosis follow one rule
each:

- what runs is the job's knobs with the overrides applied, for ``limits.steps`` steps unless a
  step count is given (:mod:`rltune.launch.job`);
- ``metrics.path`` is resolved once, relative to the job's working directory
  (:func:`rltune.launch.job.metrics_path_of`);
- warm-up steps are the job's ``limits.warmup_steps``, always leaving one step measured
  (:func:`rltune.launch.job.warmup_steps`); for logs, ``--warmup``; the stage table's ``warmup``
  column is the only place they are recorded, and everything downstream reads it.

Public API::

    record_run(job_path, run_dir, overrides=None, steps=None, ...) -> RecordedRun   # never raises for the job's failure
    record_logs(path, run_dir, log_format='auto', ...) -> RecordedRun
    profile_job(job_path, run_dir, ...) -> RecordedRun    # record_run, raising JobFailedError when the job failed

A run directory receives job.yaml (resolved), launch.log, launch.json, stages.parquet and
diagnosis.yaml (from logs: stages.parquet, parse_report.json and diagnosis.yaml).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.contracts.diagnosis import Diagnosis, save_diagnosis
from rltune.contracts.job import JobSpec, KnobValue, load_job
from rltune.contracts.rundir import DIAGNOSIS_NAME, PARSE_REPORT_NAME, STAGES_NAME
from rltune.contracts.stages import check_stage_row, rows_to_table, source_of, write_stages
from rltune.errors import LaunchError, RltuneError
from rltune.launch import LaunchResult, resolved_job, run_job
from rltune.launch.job import metrics_path_of, run_knobs
from rltune.profile.diagnose import NotDiagnosableError, diagnose, infer_rl_mode
from rltune.profile.report import ParseReport
from rltune.profile.stage_map import map_metrics
from rltune.profile.stats import mean_over, measured_steps, median_over
from rltune.profile.table import stage_table_from_logs

if TYPE_CHECKING:
    import pyarrow as pa

LOG_TAIL_LINES = 30
STAGE_COLUMNS = ("rollout", "training", "weight_sync", "old_logprob")


class JobFailedError(LaunchError):
    """The job crashed, ran past its time-out or measured nothing; the message ends with its log tail."""

    exit_code = 4


@dataclass
class RecordedRun:
    """One run as recorded: its rows, diagnosis and how it ended (status ok, failed or timed_out)."""

    run_id: str
    run_dir: Path
    knobs: dict[str, KnobValue]
    status: str = "ok"
    warmup_steps: int = 0
    table: Any = None  # pyarrow.Table (untyped so importing this module does not import pyarrow)
    diagnosis: Diagnosis | None = None
    error: str = ""
    cause: str = ""  # crashed | timed_out | no_metrics | unreadable_metrics | no_measured_step
    log_tail: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0
    launch: LaunchResult | None = None
    report: ParseReport | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        return [] if self.table is None else self.table.to_pylist()

    def measured_step_indices(self) -> list[int]:
        return sorted(measured_steps(self.rows))

    def step_s(self, steps: list[int] | None = None) -> float | None:
        """Mean step over ``steps`` (default: every measured step): the wall time a step costs."""
        return mean_over(self.rows, "step_s", steps)

    def step_median_s(self, steps: list[int] | None = None) -> float | None:
        return median_over(self.rows, "step_s", steps)

    def stage_means(self, steps: list[int] | None = None) -> dict[str, float]:
        out = {}
        for name in STAGE_COLUMNS:
            value = mean_over(self.rows, f"{name}_s", steps)
            if value is not None:
                out[name] = value
        return out

    @classmethod
    def from_dir(cls, run_dir: str | Path, run_id: str | None = None,
                 knobs: dict[str, KnobValue] | None = None) -> RecordedRun:
        """A finished run read back from its directory (the run-dir contract): its stage table and, where
        it was written, its diagnosis; knobs from its resolved job.yaml unless given."""
        from rltune.contracts.rundir import RunDir

        where = RunDir(run_dir)
        table = where.table()
        if knobs is None:
            knobs = dict(where.job().knobs) if where.job_path.exists() else {}
        rows = table.to_pylist()
        return cls(run_id=run_id or where.name, run_dir=where.path, knobs=dict(knobs), table=table,
                   warmup_steps=sum(1 for r in rows if r.get("warmup")),
                   diagnosis=where.diagnosis() if where.diagnosis_path.exists() else None)

    def _fail(self, status: str, cause: str, error: str) -> None:
        self.status, self.cause, self.error = status, cause, error
        if self.launch is not None:
            self.log_tail = self.launch.log_tail(LOG_TAIL_LINES)


def _merge_engine_metrics(table: pa.Table, per_step: dict[int, dict[str, float]], url: str) -> pa.Table:
    rows = table.to_pylist()
    for row in rows:
        snapshot = per_step.get(row["step"])
        if not snapshot:
            continue
        core, used = map_metrics("vllm", snapshot)
        for column, value in core.items():
            # vLLM reports a histogram with no observation in the step as NaN: not measured, left null
            if row.get(column) is None and not math.isnan(value):
                row[column] = value
        check_stage_row(row, url, used)
        for key, value in snapshot.items():
            if "/bucket/" not in key:
                row.setdefault(key, value)
    return rows_to_table(rows, source=source_of(table))


def _launch(job: JobSpec, job_path: Path, run: RecordedRun, overrides, steps, metrics: Path,
            on_output: Callable[[str], None] | None, on_submit: Callable[[dict], None] | None,
            resume: dict | None) -> tuple[LaunchResult, dict[int, dict[str, float]], int]:
    """Run the job (or follow the one ``resume`` names), scraping its vLLM /metrics endpoint alongside."""
    from rltune.launch import resume_job
    from rltune.profile.scrape import StepScraper

    def start() -> LaunchResult:
        if resume is not None:
            return resume_job(resume, on_output)
        return run_job(job, job_path, run.run_dir, overrides=overrides, steps=steps, on_output=on_output,
                       on_submit=on_submit)

    if not job.metrics.vllm_metrics_url:
        return start(), {}, 0
    scraper = StepScraper(job.metrics.vllm_metrics_url, metrics)
    with scraper:
        launch = start()
    return launch, scraper.per_step, scraper.failures


def record_run(job_path: str | Path, run_dir: str | Path, *, job: JobSpec | None = None, run_id: str | None = None,
               overrides: dict[str, KnobValue] | None = None, steps: int | None = None,
               on_output: Callable[[str], None] | None = None, on_submit: Callable[[dict], None] | None = None,
               resume: dict | None = None) -> RecordedRun:
    """Run the job with ``overrides`` in ``run_dir``; write its stage table and diagnosis there.

    ``on_submit(identity)`` gets the launcher's identity of the job once it is submitted (journal it);
    ``resume`` (such an identity) records the run an earlier process submitted instead of starting one.

    Never raises for the job's own failure (crash, time-out, no or unreadable metrics): that comes
    back as a run with status 'failed' or 'timed_out', the cause and the log tail. Bad input that
    stops the job from starting at all (an unmapped knob, a missing command) raises.
    """
    job_path = Path(job_path)
    job = job if job is not None else load_job(job_path)
    run_dir = Path(run_dir).resolve()
    resolved = resolved_job(job, job_path, overrides, steps)
    run = RecordedRun(run_id=run_id or run_dir.name, run_dir=run_dir, knobs=run_knobs(job, overrides),
                      warmup_steps=resolved.limits.warmup_steps, started_at=time.time())
    metrics = metrics_path_of(job, job_path, run_dir)
    launch, per_step, scrape_failures = _launch(job, job_path, run, overrides, steps, metrics, on_output, on_submit,
                                                resume)
    run.launch, run.finished_at = launch, max(time.time(), run.started_at)
    if launch.state == "lost":
        run._fail("failed", "lost", "was lost: its launcher no longer knows the job (it died with the process that "
                                    "followed it, or the cluster forgot it); run it again")
    elif not launch.ok:
        if launch.timed_out:
            run._fail("timed_out", "timed_out", f"ran past launch.timeout_s ({job.launch.timeout_s:g} s) and was killed")
        else:
            run._fail("failed", "crashed", f"exited with code {launch.returncode}")
    if not metrics.exists():
        if run.ok:
            run._fail("failed", "no_metrics", f"finished but wrote no metrics at {metrics}; check metrics.path "
                                              "against where the job writes its metrics")
        return run
    try:
        table, report = stage_table_from_logs(metrics, job.metrics.format, run_id=run.run_id,
                                              warmup_steps=run.warmup_steps)
    except RltuneError as exc:
        if run.ok:
            run._fail("failed", "unreadable_metrics", f"its metrics cannot be read ({exc})")
        return run
    if per_step:
        try:
            table = _merge_engine_metrics(table, per_step, job.metrics.vllm_metrics_url or "")
        except RltuneError as exc:
            if run.ok:
                run._fail("failed", "unreadable_metrics", f"its engine metrics cannot be read ({exc})")
            return run
    run.table, run.report = table, report
    write_stages(table, run_dir / STAGES_NAME)
    if not run.ok:
        return run
    if not run.measured_step_indices():
        run._fail("failed", "no_measured_step", f"finished without a measured step after its {run.warmup_steps} "
                                                "warm-up steps; run more steps (--steps) or check the metrics")
        return run
    rl_mode = str(run.knobs.get("rl_mode", job.rl_mode))
    try:
        run.diagnosis = diagnose(table, rl_mode, run_id=run.run_id)
    except NotDiagnosableError as exc:
        run._fail("failed", "unreadable_metrics", f"its metrics time no step or stage ({exc})")
        return run
    run.diagnosis.job = "job.yaml"
    run.diagnosis.job_name = job.name
    if scrape_failures:
        run.diagnosis.notes.append(f"{scrape_failures} scrapes of {job.metrics.vllm_metrics_url} failed")
    save_diagnosis(run.diagnosis, run_dir / DIAGNOSIS_NAME)
    return run


def profile_job(job_path: str | Path, run_dir: str | Path, steps: int | None = None,
                overrides: dict[str, KnobValue] | None = None,
                on_output: Callable[[str], None] | None = None, job: JobSpec | None = None) -> RecordedRun:
    """:func:`record_run` for ``rltune profile``: a failed job raises, with what was saved and its log tail.

    ``job``: the job file's contents as changed by the caller (``--vllm-metrics`` sets its metrics URL).
    """
    from rltune.workload.jobcheck import check_workload_job

    # a reference-workload job whose config the workload (or vLLM) would refuse: one line, before it starts
    check_workload_job(job if job is not None else load_job(job_path), job_path, overrides, steps)
    run = record_run(job_path, run_dir, job=job, overrides=overrides, steps=steps, on_output=on_output)
    if run.ok:
        return run
    if run.cause in ("no_metrics", "unreadable_metrics"):
        # The job ran and measured nothing rltune can use: the job's failure (exit 4), as a trial records it.
        raise JobFailedError(f"{job_path}: metrics: the job {run.error}")
    saved = (f"{run.table.num_rows} steps saved in {run.run_dir / STAGES_NAME}" if run.table is not None
             else "no steps recorded")
    log = run.launch.log_path if run.launch is not None else run.run_dir
    raise JobFailedError(f"{job_path}: the job {run.error} ({saved}); log {log}, last lines:\n{run.log_tail}")


def record_logs(path: str | Path, run_dir: str | Path, *, log_format: str = "auto", rl_mode: str | None = None,
                run_id: str | None = None, warmup: int = 1) -> RecordedRun:
    """Read existing logs into ``run_dir``: stages.parquet (warm-up column from ``warmup``), diagnosis.

    A log holding several runs gets no diagnosis unless ``run_id`` picks one; the warnings say so.
    """
    path, run_dir = Path(path), Path(run_dir)
    table, report = stage_table_from_logs(path, format=log_format, warmup_steps=warmup)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_stages(table, run_dir / STAGES_NAME)
    (run_dir / PARSE_REPORT_NAME).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    run = RecordedRun(run_id=run_id or path.stem, run_dir=run_dir, knobs={}, warmup_steps=warmup, table=table,
                      report=report, warnings=list(report.warnings))
    if rl_mode is None:
        inferred = infer_rl_mode(table)
        rl_mode = inferred[0] if inferred else "sync"
        run.warnings.append(f"RL mode {rl_mode}: {inferred[1]}" if inferred else "RL mode sync assumed; pass --rl-mode")
    runs = sorted(set(table.column("run_id").to_pylist()))
    if run_id is None and len(runs) > 1:
        run.warnings.append(f"{len(runs)} runs in these logs: no diagnosis written; pick one with --run-id")
        return run
    try:
        run.diagnosis = diagnose(table, rl_mode, run_id=run_id)
    except NotDiagnosableError as exc:
        run.warnings.append(f"no diagnosis: {exc}")
        return run
    run.run_id = run.diagnosis.run_id
    save_diagnosis(run.diagnosis, run_dir / DIAGNOSIS_NAME)
    return run
