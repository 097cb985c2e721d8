"""The seed's worked example (Figure 4) and Figure 3's table, reproduced through the real predictor.

Cases A-E are hand-made so that their distances and scaled times are the seed's: they test the
method (distance -> score -> normalised weight -> theory scaling -> RL-mode combination), not
measurements. Their concurrency values were chosen so that the scores land on the seed's
rounded figures (sum 2.52, A 26.62 %, E 12.26 %).
"""

from __future__ import annotations

import math

import pytest
from predict_casekit import make_case

from rltune.contracts.candidates import Candidate, Candidates
from rltune.contracts.forecast import CandidateForecast
from rltune.predict.forecast import finish, forecast_prepared, prepare
from rltune.predict.setup import Setup, distance, score, setup_from_case
from rltune.predict.theory import TheoryModel
from rltune.steps import combine

FACTS = {"tasks_per_batch": 32.0, "trials_per_task": 8.0, "answer_cap_tokens": 8192.0, "context_limit_tokens": 12288.0,
         "total_params": 27e9, "active_params": 27e9, "layers": 64.0, "kv_heads": 8.0, "head_dim": 128.0, "model_dtype": "bf16"}
BASE = {"rl_mode": "one_step_async", "mtp": False, "weight_dtype": "bf16", "kv_cache_dtype": "auto",
        "engine_max_concurrency": 64, "chunked_prefill": False, "pd_disaggregation": False}
JOB = dict(job="qwen3.8-27b-math", model="Qwen3.8-27B", workload="math", device="H200", gpus=16)
# A training theory that is purely proportional to the work, as in the seed's "scales by 2/3".
THEORY = TheoryModel(coefficients={"gpu": {"training_fixed_s": 0.0, "s_per_micro_batch": 0.0, "dp_exposed": 0.0}})
CASES = {  # name -> (tasks per batch, knob changes, training time after scaling to the target)
    "A": (32, {"mtp": True}, 54.40),
    "B": (48, {"weight_dtype": "fp8", "kv_cache_dtype": "fp8", "chunked_prefill": True}, None),
    "C": (32, {"mtp": True, "kv_cache_dtype": "fp8", "engine_max_concurrency": 128}, 53.9),
    "D": (32, {"pd_disaggregation": True, "chunked_prefill": True, "engine_max_concurrency": 168}, 53.6),
    "E": (48, {"mtp": True, "weight_dtype": "fp8", "kv_cache_dtype": "fp8", "engine_max_concurrency": 28}, 54.0),
}


def target() -> Setup:
    return Setup(JOB["job"], JOB["model"], JOB["workload"], JOB["device"], JOB["gpus"], dict(FACTS), dict(BASE))


def build_cases():
    """Cases whose times scale back to the seed's rollout 50.0 s and weight sync 3.5 s."""
    cases = []
    for i, (name, (tasks, knobs, scaled_training)) in enumerate(CASES.items()):
        facts = {**FACTS, "tasks_per_batch": float(tasks)}
        probe = make_case(name, rollout=1, training=1, weight_sync=1, knobs={**BASE, **knobs}, facts=facts, t=i * 100.0, defaults=False, **JOB)
        ratio = THEORY.ratio(target(), setup_from_case(probe))
        training = 79.7 if name == "B" else scaled_training / ratio["training"]
        cases.append(make_case(name, rollout=50.0 / ratio["rollout"], training=training, weight_sync=3.5 / ratio["weight_sync"],
                               knobs={**BASE, **knobs}, facts=facts, t=i * 100.0, defaults=False, **JOB))
    return cases


def test_case_a_differs_only_in_mtp_and_scores_0_67():
    a = setup_from_case(build_cases()[0])
    assert distance(target(), a) == pytest.approx(0.8)
    assert score(0.8) == pytest.approx(math.exp(-0.4))
    assert round(score(0.8), 2) == 0.67


def test_weights_match_the_seed_and_sum_to_one():
    fc = forecast_prepared(prepare(build_cases(), THEORY, fit=False), target())
    assert fc.method == "similar", "no case may anchor: A and C differ in MTP, D in PD, B and E in batch"
    weights = {c.run_id: c.weight for c in fc.cases}
    assert sum(weights.values()) == pytest.approx(1.0, abs=1e-5)
    assert round(100 * weights["A"], 2) == 26.62
    assert round(100 * weights["E"], 2) == 12.26
    scores = {c.run_id: score(c.distance) for c in fc.cases}
    assert round(sum(scores.values()), 2) == 2.52
    assert round(scores["E"], 2) == 0.31
    assert min(scores, key=scores.get) == "E"


def test_case_b_training_scales_by_two_thirds():
    b = setup_from_case(build_cases()[1])
    ratio = THEORY.ratio(target(), b)["training"]
    assert ratio == pytest.approx(256 / 384, rel=1e-9)
    assert 79.7 * ratio == pytest.approx(53.2, abs=0.1)


