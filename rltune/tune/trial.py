"""Run one candidate for real and decide whether to keep it (the seed's step 4).

A trial runs the job with the candidate's knobs through the job's launcher, builds its stage
table and diagnosis as profile does, times it on the same steps as its baseline, holds it to the
limits fixed in job.yaml, writes verdict.yaml into the run directory and appends the run to the case
library with the forecast made before it. A job that crashes or hangs is a *failed* trial with its
log tail, not an error: the loop goes on.

Order of writes, which ``auto`` relies on to resume after ``kill -9`` without losing or
duplicating a run: run -> verdict.yaml -> case appended to the library. A run whose case is in the
library is finished and has its verdict; anything else is run again under a new id.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltune.contracts.forecast import CandidateForecast
from rltune.contracts.job import JobSpec, KnobValue
from rltune.contracts.verdict import Verdict, save_verdict
from rltune.errors import RltuneError
from rltune.tune.limits import Judgement, judge, median_over, recheck_threshold, rows_of

STAGE_NAMES = ("rollout", "training", "weight_sync", "old_logprob")
LOG_TAIL_LINES = 30


@dataclass
class MeasuredRun:
    """One real run of the job: its per-step rows, diagnosis and how it ended."""

    run_id: str
    run_dir: Path
    knobs: dict[str, KnobValue]
    status: str  # ok | failed | timed_out
    rows: list[dict[str, Any]] = field(default_factory=list)
    table: Any = None
    diagnosis: Any = None
    log_tail: str = ""
    error: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def median_step_s(self) -> float | None:
        steps = sorted({int(r["step"]) for r in self.rows if not r.get("warmup")})
        return median_over(self.rows, "step_s", steps) if steps else None

    def stage_medians(self, steps: list[int] | None = None) -> dict[str, float]:
        steps = steps if steps is not None else sorted({int(r["step"]) for r in self.rows if not r.get("warmup")})
        out = {}
        for name in STAGE_NAMES:
            value = median_over(self.rows, f"{name}_s", steps) if steps else None
            if value is not None:
                out[name] = value
        return out


def overrides_against(job: JobSpec, knobs: dict[str, KnobValue]) -> dict[str, KnobValue]:
    """The knobs that differ from job.yaml's baseline: what the launcher must override."""
    return {k: v for k, v in knobs.items() if job.knobs.get(k) != v}


def measure_run(job: JobSpec, job_path: str | Path, run_dir: str | Path, run_id: str, knobs: dict[str, KnobValue],
                steps: int | None = None) -> MeasuredRun:
    """Run the job once with ``knobs`` in ``run_dir``; write its stages.parquet and diagnosis.yaml there.

    Launch (rltune.launch), stage table and diagnosis (rltune.profile) are composed here, as profile
    does. Never raises for the job's own failure (crash, time-out, no metrics): that comes back as a
    run with status 'failed' or 'timed_out' and the log tail.
    """
    from rltune.contracts.diagnosis import save_diagnosis
    from rltune.contracts.stages import write_stages
    from rltune.launch import run_job
    from rltune.profile.diagnose import diagnose
    from rltune.profile.table import stage_table_from_logs

    run_dir = Path(run_dir)
    started = time.time()
    run = MeasuredRun(run_id=run_id, run_dir=run_dir, knobs=dict(knobs), status="ok", started_at=started)
    warmup = job.limits.warmup_steps
    try:
        launch = run_job(job, Path(job_path), run_dir, overrides=overrides_against(job, knobs), steps=steps)
    except RltuneError as exc:
        run.status, run.error, run.finished_at = "failed", str(exc), max(time.time(), started)
        return run
    run.finished_at = max(time.time(), started)
    if not launch.ok:
        run.status = "timed_out" if launch.timed_out else "failed"
        run.error = (f"ran past launch.timeout_s ({job.launch.timeout_s:g} s) and was killed" if launch.timed_out
                     else f"exited with code {launch.returncode}")
        run.log_tail = launch.log_tail(LOG_TAIL_LINES)
    metrics = Path(job.metrics.path.replace("{run_dir}", str(launch.run_dir)))
    if not metrics.exists():
        if run.ok:
            run.status, run.error = "failed", f"wrote no metrics at {metrics}"
            run.log_tail = launch.log_tail(LOG_TAIL_LINES)
        return run
    try:
        table, _ = stage_table_from_logs(metrics, job.metrics.format, run_id=run_id, warmup_steps=warmup)
        run.table, run.rows = table, rows_of(table)
        write_stages(table, run_dir / "stages.parquet")
        if run.ok:
            run.diagnosis = diagnose(table, str(knobs.get("rl_mode", job.rl_mode)), warmup, run_id)
            save_diagnosis(run.diagnosis, run_dir / "diagnosis.yaml")
    except RltuneError as exc:
        if run.ok:
            run.status, run.error = "failed", f"its metrics cannot be read ({exc})"
            run.log_tail = launch.log_tail(LOG_TAIL_LINES)
        return run
    if run.ok and not any(not r.get("warmup") and r.get("step_s") is not None for r in run.rows):
        run.status, run.error = "failed", "finished without a measured step after warm-up"
        run.log_tail = launch.log_tail(LOG_TAIL_LINES)
    return run


