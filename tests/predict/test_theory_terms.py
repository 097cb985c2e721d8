"""Theory terms for CPU-only jobs, the fit's use of finer columns, and what eval calls training time.

The cases are hand-made with known answers (see predict_casekit); none of their numbers is a measurement.
"""

from __future__ import annotations

import numpy as np
import pytest
from predict_casekit import make_case

from rltune.predict.evaluate import evaluate
from rltune.predict.setup import setup_from_case
from rltune.predict.theory import (
    Features,
    TheoryModel,
    case_fit_weight,
    concurrency_per_engine,
    job_key,
    median_error,
    overlap_slowdown,
    pinned_coefficients,
    sandbox_parallelism,
)

TOOL = {"job": "tiny-tool-use-cpu", "workload": "tool_use"}


def tool_setup(**knobs):
    return setup_from_case(make_case("t", rollout=1.0, training=1.0, weight_sync=0.0, **TOOL)).with_knobs(**knobs)


def test_sandbox_parallelism_is_the_pool_until_the_cores_run_out():
    f = Features([tool_setup(sandbox_pool_size=n) for n in (1, 2, 8, 32, 128)])
    got = sandbox_parallelism(f, 2.0)
    assert got[0] == pytest.approx(1.0, rel=0.02)  # one slot: the cores are not the limit (the soft minimum gives 0.985)
    assert got[-1] == pytest.approx(2.0, rel=1e-3)  # 128 slots on 2 cores run 2 at a time
    assert np.all(np.diff(got) > 0) and np.all(got <= 2.0)
    hosts = Features([tool_setup(sandbox_pool_size=32, sandbox_hosts=4)])
    assert sandbox_parallelism(hosts, 2.0)[0] == pytest.approx(8.0, rel=1e-3)  # each host brings its cores


def test_sandbox_pool_beyond_the_cores_barely_moves_a_cpu_rollout():
    theory = TheoryModel()
    rollout = {n: theory.stages(tool_setup(sandbox_pool_size=n))["rollout"] for n in (8, 32)}
    assert rollout[32] == pytest.approx(rollout[8], rel=0.02)  # the old term divided the sandbox time by 4
    gpu = setup_from_case(make_case("g", rollout=1.0, training=1.0, weight_sync=0.0, device="H200", gpus=8, **TOOL))
    ratio = theory.ratio(gpu.with_knobs(sandbox_pool_size=32), gpu.with_knobs(sandbox_pool_size=8))
    assert ratio["rollout"] < 0.5  # on a GPU job's sandbox host (64 cores by prior) a bigger pool still pays


def test_overlap_slowdown_is_one_in_sync_mode_and_the_fitted_factor_on_the_overlapped_part():
    f = Features([tool_setup(rl_mode=m) for m in ("sync", "one_step_async", "fully_async")])
    c = {"overlap_one_step_async_training": 3.0, "overlap_fully_async_training": 2.0,
         "overlap_one_step_async_rollout": 1.0, "overlap_fully_async_rollout": 2.5}
    # training is the shorter stage: all of it runs beside the rollout, so all of it takes the factor
    own = {"rollout": np.full(3, 2.0), "training": np.full(3, 1.0), "weight_sync": np.full(3, 0.1)}
    assert list(overlap_slowdown(f, c, "training", own)) == [1.0, 3.0, 2.0]
    # the rollout overlaps the trainer for half its time: half of it takes the factor
    assert list(overlap_slowdown(f, c, "rollout", own)) == [1.0, 1.0, 1.75]
    assert list(overlap_slowdown(f, c, "weight_sync", own)) == [1.0, 1.0, 1.0]
    none = {"rollout": np.zeros(3), "training": np.zeros(3), "weight_sync": np.zeros(3)}
    assert list(overlap_slowdown(f, c, "rollout", none)) == [1.0, 1.0, 1.0]  # a stage of no time stays at no time


