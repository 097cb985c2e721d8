"""Anchor, similar-runs and theory forecasts; knob effects; theory fitting; retrospective eval.

All case sets here are hand-made with known answers (see predict_casekit) -- they test the
method, and none of their numbers is a measurement.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from predict_casekit import make_case

from rltune.predict.effects import knob_effects
from rltune.predict.evaluate import evaluate, perfect_forecast, plot
from rltune.predict.forecast import (
    ANCHOR_UNCERTAINTY_BUDGET,
    RANGE_Z,
    RL_MODE_SHARED_DEVICE_SIGMA,
    _adjust,
    forecast_prepared,
    prepare,
)
from rltune.predict.setup import SETTING_WEIGHTS, setup_from_case
from rltune.predict.theory import (
    TERMS,
    TheoryModel,
    job_key,
    median_error,
    modelled_settings,
    register_term,
    systematic_miss,
)


def target_like(case, **knobs):
    return setup_from_case(case).with_knobs(**knobs)


def test_identical_anchor_gives_its_measured_step_unchanged():
    base = make_case("b", rollout=1.0, training=2.0, weight_sync=0.1, step=3.3)
    fc = forecast_prepared(prepare([base]), target_like(base))
    assert fc.method == "anchor" and fc.step_s == pytest.approx(3.3) and fc.uncertain == []
    assert [c.run_id for c in fc.cases] == ["b"] and fc.cases[0].weight == 1.0
    assert fc.range_s[0] < 3.3 < fc.range_s[1]


def test_anchor_adjusts_by_a_change_earlier_runs_measured():
    b0 = make_case("b0", rollout=1.0, training=2.0, weight_sync=0.1, t=0)
    mb4 = make_case("mb4", rollout=1.0, training=1.5, weight_sync=0.1, knobs={"micro_batch_size": 4}, t=100)
    packed = make_case("packed", rollout=1.2, training=1.6, weight_sync=0.1, knobs={"packing": True}, t=200)
    p = prepare([b0, mb4, packed], fit=False)
    fc = forecast_prepared(p, target_like(b0, micro_batch_size=4, packing=True))
    assert fc.method == "anchor"
    # two equally close anchors: packed moved by the measured micro-batch change, mb4 moved by the measured packing change.
    # Both changes were measured from b0, not from the anchor, so their stage ratios move the anchor's stages and the
    # step follows the stages (a step ratio from b0 would weigh them as b0 does). Both settings are read by training
    # terms only, so only training moves: 1.6 x 0.75 either way; each anchor keeps its own rollout (1.2 and 1.0: the
    # pair's rollout change was run-to-run noise, as no term of packing touches the rollout).
    assert fc.stages_s["training"] == pytest.approx(1.6 * 1.5 / 2.0, rel=1e-2)
    assert fc.stages_s["rollout"] == pytest.approx((1.2 + 1.0) / 2, rel=1e-2)
    assert fc.step_s == pytest.approx((1.2 + 1.0) / 2 + 1.6 * 1.5 / 2.0 + 0.1, rel=1e-3)
    assert fc.step_s != pytest.approx(packed.step_s * mb4.step_s / b0.step_s, rel=1e-2)


def test_a_value_no_case_ran_is_priced_by_the_prior_theory_not_the_fit():
    """Every case ran micro-batch 8, so the fit cannot tell its per-micro-batch cost from a fixed cost."""
    runs = [make_case(f"b{i}", rollout=1.0, training=0.4 + 0.01 * i, weight_sync=0.02, t=100 * i) for i in range(3)]
    p = prepare(runs)
    base = setup_from_case(runs[0])
    target = base.with_knobs(micro_batch_size=2)
    assert not p.has_seen(target.device, "micro_batch_size", 2) and p.has_seen(target.device, "micro_batch_size", 8)
    fc = forecast_prepared(p, target)
    prior = p.prior_ratio(target, base)["training"]
    assert prior > 1.1  # more micro-batches cost more by the priors
    assert fc.stages_s["training"] == pytest.approx(np.mean([r.measured["training_s"] for r in runs]) * prior, rel=1e-3)


def test_an_unestimable_difference_over_budget_disqualifies_the_anchor():
    assert "mtp" not in modelled_settings()
    assert SETTING_WEIGHTS["mtp"][1] > ANCHOR_UNCERTAINTY_BUDGET >= SETTING_WEIGHTS["chunked_prefill"][1]
    base = make_case("b", rollout=1.0, training=2.0, weight_sync=0.1)
    p = prepare([base], fit=False)
    mtp = forecast_prepared(p, target_like(base, mtp=True))
    assert mtp.method == "similar" and mtp.uncertain == ["mtp"]
    assert mtp.step_s == pytest.approx(base.step_s)  # assumed to have no effect ...
    chunked = forecast_prepared(p, target_like(base, chunked_prefill=True))
    assert chunked.method == "anchor" and chunked.uncertain == ["chunked_prefill"]
    wide, narrow = mtp.range_s[1] / mtp.range_s[0], forecast_prepared(p, target_like(base)).range_s
    assert wide > narrow[1] / narrow[0]  # ... but says it is less sure


def test_theory_moves_a_setting_no_run_measured():
    base = make_case("b", rollout=1.0, training=2.0, weight_sync=0.1)
    fc = forecast_prepared(prepare([base], fit=False), target_like(base, grad_checkpointing=True))
    assert fc.method == "anchor" and fc.uncertain == []
    assert fc.stages_s["training"] > 2.0 and fc.stages_s["rollout"] == pytest.approx(1.0)


def test_rl_mode_change_recombines_the_stages():
    base = make_case("b", rollout=1.0, training=2.0, weight_sync=0.5)
    fc = forecast_prepared(prepare([base], fit=False), target_like(base, rl_mode="fully_async"))
    assert fc.rl_mode == "fully_async" and fc.limiting_stage == "training+weight_sync"
    assert fc.step_s == pytest.approx(2.5, rel=1e-6)


def test_empty_library_falls_back_to_theory_with_a_wide_range():
    base = make_case("b", rollout=1.0, training=2.0, weight_sync=0.1)
    fc = forecast_prepared(prepare([]), setup_from_case(base))
    assert fc.method == "theory" and fc.cases == []
    assert fc.range_s[1] / fc.range_s[0] > 4


def test_repeats_set_the_run_to_run_noise():
    runs = [make_case(f"r{i}", rollout=1.0, training=2.0 + d, weight_sync=0.1, t=i) for i, d in enumerate((0.0, 0.2, -0.2, 0.1))]
    effects = knob_effects(runs)
    steps = np.log([r.step_s + 1e-3 for r in runs])
    assert effects.repeat_groups == 1
    assert effects.repeat_noise == pytest.approx(float(np.std(steps, ddof=1)), rel=1e-6)
    fc = forecast_prepared(prepare(runs, fit=False), setup_from_case(runs[0]))
    assert fc.step_s == pytest.approx(np.mean([r.step_s for r in runs]), rel=1e-9)


def test_measured_effects_are_symmetric_and_elasticities_interpolate():
    cases = [make_case(f"mb{mb}", rollout=1.0, training=4.0 * (8 / mb) ** 0.5, weight_sync=0.1, knobs={"micro_batch_size": mb}, t=mb)
             for mb in (2, 8, 32)]
    effects = knob_effects(cases)
    up, down = effects.lookup("micro_batch_size", 2, 8), effects.lookup("micro_batch_size", 8, 2)
    assert up.log_ratio["training"] == pytest.approx(-down.log_ratio["training"])
    assert up.log_ratio["training"] == pytest.approx(math.log(0.5), rel=1e-3)
    assert effects.elasticity("micro_batch_size")["training"] == pytest.approx(-0.5, rel=1e-3)
    assert effects.lookup("micro_batch_size", 2, 16) is None


def test_fit_recovers_the_coefficients_that_made_the_cases():
    truth = TheoryModel(coefficients={"cpu": {"s_per_train_flop": 9e-11, "s_per_decode_step": 5e-3, "sync_fixed_filesystem_s": 0.05}})
    cases = []
    for i, (mb, conc, batch) in enumerate([(2, 4, 16), (4, 8, 32), (8, 16, 32), (16, 32, 64), (8, 4, 64), (32, 16, 16), (4, 32, 128)]):
        probe = make_case(f"c{i}", rollout=1, training=1, weight_sync=1, knobs={"micro_batch_size": mb, "engine_max_concurrency": conc},
                          facts={"tasks_per_batch": batch / 4})
        stages = truth.stages(setup_from_case(probe))
        cases.append(make_case(f"c{i}", rollout=stages["rollout"], training=stages["training"], weight_sync=stages["weight_sync"],
                               knobs={"micro_batch_size": mb, "engine_max_concurrency": conc}, facts={"tasks_per_batch": batch / 4}))
    fitted = TheoryModel().fit(cases, prior_weight=1e-4)
    assert fitted.fitted_on == {"cpu": 7}
    for case in cases:
        got, want = fitted.stages(setup_from_case(case)), truth.stages(setup_from_case(case))
        for stage in want:
            assert got[stage] == pytest.approx(want[stage], rel=0.02), stage
    assert TheoryModel().stages(setup_from_case(cases[0]))["training"] != pytest.approx(cases[0].measured["training_s"], rel=0.02)


def test_systematic_miss_flags_one_sided_stage_errors_only():
    cases = [make_case(f"r{i}", rollout=1.0, training=2.0, weight_sync=0.1, t=i,
                       forecast={"rollout_s": 1.0 * (1 + 0.01 * (-1) ** i), "training_s": 1.6, "weight_sync_s": 0.1, "step_s": 3.0})
             for i in range(6)]
    misses = systematic_miss(cases)
    assert set(misses) == {"training"} and misses["training"] == pytest.approx(math.log(2.001 / 1.601), rel=1e-6)


def test_a_registered_term_makes_its_setting_estimable():
    base = make_case("b", rollout=1.0, training=2.0, weight_sync=0.1)
    assert "hot_spares" not in modelled_settings()
    register_term("rollout", "hot_spares", ("hot_spares",), {"s_per_spare": (0.5, 0.5)},
                  lambda f, c: c["s_per_spare"] * f.num("hot_spares", 0.0))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_term("rollout", "hot_spares", (), {}, lambda f, c: 0)
        theory = TheoryModel()
        moved = target_like(base, hot_spares=2)
        assert theory.stages(moved)["rollout"] == pytest.approx(theory.stages(setup_from_case(base))["rollout"] + 1.0)
        fc = forecast_prepared(prepare([base], theory, fit=False), moved)
        assert fc.method == "anchor" and fc.uncertain == [] and fc.stages_s["rollout"] > 1.0
    finally:
        TERMS[:] = [t for t in TERMS if t.name != "hot_spares"]


def test_evaluate_uses_only_runs_finished_before_each_start(tmp_path):
    runs = [make_case("r0", rollout=1.0, training=2.0, weight_sync=0.1, step=3.0, t=0),
            make_case("r1", rollout=1.0, training=2.0, weight_sync=0.1, step=3.3, t=100),
            make_case("r2", rollout=1.0, training=2.0, weight_sync=0.1, step=3.0, t=130),  # starts before r1 finished (160)
            make_case("r3", rollout=1.0, training=2.0, weight_sync=0.1, step=3.0, t=300)]
    report = evaluate(runs)
    assert report.runs == 4 and report.without_history == ["r0"]
    rows = {r.run_id: r for r in report.rows}
    assert rows["r1"].history == 1 and rows["r1"].predicted_step_s == pytest.approx(3.0)
    assert rows["r2"].history == 1 and rows["r2"].predicted_step_s == pytest.approx(3.0)
    assert rows["r3"].history == 3 and rows["r3"].predicted_step_s == pytest.approx(3.1)
    assert rows["r1"].error_pct == pytest.approx(100 * (3.0 - 3.3) / 3.3)
    assert report.median_abs_error_pct == pytest.approx(100 * 0.1 / 3.0, rel=1e-3)
    assert report.within_10pct_count == 3 and report.by_workload == {"math": report.median_abs_error_pct}
    assert report.by_method["anchor"]["count"] == 3
    # all four ran one setup: its repeat spread (log sd, n - 1 degrees of freedom) is the library's noise
    logs = [math.log(3.0), math.log(3.3), math.log(3.0), math.log(3.0)]
    sigma = math.sqrt(sum((x - sum(logs) / 4) ** 2 for x in logs) / 3)
    assert report.repeat_groups == 1 and report.repeat_noise_pct == pytest.approx(100 * sigma, rel=1e-3)
    assert report.perfect_forecast_median_abs_error_pct == pytest.approx(100 * perfect_forecast(sigma)[0], rel=1e-3)
    png = plot(report, tmp_path / "eval.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_evaluate_of_an_empty_library_reports_nothing(tmp_path):
    report = evaluate(tmp_path)
    assert (report.runs, report.evaluated, report.median_abs_error_pct, report.range_coverage) == (0, 0, None, None)
    assert (report.repeat_groups, report.repeat_noise_pct, report.perfect_forecast_within_10pct) == (0, None, None)


@pytest.mark.parametrize("sigma", [0.005, 0.03, 0.066, 0.2, 1.5])
def test_perfect_forecast_scores_match_sampled_noise(sigma):
    # a forecast equal to the true step, against runs measured with log-normal noise: sampled directly
    noise = np.random.default_rng(0).normal(0.0, sigma, 400_000)
    relative = np.abs(np.exp(-noise) - 1.0)
    median, within = perfect_forecast(sigma)
    assert median == pytest.approx(float(np.median(relative)), rel=0.01)
    assert within == pytest.approx(float(np.mean(relative <= 0.10)), abs=0.002)
    if sigma < 0.1:
        assert median == pytest.approx(0.6745 * sigma, rel=0.05)  # small noise: the half-normal median


def test_vectorised_distances_equal_the_one_by_one_definition():
    """The setting matrix must reproduce setup.distance for every case: equal, numeric, categorical, missing on either side."""
    from rltune.predict.forecast import _SettingMatrix
    from rltune.predict.setup import distance

    cases = [make_case("a", rollout=1, training=1, weight_sync=0.1),
             make_case("b", rollout=1, training=1, weight_sync=0.1, knobs={"micro_batch_size": 2, "mtp": True}),
             make_case("c", rollout=1, training=1, weight_sync=0.1, knobs={"engine_batching": "static", "odd_knob": 3}),
             make_case("d", rollout=1, training=1, weight_sync=0.1, knobs={"odd_flag": "x", "packing": True}, facts={"tasks_per_batch": 16.0}),
             make_case("e", rollout=1, training=1, weight_sync=0.1, device="H200", gpus=8, workload="tool_use")]
    setups = [setup_from_case(c) for c in cases]
    matrix = _SettingMatrix(setups)
    base = setups[0]
    targets = [base, base.with_knobs(micro_batch_size=3), base.with_knobs(micro_batch_size=None, mtp=False),
               base.with_knobs(odd_knob=12, new_knob="y"), base.with_knobs(odd_flag=None, packing=True), setups[4],
               base.with_setting("batch", 128.0), base.with_knobs(micro_batch_size=0, engine_max_concurrency=True)]
    for target in targets:
        want = [distance(target, s) for s in setups]
        assert matrix.distances(target) == pytest.approx(want, abs=1e-12)
        assert any(w > 0 for w in want)
    assert list(matrix.same_identity(base)) == [True, True, True, False, False]


def test_learned_model_is_cached_beside_the_library_and_relearned_after_an_append(tmp_path, monkeypatch):
    from rltune.predict import forecast as forecast_module
    from rltune.predict.library import CaseLibrary

    lib = CaseLibrary(tmp_path)
    for i, mb in enumerate((2, 8, 32)):
        lib.append(make_case(f"mb{mb}", rollout=1.0, training=4.0 * (8 / mb) ** 0.5, weight_sync=0.1, knobs={"micro_batch_size": mb}, t=i))
    forecast_module._LEARNED_CACHE.clear()
    first = prepare(lib.load(), cache_dir=tmp_path)
    assert (tmp_path / forecast_module.MODEL_CACHE_NAME).exists()
    forecast_module._LEARNED_CACHE.clear()  # a fresh process: only the file is left

    def refuse(*args, **kwargs):
        raise AssertionError("the theory was refit although the library did not change")

    monkeypatch.setattr(TheoryModel, "fit", refuse)
    again = prepare(lib.load(), cache_dir=tmp_path)
    assert again.theory.coefficients == first.theory.coefficients
    assert again.effects.lookup("micro_batch_size", 2, 8).log_ratio == first.effects.lookup("micro_batch_size", 2, 8).log_ratio
    assert again.effects.elasticity("micro_batch_size") == first.effects.elasticity("micro_batch_size")
    lib.append(make_case("mb4", rollout=1.0, training=2.0, weight_sync=0.1, knobs={"micro_batch_size": 4}, t=9))
    with pytest.raises(AssertionError, match="refit"):
        prepare(lib.load(), cache_dir=tmp_path)
    (tmp_path / forecast_module.MODEL_CACHE_NAME).write_text("{not json", encoding="utf-8")
    monkeypatch.undo()
    forecast_module._LEARNED_CACHE.clear()
    assert prepare(lib.load(), cache_dir=tmp_path).theory.fitted_on == {"cpu": 4}  # a damaged cache is relearned


def test_another_jobs_measured_change_moves_the_stages_and_the_step_follows_this_jobs_mix():
    """Math measured chunked prefill doubling training (step x1.5); a rollout-heavy tool-use job's step must grow less."""
    assert "chunked_prefill" not in modelled_settings()  # only a measured pair can say what it does
    tool = {"job": "tiny-tool-use-cpu", "workload": "tool_use"}
    off = {"chunked_prefill": False}
    math_base = make_case("m0", rollout=1.0, training=1.0, weight_sync=0.0, knobs=off, t=0)
    math_chunked = make_case("m1", rollout=1.0, training=2.0, weight_sync=0.0, knobs={"chunked_prefill": True}, t=100)
    tool_base = make_case("t0", rollout=8.0, training=1.0, weight_sync=0.0, knobs=off, t=200, step=9.9, **tool)  # 10 % overhead beyond the stages
    p = prepare([math_base, math_chunked, tool_base], fit=False)
    fc = forecast_prepared(p, target_like(tool_base, chunked_prefill=True))
    assert fc.method == "anchor" and fc.cases[0].run_id == "t0" and fc.uncertain == []
    assert fc.stages_s["training"] == pytest.approx(2.0, rel=1e-3) and fc.stages_s["rollout"] == pytest.approx(8.0, rel=1e-3)
    assert fc.step_s == pytest.approx(9.9 * 10.0 / 9.0, rel=1e-3)  # not 9.9 x 1.5
    same_job = forecast_prepared(p, target_like(math_base, chunked_prefill=True))
    assert same_job.step_s == pytest.approx(3.0, rel=1e-6)  # the pair itself was measured: the anchor is m1


