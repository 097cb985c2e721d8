"""What runs is what the job file says: tuned presets reproduce their knobs, limits.steps is the step
count, and a relative metrics.path works the same in profile and in trials (one run recorder)."""

from __future__ import annotations

import os
import stat

import yaml

from rltune.contracts.forecast import CandidateForecast
from rltune.contracts.job import load_job
from rltune.profile import profile_job, record_run
from rltune.tune.preset import write_tuned_preset
from rltune.tune.trial import Baseline, run_trial
from rltune.workload.config import load_workload_config

from .helpers import DEMO, REPO


def test_a_profile_of_a_tuned_preset_runs_its_knobs(tmp_path):
    job = load_job(DEMO)
    tuned_knobs = {**job.knobs, "micro_batch_size": 4, "engine_max_concurrency": 8, "sync_transport": "inprocess"}
    preset = write_tuned_preset(job, DEMO, tuned_knobs, tmp_path / "tuned", {"speedup": 1.0})
    run = profile_job(preset, tmp_path / "run", steps=3)
    assert run.ok and run.table.num_rows == 3
    resolved = load_job(tmp_path / "run" / "job.yaml")
    assert resolved.knobs == tuned_knobs and resolved.limits.steps == 3
    # the workload's own resolved config agrees with the job's knobs, through the job's knob_map
    cfg = load_workload_config(tmp_path / "run" / "config.yaml")
    assert cfg.trainer.micro_batch_size == 4 and cfg.engine.max_concurrent_seqs == 8
    assert cfg.sync.transport == "inprocess" and cfg.orchestrator.steps == 3


def test_limits_steps_is_the_step_count_of_every_run_unless_steps_says_otherwise(tmp_path):
    data = yaml.safe_load(DEMO.read_text())
    data["limits"].update(steps=3, warmup_steps=1)
    data["launch"]["workdir"] = str(REPO)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run = record_run(path, tmp_path / "default")
    assert run.ok and sorted(r["step"] for r in run.rows) == [0, 1, 2]
    assert [r["warmup"] for r in sorted(run.rows, key=lambda r: r["step"])] == [True, False, False]
    short = record_run(path, tmp_path / "short", steps=2)
    assert short.ok and len(short.rows) == 2 and short.warmup_steps == 1


def test_a_relative_metrics_path_is_read_the_same_way_by_profile_and_by_a_trial(tmp_path):
    # The job writes its metrics to a path relative to its working directory (not under {run_dir}).
    data = yaml.safe_load(DEMO.read_text())
    workdir = tmp_path / "jobdir"
    (workdir / "out").mkdir(parents=True)
    data["launch"]["workdir"] = "jobdir"
    data["launch"]["command"] = ["rltune", "workload", "run", str(REPO / "presets/workload/tiny-math.yaml"),
                                 "--run-dir", "out"]
    data["metrics"]["path"] = "out/metrics.jsonl"
    data["limits"].update(steps=3, warmup_steps=1)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    job = load_job(path)
    base = profile_job(path, tmp_path / "base")
    assert base.ok and len(base.rows) == 3
    fc = CandidateForecast(candidate="c1", overrides={"micro_batch_size": 4}, stages_s={}, step_s=1.0,
                           range_s=[0.5, 2.0], limiting_stage="rollout", method="theory", rl_mode="sync")
    from rltune.predict.library import CaseLibrary

    outcome = run_trial(job, path, fc, baseline_knobs=job.knobs,
                        baseline=Baseline(base.run_id, base.rows, base.run_id, base.rows),
                        library=CaseLibrary(tmp_path / "cases"), run_root=tmp_path / "runs", run_id="t1", remeasure=False)
    assert outcome.verdict.decision != "failed", outcome.verdict.reason
    assert outcome.verdict.knobs["micro_batch_size"] == 4 and outcome.verdict.steps_compared == [1, 2]


def test_written_files_follow_the_umask(tmp_path):
    from rltune.contracts.schema import atomic_write_text

    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "a.yaml", "x: 1\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.yaml").stat().st_mode) == 0o640
    old = os.umask(0o002)
    try:
        write_tuned_preset(load_job(DEMO), DEMO, load_job(DEMO).knobs, tmp_path / "tuned", {})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "tuned" / "tiny-math-cpu.yaml").stat().st_mode) == 0o664