def test_a_cheaper_trainer_step_shortens_the_rollout_it_overlaps_on_shared_cores():
    # The fitted contention of a CPU-only job in one-step async: the overlapped part of each stage runs 1.8x slower.
    coeffs = {"overlap_one_step_async_rollout": 1.8, "overlap_one_step_async_training": 1.8}
    theory = TheoryModel(coefficients={"cpu": coeffs})
    base = setup_from_case(make_case("m", rollout=1.0, training=1.0, weight_sync=0.01)).with_knobs(rl_mode="one_step_async")
    sync = {mb: theory.stages(base.with_knobs(rl_mode="sync", micro_batch_size=mb)) for mb in (2, 16)}
    overlapped = {mb: theory.stages(base.with_knobs(micro_batch_size=mb)) for mb in (2, 16)}
    assert sync[16]["rollout"] == pytest.approx(sync[2]["rollout"])  # alone, the rollout does not read the micro-batch
    assert sync[16]["training"] < sync[2]["training"]
    for mb in (2, 16):
        own_r, own_t = sync[mb]["rollout"], sync[mb]["training"]
        assert overlapped[mb]["rollout"] == pytest.approx(own_r + 0.8 * min(own_r, own_t))
        assert overlapped[mb]["training"] == pytest.approx(own_t + 0.8 * min(own_r, own_t))
    # at micro-batch 2 the trainer outlasts the rollout, at 16 it is the shorter: its saving frees the rollout beside it
    assert sync[16]["training"] < sync[16]["rollout"] < sync[2]["training"]
    assert overlapped[16]["rollout"] < overlapped[2]["rollout"]


def test_fit_learns_how_much_shared_cores_stretch_an_overlapped_stage():
    cases = []
    for i, (mode, stretch) in enumerate([("sync", 1.0), ("sync", 1.0), ("one_step_async", 3.0), ("one_step_async", 3.0)]):
        for j, mb in enumerate((2, 8)):
            training = (0.2 + 0.02 * 32 / mb) * stretch
            cases.append(make_case(f"c{i}{j}", rollout=1.0, training=training, weight_sync=0.01, knobs={"rl_mode": mode, "micro_batch_size": mb},
                                   t=10 * i + j))
    fitted = TheoryModel().fit(cases)
    assert fitted.coefficients["cpu"]["overlap_one_step_async_training"] == pytest.approx(3.0, rel=0.1)


def test_fit_pins_the_old_logprob_term_to_its_own_measured_column():
    cases = []
    for i, mb in enumerate((2, 4, 8, 16)):
        case = make_case(f"c{i}", rollout=1.0, training=0.5 + 0.01 * 32 / mb, weight_sync=0.01, knobs={"micro_batch_size": mb}, t=i)
        case.measured["old_logprob_s"] = 0.3  # half the trainer's time in the old-logprob pass
        case.measured["training_s"] -= 0.3
        cases.append(case)
    fitted = TheoryModel().fit(cases)
    reuse = make_case("r", rollout=1.0, training=0.2, weight_sync=0.01, knobs={"reuse_rollout_logprobs": True})
    ratio = fitted.ratio(setup_from_case(reuse), setup_from_case(cases[2]))
    assert ratio["training"] == pytest.approx((0.5 + 0.04 - 0.3) / (0.5 + 0.04), rel=0.1)


def test_eval_training_error_compares_the_trainers_whole_time():
    runs = []
    for i in range(3):
        case = make_case(f"r{i}", rollout=1.0, training=2.0, weight_sync=0.1, t=100 * i)
        case.measured["old_logprob_s"] = 0.5
        case.measured["training_s"] = 1.5  # the trainer stage is still 2.0 s
        runs.append(case)
    report = evaluate(runs)
    assert [r.measured_training_s for r in report.rows] == [2.0, 2.0]
    assert report.training_median_abs_error_pct == pytest.approx(0.0, abs=1e-6)


