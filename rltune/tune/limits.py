"""Acceptance limits: is a trial faster than its baseline beyond noise, and within every limit?

All limits are fixed before the run (job.yaml ``limits``). Baseline and trial are timed on the
same step indices with warm-up steps left out, so a slow first step or a different step count
cannot tilt the comparison.

- speed: % by which the trial's **mean** step (the wall time a user pays per step) beats the
  baseline's, over the shared steps; the median is reported beside it. It must exceed the noise
  (:func:`measured_noise`): the baseline's own measured spread -- the range of its repeated runs'
  means, and twice each run's standard error of the mean (from pairs of steps) -- with ``limits.noise_pct`` as the floor.
- gap: the trial's mean trainer-rollout gap <= ``gap_ratio_max`` x the untuned baseline's.
- sample age: the trial's mean age <= ``sample_age_mean_max``; its oldest sample <= ``sample_age_max``.
- trials cut off / failed: the trial's shares are no higher than the baseline's.

A limit whose value no run reports (a framework that logs no trainer-rollout gap) is **not
measured**: its check has ``passed: null``. It does not block a keep, and every report says it was
not measured; it is never shown as passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rltune.contracts.job import Limits
from rltune.contracts.verdict import LimitCheck
from rltune.profile.stats import (
    comparable_steps,
    max_over,
    mean_over,
    median_over,
    number,
    rounds_problem,
    standard_error_frac,
    whole_rounds,
)

# Below this mean |logp_train - logp_rollout| (nats) a gap is numerical noise of the kernels, not a
# mismatch: a ratio of two such gaps says nothing, so the gap limit never drops under
# gap_ratio_max x this floor. The seed's untuned gaps are 0.005-0.05, well above it.
GAP_NOISE_FLOOR = 1e-3
# A run's mean step is uncertain by about two standard errors (a 95 % interval's half-width).
STANDARD_ERRORS = 2.0

Row = dict[str, Any]

__all__ = ["GAP_NOISE_FLOOR", "Judgement", "Noise", "comparable_steps", "gain_pct", "judge", "measured_noise",
           "recheck_threshold", "rows_of"]


def rows_of(table: Any) -> list[Row]:
    """Rows of a stage table (a pyarrow Table or already a list of dicts)."""
    return table if isinstance(table, list) else table.to_pylist()


def trial_share(rows: Sequence[Row], column: str, steps: Sequence[int] | None) -> float | None:
    """Share of trials counted in ``column`` (cut off / failed) over the steps, or None if unreported."""
    counted = total = 0.0
    seen = False
    for r in rows:
        if r.get("warmup") or (steps is not None and int(r["step"]) not in set(steps)):
            continue
        part, whole = number(r.get(column)), number(r.get("trials_total"))
        if part is None or not whole:
            continue
        seen = True
        counted += part
        total += whole
    return counted / total if seen and total > 0 else None


def gain_pct(baseline_s: float, candidate_s: float) -> float:
    """% by which the candidate's step is faster than the baseline's (negative: slower)."""
    return 100.0 * (baseline_s - candidate_s) / baseline_s


def recheck_threshold(limits: Limits, noise_pct: float | None = None) -> float:
    """A gain below this % is measured again before deciding (default: twice the noise)."""
    if limits.recheck_below_pct is not None:
        return limits.recheck_below_pct
    return 2.0 * max(limits.noise_pct, noise_pct or 0.0)


@dataclass(frozen=True)
class Noise:
    """The % a trial must beat, and where that number came from."""

    pct: float
    measured_pct: float | None  # the spread measured on the baseline runs (None: nothing to measure)
    runs: int  # baseline runs it was measured on
    detail: str

    @property
    def from_measurement(self) -> bool:
        return self.measured_pct is not None and self.measured_pct > self.pct - 1e-12 and self.pct > 0


def _by_run(rows: Sequence[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(str(r.get("run_id", "")), []).append(r)
    return out


def measured_noise(limits: Limits, baseline: Sequence[Row], steps: Sequence[int] | None = None,
                   extra_pct: float | None = None) -> Noise:
    """The noise a trial against ``baseline`` (one or more runs' rows) must beat, in %.

    The baseline's measured spread is the range of its runs' mean steps (two or more runs) relative
    to their mean, and twice each run's standard error of its mean step; ``extra_pct`` (the spread
    measured on the untuned job's repeated runs, which a setup measured once carries over) joins
    them. ``limits.noise_pct`` is the floor.
    """
    runs = _by_run(baseline)
    means = [m for rows in runs.values() for m in [mean_over(rows, "step_s", steps)] if m is not None]
    parts: list[tuple[float, str]] = []
    if len(means) >= 2:
        centre = sum(means) / len(means)
        parts.append((100.0 * (max(means) - min(means)) / centre,
                      f"range of {len(means)} baseline runs' mean steps ({min(means):.4g}-{max(means):.4g} s)"))
    for run_id, rows in runs.items():
        se = standard_error_frac(rows, "step_s", steps)
        if se is not None:
            parts.append((100.0 * STANDARD_ERRORS * se, f"2 standard errors of run {run_id}'s mean step"))
    if extra_pct is not None and extra_pct > 0:
        parts.append((extra_pct, "the untuned job's measured spread"))
    measured = max(parts, default=None)
    if measured is None or measured[0] <= limits.noise_pct:
        what = f"; measured {measured[0]:.3g}% ({measured[1]})" if measured else ""
        return Noise(limits.noise_pct, measured[0] if measured else None, len(means),
                     f"the job's noise floor limits.noise_pct{what}")
    return Noise(round(measured[0], 6), measured[0], len(means), measured[1])


@dataclass
class Judgement:
    """The comparison of a trial with its baseline on the same steps."""

    steps: list[int]
    baseline_step_s: float | None
    step_s: float | None
    gain_pct: float | None
    checks: list[LimitCheck]
    noise: Noise
    baseline_median_s: float | None = None
    median_s: float | None = None

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed is not False for c in self.checks)

    def failed_names(self) -> list[str]:
        return [c.name for c in self.checks if c.passed is False]

    def not_measured(self) -> list[str]:
        return [c.name for c in self.checks if c.passed is None]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def judge(limits: Limits, baseline: Sequence[Row], candidate: Sequence[Row], untuned: Sequence[Row],
          untuned_noise_pct: float | None = None) -> Judgement:
    """Hold ``candidate`` (one or more runs' rows) to every limit against ``baseline`` and ``untuned``."""
    steps = comparable_steps(baseline, candidate) if baseline and candidate else []
    base_steps = steps
    if baseline and candidate and not steps and whole_rounds(baseline) and whole_rounds(candidate):
        # No whole round of both fits in the steps both ran (the candidate's rounds are longer than
        # the baseline ran): each is timed on its own whole rounds, a step's cost over its rounds.
        steps, base_steps = whole_rounds(candidate), whole_rounds(baseline)
    checks: list[LimitCheck] = []
    base_s = mean_over(baseline, "step_s", base_steps) if steps else None
    cand_s = mean_over(candidate, "step_s", steps) if steps else None
    noise = measured_noise(limits, baseline, base_steps or None, untuned_noise_pct)
    # Rounded so that float noise cannot turn a gain of exactly the noise into a pass.
    gain = round(gain_pct(base_s, cand_s), 6) if base_s and cand_s is not None else None
    base_med = median_over(baseline, "step_s", base_steps) if steps else None
    cand_med = median_over(candidate, "step_s", steps) if steps else None
    if gain is None:
        checks.append(LimitCheck(name="speed", value=None, threshold=noise.pct, passed=False,
                                 detail=rounds_problem(baseline, candidate) or "no step measured by both runs outside warm-up"))
    else:
        where = f"steps {steps}" if base_steps == steps else f"steps {steps} (baseline: its steps {base_steps})"
        checks.append(LimitCheck(
            name="speed", value=gain, threshold=noise.pct, passed=gain > noise.pct,
            detail=(f"mean step {cand_s:.4g} s vs baseline {base_s:.4g} s over {where} (medians {_fmt(cand_med)} vs "
                    f"{_fmt(base_med)} s); must be faster by more than the noise, {noise.pct:.3g}%: {noise.detail}")))

    untuned_gap = mean_over(untuned, "gap")
    gap = mean_over(candidate, "gap", steps)
    if untuned_gap is None:
        checks.append(LimitCheck(name="gap", value=gap, threshold=None, passed=None,
                                 detail="not measured: the untuned baseline reported no trainer-rollout gap"))
    else:
        bound = limits.gap_ratio_max * max(untuned_gap, GAP_NOISE_FLOOR)
        checks.append(LimitCheck(
            name="gap", value=gap, threshold=bound, passed=gap is not None and gap <= bound,
            detail=(f"mean gap {gap:.4g} vs {limits.gap_ratio_max:g} x untuned {untuned_gap:.4g} "
                    f"(floor {GAP_NOISE_FLOOR:g})") if gap is not None else "the trial reported no gap; the untuned run did"))

    age_mean = mean_over(candidate, "sample_age_mean", steps)
    age_max = max_over(candidate, "sample_age_max", steps)
    checks.append(LimitCheck(name="sample_age_mean", value=age_mean, threshold=limits.sample_age_mean_max,
                             passed=None if age_mean is None else age_mean <= limits.sample_age_mean_max,
                             detail="mean sample age in weight versions" if age_mean is not None else "not measured"))
    checks.append(LimitCheck(name="sample_age_max", value=age_max, threshold=float(limits.sample_age_max),
                             passed=None if age_max is None else age_max <= limits.sample_age_max,
                             detail="oldest sample in weight versions" if age_max is not None else "not measured"))

    for name, column in (("trials_cut_off", "trials_cut_off"), ("trials_failed", "trials_failed")):
        share = trial_share(candidate, column, steps)
        base_share = trial_share(baseline, column, base_steps)
        if share is None or base_share is None:
            checks.append(LimitCheck(name=name, value=share, threshold=base_share, passed=None,
                                     detail="not measured by both runs"))
        else:
            checks.append(LimitCheck(name=name, value=share, threshold=base_share, passed=share <= base_share,
                                     detail=f"share of trials; the baseline's is {base_share:.3g}"))
    return Judgement(steps=steps, baseline_step_s=base_s, step_s=cand_s, gain_pct=gain, checks=checks, noise=noise,
                     baseline_median_s=base_med, median_s=cand_med)

