"""``rltune auto --parallel 2`` against ``--parallel 1`` on a real one-node SLURM cluster (2 CPUs).

Starts the same cluster the tests use (tests/launch/schedulers.py), then runs the CPU demo job
(presets/cpu-demo-slurm.yaml) twice with the same trial budget, the same limits and the same
steps: once one trial at a time, once two. Each batch job gets one CPU (``--cpus-per-task=1`` and
one torch thread) in both, so the two runs differ only in how many trials the loop runs at once.
The record holds each run's wall time, its trials and that every run reached the library once.

Usage: python bench/parallel_trials.py --out runs/bench/parallel_trials.json [--trials 4] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "launch"))


def _job(root: Path) -> Path:
    data = yaml.safe_load((REPO / "presets" / "cpu-demo-slurm.yaml").read_text())
    data["launch"]["workdir"] = str(REPO)
    data["launch"]["slurm_args"] = ["--partition=debug", "--ntasks=1", "--cpus-per-task=1"]
    data["launch"]["env"] = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    data["limits"].update(baseline_runs=1)
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _auto(job: Path, workdir: Path, parallel: int, trials: int, steps: int, env: dict) -> dict:
    from rltune.predict.library import CaseLibrary

    argv = [sys.executable, "-m", "rltune.cli.main", "auto", str(job), "--workdir", str(workdir), "--trials", str(trials),
            "--per-round", str(trials), "--rounds", str(trials), "--steps", str(steps), "--parallel", str(parallel),
            "--tuned-dir", str(workdir / "tuned"), "--no-live", "--json"]
    start = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"auto --parallel {parallel} failed:\n{done.stderr[-3000:]}")
    events = [json.loads(line) for line in (workdir / "journal.jsonl").read_text().splitlines() if line.strip()]
    ids = [r.run_id for r in CaseLibrary(workdir / "cases").load()]
    runs = [e["run_id"] for e in events if e["event"] in ("baseline_run", "trial")]
    again = [e["run_id"] + "-again" for e in events if e["event"] == "trial" and e["remeasured"]]
    baseline_s = next(e for e in events if e["event"] == "baseline_run")
    first_trial = next(e["time"] for e in events if e["event"] == "run_start" and e["role"] == "trial")
    return {"parallel": parallel, "wall_s": round(wall, 2), "trials": sum(1 for e in events if e["event"] == "trial"),
            "trials_wall_s": round(events[-1]["time"] - first_trial, 2), "baseline_step_s": baseline_s["step_s"],
            "every_run_once": sorted(ids) == sorted(runs + again) and len(ids) == len(set(ids)),
            "result": json.loads(done.stdout)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from schedulers import SlurmCluster, slurm_missing

    from rltune.sync.bench import git_sha

    why = slurm_missing()
    if why:
        raise SystemExit(f"no SLURM here: {why}; run 'make setup'")
    with tempfile.TemporaryDirectory(prefix="rltune-parallel-") as tmp:
        root = Path(tmp)
        cluster = SlurmCluster(root / "slurm").start()
        try:
            env = cluster.env(PYTHONPATH=str(REPO))
            job = _job(root)
            rows = [_auto(job, root / f"p{k}", k, args.trials, args.steps, env) for k in (1, 2)]
        finally:
            cluster.stop()
    one, two = rows
    record = {"bench": "parallel_trials", "git_sha": git_sha(REPO), "python": platform.python_version(),
              "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
              "config": {"trials": args.trials, "steps": args.steps, "job": "presets/cpu-demo-slurm.yaml, 1 CPU a job"},
              "runs": rows, "ratio_wall": round(two["wall_s"] / one["wall_s"], 3),
              "ratio_trials_wall": round(two["trials_wall_s"] / one["trials_wall_s"], 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("ratio_wall", "ratio_trials_wall")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
