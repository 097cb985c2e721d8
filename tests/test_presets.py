"""Every file under presets/ is parsed by its loader, so none can go stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.contracts.job import load_job
from rltune.contracts.knowledge import load_knowledge
from rltune.sync.bench import load_sync_bench_config
from rltune.sync.bench.readers import load_readers_config
from rltune.sync.estimate import load_model_spec
from rltune.workload.config import load_workload_config

PRESETS = Path(__file__).resolve().parents[1] / "presets"
ALL = sorted(p for p in PRESETS.rglob("*") if p.is_file())
WORKLOAD_CONFIGS = sorted((PRESETS / "workload").glob("*.yaml"))
SYNC_BENCH = sorted((PRESETS / "sync").glob("*.yaml"))
SYNC_READERS = sorted((PRESETS / "sync" / "readers").glob("*.yaml"))
SYNC_ESTIMATE = sorted((PRESETS / "sync" / "estimate").rglob("*.yaml"))
JOBS = sorted(PRESETS.glob("*.yaml")) + sorted((PRESETS / "tuned").glob("*.yaml"))
JOBS = [p for p in JOBS if p.name != "knowledge.yaml"]
# Jobs of the reference workload (rltune dialect); the framework jobs (TRL, verl, prime-rl) are checked
# against their frameworks' own configs in tests/test_framework_presets.py.
REFERENCE_JOBS = [p for p in JOBS if load_job(p).launch.dialect == "rltune"]
# The reference workload's abstract knobs (the names knowledge.yaml and the case library use).
REFERENCE_KNOBS = {"rl_mode", "max_sample_age", "micro_batch_size", "packing", "grad_checkpointing",
                   "reuse_rollout_logprobs", "engine_max_concurrency", "engine_batching", "num_engines",
                   "engine_compile", "sandbox_pool_size", "sandbox_hosts", "prebuilt_image", "sync_transport"}
GPU_SPLIT_KNOBS = {"trainer_gpus", "rollout_gpus"}  # placement.*: only jobs of several GPUs map them
# vLLM engine arguments (engine.vllm.*): only jobs whose workload runs vLLM engines map them
VLLM_ENGINE_KNOBS = {"engine_max_concurrency", "engine_max_batched_tokens", "chunked_prefill", "prefix_caching",
                     "kv_cache_dtype", "spec_tokens"}
SEED_KNOBS = {"seed", "task_seed"}  # what 'rltune reward-check' sets (sampling) and holds (task order)


def test_every_preset_file_has_a_loader():
    known = set(WORKLOAD_CONFIGS) | set(JOBS) | set(SYNC_BENCH) | set(SYNC_READERS) | set(SYNC_ESTIMATE) | \
        {PRESETS / "knowledge.yaml"}
    assert [p for p in ALL if p not in known] == []
    assert len(REFERENCE_JOBS) >= 3 and len(WORKLOAD_CONFIGS) >= 2


@pytest.mark.parametrize("path", SYNC_BENCH, ids=lambda p: p.name)
def test_sync_bench_preset_loads(path):
    cfg = load_sync_bench_config(path)
    assert cfg.steps >= 1


@pytest.mark.parametrize("path", SYNC_READERS, ids=lambda p: p.name)
def test_sync_readers_preset_loads(path):
    cfg = load_readers_config(path)
    assert cfg.readers and cfg.steps >= 1


@pytest.mark.parametrize("path", SYNC_ESTIMATE, ids=lambda p: p.name)
def test_sync_estimate_model_loads(path):
    spec = load_model_spec(path)
    assert spec.params_total >= spec.params_active and spec.tensors >= 1


@pytest.mark.parametrize("path", WORKLOAD_CONFIGS, ids=lambda p: p.name)
def test_workload_config_loads(path):
    cfg = load_workload_config(path)
    assert cfg.orchestrator.tasks_per_batch >= 1


def _workload_config_of(job, path):
    configs = [a for a in job.launch.command if a.startswith("presets/workload/")]
    assert len(configs) == 1, f"{path}: expected one presets/workload/ config in launch.command"
    return (path.parent / job.launch.workdir / configs[0]).resolve()


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_job_preset_loads(path):
    job = load_job(path)
    assert job.launch.knob_map and set(job.launch.knob_map) <= set(job.knobs)


@pytest.mark.parametrize("path", REFERENCE_JOBS, ids=lambda p: p.name)
def test_job_preset_loads_and_its_knobs_are_the_workload_config_values(path):
    job = load_job(path)
    config_path = _workload_config_of(job, path)
    assert config_path.exists(), f"{path}: launch.command names {config_path}, which does not exist"
    data = load_workload_config(config_path)
    for knob, key in job.launch.knob_map.items():
        node = data
        for part in key.split("."):
            node = node[part] if isinstance(node, dict) else getattr(node, part)  # engine.vllm is a mapping
        # A run without overrides must be the job's baseline, or cases would record wrong knobs.
        assert node == job.knobs[knob], f"{path}: knob {knob}={job.knobs[knob]!r} but {config_path.name} {key}={node!r}"
    vllm = VLLM_ENGINE_KNOBS if data.engine.backend == "vllm" else set()
    assert set(job.knobs) <= REFERENCE_KNOBS | GPU_SPLIT_KNOBS | SEED_KNOBS | vllm
    assert not (set(job.knobs) & GPU_SPLIT_KNOBS) or job.gpus.count >= 2
    assert job.launch.steps_override == "orchestrator.steps"


def test_knowledge_base_loads_with_enough_fixes_and_maps_reference_knobs():
    knowledge = load_knowledge(PRESETS / "knowledge.yaml")
    assert len(knowledge.fixes) >= 25
    assert REFERENCE_KNOBS <= set(knowledge.knobs)
    expressible = [f for f in knowledge.fixes if set(f.overrides) <= REFERENCE_KNOBS]
    assert len(expressible) >= 12
    tool_use = load_job(PRESETS / "cpu-tool-use.yaml")
    # Every fix the reference workload can express is movable in the tool-use preset, which maps all its knobs,
    # and the GPU-split fixes in the four-GPU job.
    assert all(set(f.overrides) <= set(tool_use.launch.knob_map) for f in expressible)
    split_job = load_job(PRESETS / "h200x4-small-math.yaml")
    split = [f for f in knowledge.fixes if set(f.overrides) & GPU_SPLIT_KNOBS]
    assert {f.id for f in split} >= {"gpus_to_training", "gpus_to_rollout"}
    assert all(set(f.overrides) <= set(split_job.launch.knob_map) for f in split)
    assert all(f.source and f.moves for f in knowledge.fixes)


@pytest.mark.parametrize("learn, tuned_from", [("cpu-math-learn.yaml", "cpu-demo.yaml"),
                                               ("h200-tiny-math-learn.yaml", "h200-tiny-math.yaml"),
                                               ("h200-small-math-learn.yaml", "h200-small-math.yaml")])
def test_a_learning_job_has_the_knobs_of_the_job_whose_tuned_presets_it_checks(learn, tuned_from):
    # 'rltune reward-check TUNED --against LEARN' runs TUNED's changed knobs on LEARN: same names, same baseline.
    job, demo = load_job(PRESETS / learn), load_job(PRESETS / tuned_from)
    assert {k: v for k, v in job.knobs.items() if k not in SEED_KNOBS} == demo.knobs
    assert {k: v for k, v in job.launch.knob_map.items() if k not in SEED_KNOBS} == demo.launch.knob_map
    assert job.launch.knob_map["seed"] == "orchestrator.seed" and job.launch.knob_map["task_seed"] == "env.seed"


def test_every_launcher_has_a_job_preset_and_new_presets_are_found_by_the_glob():
    launchers = {load_job(p).launch.launcher: p.name for p in JOBS}
    from rltune.launch import LAUNCHERS

    assert set(LAUNCHERS) - {"torchrun"} <= set(launchers), launchers
    assert {"cpu-demo-slurm.yaml", "cpu-demo-ray.yaml"} <= {p.name for p in JOBS}


@pytest.mark.parametrize("name", ["cpu-demo-slurm.yaml", "cpu-demo-ray.yaml"])
def test_the_scheduler_demos_are_the_cpu_demo_with_another_launcher(name):
    import dataclasses

    demo, other = load_job(PRESETS / "cpu-demo.yaml"), load_job(PRESETS / name)
    launch_fields = {"launcher", "slurm_args", "ray_address", "ray_args"}
    assert other.launch.launcher != demo.launch.launcher
    for f in dataclasses.fields(other.launch):
        if f.name not in launch_fields:
            assert getattr(other.launch, f.name) == getattr(demo.launch, f.name), f.name
    assert dataclasses.replace(other, launch=demo.launch) == demo
