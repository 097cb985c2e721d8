"""Build a case library from real runs: each setting is forecast first, then run, then recorded.

For every setting (knob overrides over the job's baseline) this script

1. forecasts it from the library as it stands (``forecast_setup``), so the forecast made before
   the run is stored beside its measurement, exactly as the tuner does;
2. runs the job for real through ``rltune.launch.run_job`` for ``--steps`` steps;
3. parses the metrics with ``rltune.profile.stage_table_from_logs`` and appends a case
   (``case_from_run``) -- a failed or timed-out run is recorded with its status.

Settings come from ``--vary knob=v1,v2,...`` (each value changed alone from the baseline), plus
``--combos N`` seeded random combinations of two or three such changes, plus ``--repeats R``
copies of the baseline; they run in a seeded shuffled order so that later runs have earlier
ones to be forecast from. Run ids are deterministic (job, setting, repeat), so an interrupted
build resumes where it stopped.

Example::

    .venv/bin/python bench/build_library.py presets/cpu-demo.yaml --library cases/ --runs-dir runs/lib \
        --steps 6 --vary micro_batch_size=2,4,32 --vary packing=true --vary rl_mode=one_step_async,fully_async \
        --combos 10 --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
import warnings
from pathlib import Path

import yaml


def parse_vary(items: list[str]) -> dict[str, list]:
    out: dict[str, list] = {}
    for item in items:
        knob, _, values = item.partition("=")
        if not values:
            raise SystemExit(f"--vary {item!r}: expected knob=v1,v2")
        out[knob] = [yaml.safe_load(v) for v in values.split(",")]
    return out


def settings_plan(vary: dict[str, list], combos: int, repeats: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    plan: list[dict] = [{} for _ in range(max(repeats, 1))]
    singles = [{knob: v} for knob, values in vary.items() for v in values]
    plan += singles
    knobs = list(vary)
    seen = set()
    for _ in range(combos * 20):
        if len(seen) >= combos or len(knobs) < 2:
            break
        chosen = rng.sample(knobs, k=min(len(knobs), rng.choice((2, 3))))
        combo = {k: rng.choice(vary[k]) for k in sorted(chosen)}
        key = json.dumps(combo, sort_keys=True)
        if key not in seen:
            seen.add(key)
            plan.append(combo)
    first, rest = plan[0], plan[1:]
    rng.shuffle(rest)
    return [first, *rest]  # the baseline runs first: every later run has something to be forecast from


def run_id_of(job_name: str, overrides: dict, repeat: int) -> str:
    digest = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]
    label = "-".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "baseline"
    return f"{job_name}/{label}/{digest}/r{repeat}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", type=Path)
    parser.add_argument("--library", type=Path, default=Path("cases"))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/library"))
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the job's limits.steps)")
    parser.add_argument("--vary", action="append", default=[], help="knob=v1,v2: values to try, each alone from the baseline")
    parser.add_argument("--combos", type=int, default=0, help="random combinations of 2-3 changes")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the unchanged baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="stop after this many new runs")
    args = parser.parse_args(argv)

    from rltune.contracts.job import load_job
    from rltune.errors import RltuneError
    from rltune.launch.job import run_job
    from rltune.predict.forecast import forecast_setup
    from rltune.predict.library import CaseLibrary, case_from_run
    from rltune.profile.table import stage_table_from_logs

    job = load_job(args.job)
    steps = args.steps or job.limits.steps
    warmup = job.limits.warmup_steps
    library = CaseLibrary(args.library)
    plan = settings_plan(parse_vary(args.vary), args.combos, args.repeats, args.seed)
    counts: dict[str, int] = {}
    done = 0
    for overrides in plan:
        key = json.dumps(overrides, sort_keys=True)
        repeat = counts.get(key, 0)
        counts[key] = repeat + 1
        run_id = run_id_of(job.name, overrides, repeat)
        if library.has(run_id):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cases = library.load(statuses=("ok",))
        forecast = forecast_setup(job, {**job.knobs, **overrides}, cases, candidate=run_id) if cases else None
        run_dir = args.runs_dir / run_id.replace("/", "__")
        started = time.time()
        result = run_job(job, args.job, run_dir, overrides, steps)
        finished = time.time()
        status = "timed_out" if result.timed_out else ("ok" if result.returncode == 0 else "failed")
        metrics = Path(job.metrics.path.replace("{run_dir}", str(result.run_dir)))
        try:
            table, _ = stage_table_from_logs(metrics, job.metrics.format, run_id=run_id, warmup_steps=warmup)
            case = case_from_run(job, overrides, table, run_id, started, finished, status, forecast, warmup)
        except (RltuneError, OSError) as exc:  # a run without usable metrics is recorded as failed, with the reason
            print(f"{run_id}: no usable metrics ({exc}); recorded as failed", file=sys.stderr)
            if status == "ok":
                status = "failed"
            import pyarrow as pa

            case = case_from_run(job, overrides, pa.table({"step": pa.array([], pa.int64())}), run_id, started, finished,
                                 status, forecast, warmup)
        library.append(case)
        done += 1
        fc = f"forecast {forecast.step_s:.3f} s [{forecast.method}]" if forecast else "no forecast"
        got = f"measured {case.step_s:.3f} s" if case.status == "ok" else case.status
        print(f"[{done}] {run_id}: {got}, {fc}, {finished - started:.0f} s wall", file=sys.stderr, flush=True)
        if args.limit and done >= args.limit:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
