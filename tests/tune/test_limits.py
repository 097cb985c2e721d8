"""Acceptance limits compare like with like and hold every limit, with the seed's thresholds."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.contracts.job import Limits
from rltune.tune.limits import GAP_NOISE_FLOOR, comparable_steps, judge, measured_noise, recheck_threshold

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(step_times, warmup=1, first=0, **columns):
    rows = []
    for i, t in enumerate(step_times):
        row = {"step": first + i, "warmup": i < warmup, "step_s": t}
        for name, values in columns.items():
            row[name] = values[i] if isinstance(values, list) else values
        rows.append(row)
    return rows


def check(judgement, name):
    return next(c for c in judgement.checks if c.name == name)


def test_steps_compared_are_the_shared_non_warmup_ones():
    base = run([9.0, 1.0, 1.0, 1.0, 1.0])                     # steps 1-4 measured
    cand = run([9.0, 0.5, 0.5, 0.5], first=1)                # steps 2-4 measured (1 is warm-up)
    assert comparable_steps(base, cand) == [2, 3, 4]
    j = judge(Limits(), base, cand, base)
    assert j.steps == [2, 3, 4] and j.gain_pct == pytest.approx(50.0)


def test_a_slow_step_outside_the_shared_steps_does_not_count():
    base = run([1.0, 1.0, 1.0, 1.0, 100.0])                  # step 4 only in the baseline
    cand = run([1.0, 0.9, 0.9, 0.9])
    j = judge(Limits(noise_pct=4), base, cand, base)
    assert j.baseline_step_s == 1.0 and j.step_s == 0.9
    assert check(j, "speed").passed and j.gain_pct == pytest.approx(10.0)


@pytest.mark.parametrize("cand_step, noise, passed", [(0.95, 4.0, True), (0.96, 4.0, False), (0.97, 4.0, False),
                                                      (0.8, 15.0, True), (0.86, 15.0, False), (1.2, 4.0, False)])
def test_speed_must_beat_noise(cand_step, noise, passed):
    j = judge(Limits(noise_pct=noise), run([1.0] * 5), run([1.0] + [cand_step] * 4), run([1.0] * 5))
    assert check(j, "speed").passed is passed
    assert check(j, "speed").threshold == noise


def test_gap_ratio_against_the_untuned_baseline():
    untuned = run([1.0] * 4, gap=0.01)
    base = run([1.0] * 4, gap=0.015)
    ok = judge(Limits(gap_ratio_max=2.0), base, run([1.0] + [0.5] * 3, gap=0.02), untuned)
    bad = judge(Limits(gap_ratio_max=1.25), base, run([1.0] + [0.5] * 3, gap=0.0126), untuned)
    assert check(ok, "gap").passed and check(ok, "gap").threshold == pytest.approx(0.02)
    assert not check(bad, "gap").passed and check(bad, "gap").threshold == pytest.approx(0.0125)
    assert not bad.passed and bad.failed_names() == ["gap"]


def test_tiny_gaps_are_held_to_the_noise_floor():
    untuned = run([1.0] * 4, gap=1e-7)
    j = judge(Limits(gap_ratio_max=2.0), untuned, run([1.0] + [0.5] * 3, gap=5e-7), untuned)
    assert check(j, "gap").threshold == pytest.approx(2 * GAP_NOISE_FLOOR) and check(j, "gap").passed


def test_missing_gap_in_trial_fails_when_the_untuned_run_had_one():
    untuned = run([1.0] * 4, gap=0.01)
    j = judge(Limits(), untuned, run([1.0] + [0.5] * 3), untuned)
    assert not check(j, "gap").passed


def test_sample_age_mean_and_max():
    base = run([1.0] * 4)
    young = judge(Limits(), base, run([1.0] + [0.5] * 3, sample_age_mean=2.5, sample_age_max=8), base)
    old_mean = judge(Limits(), base, run([1.0] + [0.5] * 3, sample_age_mean=3.5, sample_age_max=4), base)
    too_old = judge(Limits(), base, run([1.0] + [0.5] * 3, sample_age_mean=1.0, sample_age_max=[0, 1, 9, 2]), base)
    assert young.passed
    assert old_mean.failed_names() == ["sample_age_mean"]
    assert too_old.failed_names() == ["sample_age_max"] and check(too_old, "sample_age_max").value == 9


def test_trial_shares_no_higher_than_baseline():
    base = run([1.0] * 4, trials_total=32, trials_cut_off=1, trials_failed=0)
    same = judge(Limits(), base, run([1.0] + [0.5] * 3, trials_total=32, trials_cut_off=1, trials_failed=0), base)
    worse = judge(Limits(), base, run([1.0] + [0.5] * 3, trials_total=32, trials_cut_off=1, trials_failed=[0, 0, 1, 0]), base)
    assert same.passed
    assert worse.failed_names() == ["trials_failed"]
    assert check(worse, "trials_failed").value == pytest.approx(1 / 96)


def test_no_shared_step_fails_speed():
    j = judge(Limits(), run([1.0, 1.0]), run([1.0], warmup=1), run([1.0, 1.0]))
    assert j.steps == [] and not j.passed and check(j, "speed").value is None


def test_recheck_threshold_defaults_to_twice_noise():
    assert recheck_threshold(Limits(noise_pct=4)) == 8
    assert recheck_threshold(Limits(noise_pct=4, recheck_below_pct=5)) == 5


def runs(*means_per_run, steps=4, warmup=1):
    """Rows of several runs of one setup, each run's steps all at its mean."""
    rows = []
    for k, mean in enumerate(means_per_run):
        rows += [{**r, "run_id": f"run{k}"} for r in run([mean] * (steps + warmup), warmup=warmup)]
    return rows