def test_another_jobs_pair_on_a_setting_theory_reads_is_left_to_the_fitted_theory():
    """A decode-bound job's concurrency pair must not move a rollout that theory says is mostly sandbox time."""
    tool = {"job": "tiny-tool-use-cpu", "workload": "tool_use"}
    math_base = make_case("m0", rollout=1.0, training=1.0, weight_sync=0.0, t=0)
    math_c4 = make_case("m1", rollout=3.0, training=1.0, weight_sync=0.0, knobs={"engine_max_concurrency": 4}, t=100)
    tool_base = make_case("t0", rollout=8.0, training=1.0, weight_sync=0.0, t=200, **tool)
    p = prepare([math_base, math_c4, tool_base], fit=False)
    target = target_like(tool_base, engine_max_concurrency=4)
    fc = forecast_prepared(p, target)
    ratio = p.theory_ratio(target, setup_from_case(tool_base))
    assert fc.method == "anchor" and fc.cases[0].run_id == "t0"
    assert ratio["rollout"] < 2.0  # the sandbox term does not change with concurrency
    assert fc.stages_s["rollout"] == pytest.approx(8.0 * ratio["rollout"], rel=1e-6)  # not 8 x 3


def test_rl_mode_rule_on_a_cpu_only_job_is_less_sure_than_on_gpus():
    cpu = make_case("cpu", rollout=1.0, training=2.0, weight_sync=0.5)
    gpu = make_case("gpu", rollout=1.0, training=2.0, weight_sync=0.5, device="H200", gpus=8)
    widths = {}
    for case in (cpu, gpu):
        fc = forecast_prepared(prepare([case], fit=False), target_like(case, rl_mode="fully_async"))
        assert fc.method == "similar" and fc.step_s == pytest.approx(2.5, rel=1e-6)  # no pair measured the mode change
        widths[case.run_id] = math.log(fc.range_s[1] / fc.range_s[0])
    assert widths["cpu"] > 2 * widths["gpu"]


