"""End-to-end runs with real engine processes: each RL mode's weight versions and sample ages, the
metrics record's keys, the CLI, the torchrun entrypoint and tool use in sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rltune.workload as workload
from rltune.contracts.stages import CORE_NAMES
from rltune.errors import RltuneError
from rltune.workload.config import load_workload_config

REPO = Path(__file__).resolve().parents[2]
TINY_MATH = REPO / "presets" / "workload" / "tiny-math.yaml"
TINY_TOOL = REPO / "presets" / "workload" / "tiny-tool-use.yaml"
# Small batches keep each run to a few seconds after the engine starts.
# fp32 engines, so that "same weights on both sides" means a gap of numerical noise only (~1e-7);
# the presets serve bf16 like real engines, which puts the untuned gap near 1e-3.
FAST = ["orchestrator.tasks_per_batch=2", "orchestrator.trials_per_task=3", "env.max_new_tokens=6",
        "model.engine_dtype=float32"]
ALWAYS = set(CORE_NAMES) - {"run_id", "warmup", "sandbox_setup_s", "sandbox_exec_s"}


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_record_shapes(recs: list[dict], tool_use: bool) -> None:
    for i, rec in enumerate(recs):
        assert rec["step"] == i
        missing = ALWAYS - set(rec)
        assert not missing, missing
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in rec.values())
        assert ("sandbox_setup_s" in rec) is tool_use and ("sandbox_exec_s" in rec) is tool_use
        for key in ("step_s", "rollout_s", "training_s", "weight_sync_s", "gen_tokens", "sync_bytes"):
            assert rec[key] > 0, key
        assert rec["weight_version"] == i + 1
        assert 0 <= rec["padding_frac"] < 1 and 0 < rec["trainer_busy_frac"] <= 1
        assert 0 < rec["kv_cache_usage"] <= 1
        assert rec["trials_total"] == 6


def test_cli_runs_tiny_math_for_three_steps_in_sync_mode(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "rltune.cli.main", "workload", "run", str(TINY_MATH), "--steps", "3",
                          "--run-dir", str(run_dir), "--json", *FAST], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["steps"] == 3 and Path(summary["metrics"]) == run_dir / "metrics.jsonl"
    resolved = load_workload_config(run_dir / "config.yaml")
    assert (resolved.orchestrator.steps, resolved.orchestrator.tasks_per_batch) == (3, 2)
    recs = records(run_dir / "metrics.jsonl")
    check_record_shapes(recs, tool_use=False)
    # sync: every batch comes from the weights the trainer holds -> age 0; no overlap, so the
    # step is at least the sum of its stages.
    assert [(r["sample_age_mean"], r["sample_age_max"]) for r in recs] == [(0, 0)] * 3
    for rec in recs[1:]:
        assert rec["step_s"] >= rec["rollout_s"] + rec["training_s"] + rec["weight_sync_s"]
    assert all(r["old_logprob_s"] > 0 for r in recs)
    # Same weights on both sides: the gap is numerical noise only (fp32, measured ~1e-7).
    assert all(r["gap"] < 1e-4 for r in recs)


@pytest.mark.slow
def test_one_step_async_under_torchrun_trains_each_batch_one_version_late(tmp_path):
    metrics = workload.run(TINY_MATH, tmp_path, steps=3,
                           overrides=[*FAST, "orchestrator.rl_mode=one_step_async", "trainer.launcher=torchrun",
                                      "sync.transport=inprocess"])
    recs = records(metrics)
    check_record_shapes(recs, tool_use=False)
    assert [(r["sample_age_mean"], r["sample_age_max"]) for r in recs] == [(0, 0), (1, 1), (1, 1)]
    assert (tmp_path / "launch-config.yaml").exists() and (tmp_path / "torchrun.log").exists()


def test_fully_async_keeps_sample_age_within_the_cap_with_sparse_delta_sync(tmp_path):
    metrics = workload.run(TINY_MATH, tmp_path, steps=4,
                           overrides=[*FAST, "orchestrator.rl_mode=fully_async", "orchestrator.max_sample_age=1",
                                      "trainer.reuse_rollout_logprobs=true", "trainer.packing=true",
                                      "sync.transport=sparse_delta", "sync.anchor_interval=2"])
    recs = records(metrics)
    check_record_shapes(recs, tool_use=False)
    assert recs[0]["sample_age_max"] == 0
    assert all(r["sample_age_max"] <= 1 for r in recs)
    assert all(r["old_logprob_s"] == 0 for r in recs)  # logprobs reused: the pass does not run
    assert all(r["padding_frac"] == 0 for r in recs)  # packed rows carry no padding
    assert all("groups_dropped_stale" in r for r in recs)
    # Engines took every version through rltune.sync: deltas each step, an anchor every 2nd version.
    assert [r["sync_anchor_bytes"] > 0 for r in recs] == [False, True, False, True]
    assert all(r["sync_delta_bytes"] > 0 for r in recs)
    # the engines' loader read and decoded every step on a thread as soon as it was published (the engines
    # attached and loaded step 0 before serving); the pause only patched
    assert [r["sync_prefetched_frac"] for r in recs] == [1.0] * 4
    assert all(0 < r["sync_blocking_s_max"] <= r["sync_load_s_max"] for r in recs)


def test_tool_use_in_one_step_async_mode_runs_turns_in_sandboxes_and_leaves_nothing(tmp_path):
    before = set(Path("/tmp").glob("rltune-sandboxes-*"))
    metrics = workload.run(TINY_TOOL, tmp_path / "run", steps=3,
                           overrides=[*FAST, "env.max_turns=2", "env.sandbox_pool_size=2", "env.image_modules=4",
                                      "env.prebuilt_image=true", "orchestrator.rl_mode=one_step_async"])
    recs = records(metrics)
    check_record_shapes(recs, tool_use=True)
    # one-step async: batch k+1 is generated with v_k while v_k+1 is trained -> one version old.
    assert [(r["sample_age_mean"], r["sample_age_max"]) for r in recs] == [(0, 0), (1, 1), (1, 1)]
    for rec in recs:
        assert rec["sandbox_setup_s"] > 0 and rec["sandbox_exec_s"] > 0
        assert 1 < rec["turns_mean"] <= 2
    assert set(Path("/tmp").glob("rltune-sandboxes-*")) == before


@pytest.mark.slow
def test_a_batch_cut_off_entirely_is_a_clear_error(tmp_path):
    with pytest.raises(RltuneError, match="no generated tokens"):
        workload.run(TINY_MATH, tmp_path, steps=1, overrides=[*FAST, "env.trial_timeout_s=0.01"])


def test_a_script_without_a_main_guard_fails_at_once_naming_the_engine_and_the_fix(tmp_path):
    # Engines are spawned, so each imports the script again and dies before it is ready; the run
    # must say so at once instead of waiting out the start-up timeout.
    script = tmp_path / "job.py"
    script.write_text("import rltune.workload as workload\n"
                      f"workload.run({str(TINY_MATH)!r}, {str(tmp_path / 'run')!r}, steps=1)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "engine process exited before it was ready (rltune-engine-0: exit code 1)" in last, proc.stderr[-2000:]
    assert 'if __name__ == "__main__":' in last
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_torchrun_with_two_ranks_trains_with_ddp(tmp_path):
    metrics = workload.run(TINY_MATH, tmp_path, steps=2,
                           overrides=[*FAST, "trainer.launcher=torchrun", "trainer.world_size=2"])
    recs = records(metrics)
    check_record_shapes(recs, tool_use=False)
    assert all(r["gap"] < 1e-4 for r in recs)


@pytest.mark.slow
@pytest.mark.parametrize("preset", [TINY_MATH, TINY_TOOL])
def test_five_steps_of_a_tiny_preset_finish_in_two_minutes(tmp_path, preset):
    import time

    start = time.perf_counter()
    metrics = workload.run(preset, tmp_path, steps=5)
    assert len(records(metrics)) == 5
    assert time.perf_counter() - start < 120
