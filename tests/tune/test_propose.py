"""Composing candidates follows the seed's three rules on its Figure 3 example, and their edge cases."""

from __future__ import annotations

import dataclasses

from rltune.contracts.candidates import load_candidates, save_candidates
from rltune.contracts.diagnosis import Problem
from rltune.tune.knowledge import load_default_knowledge
from rltune.tune.propose import propose

from .helpers import figure3_diagnosis, figure3_job

ENGINE = {"chunked_prefill", "pd_disaggregation"}          # the seed's d and c
SANDBOX = {"add_sandbox_host", "prebuilt_image"}           # e and f
TRAINER = {"larger_micro_batch", "fewer_trainer_tp"}       # a and b


def test_every_setup_fixes_bottleneck_and_next_and_never_combines_c_with_d(tmp_path):
    job = figure3_job(tmp_path)
    out = propose(figure3_diagnosis(), job, load_default_knowledge(), max_candidates=50)
    sets = [set(c.fixes) for c in out.candidates]
    assert len(sets) == 8, sets                 # {a,b} x {c,d} x {e,f}
    assert {frozenset(s) for s in sets} == {frozenset({t, e, s}) for t in TRAINER for e in ENGINE for s in SANDBOX}
    assert all(len(s & ENGINE) == 1 and len(s & SANDBOX) == 1 and len(s & TRAINER) == 1 for s in sets)
    assert out.limiting_stage == "rollout" and out.next_stage == "training+weight_sync"
    by_fixes = {frozenset(c.fixes): c for c in out.candidates}
    b = by_fixes[frozenset({"larger_micro_batch", "pd_disaggregation", "prebuilt_image"})]  # the seed's B
    assert b.overrides == {"micro_batch_size": 2, "pd_disaggregation": True, "prebuilt_image": True}
    assert b.needs == []
    assert "fixes the bottleneck (rollout)" in b.rationale and "fixes the next bottleneck" in b.rationale
    c = by_fixes[frozenset({"fewer_trainer_tp", "chunked_prefill", "add_sandbox_host"})]   # the seed's C
    assert c.overrides == {"trainer_tp": 2, "chunked_prefill": True, "sandbox_hosts": 3}
    assert c.needs == ["extra_cpu_host"]
    knowledge = {f.id: f for f in load_default_knowledge().fixes}
    for cand in out.candidates:   # each carries the terms its fixes move, what an unforecastable change is judged by
        assert cand.moves == sorted({m for fix in cand.fixes for m in knowledge[fix].moves})
    assert "rollout" in b.moves and "training" in b.moves


def test_setups_needing_more_hardware_can_be_left_out(tmp_path):
    out = propose(figure3_diagnosis(), figure3_job(tmp_path), load_default_knowledge(), allow_needs=False)
    assert len(out.candidates) == 4
    assert all("add_sandbox_host" not in c.fixes and not c.needs for c in out.candidates)


def test_a_fix_already_in_effect_is_not_proposed_again(tmp_path):
    job = figure3_job(tmp_path, prebuilt_image=True, trainer_tp=1)
    out = propose(figure3_diagnosis(), job, load_default_knowledge(), max_candidates=50)
    assert {frozenset(c.fixes) for c in out.candidates} == {
        frozenset({"larger_micro_batch", e, "add_sandbox_host"}) for e in ENGINE}


def test_tried_setups_are_skipped_and_candidates_round_trip(tmp_path):
    job = figure3_job(tmp_path)
    knowledge = load_default_knowledge()
    first = propose(figure3_diagnosis(), job, knowledge, max_candidates=50)
    tried = [{**job.knobs, **first.candidates[0].overrides}]
    second = propose(figure3_diagnosis(), job, knowledge, max_candidates=50, tried=tried, round_tag="r2")
    assert len(second.candidates) == 7
    assert all(c.overrides != first.candidates[0].overrides for c in second.candidates)
    assert all(c.id.startswith("r2-c") for c in second.candidates)
    save_candidates(second, tmp_path / "candidates.yaml")
    assert load_candidates(tmp_path / "candidates.yaml") == second


def test_a_knob_the_job_cannot_move_removes_its_fixes(tmp_path):
    job = figure3_job(tmp_path)
    del job.launch.knob_map["pd_disaggregation"]
    out = propose(figure3_diagnosis(), job, load_default_knowledge(), max_candidates=50)
    assert all("pd_disaggregation" not in c.fixes for c in out.candidates)
    assert {frozenset(c.fixes) for c in out.candidates} == {
        frozenset({t, "chunked_prefill", s}) for t in TRAINER for s in SANDBOX}


def test_a_problem_without_an_applicable_fix_is_reported_unfixed(tmp_path):
    job = figure3_job(tmp_path)
    del job.knobs["pd_disaggregation"], job.launch.knob_map["pd_disaggregation"]
    out = propose(figure3_diagnosis(), job, load_default_knowledge(), max_candidates=50)
    # chunked_prefill's condition names pd_disaggregation, which the job no longer has: it drops too.
    assert out.unfixed == ["decode_interrupted_by_prefill"]
    assert len(out.candidates) == 4


def test_sync_job_gets_overlap_as_an_optional_extra(tmp_path):
    job = figure3_job(tmp_path, rl_mode="sync")
    diagnosis = dataclasses.replace(figure3_diagnosis(), rl_mode="sync")
    out = propose(diagnosis, job, load_default_knowledge(), max_candidates=100)
    modes = {c.overrides.get("rl_mode") for c in out.candidates}
    assert modes == {None, "one_step_async", "fully_async"}
    # in sync mode training (450 s) is next: still fixed in every setup
    assert all(set(c.fixes) & TRAINER for c in out.candidates)