def test_an_rl_mode_change_measured_on_another_job_moves_the_step_by_its_ratio():
    tool = {"job": "tiny-tool-use-cpu", "workload": "tool_use"}
    sync = make_case("m0", rollout=1.0, training=1.0, weight_sync=0.0, t=0)
    overlapped = make_case("m1", rollout=4.0, training=1.0, weight_sync=0.0, step=1.5, knobs={"rl_mode": "fully_async"}, t=100)
    tool_base = make_case("t0", rollout=8.0, training=1.0, weight_sync=0.0, t=200, **tool)
    fc = forecast_prepared(prepare([sync, overlapped, tool_base], fit=False), target_like(tool_base, rl_mode="fully_async"))
    assert fc.method == "anchor" and fc.cases[0].run_id == "t0"
    assert fc.step_s == pytest.approx((9.0 + 1e-3) * (1.5 + 1e-3) / (2.0 + 1e-3) - 1e-3, rel=1e-6)


def test_each_job_gets_its_own_run_to_run_noise_shrunk_towards_the_pooled_figure():
    tool = {"job": "tiny-tool-use-cpu", "workload": "tool_use"}
    steady = [make_case(f"m{i}", rollout=1.0, training=2.0 + d, weight_sync=0.1, t=i) for i, d in enumerate((0.0, 0.01, -0.01))]
    noisy = [make_case(f"t{i}", rollout=8.0 + d, training=2.0, weight_sync=0.1, t=10 + i, **tool) for i, d in enumerate((0.0, 2.0, -2.0))]
    effects = knob_effects(steady + noisy)
    m_id, t_id = setup_from_case(steady[0]).identity(), setup_from_case(noisy[0]).identity()
    logs = {k: np.log([c.step_s + 1e-3 for c in group]) for k, group in (("m", steady), ("t", noisy))}
    squares = {k: float(np.sum((v - v.mean()) ** 2)) for k, v in logs.items()}
    pooled = math.sqrt((squares["m"] + squares["t"]) / 4)
    assert effects.repeat_noise == pytest.approx(pooled, rel=1e-6)
    assert effects.noise_for(t_id) == pytest.approx(math.sqrt((squares["t"] + 2 * pooled ** 2) / 4), rel=1e-6)
    assert effects.noise_for(m_id) < effects.repeat_noise < effects.noise_for(t_id)
    assert effects.noise_for(("other-job",)) == effects.repeat_noise
    p = prepare(steady + noisy, fit=False)
    width = {k: math.log(fc.range_s[1] / fc.range_s[0]) for k, fc in
             (("m", forecast_prepared(p, setup_from_case(steady[0]))), ("t", forecast_prepared(p, setup_from_case(noisy[0]))))}
    assert width["t"] > 2 * width["m"]
    back = type(effects).from_json(effects.to_json())
    assert back.noise_for(t_id) == effects.noise_for(t_id) and back.job_noise == effects.job_noise


