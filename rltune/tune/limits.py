"""Acceptance limits: is a trial faster than its baseline beyond noise, and within every limit?

All limits are fixed before the run (job.yaml ``limits``). Baseline and trial are timed on the
same step indices with warm-up steps left out, so a slow first step or a different step count
cannot tilt the comparison.

- speed: % faster than the baseline's median step; must exceed ``noise_pct``.
- gap: the trial's mean trainer-rollout gap <= ``gap_ratio_max`` x the untuned baseline's.
- sample age: the trial's mean age <= ``sample_age_mean_max``; its oldest sample <= ``sample_age_max``.
- trials cut off / failed: the trial's shares are no higher than the baseline's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rltune.contracts.job import Limits
from rltune.contracts.verdict import LimitCheck

# Below this mean |logp_train - logp_rollout| (nats) a gap is numerical noise of the kernels, not a
# mismatch: a ratio of two such gaps says nothing, so the gap limit never drops under
# gap_ratio_max x this floor. The seed's untuned gaps are 0.005-0.05, well above it.
GAP_NOISE_FLOOR = 1e-3

Row = dict[str, Any]


def rows_of(table: Any) -> list[Row]:
    """Rows of a stage table (a pyarrow Table or already a list of dicts)."""
    return table if isinstance(table, list) else table.to_pylist()


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def measured_steps(rows: Iterable[Row]) -> dict[int, Row]:
    """Non-warm-up rows with a step time, by step index."""
    return {int(r["step"]): r for r in rows if not r.get("warmup") and _number(r.get("step_s")) is not None}


def comparable_steps(*tables: Sequence[Row]) -> list[int]:
    """Step indices every run measured outside its warm-up: the steps a comparison is timed on."""
    common: set[int] | None = None
    for rows in tables:
        steps = set(measured_steps(rows))
        common = steps if common is None else common & steps
    return sorted(common or ())


def median_over(rows: Sequence[Row], column: str, steps: Sequence[int]) -> float | None:
    """Median of ``column`` over ``steps`` (pooled when several runs hold the same step)."""
    wanted = set(steps)
    values = [v for r in rows if int(r["step"]) in wanted and not r.get("warmup")
              for v in [_number(r.get(column))] if v is not None]
    return statistics.median(values) if values else None


def mean_over(rows: Sequence[Row], column: str, steps: Sequence[int] | None = None) -> float | None:
    values = [v for r in rows if not r.get("warmup") and (steps is None or int(r["step"]) in set(steps))
              for v in [_number(r.get(column))] if v is not None]
    return sum(values) / len(values) if values else None


def max_over(rows: Sequence[Row], column: str, steps: Sequence[int]) -> float | None:
    values = [v for r in rows if not r.get("warmup") and int(r["step"]) in set(steps)
              for v in [_number(r.get(column))] if v is not None]
    return max(values) if values else None


def trial_share(rows: Sequence[Row], column: str, steps: Sequence[int] | None) -> float | None:
    """Share of trials counted in ``column`` (cut off / failed) over the steps, or None if unreported."""
    counted = total = 0.0
    seen = False
    for r in rows:
        if r.get("warmup") or (steps is not None and int(r["step"]) not in set(steps)):
            continue
        part, whole = _number(r.get(column)), _number(r.get("trials_total"))
        if part is None or not whole:
            continue
        seen = True
        counted += part
        total += whole
    return counted / total if seen and total > 0 else None


def gain_pct(baseline_s: float, candidate_s: float) -> float:
    """% by which the candidate's step is faster than the baseline's (negative: slower)."""
    return 100.0 * (baseline_s - candidate_s) / baseline_s


def recheck_threshold(limits: Limits) -> float:
    """A gain below this % is measured again before deciding (default: twice the noise)."""
    return limits.recheck_below_pct if limits.recheck_below_pct is not None else 2.0 * limits.noise_pct


@dataclass
class Judgement:
    """The comparison of a trial with its baseline on the same steps."""

    steps: list[int]
    baseline_step_s: float | None
    step_s: float | None
    gain_pct: float | None
    checks: list[LimitCheck]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def failed_names(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]


def judge(limits: Limits, baseline: Sequence[Row], candidate: Sequence[Row], untuned: Sequence[Row]) -> Judgement:
    """Hold ``candidate`` (one or more runs' rows) to every limit against ``baseline`` and ``untuned``."""
    steps = comparable_steps(baseline, candidate)
    checks: list[LimitCheck] = []
    base_s = median_over(baseline, "step_s", steps) if steps else None
    cand_s = median_over(candidate, "step_s", steps) if steps else None
    # Rounded so that float noise cannot turn a gain of exactly the noise into a pass.
    gain = round(gain_pct(base_s, cand_s), 6) if base_s and cand_s is not None else None
    if gain is None:
        checks.append(LimitCheck(name="speed", value=None, threshold=limits.noise_pct, passed=False,
                                 detail="no step measured by both runs outside warm-up"))
    else:
        checks.append(LimitCheck(name="speed", value=gain, threshold=limits.noise_pct, passed=gain > limits.noise_pct,
                                 detail=f"median step {cand_s:.4g} s vs baseline {base_s:.4g} s over steps {steps}; "
                                        f"must be faster by more than the {limits.noise_pct:g}% noise"))

    untuned_gap = mean_over(untuned, "gap")
    gap = mean_over(candidate, "gap", steps)
    if untuned_gap is None:
        checks.append(LimitCheck(name="gap", value=gap, threshold=None, passed=True,
                                 detail="the untuned baseline reported no gap; nothing to hold the trial to"))
    else:
        bound = limits.gap_ratio_max * max(untuned_gap, GAP_NOISE_FLOOR)
        checks.append(LimitCheck(
            name="gap", value=gap, threshold=bound, passed=gap is not None and gap <= bound,
            detail=(f"mean gap {gap:.4g} vs {limits.gap_ratio_max:g} x untuned {untuned_gap:.4g} "
                    f"(floor {GAP_NOISE_FLOOR:g})") if gap is not None else "the trial reported no gap"))

    age_mean = mean_over(candidate, "sample_age_mean", steps)
    age_max = max_over(candidate, "sample_age_max", steps)
    checks.append(LimitCheck(name="sample_age_mean", value=age_mean, threshold=limits.sample_age_mean_max,
                             passed=age_mean is None or age_mean <= limits.sample_age_mean_max,
                             detail="mean sample age in weight versions" if age_mean is not None else "not reported"))
    checks.append(LimitCheck(name="sample_age_max", value=age_max, threshold=float(limits.sample_age_max),
                             passed=age_max is None or age_max <= limits.sample_age_max,
                             detail="oldest sample in weight versions" if age_max is not None else "not reported"))

    for name, column in (("trials_cut_off", "trials_cut_off"), ("trials_failed", "trials_failed")):
        share = trial_share(candidate, column, steps)
        base_share = trial_share(baseline, column, steps)
        if share is None or base_share is None:
            checks.append(LimitCheck(name=name, value=share, threshold=base_share, passed=share is None or base_share is None,
                                     detail="not reported by both runs"))
        else:
            checks.append(LimitCheck(name=name, value=share, threshold=base_share, passed=share <= base_share,
                                     detail=f"share of trials; the baseline's is {base_share:.3g}"))
    return Judgement(steps=steps, baseline_step_s=base_s, step_s=cand_s, gain_pct=gain, checks=checks)
