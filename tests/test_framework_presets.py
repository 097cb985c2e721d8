"""The framework job presets (TRL, verl, prime-rl) against each framework's own configuration.

- TRL: every flag the presets pass is a field of trl 1.16's GRPOConfig or of the job script, and
  TRL's own parser, given the command with no override, yields every knob's baseline value.
- verl: every override is composed with hydra against verl 0.9.1's config YAMLs, read from the
  installed wheel without importing verl (so a renamed key fails here), and the command alone
  composes to the knobs' baseline values.
- prime-rl: every flag is a key of prime-rl's RLConfig at the commit the preset names, from the
  list extracted there (tests/data/prime-rl/rl_config_keys.txt, its header says how); vLLM engine
  arguments passed through inference.vllm.* are checked against vLLM's EngineArgs where vLLM is installed.
- All: the full argv each preset renders (rltune.launch.build_argv) with every knob overridden,
  and each knob's framework key matches the knowledge base's keys for that framework.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from rltune.contracts.job import load_job
from rltune.contracts.knowledge import load_knowledge, parse_relative
from rltune.launch import build_argv, render_overrides

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "presets"
DATA = Path(__file__).parent / "data" / "prime-rl"
TRL_PRESETS = [PRESETS / "trl-grpo-cpu.yaml", PRESETS / "trl-grpo-h200.yaml", PRESETS / "trl-grpo-cpu-learn.yaml"]
VERL = PRESETS / "verl-grpo.yaml"
PRIME_RL = PRESETS / "prime-rl.yaml"
PRIME_RL_COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"
FRAMEWORK_OF = {"trl-grpo-cpu.yaml": "trl", "trl-grpo-h200.yaml": "trl", "verl-grpo.yaml": "verl",
                "prime-rl.yaml": "prime-rl"}
RUN_DIR = Path("/runs/r1")


def bare_argv(job) -> list[str]:
    """The job's own command with only the step count: what the framework runs when no knob is passed."""
    command = [part.replace("{run_dir}", str(RUN_DIR)).replace("{steps}", str(job.limits.steps))
               for part in job.launch.command]
    return command + render_overrides(job.launch.dialect, {job.launch.steps_override: job.limits.steps})


def every_knob(job) -> dict:
    """Each mapped knob at its baseline value: what a launch that sets every knob passes."""
    return {knob: job.knobs[knob] for knob in job.launch.knob_map}


def fix_values(job, knowledge) -> dict:
    """For each mapped knob, a value some knowledge-base fix sets it to (relative changes resolved)."""
    out = {}
    for fix in knowledge.fixes:
        for knob, value in fix.overrides.items():
            if knob in job.launch.knob_map and knob not in out:
                relative = parse_relative(value)
                if relative is None:
                    out[knob] = value
                else:
                    op, amount = relative
                    base = job.knobs[knob]
                    new = {"*": base * amount, "/": base / amount, "+": base + amount, "-": base - amount}[op]
                    out[knob] = int(new) if isinstance(base, int) else new
    return out


# --- TRL -------------------------------------------------------------------------------------------

def trl_fields() -> set[str]:
    from trl import GRPOConfig

    from rltune.integrations.trl_grpo import JobArguments

    return {f.name for f in dataclasses.fields(GRPOConfig)} | {f.name for f in dataclasses.fields(JobArguments)}


@pytest.mark.parametrize("path", TRL_PRESETS, ids=lambda p: p.name)
def test_trl_preset_flags_are_grpo_config_or_job_fields(path):
    from trl import GRPOConfig

    job = load_job(path)
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    # A knob maps to a GRPOConfig field or, like a learning job's task_seed, to one of the job's own flags.
    assert set(job.launch.knob_map.values()) <= trl_fields(), set(job.launch.knob_map.values()) - trl_fields()
    assert job.launch.steps_override in grpo
    flags = {a[2:] for a in job.launch.command if a.startswith("--")}
    assert flags <= trl_fields(), flags - trl_fields()
    assert job.launch.command[:3] == ["python3", "-m", "rltune.integrations.trl_grpo"]


@pytest.mark.parametrize("path", TRL_PRESETS, ids=lambda p: p.name)
def test_trl_preset_baseline_is_what_trl_parses_from_the_command(path):
    from rltune.integrations.trl_grpo import parse

    job = load_job(path)
    argv = bare_argv(job)[3:]
    # A CPU cannot build the H200 preset's bf16 config; the last --bf16 wins, nothing else changes.
    config, extra = parse([*argv, "--bf16", "false"])
    for knob, field in job.launch.knob_map.items():
        parsed = getattr(config if hasattr(config, field) else extra, field)  # a GRPOConfig field or the job's own
        assert parsed == job.knobs[knob], f"{path.name}: knob {knob}={job.knobs[knob]!r}, TRL {field}={parsed!r}"
    batch = job.workload.tasks_per_batch * job.workload.trials_per_task
    assert extra.samples_per_step == batch
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == batch
    assert config.num_generations == job.workload.trials_per_task
    assert config.max_completion_length == job.workload.answer_cap_tokens
    assert config.max_steps == job.limits.steps and config.output_dir == f"{RUN_DIR}/trl"


