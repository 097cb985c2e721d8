"""How long ``rltune predict`` takes for 100 candidates against a 1,000-case library, before and after.

The libraries are synthetic (hand-made settings and times drawn from a seeded generator): the
benchmark measures the predictor's own cost, not accuracy, and none of its times is a
measurement of a job. Two shapes are timed:

- ``random``: three jobs, every knob drawn at random (most cases are far from any candidate, so
  forecasts go through the similar-runs path);
- ``near``: the demo job's baseline with 0-3 changed knobs, repeats included, plus other jobs
  (most candidates find anchors, the path a tuner's own library exercises).

Each library is written through ``CaseLibrary.append`` and loaded once (index warm, as in the
tuner's loop). Each timed call runs in a fresh Python process, like ``rltune predict``: the
process reports its import time, its first library load (which includes importing pyarrow),
and then load + forecast of all candidates (``forecast_candidates``, which loads the library
again inside, as the CLI does) -- the figure the 1 s target is about. The first call
per library finds no learned-model cache beside the library (the theory fit and knob effects are
learned then: "cold"); later calls reuse it. ``rltune predict`` is also timed end to end as a
subprocess (interpreter start, imports, YAML, forecast, table).

The baseline is the predictor at ``--baseline-rev`` (default: the last commit before it was
vectorised), extracted with ``git archive`` and run on its own copy of each library in the same
run. Target (issue 7): load + forecast < 1 s on the 2-core CPU. Writes a JSON record (config,
versions, git SHA, min/median/max of each figure, ratios).

Example::

    .venv/bin/python bench/predict_speed.py --out bench/results/predict_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE_REV = "897c38231967494551c8632b72547b39d75d7053"
CACHE_NAMES = ("_theory.json", "_model.json")
KNOB_VALUES = {
    "rl_mode": ["sync", "one_step_async", "fully_async"], "micro_batch_size": [1, 2, 4, 8, 16, 32], "packing": [False, True],
    "grad_checkpointing": [False, True], "reuse_rollout_logprobs": [False, True], "engine_max_concurrency": [4, 8, 16, 32, 64],
    "engine_batching": ["static", "continuous"], "num_engines": [1, 2, 4], "engine_compile": [False, True],
    "sync_transport": ["filesystem", "inprocess", "sparse_delta"], "mtp": [False, True], "kv_cache_dtype": ["auto", "fp8"],
}


def synthetic_library(path: Path, n: int, seed: int, shape: str = "random"):
    """Write ``n`` synthetic cases (see the module docstring); returns the CaseLibrary."""
    sys.path.insert(0, str(ROOT / "tests" / "predict"))
    from predict_casekit import make_case

    from rltune.contracts.job import load_job
    from rltune.predict.library import CaseLibrary

    demo = load_job(ROOT / "presets" / "cpu-demo.yaml")
    rng = random.Random(seed)
    lib = CaseLibrary(path)
    for i in range(n):
        if shape == "near" and rng.random() < 0.8:
            job, knobs = demo.name, dict(demo.knobs)
            for k in rng.sample(sorted(KNOB_VALUES), rng.choice((0, 1, 1, 2, 2, 3))):
                knobs[k] = rng.choice(KNOB_VALUES[k])
        else:
            knobs = {k: rng.choice(v) for k, v in KNOB_VALUES.items()}
            job = rng.choice(["tiny-math-cpu", "tiny-tool-use-cpu", "small-math-h200"])
        lib.append(make_case(f"case-{i}", rollout=rng.uniform(0.5, 3), training=rng.uniform(0.5, 3), weight_sync=rng.uniform(0.01, 0.3),
                             knobs=knobs, t=float(i), job=job, workload="tool_use" if "tool" in job else "math",
                             device="H200" if "h200" in job else "cpu", gpus=1 if "h200" in job else 0))
    return lib


def write_candidates(path: Path, count: int, seed: int) -> None:
    from rltune.contracts.candidates import Candidate, Candidates, save_candidates
    from rltune.contracts.job import load_job

    job = load_job(ROOT / "presets" / "cpu-demo.yaml")
    rng = random.Random(seed + 1)
    save_candidates(Candidates(
        schema_version=1, job=str(ROOT / "presets" / "cpu-demo.yaml"), baseline_run="base", baseline_knobs=dict(job.knobs),
        limiting_stage="rollout", candidates=[
            Candidate(id=f"c{i}", fixes=["f"], rationale="speed benchmark",
                      overrides={k: rng.choice(KNOB_VALUES[k]) for k in rng.sample(sorted(KNOB_VALUES), rng.choice((1, 2, 3)))})
            for i in range(count)]), path)


def worker(library: str, candidates: str) -> None:
    """One timed call in a fresh process (imports from whatever rltune is first on sys.path)."""
    t0 = time.perf_counter()
    from rltune.contracts.candidates import load_candidates
    from rltune.contracts.job import load_job
    from rltune.predict.forecast import forecast_candidates
    from rltune.predict.library import CaseLibrary

    cands = load_candidates(candidates)
    job = load_job(cands.job)
    t1 = time.perf_counter()
    CaseLibrary(library).load(statuses=("ok",))
    t2 = time.perf_counter()
    out = forecast_candidates(job, cands, CaseLibrary(library))
    t3 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "load_and_forecast_s": t3 - t2,
                      "steps": {f.candidate: round(f.step_s, 6) for f in out.forecasts}, "methods": [f.method for f in out.forecasts]}))


def call_worker(tree: Path, library: Path, candidates: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(library), str(candidates)],
                          capture_output=True, text=True, env=env, cwd=tree, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def call_cli(tree: Path, library: Path, candidates: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-c", "import sys; from rltune.cli.main import main; sys.exit(main())",
            "predict", str(candidates), "--library", str(library), "--json"]
    t = time.perf_counter()
    subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tree, check=True)
    return time.perf_counter() - t


def stats(xs: list[float]) -> dict:
    return {"min_s": round(min(xs), 4), "median_s": round(statistics.median(xs), 4), "max_s": round(max(xs), 4)}


def measure(tree: Path, library: Path, candidates: Path, repeats: int) -> dict:
    for name in CACHE_NAMES:
        (library / name).unlink(missing_ok=True)
    cold = call_worker(tree, library, candidates)
    runs = [call_worker(tree, library, candidates) for _ in range(repeats)]
    cli = [call_cli(tree, library, candidates) for _ in range(repeats)]
    return {
        "cold_with_learning_s": round(cold["load_and_forecast_s"], 3),
        "first_load_with_imports": stats([r["load_s"] for r in runs]),
        "load_and_forecast": stats([r["load_and_forecast_s"] for r in runs]),
        "imports": stats([r["import_s"] for r in runs]),
        "cli_end_to_end": stats(cli),
        "methods": {m: runs[-1]["methods"].count(m) for m in sorted(set(runs[-1]["methods"]))},
        "_steps": runs[-1]["steps"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", default="random,near")
    parser.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision of the predictor to compare against ('' for none)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("LIBRARY", "CANDIDATES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0

    import numpy
    import scipy

    record: dict = {"benchmark": "predict_speed", "cases": args.cases, "candidates": args.candidates, "repeats": args.repeats,
                    "target_s": 1.0, "baseline_rev": args.baseline_rev or None, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        trees = {"after": ROOT}
        if args.baseline_rev:
            before = tmp / "before"
            before.mkdir()
            archive = subprocess.run(["git", "archive", args.baseline_rev, "rltune", "presets"], cwd=ROOT, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
            trees = {"before": before, "after": ROOT}
        candidates = tmp / "candidates.yaml"
        write_candidates(candidates, args.candidates, args.seed)
        for shape in args.shapes.split(","):
            t = time.perf_counter()
            synthetic_library(tmp / f"{shape}-after", args.cases, args.seed, shape)
            build_s = time.perf_counter() - t
            from rltune.predict.library import CaseLibrary

            CaseLibrary(tmp / f"{shape}-after").load()  # builds the index once, as the first load after appends does
            results = {}
            for label, tree in trees.items():
                library = tmp / f"{shape}-{label}"
                if label != "after":
                    shutil.copytree(tmp / f"{shape}-after", library)
                print(f"{shape}: timing {label} ...", file=sys.stderr, flush=True)
                results[label] = measure(tree, library, candidates, args.repeats)
            entry = {"library_build_s": round(build_s, 2), **{k: {n: v for n, v in r.items() if not n.startswith("_")}
                                                              for k, r in results.items()}}
            after = results["after"]
            entry["meets_target"] = after["load_and_forecast"]["median_s"] < 1.0
            if "before" in results:
                before_r = results["before"]
                entry["speedup_load_and_forecast"] = round(before_r["load_and_forecast"]["median_s"] / after["load_and_forecast"]["median_s"], 2)
                entry["speedup_cli_end_to_end"] = round(before_r["cli_end_to_end"]["median_s"] / after["cli_end_to_end"]["median_s"], 2)
                diffs = [abs(a - before_r["_steps"][c]) / before_r["_steps"][c] for c, a in after["_steps"].items() if before_r["_steps"][c] > 0]
                entry["forecast_steps_max_rel_change_vs_before"] = round(max(diffs), 6) if diffs else None
            record["shapes"][shape] = entry
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "rltune/predict", "bench/predict_speed.py"],
                                capture_output=True, text=True, cwd=ROOT).stdout.strip())
    record.update({"device": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                   "python": platform.python_version(), "numpy": numpy.__version__, "scipy": scipy.__version__,
                   "git_sha": sha, "predict_tree_dirty": dirty})
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