def test_a_measured_change_moves_only_the_stages_its_terms_read():
    """The in-process transport pair also read a slower rollout: run-to-run noise, as no rollout term reads the transport."""
    b0 = make_case("b0", rollout=1.0, training=2.0, weight_sync=0.1, t=0)
    inproc = make_case("inproc", rollout=1.3, training=2.0, weight_sync=0.02, knobs={"sync_transport": "inprocess"}, t=100)
    packed = make_case("packed", rollout=1.0, training=1.6, weight_sync=0.1, knobs={"packing": True}, t=200)
    p = prepare([b0, inproc, packed], fit=False)
    assert p.stages_reading["sync_transport"] == {"weight_sync"} and p.stages_reading["packing"] == {"training"}
    target = target_like(b0, packing=True, sync_transport="inprocess")
    stages, step, *_ = _adjust(p, 2, target, use_theory_for_all=False)  # the packed run, moved by the transport pair
    assert stages["rollout"] == pytest.approx(1.0) and stages["training"] == pytest.approx(1.6)
    assert stages["weight_sync"] == pytest.approx((0.1 + 1e-3) * (0.02 + 1e-3) / (0.1 + 1e-3) - 1e-3)
    assert step == pytest.approx(1.0 + 1.6 + 0.02, rel=1e-6)


