"""Reward parity over a long run: a tuned preset against the learning tiny math job, and the curves.

Runs ``rltune reward-check`` (the same core, :func:`rltune.tune.reward_check.run_reward_check`) and
writes beside its reward_check.yaml a self-describing record (command, git SHA, versions, device,
load, wall time, the band, each run's moving average every ``--every`` steps, the verdict) and a
plot of the curves with the band. The figures go to docs/BENCHMARKS.md ("Reward parity").

    .venv/bin/python bench/reward_parity.py --tuned runs/demo/tuned/tiny-math-cpu.yaml \\
        --against presets/cpu-math-learn.yaml --steps 300 --out runs/bench/reward-parity

Without ``--tuned`` it checks the untuned job against itself (a neutral change: the tuned run is
one more seed of the untuned setup), which is how the learning curve alone is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _git_sha() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=REPO).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def _device() -> dict:
    import torch

    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tuned", type=Path, default=None, help="tuned job.yaml (default: the untuned job itself)")
    ap.add_argument("--against", type=Path, default=REPO / "presets" / "cpu-math-learn.yaml")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--journal", type=Path, default=None, help="auto journal: undo its kept changes on a failure")
    ap.add_argument("--every", type=int, default=10, help="record each moving average every this many steps")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "reward-parity")
    args = ap.parse_args(argv)

    from rltune.contracts.job import load_job
    from rltune.tune.journal import Journal
    from rltune.tune.reward_check import (
        curves_of,
        kept_changes,
        moving_average,
        plan_reward_check,
        run_reward_check,
    )

    plan = plan_reward_check(args.against, args.steps, args.seeds, args.window)
    tuned = args.tuned or args.against
    changes = None
    if args.journal is not None:
        changes = kept_changes(Journal(args.journal).events(), plan.job.knobs, load_job(tuned).knobs)
    load_before = os.getloadavg()
    started = time.time()
    outcome = run_reward_check(tuned, plan, args.out, changes=changes,
                               on_run=lambda run_id, state, detail: print(f"{run_id}: {state} {detail}",
                                                                          file=sys.stderr, flush=True))
    wall = time.time() - started
    check, curves = curves_of(outcome.path)

    import torch
    import transformers

    record = {
        "bench": "reward_parity", "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "git_sha": _git_sha(), "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "device": _device(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "wall_s": wall,
        "tuned": str(tuned), "against": str(args.against), "tuned_overrides": check.tuned_overrides,
        "steps": check.steps, "window": check.window, "seeds": check.seeds,
        "decision": check.decision, "reason": check.reason, "blamed": check.blamed,
        "band": None if check.band is None else vars(check.band),
        "checks": {c.name: {"value": c.value, "threshold": c.threshold, "passed": c.passed} for c in check.checks},
        "runs": {r.run_id: {"role": r.role, "seed": r.seed, "status": r.status, "first_window": r.first_window_mean,
                            "final_window": r.final_window_mean, "max_deviation": r.max_deviation,
                            "gap_mean": r.gap_mean, "sample_age_mean": r.sample_age_mean,
                            "step_s_mean": r.step_s_mean,
                            "moving_average_every": {str(check.window - 1 + i): round(v, 5) for i, v in
                                                     enumerate(moving_average(curves.get(r.run_id, []), check.window))
                                                     if i % args.every == 0 or i == args.steps - check.window}}
                 for r in check.runs},
        "attribution": [vars(a) for a in check.attribution],
    }
    (args.out / "record.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    _plot(check, curves, args.out / "curves.png")
    print(json.dumps({"record": str(args.out / "record.json"), "decision": check.decision, "wall_s": round(wall)}))
    return outcome.exit_code


def _plot(check, curves, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rltune.tune.reward_check import moving_average, seed_band

    w = check.window
    fig, ax = plt.subplots(figsize=(7, 3.6))
    untuned = [curves[r.run_id] for r in check.runs if r.role == "untuned" and r.run_id in curves]
    if len(untuned) >= 2:
        band = seed_band(untuned, w, check.band.z)
        xs = range(band.first_step, band.first_step + len(band.centre))
        ax.fill_between(xs, [c - band.half_width for c in band.centre], [c + band.half_width for c in band.centre],
                        color="#34495e", alpha=0.15, label=f"untuned band (+-{band.half_width:.3g})")
    colors = {"untuned": "#7f8c8d", "tuned": "#2a9d3f" if check.passed else "#c0392b", "reverted": "#c98a0b"}
    for run in check.runs:
        if run.run_id in curves:
            ma = moving_average(curves[run.run_id], w)
            ax.plot(range(w - 1, w - 1 + len(ma)), ma, "--" if run.role == "reverted" else "-",
                    color=colors[run.role], linewidth=2 if run.role == "tuned" else 1, label=run.run_id)
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward, {w}-step moving average")
    ax.set_title(f"reward check: {check.decision}")
    ax.legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=96, bbox_inches="tight")


if __name__ == "__main__":
    sys.exit(main())
