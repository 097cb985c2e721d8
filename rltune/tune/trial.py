"""Run one candidate for real and decide whether to keep it (the seed's step 4).

A trial runs the job with the candidate's knobs through the one run recorder
(:func:`rltune.profile.record_run`: launch, stage table, diagnosis, run directory), times it on the
same steps as its baseline, holds it to the limits fixed in job.yaml (:mod:`rltune.tune.limits`:
mean step beyond the measured noise, gap, sample age, trial shares), writes verdict.yaml into the
run directory and appends the run to the case library with the forecast made before it. A gain
under the recheck bar is measured again and both runs count. A job that crashes or hangs is a
*failed* trial with its log tail, not an error: the loop goes on.

Order of writes, which ``auto`` relies on to resume after ``kill -9`` without losing or
duplicating a run: run -> verdict.yaml -> case appended to the library. A run whose case is in the
library is finished and has its verdict; anything else is run again under a new id.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltune.contracts.forecast import CandidateForecast
from rltune.contracts.job import JobSpec, KnobValue
from rltune.contracts.verdict import Verdict, save_verdict
from rltune.errors import LaunchError
from rltune.profile.run import RecordedRun, record_run
from rltune.profile.stats import mean_over
from rltune.tune.limits import Judgement, judge, recheck_threshold

STAGE_NAMES = ("rollout", "training", "weight_sync", "old_logprob")

# Exit codes of 'rltune trial' (and of 'rltune profile' for a job that failed); 2 is bad input.
EXIT_KEPT, EXIT_REJECTED, EXIT_FAILED = 0, 3, 4


def trial_steps(job: JobSpec, knobs: dict[str, KnobValue], steps: int | None = None) -> int:
    """Steps a run of ``knobs`` gets: the job's (or ``steps``), raised where one generation round feeds
    several optimizer steps so that the run measures two whole rounds after its warm-up (a mean over
    part of a round is wrong by up to the round's generation; :mod:`rltune.profile.stats`)."""
    from rltune.launch.job import run_steps
    from rltune.predict.setup import setup_from_job
    from rltune.predict.theory import Features, generation_cadence

    base = run_steps(job, steps)
    cadence = math.ceil(float(generation_cadence(Features([setup_from_job(job, knobs)]))[0]) - 1e-9)
    if cadence <= 1:
        return base
    first_round = cadence * math.ceil(job.limits.warmup_steps / cadence)  # steps before the first measured round
    return max(base, first_round + 2 * cadence)


def overrides_against(job: JobSpec, knobs: dict[str, KnobValue]) -> dict[str, KnobValue]:
    """The knobs that differ from job.yaml's baseline (what a verdict lists as the trial's change)."""
    return {k: v for k, v in knobs.items() if job.knobs.get(k) != v}


def measure_run(job: JobSpec, job_path: str | Path, run_dir: str | Path, run_id: str, knobs: dict[str, KnobValue],
                steps: int | None = None, on_output: Callable[[str], None] | None = None,
                on_submit: Callable[[dict], None] | None = None, resume: dict | None = None) -> RecordedRun:
    """Run the job once with ``knobs`` through the run recorder; a job that cannot even start is a failed run.

    ``on_submit`` / ``resume``: see :func:`rltune.profile.record_run`.
    """
    started = time.time()
    try:
        return record_run(job_path, run_dir, job=job, run_id=run_id, overrides=knobs, steps=steps, on_output=on_output,
                          on_submit=on_submit, resume=resume)
    except LaunchError as exc:
        return RecordedRun(run_id=run_id, run_dir=Path(run_dir), knobs={**job.knobs, **knobs}, status="failed",
                           cause="not_started", error=str(exc), started_at=started, finished_at=max(time.time(), started))


def record_case(library: Any, job: JobSpec, run: RecordedRun, forecast: CandidateForecast | None) -> None:
    """Append ``run`` to the case library (a no-op if that exact run is already there)."""
    from rltune.errors import RltuneError
    from rltune.predict.library import case_from_run

    table = run.table
    if table is None:
        from rltune.contracts.stages import rows_to_table

        table = rows_to_table([], "none")
    status = run.status if run.status in ("ok", "failed", "timed_out") else "failed"
    try:
        record = case_from_run(job, run.knobs, table, run.run_id, run.started_at, run.finished_at, status, forecast,
                               run.warmup_steps)
    except RltuneError:
        # A run that finished but whose metrics cannot make an 'ok' case is recorded as failed.
        record = case_from_run(job, run.knobs, table, run.run_id, run.started_at, run.finished_at, "failed", forecast,
                               run.warmup_steps)
    library.append(record)


def library_outcomes(job: JobSpec, records: list[Any]) -> list[tuple[dict[str, KnobValue], str, list[str]]]:
    """(knobs, 'failed' or 'ok', numerical limits it broke) of each of ``job``'s cases in the library.

    What ``rltune auto`` reads from its journal, for ``rltune trial``, which has only the library: each
    case is held to the limits through its means over the measured steps, against the job's untuned
    cases (those with the job's own knobs) as its baseline, or against itself where the library has
    none (the gap is then not measured; the sample ages still are). The oldest sample is the mean of
    each step's oldest, never above the run's: a break it shows is real, one it hides is not counted.
    """
    from rltune.tune.pick import NUMERICAL_LIMITS

    def row(record: Any) -> dict[str, Any]:
        return {**record.measured, "run_id": record.run_id, "step": 0, "warmup": False}

    mine = [r for r in records if r.job == job.name]
    untuned = [row(r) for r in mine if r.status == "ok" and {**job.knobs, **r.knobs} == dict(job.knobs)]
    out = []
    for record in mine:
        knobs = {**job.knobs, **record.knobs}
        if record.status != "ok":
            out.append((knobs, "failed", []))
            continue
        judged = judge(job.limits, untuned or [row(record)], [row(record)], untuned)
        out.append((knobs, "ok", [name for name in judged.failed_names() if name in NUMERICAL_LIMITS]))
    return out


@dataclass
class TrialOutcome:
    verdict: Verdict
    runs: list[RecordedRun]

    @property
    def kept(self) -> bool:
        return self.verdict.kept

    @property
    def exit_code(self) -> int:
        return {"keep": EXIT_KEPT, "reject": EXIT_REJECTED}.get(self.verdict.decision, EXIT_FAILED)


@dataclass
class Baseline:
    """What a trial is compared with: the baseline's run(s) and the untuned job's (gap limit, noise)."""

    run_id: str
    rows: list[dict]
    untuned_run: str
    untuned_rows: list[dict]
    untuned_noise_pct: float | None = None  # the spread measured on the untuned job's repeated runs


def decide(job: JobSpec, job_name: str, candidate: CandidateForecast, runs: list[RecordedRun],
           baseline: Baseline) -> tuple[Verdict, Judgement | None]:
    """The verdict on ``runs`` (one, or two when remeasured) of ``candidate``."""
    run = runs[-1]
    common = dict(schema_version=2, run_id=runs[0].run_id, candidate=candidate.candidate, job=job_name,
                  baseline_run=baseline.run_id, untuned_run=baseline.untuned_run,
                  overrides=overrides_against(job, run.knobs), knobs=dict(run.knobs),
                  forecast_step_s=candidate.step_s, forecast_range_s=list(candidate.range_s),
                  run_dirs=[str(r.run_dir) for r in runs], remeasured=len(runs) > 1)
    if not run.ok:
        reason = f"the job {run.status.replace('_', ' ')}: {run.error}"
        return Verdict(decision="failed", reason=reason, log_tail=run.log_tail, **common), None
    rows = [r for m in runs for r in m.rows]
    judgement = judge(job.limits, baseline.rows, rows, baseline.untuned_rows, baseline.untuned_noise_pct)
    failed = [c for c in judgement.checks if c.passed is False]
    if failed:
        reason = "; ".join(f"{c.name}: {_fmt(c.value)} vs limit {_fmt(c.threshold)}" for c in failed)
        decision = "reject"
    else:
        unmeasured = judgement.not_measured()
        reason = (f"{judgement.gain_pct:.1f}% faster than the baseline (noise {judgement.noise.pct:.3g}%) and every "
                  "measured limit holds" + (f"; not measured: {', '.join(unmeasured)}" if unmeasured else ""))
        decision = "keep"
    measured = judgement.step_s
    error = within = None
    if measured:
        error = 100.0 * (measured - candidate.step_s) / measured
        within = candidate.range_s[0] <= measured <= candidate.range_s[1]
    stages = {name: value for name in STAGE_NAMES
              for value in [mean_over(rows, f"{name}_s", judgement.steps)] if value is not None}
    verdict = Verdict(decision=decision, reason=reason, steps_compared=judgement.steps,
                      baseline_step_s=judgement.baseline_step_s, step_s=measured,
                      baseline_median_s=judgement.baseline_median_s, median_s=judgement.median_s,
                      gain_pct=judgement.gain_pct, noise_pct=judgement.noise.pct, noise_source=judgement.noise.detail,
                      limits=judgement.checks, stages_s=stages, forecast_error_pct=error, within_forecast_range=within,
                      **common)
    return verdict, judgement


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def run_trial(job: JobSpec, job_path: str | Path, candidate: CandidateForecast, *, baseline_knobs: dict[str, KnobValue],
              baseline: Baseline, library: Any, run_root: str | Path, run_id: str, steps: int | None = None,
              remeasure: bool = True, on_run: Callable[[str, str], None] | None = None,
              on_output: Callable[[str], None] | None = None,
              on_submit: Callable[[str, dict], None] | None = None,
              resume: dict[str, dict] | None = None) -> TrialOutcome:
    """Run ``candidate`` on top of ``baseline_knobs``; measure again if its gain is under the recheck bar.

    Writes ``verdict.yaml`` into the first run's directory, then appends every run to ``library``.
    ``on_run(run_id, 'start'|'done')`` lets a live view follow along; ``on_submit(run_id, identity)``
    gets each run's launcher identity; ``resume`` (run id -> identity) records runs an earlier
    process submitted instead of starting them again.
    """
    from rltune.launch.job import LaunchInputError, check_launch, check_steps

    knobs = {**baseline_knobs, **candidate.overrides}
    check_steps(steps)
    steps = trial_steps(job, knobs, steps)
    if steps <= job.limits.warmup_steps:
        raise LaunchInputError(f"--steps {steps}: a trial is timed on the steps after limits.warmup_steps "
                               f"({job.limits.warmup_steps}); give at least {job.limits.warmup_steps + 1}")
    # Input the user must fix (a program not on PATH, an override the knob_map cannot pass) is refused
    # here, before a run directory or a case exists: only a job that started and then failed is recorded.
    check_launch(job, Path(job_path), knobs, steps)
    run_root = Path(run_root)
    runs: list[RecordedRun] = []
    for attempt, rid in enumerate((run_id, f"{run_id}-again")):
        if on_run:
            on_run(rid, "start")
        runs.append(measure_run(job, job_path, run_root / rid, rid, knobs, steps, on_output,
                                on_submit=None if on_submit is None else (lambda ident, rid=rid: on_submit(rid, ident)),
                                resume=(resume or {}).get(rid)))
        if on_run:
            on_run(rid, "done")
        verdict, judgement = decide(job, str(job_path), candidate, runs, baseline)
        if attempt == 1 or not remeasure or judgement is None:
            break
        gain = judgement.gain_pct
        others_pass = all(c.passed is not False for c in judgement.checks if c.name != "speed")
        if gain is None or gain <= 0 or gain >= recheck_threshold(job.limits, judgement.noise.pct) or not others_pass:
            break
    save_verdict(verdict, run_root / run_id / "verdict.yaml")
    for run in runs:
        record_case(library, job, run, candidate)
    return TrialOutcome(verdict=verdict, runs=runs)
