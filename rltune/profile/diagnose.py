"""Diagnosis of one run's stage table: medians, the limiting stage under the RL mode, and problems.

Public API: :func:`diagnose` (table, rl_mode, warmup_steps=0, run_id=None) -> Diagnosis.

Steps used: every row of the run except those marked warm-up and the first ``warmup_steps`` rows
(if that would leave nothing, all rows are used and a note says so). Every numeric column gets
median, p10 and p90 over the same steps. The trainer stage is ``training_s + old_logprob_s`` per
step (the old-logprob pass runs on the trainer); a stage the source does not measure counts as 0
and a note names it. The step's limiting stage comes from :func:`rltune.steps.combine`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rltune.contracts.diagnosis import DIAGNOSIS_SCHEMA_VERSION, Diagnosis, StageSummary
from rltune.contracts.stages import source_of
from rltune.errors import LogFormatError, RltuneError
from rltune.profile.detectors import RunFacts, detect
from rltune.profile.stats import number
from rltune.steps import RL_MODES, combine

if TYPE_CHECKING:
    import pyarrow as pa


class NotDiagnosableError(RltuneError):
    """The table has no step or stage time for the run, so nothing can be said about what limits it."""


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), without importing numpy for a few numbers."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _round(value: float) -> float:
    return float(f"{value:.6g}")


def _series(rows: list[dict], column: str) -> list[float]:
    return [v for r in rows for v in [number(r.get(column))] if v is not None]


def infer_rl_mode(table: pa.Table) -> tuple[str, str] | None:
    """(mode, reason) when the log itself says how asynchronous the run was (prime-rl's 'Async Level')."""
    if "Async Level" in table.column_names:
        levels = [v for v in table.column("Async Level").to_pylist() if v is not None]
        if levels:
            level = max(levels)
            mode = "sync" if level == 0 else "one_step_async" if level == 1 else "fully_async"
            return mode, f"the log's 'Async Level' is {level:g}"
    return None


def diagnose(table: pa.Table, rl_mode: str, warmup_steps: int = 0, run_id: str | None = None) -> Diagnosis:
    """Diagnose one run of ``table`` (see the module docstring)."""
    if rl_mode not in RL_MODES:
        raise RltuneError(f"unknown RL mode {rl_mode!r}; expected one of {', '.join(RL_MODES)}")
    rows = table.to_pylist()
    run_ids = sorted({r["run_id"] for r in rows})
    if run_id is None:
        if len(run_ids) != 1:
            raise LogFormatError(f"the stage table holds {len(run_ids)} runs ({', '.join(run_ids[:4])}"
                                 f"{', ...' if len(run_ids) > 4 else ''}); pick one with --run-id")
        run_id = run_ids[0]
    rows = sorted((r for r in rows if r["run_id"] == run_id), key=lambda r: r["step"])
    if not rows:
        raise LogFormatError(f"run {run_id!r} is not in the stage table (runs: {', '.join(run_ids[:4])})")
    notes: list[str] = []
    used = [r for i, r in enumerate(rows) if not r["warmup"] and i >= warmup_steps]
    if not used:
        used = rows
        notes.append(f"all {len(rows)} steps are warm-up; medians use them anyway")
    numeric = [f.name for f in table.schema if str(f.type) in ("double", "float", "int64")
               and f.name != "step" and "/bucket/" not in f.name]
    stages: dict[str, StageSummary] = {}
    median: dict[str, float] = {}
    p90: dict[str, float] = {}
    for column in numeric:
        values = _series(used, column)
        if not values:
            continue
        median[column] = _quantile(values, 0.5)
        p90[column] = _quantile(values, 0.9)
        stages[column] = StageSummary(median_s=_round(median[column]), p10_s=_round(_quantile(values, 0.1)),
                                      p90_s=_round(p90[column]))

    def stage_median(columns: tuple[str, ...]) -> float | None:
        per_step = []
        for r in used:
            parts = [number(r.get(c)) for c in columns]
            if parts[0] is None:
                continue
            per_step.append(sum(p for p in parts if p is not None))
        return _quantile(per_step, 0.5) if per_step else None

    for column in ("step_s", "rollout_s", "training_s", "old_logprob_s", "weight_sync_s"):
        holes = [int(r["step"]) for r in used if isinstance(r.get(column), float) and not math.isfinite(r[column])]
        if holes:
            notes.append(f"{column} is NaN or infinite on steps {holes[:8]}{' ...' if len(holes) > 8 else ''}: "
                         "left out of every median and mean, check the job's logging")

    rollout = stage_median(("rollout_s",))
    training = stage_median(("training_s", "old_logprob_s"))
    if training is None:
        training = stage_median(("old_logprob_s",))
    weight_sync = stage_median(("weight_sync_s",))
    step_measured = median.get("step_s")
    step_values = _series(used, "step_s")
    step_mean = sum(step_values) / len(step_values) if step_values else None
    measured_stages = {"rollout": rollout, "training": training, "weight_sync": weight_sync}
    if all(v is None for v in measured_stages.values()):
        if step_measured is None:
            raise NotDiagnosableError(f"run {run_id!r} has no step or stage time (source {source_of(table)}); "
                                      "the log does not time its steps — see the profile report's notes")
        limiting = "unknown"
        step_model = step_measured
        notes.append("no stage times in the source: only the step time is known, the limiting stage is not")
    else:
        for name, value in measured_stages.items():
            if value is None:
                notes.append(f"{name} is not measured by the source; counted as 0 s")
        step_model, limiting = combine(rl_mode, rollout or 0.0, training or 0.0, weight_sync or 0.0)
    if step_measured is None:
        step_measured = step_model
        notes.append("step_s is not in the source; the step median is the RL-mode rule's value")
    if "old_logprob_s" in median and training is not None:
        notes.append("the training stage includes the separate old/ref log-prob pass (old_logprob_s)")
    facts = RunFacts(rl_mode=rl_mode, median=median, p90=p90, rollout=rollout or 0.0, training=training or 0.0,
                     weight_sync=weight_sync or 0.0, step_median=step_measured, step_model=step_model)
    problems = detect(facts) if limiting != "unknown" else []
    return Diagnosis(
        schema_version=DIAGNOSIS_SCHEMA_VERSION, run_id=str(run_id), source=source_of(table), rl_mode=rl_mode,
        steps_used=[int(r["step"]) for r in used], step_median_s=_round(step_measured),
        step_mean_s=None if step_mean is None else _round(step_mean),
        step_model_s=_round(step_model), limiting_stage=limiting, stages=stages, problems=problems,
        stage_medians_s={k: (None if v is None else _round(v)) for k, v in measured_stages.items()},
        notes=notes,
    )