def test_limiting_stage_without_a_fixable_problem_uses_fixes_that_move_it(tmp_path):
    job = figure3_job(tmp_path)
    diagnosis = dataclasses.replace(figure3_diagnosis(), problems=[
        Problem(id="trainer_underbusy", stage="training", component="trainer", summary="", severity=10.0)])
    out = propose(diagnosis, job, load_default_knowledge(), max_candidates=100)
    assert out.candidates
    rollout_movers = {"chunked_prefill", "pd_disaggregation", "prebuilt_image", "add_sandbox_host"}
    assert all(set(c.fixes) & rollout_movers for c in out.candidates)
    assert all(c.fixes[0] in rollout_movers for c in out.candidates)   # main change targets the bottleneck


def test_no_problems_and_nothing_to_move_gives_no_candidates(tmp_path):
    job = figure3_job(tmp_path, prebuilt_image=True, chunked_prefill=True, pd_disaggregation=True)
    del job.launch.knob_map["sandbox_hosts"]
    diagnosis = dataclasses.replace(figure3_diagnosis(), problems=[])
    out = propose(diagnosis, job, load_default_knowledge())
    assert out.candidates == []


def test_the_four_gpu_reference_job_moves_a_gpu_to_whichever_side_is_short():
    from rltune.contracts.diagnosis import Diagnosis
    from rltune.contracts.job import load_job

    from .helpers import REPO, stage

    job = load_job(REPO / "presets" / "h200x4-small-math.yaml")
    for problem, limiting, fix, want in [
        ("gpu_split_training_short", "training", "gpus_to_training", {"trainer_gpus": 3, "rollout_gpus": 1}),
        ("gpu_split_rollout_short", "rollout", "gpus_to_rollout", {"trainer_gpus": 1, "rollout_gpus": 3}),
    ]:
        diagnosis = Diagnosis(
            schema_version=1, run_id="base", source="rltune", rl_mode="sync", steps_used=[2, 3, 4],
            step_median_s=10.0, step_model_s=10.0, limiting_stage=limiting,
            stages={"rollout_s": stage(6.0 if limiting == "rollout" else 3.0),
                    "training_s": stage(6.0 if limiting == "training" else 3.0), "weight_sync_s": stage(0.1)},
            problems=[Problem(id=problem, stage=limiting, component="trainer" if limiting == "training" else "engine",
                              summary="the other side has slack", severity=3.0)])
        out = propose(diagnosis, job, load_default_knowledge(), max_candidates=50)
        moved = [c for c in out.candidates if fix in c.fixes]
        assert moved and all({k: c.overrides[k] for k in want} == want for c in moved), (fix, out.candidates)


def _cpu_vllm_job(tmp_path, **changes):
    """The CPU vLLM tuning job (rollout and training on the same cores), with ``changes`` to its top-level sections."""
    import yaml

    from rltune.contracts.job import load_job

    from .helpers import REPO

    data = yaml.safe_load((REPO / "presets" / "cpu-vllm-demo.yaml").read_text())
    for section, values in changes.items():
        data[section] = {**data[section], **values}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_job(path)


def _rollout_limited(rl_mode: str):
    from rltune.contracts.diagnosis import Diagnosis

    from .helpers import stage

    return Diagnosis(schema_version=1, run_id="base", source="rltune", rl_mode=rl_mode, steps_used=[2, 3, 4],
                     step_median_s=10.0, step_model_s=10.0, limiting_stage="rollout",
                     stages={"rollout_s": stage(8.0), "training_s": stage(6.0), "weight_sync_s": stage(0.5)},
                     problems=[])


def test_on_shared_cores_fixes_of_the_overlapped_trainer_stand_in_for_the_rollout_it_slows(tmp_path):
    knowledge = load_default_knowledge()
    trainer_only = {f.id for f in knowledge.fixes
                    if any(m.startswith("training") for m in f.moves) and not any(m.startswith("rollout") for m in f.moves)}
    assert "larger_micro_batch" in trainer_only
    job = _cpu_vllm_job(tmp_path, knobs={"rl_mode": "one_step_async"})
    out = propose(_rollout_limited("one_step_async"), job, knowledge, max_candidates=200)
    with_trainer = [c for c in out.candidates if set(c.fixes) & trainer_only]
    # optional: composed with and without, and never in place of a fix that moves the rollout itself
    assert with_trainer and len(with_trainer) < len(out.candidates)
    assert all(not set(c.fixes) <= trainer_only for c in out.candidates)
    assert all("training_shares_cores" in c.targets for c in with_trainer)
    assert all("fixes the next bottleneck (training)" in c.rationale for c in with_trainer)
    # In sync mode the stages never run side by side, and on GPUs each stage has its own devices: no stand-ins.
    sync = propose(_rollout_limited("sync"), _cpu_vllm_job(tmp_path), knowledge, max_candidates=200)
    gpus = propose(_rollout_limited("one_step_async"), _cpu_vllm_job(
        tmp_path, knobs={"rl_mode": "one_step_async"}, gpus={"count": 2, "device": "H200", "trainer": 1, "rollout": 1}),
        knowledge, max_candidates=200)
    for other in (sync, gpus):
        assert other.candidates
        assert all("training_shares_cores" not in c.targets for c in other.candidates)
