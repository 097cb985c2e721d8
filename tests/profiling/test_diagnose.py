"""Diagnosis: the limiting stage follows the RL-mode rule, and each detector fires on its evidence only.

Tables here are built from hand-chosen numbers so each expected value can be worked out by hand.
"""

from __future__ import annotations

import pytest

from rltune.contracts.diagnosis import load_diagnosis, save_diagnosis
from rltune.contracts.stages import rows_to_table
from rltune.errors import LogFormatError
from rltune.profile import PROBLEM_IDS, diagnose
from rltune.profile import detectors as d


def table(n=5, run_id="r", **columns):
    """n steps; each column is a constant or a list of per-step values."""
    rows = []
    for i in range(n):
        row = {"run_id": run_id, "step": i, "warmup": False}
        for key, value in columns.items():
            row[key] = value[i] if isinstance(value, list) else value
        rows.append(row)
    return rows_to_table(rows, source="rltune")


def ids(diagnosis):
    return [p.id for p in diagnosis.problems]


@pytest.mark.parametrize(("mode", "stages", "step", "limiting"), [
    ("sync", (6.0, 4.0, 1.0), 11.0, "rollout"),
    ("sync", (2.0, 4.0, 1.0), 7.0, "training"),
    ("one_step_async", (6.0, 4.0, 1.0), 7.0, "rollout"),
    ("one_step_async", (3.0, 4.0, 1.0), 5.0, "training"),
    ("fully_async", (6.0, 4.0, 1.0), 6.0, "rollout"),
    ("fully_async", (4.5, 4.0, 1.0), 5.0, "training+weight_sync"),
])
def test_limiting_stage_and_model_step_follow_the_rl_mode(mode, stages, step, limiting):
    r, t, w = stages
    diagnosis = diagnose(table(rollout_s=r, training_s=t, weight_sync_s=w, step_s=step), mode)
    assert diagnosis.limiting_stage == limiting
    assert diagnosis.step_model_s == pytest.approx(step)


def test_old_logprob_pass_counts_in_the_training_stage_and_is_flagged_when_costly():
    diagnosis = diagnose(table(rollout_s=5.0, training_s=4.0, old_logprob_s=2.0, step_s=11.0), "sync")
    assert diagnosis.stage_medians_s["training"] == 6.0 and diagnosis.limiting_stage == "training"
    problem = diagnosis.problems[0]
    assert problem.id == "old_logprob_pass_costly"
    assert problem.severity == pytest.approx(2.0)  # sync: every trainer second is a step second
    assert problem.evidence["share"] == pytest.approx(2.0 / 6.0, rel=1e-3)


def test_warmup_rows_and_first_steps_are_left_out_of_medians():
    step_s = [100.0, 50.0, 10.0, 10.0, 12.0]
    t = table(step_s=step_s, rollout_s=[90.0, 40.0, 6.0, 6.0, 8.0], training_s=4.0)
    assert diagnose(t, "sync", warmup_steps=2).steps_used == [2, 3, 4]
    assert diagnose(t, "sync", warmup_steps=2).step_median_s == 10.0
    assert diagnose(t, "sync").step_median_s == 12.0
    only_warm = diagnose(t, "sync", warmup_steps=9)
    assert only_warm.steps_used == [0, 1, 2, 3, 4] and "warm-up" in only_warm.notes[0]


def test_severity_is_zero_for_waste_off_the_critical_path_but_the_excess_is_kept():
    # fully async, rollout-bound: trainer waste does not cost step time today
    base = {"rollout_s": 10.0, "training_s": 4.0, "weight_sync_s": 1.0, "trainer_busy_frac": 0.4}
    diagnosis = diagnose(table(**base), "fully_async")
    problem = next(p for p in diagnosis.problems if p.id == "trainer_underbusy")
    assert problem.severity == 0.0
    assert problem.evidence["stage_excess_s"] == pytest.approx(4.0 * (1 - 0.4 / d.TRAINER_BUSY_TARGET), rel=1e-3)
    assert "weight_sync_on_critical_path" not in ids(diagnosis)  # it overlaps with the rollout


def test_the_seed_example_names_all_three_problems_and_rollout_limits():
    # rollout 620 s vs training + sync 480 s; trainer half busy; prefill-heavy engines; slow sandbox setup
    diagnosis = diagnose(table(rollout_s=620.0, training_s=450.0, weight_sync_s=30.0, trainer_busy_frac=0.5,
                               engine_prefill_s=4.0, engine_decode_s=8.0, sandbox_setup_s=180.0,
                               sandbox_exec_s=60.0, sandbox_host_load=1.8), "fully_async")
    assert diagnosis.limiting_stage == "rollout"
    assert {"trainer_underbusy", "decode_interrupted_by_prefill", "sandbox_setup_dominant",
            "sandbox_hosts_overloaded"} <= set(ids(diagnosis))
    assert diagnosis.problems[0].stage == "rollout"