def test_one_step_async_forecast_is_57_3_limited_by_training():
    fc = forecast_prepared(prepare(build_cases(), THEORY, fit=False), target())
    assert fc.stages_s["rollout"] == pytest.approx(50.0, abs=1e-6)
    assert fc.stages_s["weight_sync"] == pytest.approx(3.5, abs=1e-6)
    assert round(fc.stages_s["training"], 2) == 53.83
    assert fc.step_s == pytest.approx(max(50.0, fc.stages_s["training"]) + 3.5, rel=1e-9)
    assert round(fc.step_s, 1) == 57.3
    assert fc.limiting_stage == "training"
    assert fc.range_s[0] < 57.3 < fc.range_s[1]
    assert {"mtp", "pd_disaggregation"} <= set(fc.uncertain)


# Figure 3: fully async, step = max(rollout, training + weight sync); baseline 620 s measured.
FIGURE_3 = [  # setup, training, weight sync, rollout, step, limited by
    ("baseline", 450, 30, 620, 620, "rollout"),
    ("A", 370, 30, 470, 470, "rollout"),
    ("B", 370, 30, 390, 400, "training+weight_sync"),
    ("C", 350, 30, 440, 440, "rollout"),
]


@pytest.mark.parametrize("name,training,sync,rollout,step,limit", FIGURE_3)
def test_figure_3_fully_async_rule(name, training, sync, rollout, step, limit):
    assert combine("fully_async", rollout, training, sync) == (step, limit)


def test_figure_3_candidates_ranked_and_marked_from_measured_anchors():
    """Each Figure-3 setup measured once; forecasting them back must rank B, C, A (400, 440, 470 s) and mark all >= 5 % faster."""
    from rltune.contracts.job import GpuBudget, JobSpec, LaunchSpec, ModelSpec, WorkloadSpec
    from rltune.predict.forecast import forecast_candidates

    job = JobSpec(schema_version=1, name="qwen3.8-27b-coding",
                  model=ModelSpec(name="Qwen3.8-27B", total_params=27e9, active_params=27e9, layers=64, hidden=5120, kv_heads=8, head_dim=128),
                  workload=WorkloadSpec(kind="coding", tasks_per_batch=32, trials_per_task=8, answer_cap_tokens=8192,
                                        context_limit_tokens=65536, trial_timeout_s=1500),
                  gpus=GpuBudget(count=16, device="H200"), launch=LaunchSpec(command=["true"]),
                  knobs={"rl_mode": "fully_async", "micro_batch_size": 1, "mtp": False})
    facts = {"tasks_per_batch": 32.0, "trials_per_task": 8.0, "answer_cap_tokens": 8192.0, "context_limit_tokens": 65536.0,
             "total_params": 27e9, "active_params": 27e9, "layers": 64.0, "hidden": 5120.0, "kv_heads": 8.0, "head_dim": 128.0,
             "model_dtype": "bf16", "moe": 0.0, "trainer_gpus": 0.0, "rollout_gpus": 0.0}
    overrides = {"baseline": {}, "A": {"micro_batch_size": 4, "mtp": True}, "B": {"micro_batch_size": 4, "pd_disaggregation": True},
                 "C": {"trainer_tp": 2, "mtp": True, "sandbox_hosts": 2}}
    cases = [make_case(name, rollout=r, training=tr, weight_sync=ws, knobs={**job.knobs, **overrides[name]}, facts=facts,
                       t=i * 1e4, job=job.name, model="Qwen3.8-27B", workload="coding", device="H200", gpus=16, defaults=False)
             for i, (name, tr, ws, r, _, _) in enumerate(FIGURE_3)]
    cands = Candidates(schema_version=1, job="job.yaml", baseline_run="baseline", baseline_knobs=dict(job.knobs), limiting_stage="rollout",
                       candidates=[Candidate(id=n, fixes=[n], overrides=overrides[n], rationale="figure 3") for n in ("A", "B", "C")])
    out = forecast_candidates(job, cands, cases)
    assert out.baseline_step_s == pytest.approx(620)
    assert [f.candidate for f in out.forecasts] == ["B", "C", "A"]
    expect = {name: (step, limit) for name, _, _, _, step, limit in FIGURE_3}
    for f in out.forecasts:
        assert f.method == "anchor" and f.cases[0].run_id == f.candidate
        assert (f.step_s, f.limiting_stage) == (pytest.approx(expect[f.candidate][0]), expect[f.candidate][1])
        assert f.worth_trial
    gains = {f.candidate: f.gain_pct for f in out.forecasts}
    assert gains["B"] == pytest.approx(100 * (620 - 400) / 620)


@pytest.mark.parametrize("step,worth", [(589.0, True), (589.1, False), (651.0, False)])
def test_worth_trial_threshold_is_inclusive_at_five_percent(step, worth):
    fc = CandidateForecast(candidate="x", overrides={}, stages_s={}, step_s=step, range_s=[step, step], limiting_stage="rollout",
                           method="anchor", rl_mode="fully_async")
    assert finish(fc, 620.0, 5.0).worth_trial is worth