def test_noise_is_the_range_of_the_baseline_runs_with_noise_pct_as_its_floor():
    base = runs(1.0, 1.3)                                 # 26.1 % apart: the job is that noisy here
    noise = measured_noise(Limits(noise_pct=4), base)
    assert noise.pct == pytest.approx(100 * 0.3 / 1.15) and noise.runs == 2 and "range of 2" in noise.detail
    assert not judge(Limits(noise_pct=4), base, run([1.0] + [0.92] * 4), base).passed          # 20 % faster: noise
    assert judge(Limits(noise_pct=4), base, run([1.0] + [0.80] * 4), base).passed               # 30 % faster
    assert measured_noise(Limits(noise_pct=40), base).pct == 40                              # the floor holds


def test_a_single_runs_noise_is_two_standard_errors_of_its_mean_step_from_pairs_of_steps():
    base = run([1.0, 1.2, 1.0, 0.8, 1.0])                   # pairs of measured steps: 1.1, 0.9 -> se 0.1
    noise = measured_noise(Limits(noise_pct=1), base)
    assert noise.pct == pytest.approx(20.0)
    assert check(judge(Limits(noise_pct=1), base, run([1.0] + [0.9] * 4), base), "speed").passed is False


def test_alternating_steps_of_a_fully_async_baseline_are_not_counted_as_noise():
    base = run([9.0, 1.6, 8.2, 1.6, 8.2, 1.6, 8.2, 1.6, 8.2])  # bursts: every pair costs 9.8 s
    assert measured_noise(Limits(noise_pct=4), base).pct == 4


def test_the_untuned_jobs_measured_spread_carries_over_to_a_setup_measured_once():
    kept = run([1.0] * 5)
    j = judge(Limits(noise_pct=4), kept, run([1.0] + [0.85] * 4), kept, untuned_noise_pct=20.0)
    assert check(j, "speed").threshold == 20.0 and not j.passed
    assert judge(Limits(noise_pct=4), kept, run([1.0] + [0.85] * 4), kept).passed


def test_alternating_fully_async_steps_are_compared_on_their_mean_not_their_median():
    base = run([5.0] * 6)
    cand = run([5.0, 1.0, 8.6, 1.0, 8.6, 1.0])             # bursts: the median (1.0 s) misstates the cost
    j = judge(Limits(noise_pct=4), base, cand, base)
    assert j.step_s == pytest.approx(20.2 / 5) and j.median_s == 1.0
    assert j.gain_pct == pytest.approx(100 * (5.0 - 4.04) / 5.0)