@pytest.mark.parametrize("path", TRL_PRESETS, ids=lambda p: p.name)
def test_trl_preset_parses_with_every_knob_and_every_fix_value(path):
    from rltune.integrations.trl_grpo import parse

    job = load_job(path)
    knowledge = load_knowledge(PRESETS / "knowledge.yaml")
    for overrides in (every_knob(job), {k: v for k, v in fix_values(job, knowledge).items()
                                         if k not in ("vllm_rollout", "engine_placement")}):
        config, extra = parse([*build_argv(job, path, RUN_DIR, overrides=overrides)[3:], "--bf16", "false"])
        for knob, value in overrides.items():
            field = job.launch.knob_map[knob]
            assert getattr(config if hasattr(config, field) else extra, field) == value
    # A larger micro-batch halves the accumulation: the batch stays the workload's.
    config, _ = parse([*build_argv(job, path, RUN_DIR, overrides={"micro_batch_size": job.knobs["micro_batch_size"] * 2})[3:],
                       "--bf16", "false"])
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == \
        job.workload.tasks_per_batch * job.workload.trials_per_task


# --- verl ------------------------------------------------------------------------------------------

def verl_config_dir() -> Path:
    spec = importlib.util.find_spec("verl")  # finds the installed wheel without importing it
    assert spec is not None and spec.submodule_search_locations, "verl is not installed: pip install --no-deps verl==0.9.1"
    return Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config"


def verl_compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def verl_overrides(argv: list[str]) -> list[str]:
    start = argv.index("verl.trainer.main_ppo") + 1
    return argv[start:]


def test_verl_is_read_from_its_wheel_not_imported():
    import sys

    assert (verl_config_dir() / "ppo_trainer.yaml").is_file()
    assert (verl_config_dir() / "_generated_ppo_trainer.yaml").is_file()
    verl_compose([])
    assert "verl" not in sys.modules