def _cases_from(truth: TheoryModel, specs, **identity):
    """Cases whose stage times are exactly what ``truth`` says for their settings (spec: run id, knobs, facts, t)."""
    cases = []
    for run_id, knobs, facts, t in specs:
        probe = make_case(run_id, rollout=1, training=1, weight_sync=1, knobs=knobs, facts=facts, t=t, **identity)
        stages = truth.stages(setup_from_case(probe))
        cases.append(make_case(run_id, rollout=stages["rollout"], training=stages["training"], weight_sync=stages["weight_sync"],
                               knobs=knobs, facts=facts, t=t, **identity))
    return cases


def test_each_job_gets_its_own_coefficients_tied_to_its_device_class():
    """A tool-use trainer three times slower per token than the math one: one shared set cannot fit both jobs."""
    math_truth = TheoryModel(coefficients={"cpu": {"s_per_train_flop": 9e-11}})
    tool_truth = TheoryModel(coefficients={"cpu": {"s_per_train_flop": 27e-11}})
    math_cases = _cases_from(math_truth, [(f"m{mb}", {"micro_batch_size": mb}, None, mb) for mb in (2, 4, 8, 16)])
    tool_cases = _cases_from(tool_truth, [(f"t{mb}", {"micro_batch_size": mb}, None, 100 + mb) for mb in (2, 8)], **TOOL)
    fitted = TheoryModel().fit(math_cases + tool_cases)
    keys = {job_key(setup_from_case(c)) for c in (math_cases[0], tool_cases[0])}
    assert set(fitted.job_coefficients) == keys and fitted.fitted_on == {"cpu": 6}
    for case in math_cases + tool_cases:
        got = fitted.stages(setup_from_case(case))["training"]
        assert got == pytest.approx(case.measured["training_s"], rel=0.05), case.run_id
    pooled = TheoryModel(coefficients={"cpu": fitted.coefficients["cpu"]})  # the class's set alone misses one job or the other
    misses = [abs(pooled.stages(setup_from_case(c))["training"] / c.measured["training_s"] - 1) for c in (math_cases[0], tool_cases[0])]
    assert max(misses) > 0.25
    # one job alone, or a job with a single run, gets no set of its own
    assert TheoryModel().fit(math_cases).job_coefficients == {}
    assert set(TheoryModel().fit(math_cases + tool_cases[:1]).job_coefficients) == {job_key(setup_from_case(math_cases[0]))}


def test_a_noisy_run_counts_less_in_the_fit():
    steady = make_case("s", rollout=1.0, training=1.0, weight_sync=0.1)
    noisy = make_case("n", rollout=1.0, training=1.0, weight_sync=0.1)
    noisy.step_noise_frac, noisy.measured_steps = 0.5, 3
    se = 1.2533 * 0.5 / np.sqrt(3)
    assert median_error(noisy) == pytest.approx(se)
    assert case_fit_weight(noisy) == pytest.approx(0.03 / np.sqrt(0.03 ** 2 + se ** 2))  # about 0.08
    steady.step_noise_frac = None
    assert case_fit_weight(steady) == 1.0 and median_error(steady) == 0.0
    # four steady runs of a truth and one noisy run whose training read twice as long: the fit stays with the steady ones
    truth = TheoryModel(coefficients={"cpu": {"s_per_train_flop": 9e-11}})
    cases = _cases_from(truth, [(f"c{mb}", {"micro_batch_size": mb}, None, mb) for mb in (2, 4, 8, 16)])
    outlier = _cases_from(truth, [("o", {"micro_batch_size": 32}, None, 50)])[0]
    want = outlier.measured["training_s"]
    outlier.measured["training_s"] *= 2.0
    outlier.step_noise_frac, outlier.measured_steps = 0.5, 3
    got = TheoryModel().fit([*cases, outlier]).stages(setup_from_case(outlier))["training"]
    assert got == pytest.approx(want, rel=0.1)