def test_a_limit_no_run_reports_is_not_measured_and_never_shown_as_passed():
    base = run([1.0] * 5)                                   # no gap, no sample age, no trial counts
    j = judge(Limits(), base, run([1.0] + [0.5] * 4), base)
    assert j.passed and j.failed_names() == []
    assert set(j.not_measured()) == {"gap", "sample_age_mean", "sample_age_max", "trials_cut_off", "trials_failed"}
    assert all(check(j, name).passed is None for name in j.not_measured())
    assert check(j, "gap").detail.startswith("not measured")


def test_a_nan_step_is_a_hole_flagged_by_the_diagnosis_never_a_number():
    from rltune.contracts.stages import rows_to_table
    from rltune.profile.diagnose import diagnose

    rows = run([1.0, 1.0, float("nan"), 1.2, float("inf")], rollout_s=0.5, training_s=0.4, weight_sync_s=0.1)
    for r in rows:
        r["run_id"] = "r"
    j = judge(Limits(), rows, rows, rows)
    assert j.steps == [1, 3] and j.step_s == pytest.approx(1.1)
    d = diagnose(rows_to_table(rows, "rltune"), "sync")
    assert d.step_mean_s == pytest.approx(1.1) and any("step_s is NaN or infinite on steps [2, 4]" in n for n in d.notes)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_limit_that_is_not_a_finite_number_is_refused_with_the_field(tmp_path, value):
    from rltune.contracts.job import load_job
    from rltune.errors import WrongTypeError

    text = (REPO_ROOT / "presets" / "cpu-demo.yaml").read_text().replace("  noise_pct: 5", f"  noise_pct: {value}")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(WrongTypeError, match=r"limits\.noise_pct: expected a finite number"):
        load_job(path)


# -- generation rounds of several steps: real TRL runs on an H200 (tests/data/trl-h200/README.md) ----

TRL_H200 = REPO_ROOT / "tests" / "data" / "trl-h200"


def trl_rows(name):
    import pyarrow.parquet as pq

    return pq.read_table(TRL_H200 / f"{name}.stages.parquet").to_pylist()


def test_a_round_of_several_steps_is_timed_in_whole_rounds():
    from rltune.profile.stats import generation_cycle, mean_over, whole_rounds

    reuse4 = trl_rows("r2-c3-a1")  # generates at steps 1, 5 and 9; warm-up 1-2
    names = ("r0-untuned", "r1-c5-a1", "r2-c3-a1", "r3-c3-a1")
    assert [generation_cycle(trl_rows(n)) for n in names] == [1, 2, 4, 8]
    assert whole_rounds(reuse4) == list(range(5, 13)) and whole_rounds(trl_rows("r3-c3-a1")) == list(range(9, 25))
    expected = sum(r["step_s"] for r in reuse4 if 5 <= r["step"] <= 12) / 8
    assert mean_over(reuse4, "step_s") == pytest.approx(expected)
    # steps 3-12 hold two generations in ten steps, not one in four
    partial = sum(r["step_s"] for r in reuse4 if r["step"] >= 3) / 10
    assert partial < 0.95 * expected  # 1.74 s against 1.92 s


def test_a_trial_is_judged_on_whole_rounds_and_its_noise_on_rounds():
    from rltune.profile.stats import standard_error_frac

    untuned = trl_rows("r0-untuned") + trl_rows("r0-untuned-2")
    reuse2, reuse4 = trl_rows("r1-c5-a1"), trl_rows("r2-c3-a1")
    j = judge(Limits(noise_pct=4), untuned, reuse4, untuned)
    assert j.steps == [5, 6, 7, 8]  # the untuned runs end at 8: one whole round both ran
    base = sum(r["step_s"] for r in untuned if 5 <= r["step"] <= 8) / 8
    cand = sum(r["step_s"] for r in reuse4 if 5 <= r["step"] <= 8) / 4
    assert j.gain_pct == pytest.approx(100 * (1 - cand / base), abs=1e-4)
    # rounds of 2 against rounds of 4: whole rounds of both, from a step where both generate
    assert judge(Limits(), reuse2, reuse4, untuned).steps == [5, 6, 7, 8]
    # a run's standard error comes from its rounds' means: two rounds of four steps
    values = [r["step_s"] for r in reuse4 if 5 <= r["step"] <= 12]
    rounds = [sum(values[:4]) / 4, sum(values[4:]) / 4]
    import statistics

    assert standard_error_frac(reuse4) == pytest.approx(statistics.stdev(rounds) / 2 ** 0.5 / (sum(values) / 8))
    assert standard_error_frac([r for r in reuse4 if r["step"] <= 8]) is None  # one round says nothing of the next


