"""The real TRL GRPO job and the stage-timer callback, run for real (trl 1.16, CPU).

Each run is TRL's own GRPOTrainer through ``python -m rltune.integrations.trl_grpo`` on the tiny
random Qwen3; the assertions are identities between what TRL timed and what the callback derived,
and the exact sample ages TRL's buffering implies (which do not depend on how fast anything ran).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rltune.integrations import trl as timers

REPO = Path(__file__).resolve().parents[2]
CPU_PRESET = REPO / "presets" / "trl-grpo-cpu.yaml"
PREPARE = timers.PROFILING_PREFIX + "GRPOTrainer._prepare_inputs"
TINY = ["--bf16", "false", "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no",
        "--num_generations", "4", "--max_completion_length", "8", "--num_tasks", "64", "--samples_per_step", "16"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_job(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rltune.integrations.trl_grpo", "--output_dir", str(out), *flags],
                          capture_output=True, text=True, env=ENV, timeout=300, cwd=REPO)


def steps_of(out: Path) -> list[dict]:
    state = json.loads((out / timers.STATE_FILE).read_text())
    return [e for e in state["log_history"] if "train_runtime" not in e]


@pytest.fixture(scope="module")
def reused(tmp_path_factory) -> list[dict]:
    """Generation for 2 steps at once, each batch trained twice: one generation round per 4 optimizer steps."""
    out = tmp_path_factory.mktemp("trl") / "reused"
    done = run_job(out, *TINY, "--max_steps", "5", "--per_device_train_batch_size", "8",
                   "--generation_batch_size", "32", "--num_iterations", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    return steps_of(out)


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> list[dict]:
    """Micro-batch 4, 4 accumulation steps, a generation round every 2 micro-steps: 2 rounds per step."""
    out = tmp_path_factory.mktemp("trl") / "split"
    done = run_job(out, *TINY, "--max_steps", "3", "--per_device_train_batch_size", "4", "--generation_batch_size", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "micro-batch 4 x 4 accumulation" in done.stdout
    return steps_of(out)


def test_every_step_logs_the_callbacks_keys_and_trls_own_timers(reused):
    assert [e["step"] for e in reused] == [1, 2, 3, 4, 5]
    for entry in reused:
        missing = [k for k in timers.KEYS if k not in entry]
        assert missing == [], (entry["step"], missing)
        assert entry[PREPARE] > 0 and entry[timers.PROFILING_PREFIX + "GRPOTrainer.compute_loss"] > 0


def test_sample_age_is_the_optimizer_steps_since_the_batch_was_generated(reused):
    # generation_batch_size 32 = 2 steps' worth, num_iterations 2: generated at steps 1 and 5.
    assert [e[timers.GENERATIONS] for e in reused] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert [e[timers.SAMPLE_AGE_MAX] for e in reused] == [0.0, 1.0, 2.0, 3.0, 0.0]
    assert [e[timers.SAMPLE_AGE_MEAN] for e in reused] == [0.0, 1.0, 2.0, 3.0, 0.0]


def test_stage_times_add_up_to_trls_timers(reused):
    for e in reused:
        # rollout is _prepare_inputs less the log-prob pass inside it (nothing to sync without vLLM)
        assert e[timers.ROLLOUT_S] + e[timers.OLD_LOGPROB_S] == pytest.approx(e[PREPARE], rel=1e-9, abs=1e-12)
        assert e[timers.WEIGHT_SYNC_S] == 0.0
        assert e[timers.GENERATE_S] <= e[timers.ROLLOUT_S]
        assert e[timers.FORWARD_S] < e[timers.TRAINING_S]
        assert e[timers.OPTIMIZER_S] < e[timers.TRAINING_S]
        assert e[timers.ROLLOUT_S] + e[timers.OLD_LOGPROB_S] + e[timers.TRAINING_S] <= e[timers.STEP_S]
        # TRL's step_time times the micro-steps' training_step calls only: inside the step, never more.
        assert e["step_time"] <= e[timers.STEP_S]
    # A batch trained on in later steps needs its old log-probs: TRL computes them once, when it generates.
    assert [e[timers.OLD_LOGPROB_S] > 0 for e in reused] == [True, False, False, False, True]
    assert "sampling/sampling_logp_difference/mean" not in reused[0]  # no vLLM, no gap to report


def test_several_generation_rounds_in_one_step_are_all_on_policy(split):
    assert [e[timers.GENERATIONS] for e in split] == [2.0, 2.0, 2.0]
    assert [e[timers.SAMPLE_AGE_MAX] for e in split] == [0.0, 0.0, 0.0]
    # Each step's rounds finish before its optimizer step: TRL skips the old-logprob pass.
    assert [e[timers.OLD_LOGPROB_S] for e in split] == [0.0, 0.0, 0.0]


def test_a_flag_trl_does_not_know_is_one_line_and_exit_code_2(tmp_path):
    done = run_job(tmp_path / "x", *TINY, "--per_device_train_batch_sz", "8")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--per_device_train_batch_sz 8: not a flag of TRL's GRPOConfig" in lines[0]
    assert "launch.knob_map" in lines[0]


@pytest.mark.parametrize(("flags", "message"), [
    (["--per_device_train_batch_size", "5"], "--samples_per_step 16 is not a multiple of per_device_train_batch_size"),
    (["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4"], "contradicts --samples_per_step 16"),
    (["--bf16", "true"], "on a CPU pass --bf16 false"),
], ids=["indivisible-batch", "accumulation-contradicts-batch", "bf16-on-cpu"])
def test_a_value_the_job_cannot_run_with_is_one_line_naming_the_fix(tmp_path, flags, message):
    done = run_job(tmp_path / "x", *TINY, *flags)
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr


def test_the_callback_refuses_a_trainer_without_trls_metrics():
    with pytest.raises(TypeError, match="needs a TRL GRPOTrainer"):
        timers.TrlStageTimers(object())


def test_what_the_frameworks_process_imports_stays_below_the_tuner():
    code = ("import sys, rltune.integrations.trl, rltune.integrations.trl_grpo; "
            "print(sorted(m for m in sys.modules if m.startswith(('rltune.tune', 'rltune.predict', 'rltune.cli'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_profile_of_the_cpu_preset_times_every_step(tmp_path):
    from rltune.contracts.job import load_job
    from rltune.profile import profile_job

    result = profile_job(CPU_PRESET, tmp_path / "run", steps=3)
    rows = result.table.to_pylist()
    assert [r["step"] for r in rows] == [1, 2, 3]
    for column in ("step_s", "rollout_s", "training_s", "sample_age_mean"):
        assert all(r[column] is not None for r in rows), column
    assert all(r["rollout_s"] + r["training_s"] <= r["step_s"] for r in rows)
    assert [r["gap"] for r in rows] == [None] * 3  # transformers' generate gives no rollout log-probs
    assert result.diagnosis.limiting_stage in ("rollout", "training")
    assert load_job(tmp_path / "run" / "job.yaml").limits.steps == 3


def test_a_knob_map_entry_naming_no_trl_flag_fails_the_run_with_the_jobs_line(tmp_path):
    from rltune.errors import LaunchError
    from rltune.profile import profile_job

    data = yaml.safe_load(CPU_PRESET.read_text())
    data["launch"]["knob_map"]["micro_batch_size"] = "per_device_train_batch_sz"
    data["launch"]["workdir"] = str(REPO)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    with pytest.raises(LaunchError, match="exited with code 2") as err:
        profile_job(job, tmp_path / "run", steps=2, overrides={"micro_batch_size": 16})
    assert "--per_device_train_batch_sz 16: not a flag of TRL's GRPOConfig" in str(err.value)


def test_a_misspelt_knob_on_the_command_line_is_one_line_naming_the_job_file(capsys):
    from rltune.cli.main import main

    assert main(["profile", str(CPU_PRESET), "--set", "micro_batchsize=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"--set (job {CPU_PRESET}): micro_batchsize: not a knob of job 'trl-grpo-cpu'" in err[0]
    assert "did you mean 'micro_batch_size'?" in err[0]


def test_the_job_reads_its_flags_from_trls_config_file_too(tmp_path):
    from rltune.integrations.trl_grpo import parse

    config_file = tmp_path / "grpo.yaml"
    config_file.write_text("samples_per_step: 16\nper_device_train_batch_size: 4\nnum_generations: 4\nbf16: false\n"
                           "output_dir: out\n")
    config, job = parse(["--config", str(config_file)])
    assert (job.samples_per_step, config.per_device_train_batch_size, config.gradient_accumulation_steps) == (16, 4, 4)
    assert config.generation_batch_size == 16 and config.steps_per_generation == 4
