"""Which candidate runs next: the one rule ``rltune trial`` and ``rltune auto`` share.

A forecast file ranks its candidates in the order to try them (:func:`rltune.predict.forecast.rank_key`:
those worth a trial first, by the optimistic end of their range when the evidence is thin, by the
point forecast otherwise). On top of that order:

- a setup holding every value of a crashed run's set of never-fine values is not run again
  (:func:`holds_a_failed_set`);
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


def pick(forecast: Forecast, baseline_knobs: dict[str, KnobValue], *, failed: Sequence[FailedSet] = (),
         tried: Sequence[dict[str, KnobValue]] = (), allowed: set[str] | None = None) -> CandidateForecast | None:
    """The next candidate worth a trial, or None when no candidate's forecast or range reaches the gate."""
    tried_sets = [dict(t) for t in tried]
    for fc in crash_aware_order(forecast.forecasts, baseline_knobs, failed):
        if not fc.worth_trial or (allowed is not None and fc.candidate not in allowed):
            continue
        setup = {**baseline_knobs, **fc.overrides}
        if holds_a_failed_set(baseline_knobs, fc.overrides, failed) or setup in tried_sets:
            continue
        return fc
    return None
