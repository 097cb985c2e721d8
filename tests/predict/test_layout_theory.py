"""The theory's layout terms and the forecasts of imported public runs, checked against hand computations.

Each expected value is computed here from the formula's definition (docs/artifacts.md and the term's
docstring), not by calling the code under test. The setups are real rows of the shipped public CSVs
(rltune/predict/public/); the coefficients are set by the test so that each term can be read alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from predict_casekit import make_case

from rltune.predict.evaluate import allowed_history, release_order
from rltune.predict.forecast import case_times, forecast_prepared, prepare, prior_library
from rltune.predict.public import SHIPPED_DIR, read_rows
from rltune.predict.setup import setup_from_case
from rltune.predict.theory import TERMS, Features, TheoryModel, combine_many, prior_coefficients

NEMO = [r.case for r in read_rows(SHIPPED_DIR / "nemo_rl.csv")]
TITAN = [r.case for r in read_rows(SHIPPED_DIR / "torchtitan.csv")]
H100_BF16, GB200_BF16, B200_BF16, H200_BF16 = 989e12, 2.5e15, 2.25e15, 989e12  # datasheet dense bf16 FLOP/s


def term(stage: str, name: str):
    return next(t for t in TERMS if t.stage == stage and t.name == name)


def only(**values: float) -> dict[str, float]:
    """GPU coefficients with every seconds-per-unit cost zero but ``values`` (factors keep their priors)."""
    c = prior_coefficients("gpu")
    for name in c:
        if name.startswith("s_per_") or name.endswith("_fixed_s") or name in ("dp_exposed", "tp_comm", "moe_overhead", "ep_comm",
                                                                               "pipeline_bubble_weight", "sandbox_build_s", "sandbox_exec_s"):
            c[name] = 0.0
    c.update(values)
    return c


def width_depth(active: float) -> float:
    return 0.0147 * active ** 0.702  # layers x hidden of a model whose shape the row does not give


def test_training_compute_of_a_torchtitan_row_is_the_flops_over_the_gpus_datasheet():
    case = TITAN[0]  # Llama 3.1 8B, 8 GPUs, 16 x 8192 tokens, selective recompute, bf16
    setup = setup_from_case(case)
    c = only(s_per_train_flop=1e-15)
    tokens, seq, active = 16 * 8192, 8192, 8e9
    flops = tokens * (6 * active + 6 * width_depth(active) * seq)
    padding, selective = 1 + c["padding_overhead"], 1 + c["selective_overhead"]  # no packing stated: padding is paid
    hand = 1e-15 * flops * padding * selective / (8 * H100_BF16 / H200_BF16)
    f = Features([setup])
    assert term("training", "compute").compute(f, c)[0] == pytest.approx(hand, rel=1e-12)
    stages = TheoryModel(coefficients={"gpu": c}).stages(setup)
    assert stages["training"] == pytest.approx(hand, rel=1e-12)
    assert stages["rollout"] == 0 and stages["weight_sync"] == 0  # a trainer benchmark has neither
    # the same job on GB200s: its datasheet, times its fitted factor
    gb = setup.with_setting("device", "GB200")
    c_gb = {**c, "gpu_speed_GB200": 1.25}
    assert TheoryModel(coefficients={"gpu": c_gb}).stages(gb)["training"] == pytest.approx(
        hand * H100_BF16 / (GB200_BF16 * 1.25), rel=1e-12)


def test_a_gpu_no_case_ran_is_priced_by_its_datasheet():
    setup = setup_from_case(TITAN[0])
    c = only(s_per_train_flop=1e-15)
    theory = TheoryModel(coefficients={"gpu": c})
    ratio = theory.ratio(setup.with_setting("device", "B200"), setup.with_setting("device", "H100"))["training"]
    assert ratio == pytest.approx(H100_BF16 / B200_BF16, rel=1e-12)


def test_pipeline_bubble_and_expert_parallelism_of_deepseek_v3_on_256_gpus():
    case = NEMO[2]  # DeepSeek V3, 256 H100, [TP,CP,EP,PP] = [1,1,16,16], dp 16, micro-batch 1, 512 samples an optimizer step
    f = Features([setup_from_case(case)])
    c = only(s_per_train_flop=1e-15, tp_comm=0.5, pipeline_bubble_weight=1.0, moe_overhead=0.2, ep_comm=0.1)
    compute = term("training", "compute").compute(f, c)[0]
    layout = term("training", "layout").compute(f, c)[0]
    m = 512 / (16 * 1)  # micro-batches per data-parallel rank per optimizer step
    bubble = (16 - 1) / (m + 16 - 1)
    hand = bubble / (1 - bubble) + (0.2 + 0.1 * math.log2(16))  # tp x cp = 1: no tensor-parallel collective
    assert layout == pytest.approx(compute * hand, rel=1e-12)
    # dense and MoE of one total size: compute follows the active parameters, the engines read all the weights
    dense = setup_from_case(case).with_setting("active_params", 671e9)
    fd = Features([dense])
    seq = case.facts["sequence_tokens"]
    hand_ratio = (6 * 37e9 + 6 * width_depth(37e9) * seq) / (6 * 671e9 + 6 * width_depth(671e9) * seq)
    assert compute / term("training", "compute").compute(fd, c)[0] == pytest.approx(hand_ratio, rel=1e-12)
    assert term("training", "layout").compute(fd, c)[0] == pytest.approx(
        term("training", "compute").compute(fd, c)[0] * bubble / (1 - bubble), rel=1e-12)  # no expert term for a dense model


def test_the_rl_mode_rule_combines_stages_as_the_seed_says():
    setups = [setup_from_case(NEMO[i]).with_knobs(rl_mode=mode) for i, mode in ((0, "sync"), (1, "one_step_async"), (1, "fully_async"))]
    f = Features(setups)
    r, t, w = np.array([30.0, 30.0, 30.0]), np.array([50.0, 50.0, 20.0]), np.array([4.0, 4.0, 4.0])
    got = combine_many(f, {"rollout": r, "training": t, "weight_sync": w})
    assert list(got) == [30 + 50 + 4, max(30, 50) + 4, max(30, 20 + 4)]


def test_a_step_only_case_takes_the_theorys_split_scaled_to_its_measured_step():
    sync, async_ = NEMO[0], NEMO[1]  # Llama 8B: 97.7 s colocated sync, 74.6 s one-step async
    theory = {"rollout": 30.0, "training": 50.0, "weight_sync": 4.0}
    stages, step = case_times(sync, theory)
    k = 97.7 / (30 + 50 + 4)
    assert step == 97.7 and stages == pytest.approx({s: v * k for s, v in theory.items()}, rel=1e-9)
    stages, step = case_times(async_, theory)
    k = 74.6 / (max(30, 50) + 4)
    assert step == 74.6 and stages == pytest.approx({s: v * k for s, v in theory.items()}, rel=1e-9)


def test_a_release_anchor_moves_by_the_change_another_setup_measured_between_the_releases():
    dsv3_04, dsv3_05 = NEMO[2], NEMO[12]  # DeepSeek V3 on 256 H100, colocated sync: 154 s in v0.4, 134 s in v0.5
    qwen_04, qwen_05 = NEMO[4], NEMO[15]  # Qwen3-235B on 128 H100, colocated sync: 506 s in v0.4 (431 s in v0.5)
    assert (dsv3_04.step_s, dsv3_05.step_s, qwen_04.step_s) == (154.0, 134.0, 506.0)
    fc = forecast_prepared(prepare([dsv3_04, dsv3_05, qwen_04]), setup_from_case(qwen_05))
    assert fc.method == "anchor" and [c.run_id for c in fc.cases] == [qwen_04.run_id]
    assert fc.step_s == pytest.approx(506.0 * 134.0 / 154.0, rel=1e-4)
    assert fc.range_s[0] < fc.step_s < fc.range_s[1]


def test_public_runs_stand_behind_a_gpu_job_with_no_runs_and_give_way_to_its_own():
    prior = prior_library([r.case for r in read_rows(SHIPPED_DIR / "easyr1.csv")])
    gpu_job = make_case("mine-0", rollout=100.0, training=60.0, weight_sync=5.0, device="H100", gpus=8, job="my-vl-job",
                        model="my-7b", workload="vision_language",
                        facts={"total_params": 7e9, "active_params": 7e9, "tasks_per_batch": 512.0, "trials_per_task": 5.0,
                               "answer_cap_tokens": 2048.0}, defaults=False, knobs={"rl_mode": "sync", "engine_tp": 2})
    target = setup_from_case(gpu_job)
    first = forecast_prepared(prepare([], prior=prior), target)
    assert first.method == "similar" and first.cases and all(c.run_id.startswith("public/easyr1/") for c in first.cases)
    assert sum(c.weight for c in first.cases) == pytest.approx(1.0, abs=1e-5)
    own = forecast_prepared(prepare([gpu_job], prior=prior), target)
    assert own.method == "anchor" and [c.run_id for c in own.cases] == ["mine-0"]
    cpu = make_case("cpu-0", rollout=1.0, training=1.0, weight_sync=0.1)
    cpu_forecast = forecast_prepared(prepare([], prior=prior), setup_from_case(cpu))
    assert cpu_forecast.method == "theory" and not cpu_forecast.cases  # public GPU runs say nothing of a CPU job


def test_leave_one_out_uses_the_same_release_or_earlier_of_a_source_only():
    cases = NEMO[:12] + TITAN[:2]
    order = release_order(cases)
    v04 = cases[0]
    v05 = cases[10]
    assert v04.release == "v0.4" and v05.release == "v0.5"
    earlier = allowed_history(v04, cases, "same_or_earlier", order)
    assert v04 not in earlier and all(c.release == "v0.4" for c in earlier if c.source == v04.source)
    assert TITAN[0] in earlier  # another source's releases are not ordered against this one's
    later = allowed_history(v05, cases, "same_or_earlier", order)
    assert {c.release for c in later if c.source == v05.source} == {"v0.4", "v0.5"} and v05 not in later
    same = allowed_history(v05, cases, "same", order)
    assert {c.release for c in same if c.source == v05.source} == {"v0.5"}


def test_a_gpu_jobs_first_forecast_names_the_shipped_public_runs_it_leaned_on():
    from pathlib import Path

    from rltune.contracts.job import load_job
    from rltune.predict.forecast import forecast_setup

    job = load_job(Path(__file__).resolve().parents[2] / "presets" / "h200-small-math-short.yaml")
    first = forecast_setup(job, {}, [])
    assert first.method == "similar" and first.cases and all(c.run_id.startswith("public/") for c in first.cases)
    alone = forecast_setup(job, {}, [], prior=None)
    assert alone.method == "theory" and not alone.cases
