"""Statistics over the rows of stage tables: the steps a comparison is timed on, means, medians, spread.

One place for what "the step time of a run" means, so that profile, trial, the case library and
the acceptance limits can never disagree:

- only non-warm-up rows with a finite value count (a NaN is a hole, never a number);
- a comparison is timed on the step indices every run measured (:func:`comparable_steps`);
- the step time a user pays is the **mean** over those steps (wall time per step): fully async
  steps alternate (1.6 / 8.2 / 1.7 / 7.4 s), and a median of such steps misstates the cost by up
  to 40 %. The median is reported beside it;
- where one generation round feeds several optimizer steps (TRL's ``generation_batch_size`` beyond
  one step's samples, ``num_iterations``), only the round's first step generates (TRL on an H200,
  batch reuse 4: 3.8 / 1.1 / 0.9 / 0.6 s), so a mean over a window that holds a partial round is
  wrong by up to a round's generation. Steps are then taken in **whole rounds**
  (:func:`generation_cycle`, :func:`whole_rounds`), and a run that measured no whole round has no
  step time.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
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


def comparable_steps_raw(*tables: Sequence[Row]) -> list[int]:
    """Step indices every run measured outside its warm-up, whole rounds or not."""
    common: set[int] | None = None
    for rows in tables:
        steps = set(measured_steps(rows))
        common = steps if common is None else common & steps
    return sorted(common or ())


# A step generated when its rollout took more than this share of the run's median step; a step that
# trains on an earlier round's samples reports the timer's floor (TRL: 0.1 ms against seconds).
GENERATED_SHARE = 0.01


def generating_steps(rows: Iterable[Row]) -> list[int] | None:
    """Step indices (warm-up included) whose rollout generated; None without a rollout column."""
    rows = list(rows)
    rollouts = {int(r["step"]): v for r in rows for v in [number(r.get("rollout_s"))] if v is not None}
    steps = [v for r in rows for v in [number(r.get("step_s"))] if v is not None]
    if not rollouts or not steps:
        return None
    floor = GENERATED_SHARE * statistics.median(steps)
    return sorted(step for step, value in rollouts.items() if value > floor)


def generation_cycle(rows: Sequence[Row]) -> int | None:
    """Optimizer steps one generation round feeds: 1 when every step generates (or nothing says
    otherwise), the most common distance between generating steps when some do not, None when the
    run generated once or never in its rows (a round longer than the run)."""
    generating = generating_steps(rows)
    timed = {int(r["step"]) for r in rows if number(r.get("rollout_s")) is not None}  # a hole says nothing
    if generating is None or len(generating) == len(timed):
        return 1
    if len(generating) < 2:
        return None
    gaps = Counter(b - a for a, b in zip(generating, generating[1:], strict=False))
    return max(gaps, key=lambda gap: (gaps[gap], gap))


def whole_rounds(*tables: Sequence[Row], steps: Iterable[int] | None = None) -> list[int]:
    """The longest run of whole generation rounds inside ``steps`` (default: the steps every table
    measured) that starts where every table with rounds of several steps generates; ``steps``
    itself when every table generates each step; [] when no whole round fits."""
    common = set(comparable_steps_raw(*tables)) if steps is None else set(steps)
    cycles = [generation_cycle(rows) for rows in tables]
    if all(c == 1 for c in cycles):
        return sorted(common)
    if any(c is None for c in cycles):
        return []
    length = math.lcm(*cycles)
    starts = None
    for rows, cycle in zip(tables, cycles, strict=True):
        if cycle > 1:
            mine = set(generating_steps(rows) or ())
            starts = mine if starts is None else starts & mine
    for start in sorted(starts & common):
        rounds = 0
        while all(start + rounds * length + i in common for i in range(length)):
            rounds += 1
        if rounds:
            return list(range(start, start + rounds * length))
    return []


def comparable_steps(*tables: Sequence[Row]) -> list[int]:
    """The steps a comparison is timed on: those every run measured outside its warm-up, in whole
    generation rounds (:func:`whole_rounds`)."""
    return whole_rounds(*tables)


def rounds_problem(*tables: Sequence[Row]) -> str | None:
    """Why :func:`comparable_steps` is empty although the runs measured steps, in words; else None."""
    common = comparable_steps_raw(*tables)
    if not common or whole_rounds(*tables):
        return None
    cycles = [generation_cycle(rows) for rows in tables]
    feeds = "longer than the run" if any(c is None for c in cycles) else f"{max(c for c in cycles if c)} steps"
    return (f"a generation round feeds {feeds} and the measured steps {common[0]}-{common[-1]} hold no whole "
            "round; raise limits.steps (or --steps) to the warm-up plus at least two rounds")


def values_over(rows: Sequence[Row], column: str, steps: Sequence[int] | None = None) -> list[float]:
    """Finite values of ``column`` over ``steps`` (None: the run's measured steps in whole rounds),
    warm-up left out."""
    wanted = set(whole_rounds(rows)) if steps is None else set(steps)
    return [v for r in rows if not r.get("warmup") and int(r["step"]) in wanted
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

    Computed from the means of consecutive blocks of steps (batch means): fully async steps
    alternate (a burst of finished groups, then a wait), and such a pattern averages out within
    each pair, whereas treating the steps as independent would count it as noise; a generation
    round of several steps is one block. For independent steps the estimates agree. Fewer than two
    blocks of a round, or fewer than four single steps: from the single steps if each generates,
    else None (one round says nothing of the next).
    """
    wanted = set(whole_rounds(rows)) if steps is None else set(steps)
    values = [v for _, v in sorted((int(r["step"]), v) for r in rows if not r.get("warmup")
                                   and int(r["step"]) in wanted
                                   for v in [number(r.get(column))] if v is not None)]
    if len(values) < 2:
        return None
    centre = sum(values) / len(values)
    if centre <= 0:
        return None
    cycle = generation_cycle(rows) or 0
    block = cycle if cycle > 1 else 2
    if cycle > 1 and len(values) < 2 * block:
        return None
    if len(values) >= 2 * block:
        blocks = [sum(values[i:i + block]) / block for i in range(0, len(values) - block + 1, block)]
        return statistics.stdev(blocks) / math.sqrt(len(blocks)) / centre
    return statistics.stdev(values) / math.sqrt(len(values)) / centre