def test_anchors_are_weighed_by_how_precisely_they_measured():
    steady = make_case("steady", rollout=1.0, training=2.0, weight_sync=0.0, t=0)
    shaky = make_case("shaky", rollout=1.6, training=2.0, weight_sync=0.0, t=100)
    shaky.step_noise_frac, shaky.measured_steps = 0.4, 3  # its steps spread 40 %: its median is known to about 29 %
    p = prepare([steady, shaky], fit=False)
    fc = forecast_prepared(p, setup_from_case(steady))
    noise = p.effects.noise_for(setup_from_case(steady).identity())
    precision = [1.0 / (noise ** 2 + median_error(c) ** 2) for c in (steady, shaky)]
    want = (precision[0] * steady.step_s + precision[1] * shaky.step_s) / sum(precision)
    assert fc.method == "anchor" and fc.step_s == pytest.approx(want, rel=1e-6)
    assert abs(fc.step_s - steady.step_s) < abs(fc.step_s - shaky.step_s)  # an equal-weight mean would sit half-way


def test_a_value_no_case_ran_keeps_what_a_measured_column_pinned():
    """Every case ran concurrency 16, but their decode-step counts say continuous batching refilled nothing."""
    runs = []
    for i in range(3):
        case = make_case(f"b{i}", rollout=0.3, training=0.4 + 0.01 * i, weight_sync=0.02, t=100 * i)
        case.measured["engine_decode_steps"] = 32.0  # 32 samples, 16 at a time, 16 tokens: two whole waves
        runs.append(case)
    p = prepare(runs)
    base = setup_from_case(runs[0])
    key = job_key(base)
    prior = p.prior_theory.coefficients_for("cpu", key)
    assert prior["continuous_fill"] == pytest.approx(1.0, abs=0.02)  # pinned by the counts, not the prior's 0.7
    assert prior["s_per_decode_step"] == TheoryModel().coefficients_for("cpu")["s_per_decode_step"]  # the rest: priors
    target = base.with_knobs(engine_max_concurrency=64)
    assert not p.has_seen("cpu", "engine_max_concurrency", 64)
    fc = forecast_prepared(p, target)
    assert fc.stages_s["rollout"] == pytest.approx(np.mean([r.measured["rollout_s"] for r in runs]) * p.prior_ratio(target, base)["rollout"],
                                                   rel=1e-3)
    # one wave of 32 instead of two of 16: fewer, costlier decode steps -- by the unpinned priors one wave would cost more
    assert p.prior_ratio(target, base)["rollout"] < 1.0 < TheoryModel().ratio(target, base)["rollout"]


