"""Which candidate runs next: the one rule ``rltune trial`` and ``rltune auto`` share.

A forecast file ranks its candidates in the order to try them (:func:`rltune.predict.forecast.rank_key`:
those worth a trial first, by the optimistic end of their range when the evidence is thin, by the
point forecast otherwise). On top of that order:

- a setup holding every value of a crashed run's set of never-fine values is not run again
  (:func:`holds_a_failed_set`);
- nor is one holding every value of a run that broke a numerical limit (gap, sample age, trial shares)
  that no run holding that limit had (:func:`limit_breaking_settings`): fully async broke the gap
  limit from one baseline, so it is not tried again from the next, and once two different setups
  with it broke the gap it is banned whatever comes with it; unlike a crash, such a run leaves the
  order of the others alone (it cost one run, not a time-out, and says nothing about them);
- setups sharing fewer values with crashed runs go first: after a crash of a setup that changed
  several knobs, the culprit is one of them (:func:`crash_aware_order`);
- a setup already measured is not run again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rltune.contracts.forecast import CandidateForecast, Forecast
from rltune.contracts.job import KnobValue
from rltune.predict.forecast import rank_key

FailedSet = set[tuple[str, Any]]

# The limits a setting breaks by what it is (a stale policy, cut-off or failing trials), not by how
# fast it ran: "speed" is left out, a slow setup may be fast combined with others.
NUMERICAL_LIMITS = ("gap", "sample_age_mean", "sample_age_max", "trials_cut_off", "trials_failed")


def holds_a_failed_set(baseline_knobs: dict[str, KnobValue], overrides: dict[str, KnobValue],
                       failed: Sequence[FailedSet]) -> bool:
    """True if the setup holds every value of some crashed run's set."""
    setup = set({**baseline_knobs, **overrides}.items())
    return any(f <= setup for f in failed)


def crash_aware_order(forecasts: Iterable[CandidateForecast], baseline_knobs: dict[str, KnobValue],
                      failed: Sequence[FailedSet]) -> list[CandidateForecast]:
    """The forecasts in trial order, setups sharing fewer values with crashed runs first."""
    suspect = set().union(*failed) if failed else set()
    return sorted(forecasts, key=lambda f: (len(suspect & set({**baseline_knobs, **f.overrides}.items())), rank_key(f)))


def failed_settings(finished: Iterable[tuple[dict[str, KnobValue], str]]) -> list[FailedSet]:
    """Per run that crashed or hung, the knob values it tried that never ran fine anywhere.

    ``finished`` holds (knobs, decision) of every measured run ('failed' for a crash or hang). A
    set of one value bans that value; a set of several bans only their combination.
    """
    finished = list(finished)
    ran_fine = {item for knobs, decision in finished if decision != "failed" for item in knobs.items()}
    failed = [set(knobs.items()) - ran_fine for knobs, decision in finished if decision == "failed"]
    return [f for f in failed if f]


def limit_breaking_settings(finished: Iterable[tuple[dict[str, KnobValue], str, Iterable[str]]]) -> list[FailedSet]:
    """Per run that broke a numerical limit, per limit it broke, the knob values it tried that no run
    holding that limit had; and what two such sets for one limit share.

    ``finished`` holds (knobs, decision, names of the limits the run broke) of every measured run; a
    run that crashed or hung held nothing, the untuned baseline holds every limit (they are set
    against it). A set of one value bans that value; a set of several bans only their combination.
    Two different sets that broke the same limit point at their common part: fully async with a
    larger token budget, then fully async with more concurrency, both over the gap limit, ban fully
    async alone, where each set would have banned only its own pair.
    """
    runs = [(knobs, decision, set(broke)) for knobs, decision, broke in finished]
    out: list[FailedSet] = []
    for limit in NUMERICAL_LIMITS:
        held = {item for other, decision, other_broke in runs
                if decision != "failed" and limit not in other_broke for item in other.items()}
        broken: list[FailedSet] = []
        for knobs, _, broke in runs:
            values = set(knobs.items()) - held
            if limit in broke and values and values not in broken:
                broken.append(values)
        shared = [a & b for i, a in enumerate(broken) for b in broken[i + 1:] if a & b]
        for values in (*broken, *shared):
            if values not in out:
                out.append(values)
    return out


def pick(forecast: Forecast, baseline_knobs: dict[str, KnobValue], *, failed: Sequence[FailedSet] = (),
         broke_limits: Sequence[FailedSet] = (), tried: Sequence[dict[str, KnobValue]] = (),
         allowed: set[str] | None = None) -> CandidateForecast | None:
    """The next candidate worth a trial, or None when no candidate's forecast or range reaches the gate.

    ``failed``: :func:`failed_settings` (banned, and suspects go last); ``broke_limits``:
    :func:`limit_breaking_settings` (banned only)."""
    tried_sets = [dict(t) for t in tried]
    banned = [*failed, *broke_limits]
    for fc in crash_aware_order(forecast.forecasts, baseline_knobs, failed):
        if not fc.worth_trial or (allowed is not None and fc.candidate not in allowed):
            continue
        setup = {**baseline_knobs, **fc.overrides}
        if holds_a_failed_set(baseline_knobs, fc.overrides, banned) or setup in tried_sets:
            continue
        return fc
    return None
