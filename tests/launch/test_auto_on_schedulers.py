"""``rltune auto`` with its trials on the real SLURM cluster: kill -9 of rltune mid-trial, then the same
command follows the job it left on the cluster instead of running it again; ``--parallel 2`` runs two
candidates of a round as two batch jobs at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rltune.contracts.journal import event_as_data
from rltune.predict.library import CaseLibrary

REPO = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, **limits) -> Path:
    data = yaml.safe_load((REPO / "presets" / "cpu-demo-slurm.yaml").read_text())
    data["launch"]["workdir"] = str(REPO)
    data["limits"].update(baseline_runs=1, **limits)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _events(workdir: Path) -> list[dict]:
    path = workdir / "journal.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def test_kill_9_of_auto_mid_trial_then_the_same_command_follows_the_job_on_the_cluster(slurm, tmp_path):
    job, workdir = _job(tmp_path, min_forecast_gain_pct=0), tmp_path / "tune"
    argv = [sys.executable, "-m", "rltune.cli.main", "auto", str(job), "--workdir", str(workdir), "--rounds", "1",
            "--trials", "1", "--steps", "4", "--tuned-dir", str(tmp_path / "tuned"), "--no-live"]
    env = slurm.env(PYTHONPATH=str(REPO))
    first = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline, submitted = time.monotonic() + 240, None
    while time.monotonic() < deadline and first.poll() is None:
        trials = {e["run_id"] for e in _events(workdir) if e["event"] == "run_start" and e["role"] == "trial"}
        submitted = next((e for e in _events(workdir) if e["event"] == "run_submitted" and e["run_id"] in trials), None)
        if submitted:
            break
        time.sleep(0.3)
    assert submitted is not None, "auto never submitted a trial"
    os.killpg(first.pid, signal.SIGKILL)       # rltune and everything in its session; the batch job is slurm's
    first.wait(timeout=30)
    job_id = submitted["identity"]["job_id"]
    assert slurm.scontrol_job(job_id).get("JobState") in ("PENDING", "RUNNING", "COMPLETING", "COMPLETED")

    second = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stderr[-3000:]
    events = _events(workdir)
    run_id = submitted["run_id"]
    assert not any(e["event"] == "run_abandoned" for e in events)
    trials = [e for e in events if e["event"] == "trial"]
    assert [e["run_id"] for e in trials] == [run_id]
    # the trial's job ran once: one submission, the one the killed process made
    assert [e["identity"]["job_id"] for e in events if e["event"] == "run_submitted" and e["run_id"] == run_id] == [job_id]
    # a gain under the recheck bar is measured again under its own id (whether it is depends on timings)
    again = [f"{run_id}-again"] if trials[0]["remeasured"] else []
    ids = [r.run_id for r in CaseLibrary(workdir / "cases").load()]
    assert sorted(ids) == sorted(["r0-untuned", run_id, *again])
    assert events[-1]["event"] == "finish"


def test_parallel_2_runs_two_candidates_of_a_round_as_two_batch_jobs_and_decides_from_both(slurm, tmp_path):
    from rltune.tune.auto import AutoLoop

    loop = AutoLoop(_job(tmp_path, min_forecast_gain_pct=0), tmp_path / "tune", rounds=1, trial_budget=2,
                    max_trials_per_round=2, steps=3, parallel=2, tuned_dir=tmp_path / "tuned")
    result = loop.run()
    events = [event_as_data(e) for e in loop.journal.events()]  # the lines as written
    starts = [i for i, e in enumerate(events) if e["event"] == "run_start" and e["role"] == "trial"]
    trials = [i for i, e in enumerate(events) if e["event"] == "trial"]
    assert len(starts) == 2 and len(trials) == 2
    assert max(starts) < min(trials)                   # both were submitted before either was decided
    again = sum(1 for i in trials if events[i]["remeasured"])
    jobs = {e["identity"]["job_id"] for e in events if e["event"] == "run_submitted"}
    assert len(jobs) == 3 + again                      # the baseline and each trial run, each its own batch job
    proposed = next(e for e in events if e["event"] == "proposed")
    assert len(proposed["picks"]) == 2
    kept = [events[i] for i in trials if events[i]["decision"] == "keep"]
    end = next(e for e in events if e["event"] == "round_end")
    if kept:                                           # the fastest kept one is the next baseline
        assert end["baseline_run"] == min(kept, key=lambda e: e["step_s"])["run_id"]
        assert result.best_step_s == min(e["step_s"] for e in kept)
    ids = [r.run_id for r in CaseLibrary(tmp_path / "tune" / "cases").load()]
    assert len(ids) == len(set(ids)) == 3 + again