def test_an_rl_mode_change_another_cpu_job_measured_is_doubtful():
    """The ratio moves the step either way; on a CPU-only job the range widens by the shared-core doubt."""
    widths = {}
    for device, gpus in (("cpu", 0), ("H200", 8)):
        where = {"device": device, "gpus": gpus}
        tool = {"job": "tiny-tool-use-cpu", "workload": "tool_use", **where}
        sync = make_case("m0", rollout=1.0, training=1.0, weight_sync=0.0, t=0, **where)
        overlapped = make_case("m1", rollout=4.0, training=1.0, weight_sync=0.0, step=1.5, knobs={"rl_mode": "fully_async"}, t=100, **where)
        tool_base = make_case("t0", rollout=8.0, training=1.0, weight_sync=0.0, t=200, **tool)
        fc = forecast_prepared(prepare([sync, overlapped, tool_base], fit=False), target_like(tool_base, rl_mode="fully_async"))
        assert fc.method == "anchor" and fc.step_s == pytest.approx((9.0 + 1e-3) * (1.5 + 1e-3) / (2.0 + 1e-3) - 1e-3, rel=1e-6)
        widths[device] = (math.log(fc.range_s[1] / fc.range_s[0]) / (2 * RANGE_Z)) ** 2
    assert widths["cpu"] - widths["H200"] == pytest.approx(RL_MODE_SHARED_DEVICE_SIGMA ** 2, rel=1e-3)