@pytest.mark.parametrize(("columns", "pid", "severity"), [
    ({"padding_frac": 0.3}, "padding_waste", 4.0 * 0.3),
    ({"engine_queue_s": 3.0, "engine_prefill_s": 1.0, "engine_decode_s": 6.0}, "requests_queued", 10.0 * 0.3),
    ({"engine_preemptions": 4.0, "engine_prefill_s": 0.5, "engine_decode_s": 9.0}, "kv_cache_saturated", 2.0),
    ({"kv_cache_usage": 0.97}, "kv_cache_saturated", 0.0),
    ({"trials_total": 64.0, "trials_cut_off": 4.0}, "long_tail_trials", 0.0),
    ({"trial_s_max": 50.0, "trial_s_median": 10.0}, "long_tail_trials", 10.0 * (1 - 3 / 5)),
    ({"sandbox_setup_s": 3.0, "sandbox_exec_s": 1.0}, "sandbox_setup_dominant", 3.0 - 0.2 * 4.0),
    ({"sandbox_queue_s": 2.0, "sandbox_setup_s": 1.0, "sandbox_exec_s": 2.0}, "sandbox_hosts_overloaded", 2.0),
    ({"sandbox_host_load": 4.0, "sandbox_queue_s": 0.0, "sandbox_setup_s": 1.0, "sandbox_exec_s": 3.0},
     "sandbox_hosts_overloaded", 4.0 * (1 - 1 / 4.0)),  # a measured queue of 0 does not hide the crowded cores
    ({"sandbox_fs_s": 1.5, "sandbox_setup_s": 1.0, "sandbox_exec_s": 1.0}, "sandbox_hosts_overloaded", 1.5 - 0.2 * 2.0),
    ({"weight_sync_s": 2.0}, "weight_sync_on_critical_path", 2.0),
    ({"step_s": 20.0}, "unaccounted_step_time", 20.0 - 14.0),
])
def test_each_detector_fires_with_its_cost_in_step_seconds(columns, pid, severity):
    base = {"rollout_s": 10.0, "training_s": 4.0}
    diagnosis = diagnose(table(**{**base, **columns}), "sync")
    problem = next(p for p in diagnosis.problems if p.id == pid)
    assert problem.severity == pytest.approx(severity, rel=1e-3)


@pytest.mark.parametrize("columns", [
    {"trainer_busy_frac": 0.7}, {"padding_frac": 0.1}, {"old_logprob_s": 0.5},
    {"engine_prefill_s": 1.0, "engine_decode_s": 9.0}, {"engine_queue_s": 1.0, "engine_prefill_s": 1.0, "engine_decode_s": 8.0},
    {"kv_cache_usage": 0.9, "engine_preemptions": 0.0}, {"trials_total": 100.0, "trials_cut_off": 1.0},
    {"sandbox_setup_s": 1.0, "sandbox_exec_s": 2.0}, {"sandbox_host_load": 0.8}, {"weight_sync_s": 0.5},
    {"sandbox_host_load": 1.0, "sandbox_queue_s": 0.1, "sandbox_fs_s": 0.5, "sandbox_setup_s": 1.0, "sandbox_exec_s": 2.0},
    {"step_s": 14.5},
])
def test_below_each_threshold_no_problem_is_named(columns):
    assert ids(diagnose(table(rollout_s=10.0, training_s=4.0, **columns), "sync")) == []


def test_problem_ids_are_the_stable_ones_the_knowledge_base_uses():
    assert set(PROBLEM_IDS) >= {"trainer_underbusy", "padding_waste", "old_logprob_pass_costly",
                                "decode_interrupted_by_prefill", "requests_queued", "kv_cache_saturated",
                                "long_tail_trials", "sandbox_setup_dominant", "sandbox_hosts_overloaded",
                                "weight_sync_on_critical_path"}


def test_a_table_of_several_runs_needs_a_run_id_and_the_diagnosis_round_trips(tmp_path):
    import pyarrow as pa

    both = pa.concat_tables([table(run_id="a", rollout_s=5.0, training_s=1.0), table(run_id="b", rollout_s=1.0, training_s=5.0)])
    with pytest.raises(LogFormatError, match="2 runs"):
        diagnose(both, "sync")
    diagnosis = diagnose(both, "sync", run_id="b")
    assert diagnosis.limiting_stage == "training" and diagnosis.run_id == "b"
    save_diagnosis(diagnosis, tmp_path / "diagnosis.yaml")
    assert load_diagnosis(tmp_path / "diagnosis.yaml") == diagnosis
