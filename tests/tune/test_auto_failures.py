"""What ``auto`` does after a trial crashed or hung: which setups it skips and which it tries first."""

from __future__ import annotations

from rltune.contracts.forecast import CandidateForecast
from rltune.tune.auto import AutoLoop
from rltune.tune.pick import crash_aware_order, holds_a_failed_set

from .helpers import DEMO

BASE = {"rl_mode": "sync", "micro_batch_size": 8, "packing": False, "engine_compile": False}


def test_a_crash_of_several_changes_bans_their_combination_not_each_value():
    failed = [{("engine_compile", True), ("packing", True), ("rl_mode", "fully_async")}]
    assert holds_a_failed_set(BASE, {"engine_compile": True, "packing": True, "rl_mode": "fully_async"}, failed)
    assert holds_a_failed_set(BASE, {"engine_compile": True, "packing": True, "rl_mode": "fully_async",
                                     "micro_batch_size": 32}, failed)
    assert not holds_a_failed_set(BASE, {"packing": True, "rl_mode": "fully_async"}, failed)
    assert not holds_a_failed_set(BASE, {}, failed)


def test_a_crash_of_one_change_bans_that_value_everywhere():
    failed = [{("engine_compile", True)}]
    assert holds_a_failed_set(BASE, {"engine_compile": True, "packing": True}, failed)
    assert not holds_a_failed_set(BASE, {"packing": True}, failed)


def _forecast(candidate: str, step_s: float, overrides: dict) -> CandidateForecast:
    return CandidateForecast(candidate=candidate, overrides=overrides, stages_s={}, step_s=step_s,
                             range_s=[step_s * 0.9, step_s * 1.1], limiting_stage="rollout", method="anchor",
                             rl_mode="sync", worth="point", worth_trial=True)


def test_setups_sharing_fewer_crashed_values_are_tried_first_then_by_forecast():
    f = [_forecast(c, s, o) for c, s, o in [
        ("compile+packing+async", 2.0, {"engine_compile": True, "packing": True, "rl_mode": "fully_async"}),
        ("compile+async", 2.1, {"engine_compile": True, "rl_mode": "fully_async"}),
        ("packing+async", 2.4, {"packing": True, "rl_mode": "fully_async"}),
        ("mbs", 3.0, {"micro_batch_size": 32}),
    ]]
    assert [x.candidate for x in crash_aware_order(f, BASE, [])] == [
        "compile+packing+async", "compile+async", "packing+async", "mbs"]
    failed = [{("engine_compile", True), ("packing", True), ("micro_batch_size", 32)}]
    assert [x.candidate for x in crash_aware_order(f, BASE, failed)] == [
        "compile+async", "packing+async", "mbs", "compile+packing+async"]


def test_failed_sets_come_from_the_journal_and_leave_out_values_that_ran_fine(tmp_path):
    loop = AutoLoop(DEMO, tmp_path / "tune", tuned_dir=tmp_path / "tuned")
    loop.journal.append("baseline", knobs=dict(BASE))
    loop.journal.append("trial", knobs={**BASE, "rl_mode": "fully_async", "packing": True}, decision="keep")
    loop.journal.append("trial", knobs={**BASE, "rl_mode": "fully_async", "packing": True, "engine_compile": True,
                                        "micro_batch_size": 32}, decision="failed")
    loop.journal.append("trial", knobs={**BASE, "rl_mode": "fully_async"}, decision="failed")
    assert loop._failed_settings() == [{("engine_compile", True), ("micro_batch_size", 32)}]