def test_a_forecast_from_one_run_carries_that_runs_noise_as_well_as_the_targets():
    base = make_case("b", rollout=1.0, training=2.0, weight_sync=0.1)  # 5 measured steps spread 2 %
    p = prepare([base], fit=False)
    fc = forecast_prepared(p, setup_from_case(base))
    noise = p.effects.noise_for(setup_from_case(base).identity())
    assert noise == pytest.approx(0.03)  # no repeats yet: the default run-to-run noise
    half = math.log(fc.range_s[1] / fc.range_s[0]) / 2
    assert half == pytest.approx(RANGE_Z * math.sqrt(2 * noise ** 2 + median_error(base) ** 2), rel=1e-4)
    # two repeats average their noise down: the anchors' share halves, the target's own stays
    again = make_case("b2", rollout=1.0, training=2.0, weight_sync=0.1, t=100)
    p2 = prepare([base, again], fit=False)
    fc2 = forecast_prepared(p2, setup_from_case(base))
    noise2 = p2.effects.noise_for(setup_from_case(base).identity())
    half2 = math.log(fc2.range_s[1] / fc2.range_s[0]) / 2
    assert half2 == pytest.approx(RANGE_Z * math.sqrt(noise2 ** 2 + (noise2 ** 2 + median_error(base) ** 2) / 2), rel=1e-4)
