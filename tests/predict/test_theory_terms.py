"""Theory terms for CPU-only jobs, the fit's use of finer columns, and what eval calls training time.

The cases are hand-made with known answers (see predict_casekit); none of their numbers is a measurement.
"""

from __future__ import annotations

import numpy as np
import pytest
from predict_casekit import make_case

from rltune.predict.evaluate import evaluate
from rltune.predict.setup import setup_from_case
from rltune.predict.theory import Features, TheoryModel, overlap_slowdown, sandbox_parallelism

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


def test_overlap_slowdown_is_one_in_sync_mode_and_the_fitted_factor_where_stages_overlap():
    f = Features([tool_setup(rl_mode=m) for m in ("sync", "one_step_async", "fully_async")])
    c = {"overlap_one_step_async_training": 3.0, "overlap_fully_async_training": 2.0,
         "overlap_one_step_async_rollout": 1.0, "overlap_fully_async_rollout": 2.5}
    assert list(overlap_slowdown(f, c, "training")) == [1.0, 3.0, 2.0]
    assert list(overlap_slowdown(f, c, "rollout")) == [1.0, 1.0, 2.5]
    assert list(overlap_slowdown(f, c, "weight_sync")) == [1.0, 1.0, 1.0]


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
