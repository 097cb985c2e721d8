"""Statistics over the rows of stage tables: the steps a comparison is timed on, means, medians, spread.

One place for what "the step time of a run" means, so that profile, trial, the case library and
the acceptance limits can never disagree:

- only non-warm-up rows with a finite value count (a NaN is a hole, never a number);
- a comparison is timed on the step indices every run measured (:func:`comparable_steps`);
- the step time a user pays is the **mean** over those steps (wall time per step): fully async
  steps alternate (1.6 / 8.2 / 1.7 / 7.4 s), and a median of such steps misstates the cost by up
  to 40 %. The median is reported beside it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

Row = dict[str, Any]


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None (missing, a bool, NaN or infinite)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def measured_steps(rows: Iterable[Row], column: str = "step_s") -> dict[int, Row]:
    """Non-warm-up rows with a finite ``column``, by step index."""
    return {int(r["step"]): r for r in rows if not r.get("warmup") and number(r.get(column)) is not None}


def comparable_steps(*tables: Sequence[Row]) -> list[int]:
    """Step indices every run measured outside its warm-up: the steps a comparison is timed on."""
    common: set[int] | None = None
    for rows in tables:
        steps = set(measured_steps(rows))
        common = steps if common is None else common & steps
    return sorted(common or ())


def values_over(rows: Sequence[Row], column: str, steps: Sequence[int] | None = None) -> list[float]:
    """Finite values of ``column`` over ``steps`` (all measured steps if None), warm-up left out."""
    wanted = None if steps is None else set(steps)
    return [v for r in rows if not r.get("warmup") and (wanted is None or int(r["step"]) in wanted)
            for v in [number(r.get(column))] if v is not None]


def mean_over(rows: Sequence[Row], column: str, steps: Sequence[int] | None = None) -> float | None:
    """Mean of ``column`` over ``steps`` (pooled when several runs hold the same step)."""
    values = values_over(rows, column, steps)
    return sum(values) / len(values) if values else None


def median_over(rows: Sequence[Row], column: str, steps: Sequence[int] | None = None) -> float | None:
    """Median of ``column`` over ``steps`` (pooled when several runs hold the same step)."""
    values = values_over(rows, column, steps)
    return statistics.median(values) if values else None


def max_over(rows: Sequence[Row], column: str, steps: Sequence[int] | None = None) -> float | None:
    values = values_over(rows, column, steps)
    return max(values) if values else None


def relative_spread(means: Sequence[float]) -> float | None:
    """Sample standard deviation of run means relative to their mean (None with fewer than two)."""
    if len(means) < 2:
        return None
    centre = sum(means) / len(means)
    if centre <= 0:
        return None
    return statistics.stdev(means) / centre


def standard_error_frac(rows: Sequence[Row], column: str = "step_s", steps: Sequence[int] | None = None) -> float | None:
    """Standard error of the mean of ``column`` over ``steps``, as a fraction of the mean.

    Computed from the means of consecutive pairs of steps (batch means): fully async steps
    alternate (a burst of finished groups, then a wait), and such a pattern averages out within
    each pair, whereas treating the steps as independent would count it as noise. For independent
    steps the two estimates agree. Fewer than four steps: from the single steps.
    """
    values = [v for _, v in sorted((int(r["step"]), v) for r in rows if not r.get("warmup")
                                   and (steps is None or int(r["step"]) in set(steps))
                                   for v in [number(r.get(column))] if v is not None)]
    if len(values) < 2:
        return None
    centre = sum(values) / len(values)
    if centre <= 0:
        return None
    if len(values) >= 4:
        pairs = [(values[i] + values[i + 1]) / 2 for i in range(0, len(values) - 1, 2)]
        return statistics.stdev(pairs) / math.sqrt(len(pairs)) / centre
    return statistics.stdev(values) / math.sqrt(len(values)) / centre