def record_case(library: Any, job: JobSpec, run: MeasuredRun, forecast: CandidateForecast | None) -> None:
    """Append ``run`` to the case library (a no-op if that exact run is already there)."""
    from rltune.contracts.stages import rows_to_table
    from rltune.predict.library import case_from_run

    table = run.table if run.table is not None else rows_to_table([], "none")
    status = run.status if run.ok or run.status in ("failed", "timed_out") else "failed"
    try:
        record = case_from_run(job, run.knobs, table, run.run_id, run.started_at, run.finished_at, status, forecast,
                               job.limits.warmup_steps)
    except RltuneError:
        # A run that finished but whose metrics cannot make an 'ok' case is recorded as failed.
        record = case_from_run(job, run.knobs, table, run.run_id, run.started_at, run.finished_at, "failed", forecast,
                               job.limits.warmup_steps)
    library.append(record)


@dataclass
class TrialOutcome:
    verdict: Verdict
    runs: list[MeasuredRun]

    @property
    def kept(self) -> bool:
        return self.verdict.kept

    @property
    def last_run(self) -> MeasuredRun:
        return self.runs[-1]


def decide(job: JobSpec, job_name: str, candidate: CandidateForecast, runs: list[MeasuredRun], baseline_run: str,
           baseline_rows: list[dict], untuned_run: str, untuned_rows: list[dict],
           knobs_overrides: dict[str, KnobValue]) -> tuple[Verdict, Judgement | None]:
    """The verdict on ``runs`` (one, or two when remeasured) of ``candidate``."""
    run = runs[-1]
    common = dict(schema_version=1, run_id=runs[0].run_id, candidate=candidate.candidate, job=job_name,
                  baseline_run=baseline_run, untuned_run=untuned_run, overrides=knobs_overrides,
                  forecast_step_s=candidate.step_s, forecast_range_s=list(candidate.range_s),
                  run_dirs=[str(r.run_dir) for r in runs], remeasured=len(runs) > 1)
    if not run.ok:
        reason = f"the job {run.status.replace('_', ' ')}: {run.error}"
        return Verdict(decision="failed", reason=reason, log_tail=run.log_tail, **common), None
    rows = [r for m in runs for r in m.rows]
    judgement = judge(job.limits, baseline_rows, rows, untuned_rows)
    failed = [c for c in judgement.checks if not c.passed]
    if failed:
        reason = "; ".join(f"{c.name}: {_fmt(c.value)} vs limit {_fmt(c.threshold)}" for c in failed)
        decision = "reject"
    else:
        reason = f"{judgement.gain_pct:.1f}% faster than the baseline and every limit holds"
        decision = "keep"
    measured = judgement.step_s
    error = within = None
    if measured:
        error = 100.0 * (measured - candidate.step_s) / measured
        within = candidate.range_s[0] <= measured <= candidate.range_s[1]
    stages = {name: value for name in STAGE_NAMES
              for value in [median_over(rows, f"{name}_s", judgement.steps)] if value is not None}
    verdict = Verdict(decision=decision, reason=reason, steps_compared=judgement.steps,
                      baseline_step_s=judgement.baseline_step_s, step_s=measured, gain_pct=judgement.gain_pct,
                      limits=judgement.checks, stages_s=stages, forecast_error_pct=error, within_forecast_range=within,
                      **common)
    return verdict, judgement


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def run_trial(job: JobSpec, job_path: str | Path, candidate: CandidateForecast, *, baseline_knobs: dict[str, KnobValue],
              baseline_run: str, baseline_rows: list[dict], untuned_run: str, untuned_rows: list[dict],
              library: Any, run_root: str | Path, run_id: str, steps: int | None = None,
              remeasure: bool = True, on_run: Callable[[str, str], None] | None = None) -> TrialOutcome:
    """Run ``candidate`` on top of ``baseline_knobs``; measure again if its gain is under the recheck bar.

    Writes ``verdict.yaml`` into the first run's directory, then appends every run to ``library``.
    ``on_run(run_id, 'start'|'done')`` lets a live view follow along.
    """
    knobs = {**baseline_knobs, **candidate.overrides}
    run_root = Path(run_root)
    runs: list[MeasuredRun] = []
    ids = [run_id, f"{run_id}-again"]
    for attempt, rid in enumerate(ids):
        if on_run:
            on_run(rid, "start")
        runs.append(measure_run(job, job_path, run_root / rid, rid, knobs, steps))
        if on_run:
            on_run(rid, "done")
        verdict, judgement = decide(job, str(job_path), candidate, runs, baseline_run, baseline_rows, untuned_run,
                                    untuned_rows, overrides_against(job, knobs))
        if attempt == 1 or not remeasure or judgement is None:
            break
        gain = judgement.gain_pct
        others_pass = all(c.passed for c in judgement.checks if c.name != "speed")
        if gain is None or gain <= 0 or gain >= recheck_threshold(job.limits) or not others_pass:
            break
    save_verdict(verdict, run_root / run_id / "verdict.yaml")
    for run in runs:
        record_case(library, job, run, candidate)
    return TrialOutcome(verdict=verdict, runs=runs)
