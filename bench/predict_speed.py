"""How long ``forecast_candidates`` takes for 100 candidates against a 1,000-case library.

The library is synthetic (hand-made settings and times drawn from a seeded generator): the
benchmark measures the predictor's own cost, not accuracy, and none of its times is a
measurement of a job. It is written to a temporary directory through ``CaseLibrary.append``,
so the timed path includes reading the library (index warm, as in the tuner's loop). The theory fit is a property of the library, cached in
``_theory.json`` beside it; the first ("cold") call fits and is reported separately.
Target (issue 7): < 1 s on the 2-core CPU. Writes a JSON record (config, versions, git SHA,
min/median/max of each phase).

Example::

    .venv/bin/python bench/predict_speed.py --out bench/results/predict_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KNOB_VALUES = {
    "rl_mode": ["sync", "one_step_async", "fully_async"], "micro_batch_size": [1, 2, 4, 8, 16, 32], "packing": [False, True],
    "grad_checkpointing": [False, True], "reuse_rollout_logprobs": [False, True], "engine_max_concurrency": [4, 8, 16, 32, 64],
    "engine_batching": ["static", "continuous"], "num_engines": [1, 2, 4], "engine_compile": [False, True],
    "sync_transport": ["filesystem", "inprocess", "sparse_delta"], "mtp": [False, True], "kv_cache_dtype": ["auto", "fp8"],
}


def synthetic_library(path: Path, n: int, seed: int):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "predict"))
    from predict_casekit import make_case

    from rltune.predict.library import CaseLibrary

    rng = random.Random(seed)
    lib = CaseLibrary(path)
    for i in range(n):
        knobs = {k: rng.choice(v) for k, v in KNOB_VALUES.items()}
        job = rng.choice(["tiny-math-cpu", "tiny-tool-use-cpu", "small-math-h200"])
        lib.append(make_case(f"case-{i}", rollout=rng.uniform(0.5, 3), training=rng.uniform(0.5, 3), weight_sync=rng.uniform(0.01, 0.3),
                             knobs=knobs, t=float(i), job=job, workload="tool_use" if "tool" in job else "math",
                             device="H200" if "h200" in job else "cpu", gpus=1 if "h200" in job else 0))
    return lib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import numpy
    import scipy

    from rltune.contracts.candidates import Candidate, Candidates
    from rltune.contracts.job import load_job
    from rltune.predict.forecast import forecast_candidates
    from rltune.predict.library import CaseLibrary

    job = load_job(Path(__file__).resolve().parents[1] / "presets" / "cpu-demo.yaml")
    rng = random.Random(args.seed + 1)
    cands = Candidates(schema_version=1, job="presets/cpu-demo.yaml", baseline_run="base", baseline_knobs=dict(job.knobs),
                       limiting_stage="rollout", candidates=[
                           Candidate(id=f"c{i}", fixes=["f"], rationale="speed benchmark",
                                     overrides={k: rng.choice(KNOB_VALUES[k]) for k in rng.sample(sorted(KNOB_VALUES), 3)})
                           for i in range(args.candidates)])
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        synthetic_library(Path(tmp) / "cases", args.cases, args.seed)
        build_s = time.perf_counter() - t
        CaseLibrary(Path(tmp) / "cases").load()  # builds the index once, as the first load after appends does
        import rltune.predict.forecast as forecast_module

        load, total, cold = [], [], []
        for i in range(args.repeats + 1):
            forecast_module._FIT_CACHE.clear()  # every call starts like a fresh 'rltune predict' process
            if i == 0:
                (Path(tmp) / "cases" / forecast_module.THEORY_CACHE_NAME).unlink(missing_ok=True)
            lib = CaseLibrary(Path(tmp) / "cases")
            t0 = time.perf_counter()
            lib.load(statuses=("ok",))
            t1 = time.perf_counter()
            forecast_candidates(job, cands, lib)  # loads again inside, as the CLI does
            t2 = time.perf_counter()
            if i == 0:
                cold.append(t2 - t1)  # includes fitting the theory to the 1,000 cases
                continue
            load.append(t1 - t0)
            total.append(t2 - t1)

    def stats(xs: list[float]) -> dict:
        return {"min_s": round(min(xs), 4), "median_s": round(statistics.median(xs), 4), "max_s": round(max(xs), 4)}

    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    record = {
        "benchmark": "predict_speed", "cases": args.cases, "candidates": args.candidates, "repeats": args.repeats,
        "load_library": stats(load), "load_and_forecast": stats(total), "cold_with_theory_fit_s": round(cold[0], 3), "target_s": 1.0,
        "meets_target": statistics.median(total) < 1.0, "library_build_s": round(build_s, 2),
        "device": platform.processor() or platform.machine(), "python": platform.python_version(),
        "numpy": numpy.__version__, "scipy": scipy.__version__, "git_sha": sha,
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
