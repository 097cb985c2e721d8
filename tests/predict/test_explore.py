"""Exploring while unsure: which forecasts are worth a trial, and in which order the tuner tries them."""

from __future__ import annotations

import pytest

from rltune.contracts.forecast import CandidateForecast, Forecast
from rltune.predict.forecast import finish, rank_key
from rltune.tune.pick import pick

BASELINE = CandidateForecast(candidate="baseline", overrides={}, stages_s={"rollout": 6.0, "training": 3.0, "weight_sync": 1.0},
                             step_s=10.0, range_s=[9.0, 11.0], limiting_stage="rollout", method="anchor", rl_mode="sync")


def forecast(name: str, step: float, low: float, high: float, *, method: str = "anchor", uncertain=(),
             rollout: float = 6.0, overrides=None, aimed: bool = False) -> CandidateForecast:
    fc = CandidateForecast(candidate=name, overrides=overrides or {"knob": name}, step_s=step, range_s=[low, high],
                           stages_s={"rollout": rollout, "training": 3.0, "weight_sync": step - rollout - 3.0},
                           limiting_stage="rollout", method=method, rl_mode="sync", uncertain=list(uncertain))
    return finish(fc, BASELINE, 5.0, "rollout", aimed=aimed)


def test_a_point_forecast_at_the_gate_is_worth_a_trial():
    fc = forecast("a", 9.5, 8.0, 11.0)
    assert fc.worth == "point" and fc.worth_trial and fc.gain_pct == pytest.approx(5.0)


def test_a_range_that_reaches_the_gate_is_worth_a_trial_when_it_relieves_the_limiting_stage():
    fc = forecast("a", 9.8, 7.0, 13.0, method="similar", rollout=5.8)
    assert fc.worth == "range" and fc.thin_evidence and fc.optimistic_gain_pct == pytest.approx(30.0)


def test_a_slower_forecast_that_does_not_touch_the_limiting_stage_is_not_worth_a_trial_whatever_its_range():
    fc = forecast("a", 10.2, 7.0, 14.0, method="theory", rollout=6.0)
    assert fc.worth == "" and not fc.worth_trial
    slower_but_relieving = forecast("b", 10.2, 7.0, 14.0, method="theory", rollout=5.5)
    assert slower_but_relieving.worth == "range"


def test_a_change_the_forecast_cannot_estimate_is_tried_when_its_fixes_move_the_limiting_stage():
    # An anchored forecast that could not estimate the candidate's own setting leaves every stage where
    # it was: its range reaches the gate, and only the knowledge base can say what it relieves.
    unsure = {"overrides": {"max_batched_tokens": 8192}, "uncertain": ["max_batched_tokens"]}
    assert forecast("aimed", 10.0, 9.3, 10.7, aimed=True, **unsure).worth == "range"
    assert forecast("elsewhere", 10.0, 9.3, 10.7, aimed=False, **unsure).worth == ""
    # Unsure about a setting the candidate does not change (the anchor differed there): the forecast
    # of its own change stands, and that change relieves nothing.
    other = forecast("other", 10.0, 9.3, 10.7, aimed=True, overrides={"knob": "x"}, uncertain=["max_batched_tokens"])
    assert other.worth == ""
    # Still only within the gate: an unforecastable change whose range stops short is not tried.
    assert forecast("short", 10.0, 9.7, 10.3, aimed=True, **unsure).worth == ""
    # And a forecast that is sure it relieves nothing is left alone, whatever the knowledge base expects.
    assert forecast("sure", 10.0, 9.3, 10.7, aimed=True, overrides={"max_batched_tokens": 8192}).worth == ""


def test_a_range_short_of_the_gate_is_not_worth_a_trial():
    fc = forecast("a", 9.9, 9.6, 10.2, method="similar", rollout=5.9)
    assert fc.optimistic_gain_pct == pytest.approx(4.0) and not fc.worth_trial


def test_thin_evidence_ranks_by_the_optimistic_end_and_firm_evidence_by_the_point():
    firm = forecast("firm", 8.0, 7.6, 8.4)                               # anchored: 8.0 s
    unsure = forecast("unsure", 9.0, 5.0, 16.0, method="similar")       # thin: could be 5.0 s
    unsure_but_anchored = forecast("anchored", 7.9, 4.0, 15.0, uncertain=["mtp"])  # an unestimated setting: thin
    slow = forecast("slow", 12.0, 11.0, 13.0)
    ordered = sorted([slow, firm, unsure, unsure_but_anchored], key=rank_key)
    assert [f.candidate for f in ordered] == ["anchored", "unsure", "firm", "slow"]


def test_the_pick_skips_measured_setups_and_crashed_settings_and_stops_when_nothing_reaches_the_gate():
    base = {"knob": "base"}
    fcs = [forecast(n, s, lo, hi, overrides={"knob": n}) for n, s, lo, hi in
           [("a", 8.0, 7.5, 8.5), ("b", 8.5, 8.0, 9.0), ("c", 9.0, 8.6, 9.4)]]
    out = Forecast(schema_version=1, job="j", candidates_file="c", library="l", baseline_step_s=10.0,
                   forecasts=sorted(fcs, key=rank_key))
    assert pick(out, base).candidate == "a"
    assert pick(out, base, tried=[{"knob": "a"}]).candidate == "b"
    assert pick(out, base, tried=[{"knob": "a"}], failed=[{("knob", "b")}]).candidate == "c"
    assert pick(out, base, tried=[{"knob": "a"}, {"knob": "b"}, {"knob": "c"}]) is None