def test_a_sandboxed_trial_holds_its_slot_while_it_generates():
    f = Features([tool_setup(engine_max_concurrency=c, sandbox_pool_size=8) for c in (4, 16, 64)]
                 + [tool_setup(engine_max_concurrency=16, sandbox_pool_size=8, num_engines=2)])
    assert list(concurrency_per_engine(f)) == [4.0, 8.0, 8.0, 4.0]  # the pool's 8 slots, shared by the engines
    math_setup = setup_from_case(make_case("m", rollout=1.0, training=1.0, weight_sync=0.0, knobs={"sandbox_pool_size": 2}))
    no_pool = tool_setup(engine_max_concurrency=64)  # a job that does not set a pool is not capped
    assert list(concurrency_per_engine(Features([math_setup, no_pool]))) == [16.0, 64.0]
    theory = TheoryModel()
    base = tool_setup(engine_max_concurrency=16, sandbox_pool_size=8)
    assert theory.ratio(base.with_knobs(engine_max_concurrency=64), base)["rollout"] == pytest.approx(1.0)


def test_measured_decode_steps_pin_how_much_continuous_batching_refills():
    def cases(steps_per_wave):
        out = []
        for i, mb in enumerate((2, 8)):
            case = make_case(f"c{i}", rollout=0.3, training=0.2, weight_sync=0.01, knobs={"micro_batch_size": mb}, t=i)
            case.measured["engine_decode_steps"] = 16 * steps_per_wave  # 32 samples, 16 at a time, 16-token answers
            out.append(case)
        return out
    assert pinned_coefficients(cases(2.0)) == {"continuous_fill"}
    whole = TheoryModel().fit(cases(2.0)).coefficients["cpu"]["continuous_fill"]
    refilled = TheoryModel().fit(cases(1.4)).coefficients["cpu"]["continuous_fill"]
    assert whole == pytest.approx(1.0, abs=0.02) and refilled == pytest.approx(0.7, abs=0.02)
    logprob = make_case("l", rollout=0.3, training=0.2, weight_sync=0.01)
    logprob.measured["old_logprob_s"] = 0.05
    assert pinned_coefficients([logprob]) == {"s_per_logprob_flop"}
    assert pinned_coefficients([make_case("p", rollout=0.3, training=0.2, weight_sync=0.01)]) == set()
    # a run in an overlapped mode measures that mode's contention, whatever micro-batch it ran
    overlapped = make_case("o", rollout=0.3, training=0.2, weight_sync=0.01, knobs={"rl_mode": "one_step_async"})
    assert pinned_coefficients([overlapped]) == {"overlap_one_step_async_rollout", "overlap_one_step_async_training"}


def test_sandbox_work_hides_part_of_the_engines_under_it_in_a_tool_use_rollout():
    from rltune.predict.theory import TERMS, prior_coefficients

    setup = tool_setup(sandbox_pool_size=8)
    f = Features([setup])
    c = prior_coefficients("cpu")
    part = {t.name: float(t.compute(f, c)[0]) for t in TERMS if t.stage == "rollout"}
    assert part["decode"] > 0 and part["sandbox"] > 0, "the check needs both kinds of rollout work"
    want = sum(part.values()) - c["sandbox_overlap"] * min(part["decode"], part["sandbox"])
    assert TheoryModel().stages(setup)["rollout"] == pytest.approx(want, rel=1e-12)
    math_setup = setup_from_case(make_case("m", rollout=1.0, training=1.0, weight_sync=0.0,
                                           job="tiny-math-cpu", workload="math"))
    math_parts = [float(t.compute(Features([math_setup]), c)[0]) for t in TERMS if t.stage == "rollout"]
    assert TheoryModel().stages(math_setup)["rollout"] == pytest.approx(sum(math_parts), rel=1e-12)  # no sandboxes