def test_a_run_shorter_than_its_round_has_no_step_time_and_says_why():
    from rltune.profile.stats import generation_cycle, mean_over

    reuse8 = [r for r in trl_rows("r3-c3-a1") if r["step"] <= 8]  # the first 8 steps: one generation
    assert generation_cycle(reuse8) is None and mean_over(reuse8, "step_s") is None
    j = judge(Limits(), trl_rows("r0-untuned"), reuse8, trl_rows("r0-untuned"))
    speed = check(j, "speed")
    assert speed.passed is False and "no whole round" in speed.detail and "limits.steps" in speed.detail


def test_rounds_longer_than_the_baseline_ran_are_timed_on_each_run_own_rounds():
    reuse4, reuse8 = trl_rows("r2-c3-a1"), trl_rows("r3-c3-a1")  # 12 steps in rounds of 4; 24 in rounds of 8
    j = judge(Limits(noise_pct=4), reuse4, reuse8, trl_rows("r0-untuned"))
    assert j.steps == list(range(9, 25))
    assert j.baseline_step_s == pytest.approx(sum(r["step_s"] for r in reuse4 if r["step"] >= 5) / 8)
    assert j.step_s == pytest.approx(sum(r["step_s"] for r in reuse8 if r["step"] >= 9) / 16)
    assert "baseline: its steps [5, 6, 7, 8, 9, 10, 11, 12]" in check(j, "speed").detail
    assert check(j, "sample_age_mean").passed is False  # 3.5 versions on average: the age limit holds


def test_a_trial_whose_round_outruns_the_baseline_is_timed_on_its_own_rounds():
    base = run([9.0] + [2.0] * 7, first=1)  # steps 2-8 measured, every one generates
    rounds = [(3.0 if (s - 1) % 4 == 0 else 0.0001) for s in range(1, 13)]
    cand = run([9.0, 1.0, 1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 4.0, 1.0, 1.0, 1.0], first=1, rollout_s=rounds)
    cand = [dict(r, warmup=r["step"] <= 2) for r in cand]
    j = judge(Limits(noise_pct=4), base, cand, base)
    # common steps 3-8 hold one whole round (5-8) of the candidate: compared there
    assert j.steps == [5, 6, 7, 8] and j.step_s == pytest.approx(7 / 4) and j.baseline_step_s == pytest.approx(2.0)
    short = [r for r in base if r["step"] <= 6]
    j = judge(Limits(noise_pct=4), short, cand, short)
    # the baseline ends at 6: the candidate's rounds 5-12 against every step the baseline measured
    assert j.steps == [5, 6, 7, 8, 9, 10, 11, 12] and j.baseline_step_s == pytest.approx(2.0)
    assert "baseline: its steps [2, 3, 4, 5, 6]" in check(j, "speed").detail


def test_a_trial_of_several_steps_a_round_gets_two_whole_rounds():
    from rltune.contracts.job import load_job
    from rltune.tune.trial import trial_steps

    job = load_job(REPO_ROOT / "presets" / "trl-grpo-h200.yaml")  # steps 10, warm-up 2, 128 samples a step
    assert trial_steps(job, dict(job.knobs)) == 10
    assert trial_steps(job, {**job.knobs, "batch_reuse": 4}) == 4 + 8
    assert trial_steps(job, {**job.knobs, "batch_reuse": 8}) == 8 + 16
    assert trial_steps(job, {**job.knobs, "generation_batch_size": 256, "batch_reuse": 2}) == 4 + 8
    assert trial_steps(job, {**job.knobs, "batch_reuse": 2}, steps=30) == 30