def test_verl_command_composes_to_the_knobs_baseline_values():
    from omegaconf import OmegaConf

    job = load_job(VERL)
    cfg = verl_compose(verl_overrides(bare_argv(job)))
    for knob, key in job.launch.knob_map.items():
        value = OmegaConf.select(cfg, key.lstrip("+"), default="<absent>")
        if key.startswith("+"):
            # Added to vLLM's engine arguments only when overridden; absent means vLLM's default.
            assert value == "<absent>" and job.knobs[knob] == "auto", knob
        elif job.knobs[knob] == "null":
            assert value is None, knob
        else:
            assert value == job.knobs[knob], f"knob {knob}={job.knobs[knob]!r}, verl {key}={value!r}"
    assert cfg.trainer.total_training_steps == job.limits.steps
    assert cfg.data.train_batch_size == job.workload.tasks_per_batch
    assert cfg.actor_rollout_ref.rollout.n == job.workload.trials_per_task
    assert cfg.data.max_response_length == job.workload.answer_cap_tokens
    assert list(cfg.trainer.logger) == ["console", "file"]
    # verl's separate_async trainer asserts these when it starts
    assert cfg.data.train_batch_size == (cfg.trainer.v1.separate_async.parameter_sync_step
                                         * cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    assert cfg.actor_rollout_ref.rollout.nnodes > 0 and cfg.actor_rollout_ref.rollout.checkpoint_engine.backend != "naive"
    assert job.gpus.trainer == job.knobs["trainer_gpus"] and job.gpus.rollout == job.knobs["rollout_gpus"]


def test_verl_overrides_of_every_knob_and_fix_value_compose_against_verls_config():
    from omegaconf import OmegaConf

    job = load_job(VERL)
    knowledge = load_knowledge(PRESETS / "knowledge.yaml")
    for overrides in (every_knob(job), fix_values(job, knowledge)):
        cfg = verl_compose(verl_overrides(build_argv(job, VERL, RUN_DIR, overrides=overrides, steps=3)))
        for knob, value in overrides.items():
            got = OmegaConf.select(cfg, job.launch.knob_map[knob].lstrip("+"))
            assert got == (None if value == "null" else value), knob


def test_a_misspelt_verl_key_fails_composition():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="ppo_micro_batch_size_per_gpus"):
        verl_compose(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpus=8"])


# --- prime-rl --------------------------------------------------------------------------------------

def prime_rl_keys() -> tuple[str, set[str], set[str]]:
    """(commit, keys, prefixes that take any extra key) from the committed extraction."""
    lines = (DATA / "rl_config_keys.txt").read_text().splitlines()
    commit = re.search(r"@([0-9a-f]{40})", lines[0]).group(1)
    keys = {line.split("\t")[0] for line in lines if line and not line.startswith("#")}
    return commit, keys, {"inference.vllm"}


def prime_rl_flag_keys(argv: list[str]) -> list[str]:
    """Dotted snake-case keys of every '--flag' (``--no-x`` switches off the optional section x)."""
    out = []
    for item in argv:
        if item.startswith("--"):
            name = item[2:]
            if name.startswith("no-"):
                name = name[3:]
            out.append(name.replace("-", "_"))
    return out


def test_prime_rl_key_list_is_the_commit_the_preset_names():
    commit, keys, _ = prime_rl_keys()
    assert commit == PRIME_RL_COMMIT and PRIME_RL_COMMIT in PRIME_RL.read_text()
    assert len(keys) > 500 and "orchestrator.max_off_policy_steps" in keys and "deployment.num_train_gpus" in keys


def test_prime_rl_flags_are_keys_of_its_rl_config():
    _, keys, open_prefixes = prime_rl_keys()
    job = load_job(PRIME_RL)
    argv = build_argv(job, PRIME_RL, RUN_DIR, overrides=every_knob(job), steps=job.limits.steps)
    assert argv[:3] == ["rl", "@", "examples/basic/reverse-text/rl.toml"]
    passthrough = []
    for key in prime_rl_flag_keys(argv):
        if key in keys:
            continue
        prefix = key.rsplit(".", 1)[0]
        assert prefix in open_prefixes, f"{key}: not a key of prime-rl's RLConfig at {PRIME_RL_COMMIT[:7]}"
        passthrough.append(key.rsplit(".", 1)[1])
    assert sorted(set(passthrough)) == ["enable_chunked_prefill", "kv_cache_dtype", "max_num_seqs"]
    assert "inference.vllm.quantization" in keys  # typed by prime-rl itself


def test_vllm_engine_arguments_the_prime_rl_preset_passes_through_exist():
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed here (the project's vLLM environment runs this check)")
    source = Path(list(spec.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
    tree = ast.parse(source.read_text())
    engine_args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    fields = {n.target.id for n in engine_args.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"enable_chunked_prefill", "kv_cache_dtype", "max_num_seqs", "quantization", "tensor_parallel_size"} <= fields


def test_a_misspelt_prime_rl_key_is_not_in_the_list():
    _, keys, _ = prime_rl_keys()
    assert not set(prime_rl_flag_keys(["--orchestrator.max-off-policy-step", "1"])) & keys


# --- all four --------------------------------------------------------------------------------------

EXPECTED_ARGV = {
    "trl-grpo-cpu.yaml": [
        "python3", "-m", "rltune.integrations.trl_grpo", "--output_dir", "/runs/r1/trl", "--bf16", "false",
        "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no", "--seed", "0",
        "--samples_per_step", "16", "--num_generations", "4", "--max_completion_length", "16",
        "--model_layers", "2", "--model_hidden", "128", "--model_heads", "4", "--model_kv_heads", "2",
        "--model_head_dim", "32", "--num_tasks", "512",
        "--max_steps", "8", "--per_device_train_batch_size", "8", "--generation_batch_size", "16",
        "--num_iterations", "1", "--gradient_checkpointing", "true", "--use_vllm", "false",
        "--vllm_mode", "colocate"],
    "trl-grpo-h200.yaml": [
        "python3", "-m", "rltune.integrations.trl_grpo", "--output_dir", "/runs/r1/trl", "--bf16", "true",
        "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no", "--seed", "0",
        "--samples_per_step", "128", "--num_generations", "8", "--max_completion_length", "96",
        "--model_layers", "24", "--model_hidden", "1024", "--model_heads", "16", "--model_kv_heads", "8",
        "--model_head_dim", "64", "--model_intermediate", "2048", "--num_tasks", "2048",
        "--max_steps", "10", "--per_device_train_batch_size", "8", "--generation_batch_size", "128",
        "--num_iterations", "1", "--gradient_checkpointing", "true", "--use_vllm", "false",
        "--vllm_mode", "colocate"],
    "verl-grpo.yaml": [
        "env", "VERL_FILE_LOGGER_PATH=/runs/r1/verl_metrics.jsonl", "python3", "-m", "verl.trainer.main_ppo",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        "data.train_files=data/gsm8k/train.parquet", "data.val_files=data/gsm8k/test.parquet",
        "data.train_batch_size=256", "data.max_prompt_length=512", "data.max_response_length=1024",
        "data.filter_overlong_prompts=true", "data.truncation=error",
        "actor_rollout_ref.model.path=Qwen/Qwen3-8B", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=4",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        "trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4",
        "trainer.nnodes=1", "trainer.n_gpus_per_node=4", "trainer.logger=[console,file]",
        "trainer.project_name=rltune", "trainer.experiment_name=verl-grpo", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.total_training_steps=10",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        "actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "algorithm.rollout_correction.bypass_mode=false", "trainer.v1.sampler.max_off_policy_threshold=8",
        "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n_gpus_per_node=4",
        "actor_rollout_ref.rollout.max_num_seqs=256", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.enable_chunked_prefill=true",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=auto",
        "actor_rollout_ref.rollout.quantization=null", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
    "prime-rl.yaml": [
        "rl", "@", "examples/basic/reverse-text/rl.toml", "--output-dir", "/runs/r1", "--run.name", "rltune",
        "--no-monitors.wandb", "--no-ckpt", "--trainer.monitors.file.path", "/runs/r1/metrics/trainer.jsonl",
        "--orchestrator.monitors.file.path", "/runs/r1/metrics/orchestrator.jsonl",
        "--deployment.num-train-gpus", "2", "--deployment.num-infer-gpus", "2",
        "--inference.vllm.max-num-seqs", "256", "--inference.vllm.enable-chunked-prefill", "true",
        "--max-steps", "10", "--seq-len", "2048", "--orchestrator.max-off-policy-steps", "8",
        "--deployment.num-train-gpus", "2", "--deployment.num-infer-gpus", "2",
        "--orchestrator.concurrency.max-inflight", "1024", "--inference.vllm.max-num-seqs", "256",
        "--inference.vllm.tensor-parallel-size", "1", "--inference.vllm.enable-chunked-prefill", "true",
        "--inference.vllm.kv-cache-dtype", "auto", "--inference.vllm.quantization", "None",
        "--weight-broadcast.type", "filesystem"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ARGV))
def test_preset_renders_its_full_argv_with_every_knob_overridden(name):
    path = PRESETS / name
    job = load_job(path)
    assert build_argv(job, path, RUN_DIR, overrides=every_knob(job), steps=job.limits.steps) == EXPECTED_ARGV[name]


@pytest.mark.parametrize("name", sorted(FRAMEWORK_OF))
def test_preset_maps_at_least_eight_knobs_the_knowledge_base_keys_for_its_framework(name):
    framework = FRAMEWORK_OF[name]
    job = load_job(PRESETS / name)
    knowledge = load_knowledge(PRESETS / "knowledge.yaml")
    assert len(job.launch.knob_map) >= (6 if framework == "trl" else 8)
    for knob, key in job.launch.knob_map.items():
        assert knob in knowledge.knobs, f"{name}: knob {knob} is not in knowledge.yaml"
        assert knowledge.knobs[knob].keys.get(framework) == key, \
            f"{name}: knob {knob} maps to {key!r}, knowledge.yaml keys.{framework} says {knowledge.knobs[knob].keys.get(framework)!r}"


def test_the_knowledge_base_has_fixes_each_framework_preset_can_express():
    from rltune.tune.knowledge import expressible_fixes

    knowledge = load_knowledge(PRESETS / "knowledge.yaml")
    expressible = {name: {f.id for f in expressible_fixes(load_job(PRESETS / name), knowledge)} for name in FRAMEWORK_OF}
    assert {"larger_micro_batch", "generate_two_steps_at_once", "reuse_each_batch_twice",
            "vllm_colocated_rollout"} <= expressible["trl-grpo-cpu.yaml"]
    assert "larger_micro_batch_less_accumulation" not in expressible["trl-grpo-cpu.yaml"]  # the batch is fixed by the job
    assert {"larger_micro_batch", "token_budget_batches", "reuse_rollout_logprobs", "gpus_to_training", "gpus_to_rollout",
            "chunked_prefill", "fp8_kv_cache", "fp8_weights", "more_engine_concurrency"} <= expressible["verl-grpo.yaml"]
    assert {"larger_token_micro_batch", "longer_sample_age", "gpus_to_training", "fp8_kv_cache", "fp8_weights",
            "nccl_weight_broadcast"} <= expressible["prime-rl.yaml"]