def test_measured_sandbox_setup_and_exec_pin_their_per_trial_coefficients():
    def case(i, prebuilt, setup):
        c = make_case(f"s{i}", rollout=3.0, training=0.5, weight_sync=0.01, knobs={"prebuilt_image": prebuilt}, t=i, **TOOL)
        c.measured.update(sandbox_setup_s=setup, sandbox_exec_s=0.3)
        return c

    cases = [case(0, False, 0.4), case(1, False, 0.4), case(2, True, 0.1)]
    assert {"sandbox_build_s", "prebuilt_factor", "sandbox_exec_s"} <= pinned_coefficients(cases)
    fitted = TheoryModel().fit(cases).coefficients["cpu"]
    assert fitted["sandbox_build_s"] == pytest.approx(0.4, rel=0.1)  # prior 0.5 s
    assert fitted["prebuilt_factor"] == pytest.approx(0.25, rel=0.15)  # prior 0.2
    from rltune.predict.theory import turns

    assert fitted["sandbox_exec_s"] * float(turns(Features([setup_from_case(cases[0])]))[0]) == pytest.approx(0.3, rel=0.1)


MATH = {"job": "tiny-math-cpu", "workload": "math"}


def math_setup(**knobs):
    return setup_from_case(make_case("m", rollout=1.0, training=1.0, weight_sync=0.0, **MATH)).with_knobs(**knobs)


def test_a_generation_round_that_feeds_several_steps_costs_each_step_its_share():
    base = math_setup(engine_max_concurrency=1024, generation_batch_size=32)   # one step's worth: 8 x 4 samples
    double = base.with_setting("generation_batch_size", 64)                   # two steps' worth in one round
    reused = base.with_setting("batch_reuse", 2)                              # each batch trained on twice
    rollout = TheoryModel().stages_many([base, double, reused])["rollout"]
    fixed = TheoryModel().coefficients_for("cpu")["rollout_fixed_s"]
    decode = rollout - fixed
    # twice the samples in one round (one wave: the longest answer sets it) over two steps; the same batch over two steps
    assert decode[2] == pytest.approx(decode[0] / 2)
    assert decode[0] / 2 < decode[1] < decode[0]


def test_fully_async_rollout_runs_ahead_by_as_many_batches_as_the_engines_slots_and_the_age_cap_allow():
    from rltune.predict.theory import run_ahead

    setups = [math_setup(rl_mode=mode, num_engines=engines, engine_max_concurrency=32, max_sample_age=age)
              for mode, engines, age in [("sync", 4, 2), ("fully_async", 1, 2), ("fully_async", 2, 2),
                                         ("fully_async", 4, 2), ("fully_async", 4, 1)]]
    assert list(run_ahead(Features(setups))) == [1.0, 1.0, 2.0, 3.0, 2.0]


def test_engines_on_one_hosts_cores_split_the_batch_but_not_the_time():
    theory = TheoryModel()
    cpu = math_setup(engine_max_concurrency=4)  # several waves an engine, so refills are not at their one-wave floor
    alone, two = (theory.stages(cpu.with_knobs(num_engines=n))["rollout"] for n in (1, 2))
    assert two == pytest.approx(alone, rel=1e-6)  # the prior: a second engine takes turns on the same cores
    gpu = setup_from_case(make_case("g", rollout=1.0, training=1.0, weight_sync=0.0, device="H200", gpus=8, **MATH))
    fixed = theory.coefficients_for("gpu")["rollout_fixed_s"]
    alone, two = (theory.stages(gpu.with_knobs(engine_max_concurrency=4, num_engines=n))["rollout"] - fixed for n in (1, 2))
    assert two == pytest.approx(alone / 2, rel=1e-6)  # on their own GPUs the engines halve the waves
    # runs where a second engine on the shared cores cost 40 %: the fit learns the exponent, the forecast follows
    truth = TheoryModel(coefficients={"cpu": {"engine_core_sharing": 1.5}})
    specs = [(f"e{n}c{c}", {"num_engines": n, "engine_max_concurrency": c}, None, 10 * n + c) for n in (1, 2) for c in (4, 8)]
    fitted = TheoryModel().fit(_cases_from(truth, specs, **MATH))
    target = cpu.with_knobs(num_engines=2, engine_max_concurrency=2)
    assert fitted.stages(target)["rollout"] == pytest.approx(truth.stages(target)["rollout"], rel=0.1)
    assert fitted.stages(target)["rollout"] > 1.2 * fitted.stages(cpu.with_knobs(engine_max_concurrency=2))["rollout"]
