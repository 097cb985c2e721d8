"""rltune's loop against Optuna's TPE sampler: same knobs, job, launcher and trial budget, 3 seeds.

Both searchers start from the same measured untuned baseline and spend the same number of real
runs (each run: the job through its launcher, timed on the same steps, warm-up left out). TPE
searches the knob space the job maps (booleans, choices, and powers of two around each integer
knob's baseline); rltune runs ``auto``. A TPE trial counts towards its "best" only when it also
passes the job's acceptance limits against the untuned baseline, as rltune's kept setups must.

The record (JSON) holds both curves (best step so far after each trial) for every seed, the
median best of each searcher and the trial at which each first reached within noise of its best.

    .venv/bin/python bench/tpe_vs_rltune.py --job presets/cpu-demo.yaml --trials 12 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rltune.contracts.job import load_job  # noqa: E402
from rltune.tune.knowledge import load_default_knowledge  # noqa: E402
from rltune.tune.limits import judge  # noqa: E402
from rltune.tune.trial import measure_run  # noqa: E402


def knob_space(job, knowledge) -> dict[str, list]:
    """Values TPE may pick for each knob the job maps."""
    space = {}
    for knob, base in job.knobs.items():
        if knob not in job.launch.knob_map or knob not in knowledge.knobs:
            continue
        info = knowledge.knobs[knob]
        if info.type == "bool":
            space[knob] = [False, True]
        elif info.choices:
            space[knob] = list(info.choices)
        elif info.type == "int":
            values = {int(base * f) for f in (0.25, 0.5, 1, 2, 4)} | {int(base) + 1}
            lo = info.min if info.min is not None else 1
            hi = info.max if info.max is not None else max(values)
            space[knob] = sorted(v for v in values if lo <= v <= hi)
    return space


def best_curve(values: list[float | None], start: float) -> list[float]:
    best, out = start, []
    for v in values:
        if v is not None and v < best:
            best = v
        out.append(best)
    return out


def trials_to_reach(curve: list[float], target: float, noise_pct: float) -> int | None:
    for i, v in enumerate(curve, 1):
        if v <= target * (1 + noise_pct / 100):
            return i
    return None


def run_tpe(job, job_path: Path, space: dict, baseline, trials: int, seed: int, workdir: Path, steps: int | None) -> dict:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(4, trials))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    records = []

    def objective(trial):
        knobs = dict(job.knobs)
        for knob, values in space.items():
            index = trial.suggest_categorical(knob, list(range(len(values))))
            knobs[knob] = values[index]
        run_id = f"tpe-s{seed}-t{trial.number}"
        run = measure_run(job, job_path, workdir / run_id, run_id, knobs, steps)
        step = None
        passed = False
        if run.ok:
            judgement = judge(job.limits, baseline.rows, run.rows, baseline.rows)
            step = judgement.step_s
            passed = all(c.passed for c in judgement.checks if c.name != "speed")
        records.append({"trial": trial.number + 1, "knobs": knobs, "status": run.status, "step_s": step,
                        "within_limits": passed})
        return step if step is not None else float("inf")

    study.optimize(objective, n_trials=trials)
    curve = best_curve([r["step_s"] if r["within_limits"] else None for r in records], baseline.step_s())
    return {"trials": records, "curve": curve}


def run_rltune(job_path: Path, trials: int, workdir: Path, steps: int | None, library: Path) -> dict:
    from rltune.tune.auto import auto
    from rltune.tune.journal import Journal

    result = auto(job_path, workdir, rounds=trials, trial_budget=trials, steps=steps, library=library,
                  tuned_dir=workdir / "tuned")
    events = [e for e in Journal(workdir / "journal.jsonl").events() if e["event"] == "trial"]
    kept = [e["step_s"] if e["decision"] == "keep" else None for e in events]
    curve = best_curve(kept, result.untuned_step_s)
    return {"trials": [{"trial": i + 1, "candidate": e["candidate"], "fixes": e["fixes"], "decision": e["decision"],
                        "step_s": e["step_s"]} for i, e in enumerate(events)],
            "curve": curve, "untuned_step_s": result.untuned_step_s, "reason": result.reason}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, default=REPO / "presets" / "cpu-demo.yaml")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench-tpe")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    job = load_job(args.job)
    knowledge = load_default_knowledge()
    space = knob_space(job, knowledge)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    root = args.workdir / stamp
    seeds = []
    for seed in args.seeds:
        base_id = f"untuned-s{seed}"
        baseline = measure_run(job, args.job, root / base_id, base_id, dict(job.knobs), args.steps)
        if not baseline.ok:
            print(f"untuned baseline failed: {baseline.error}\n{baseline.log_tail}", file=sys.stderr)
            return 1
        tpe = run_tpe(job, args.job, space, baseline, args.trials, seed, root / f"tpe-s{seed}", args.steps)
        ours = run_rltune(args.job, args.trials, root / f"rltune-s{seed}", args.steps, root / f"rltune-s{seed}" / "cases")
        seeds.append({"seed": seed, "untuned_step_s": baseline.step_s(), "tpe": tpe, "rltune": ours})
        print(f"seed {seed}: untuned {baseline.step_s():.4g} s; TPE best {tpe['curve'][-1]:.4g} s; "
              f"rltune best {ours['curve'][-1]:.4g} s", file=sys.stderr)

    def summary(name: str) -> dict:
        bests = [s[name]["curve"][-1] for s in seeds]
        reach = [trials_to_reach(s[name]["curve"], s[name]["curve"][-1], job.limits.noise_pct) for s in seeds]
        return {"median_best_step_s": statistics.median(bests), "best_step_s": bests,
                "trials_to_best": reach, "median_trials_to_best": statistics.median([r for r in reach if r is not None] or [0])}

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        sha = ""
    import optuna
    import torch

    record = {
        "benchmark": "tpe_vs_rltune", "job": str(args.job), "job_name": job.name, "trials": args.trials,
        "seeds": args.seeds, "steps": args.steps or job.limits.steps, "knob_space": space,
        "device": job.gpus.device, "host": platform.node(), "python": platform.python_version(),
        "torch": torch.__version__, "optuna": optuna.__version__, "git_sha": sha, "started": stamp,
        "per_seed": seeds, "tpe": summary("tpe"), "rltune": summary("rltune"),
    }
    t, r = record["tpe"], record["rltune"]
    record["rltune_at_least_as_fast"] = r["median_best_step_s"] <= t["median_best_step_s"] * (1 + job.limits.noise_pct / 100)
    record["rltune_trials_fraction"] = (r["median_trials_to_best"] / t["median_trials_to_best"]) if t["median_trials_to_best"] else None
    out = args.out or REPO / "bench" / "results" / f"tpe_vs_rltune-{job.name}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
