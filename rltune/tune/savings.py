"""The seed's Figure 8: each job's step-time saving split by technique group.

Every kept change saved (its baseline's step - its own step), both timed on the same steps. The
change is counted under the group of its main fix (the first fix of its candidate; a bundle of
fixes tested together cannot be split). A row's shares add up to 100 and, as in the seed, they
describe this tuning path, not each technique's effect alone.
"""

from __future__ import annotations

from collections.abc import Iterable


def shares_by_group(kept: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``[(group, saving_s), ...]`` -> ``{group: % of the total saving}``, largest first.

    A change that saved nothing still appears (0 %). Empty or zero total: every share is 0.
    """
    totals: dict[str, float] = {}
    for group, saving in kept:
        totals[group] = totals.get(group, 0.0) + max(saving, 0.0)
    whole = sum(totals.values())
    shares = {g: (100.0 * s / whole if whole > 0 else 0.0) for g, s in totals.items()}
    return dict(sorted(shares.items(), key=lambda item: -item[1]))


def savings_matrix(jobs: dict[str, Iterable[tuple[str, float]]]) -> tuple[list[str], dict[str, dict[str, float]]]:
    """Rows per job, columns per technique group (ordered by total share): ``(groups, rows)``."""
    rows = {job: shares_by_group(kept) for job, kept in jobs.items()}
    weight: dict[str, float] = {}
    for shares in rows.values():
        for group, share in shares.items():
            weight[group] = weight.get(group, 0.0) + share
    groups = sorted(weight, key=lambda g: (-weight[g], g))
    return groups, {job: {g: shares.get(g, 0.0) for g in groups} for job, shares in rows.items()}
