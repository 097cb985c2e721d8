"""Build a case library from real runs: each setting is forecast first, then run, then recorded.

For every setting (knob overrides over a job's baseline) this script

1. forecasts it from the library as it stands (``forecast_setup``), so the forecast made before
   the run is stored beside its measurement, exactly as the tuner does;
2. runs the job for real through the run recorder (``rltune.tune.trial.measure_run``) for ``--steps`` steps;
3. parses the metrics with ``rltune.profile.stage_table_from_logs`` and appends a case
   (``case_from_run``) -- a failed or timed-out run is recorded with its status.

Settings per job come from ``--grid reference`` (the knobs that matter on the reference
workload, each restricted to the knobs the job's ``launch.knob_map`` has) and/or ``--vary
knob=v1,v2,...``: each value changed alone from the baseline, plus ``--combos N`` seeded random
combinations of two or three such changes, plus ``--repeats R`` runs of the unchanged baseline
(so run-to-run noise is measured) and ``--repeat-singles K`` second runs of K single changes
(near-repeats: a change measured twice). Order: the baseline first; then singles and repeats
shuffled; then combinations, with the remaining repeats spread among them -- as a tuner measures
single changes before it combines them. With several job files the next run goes to the job that
has had the least wall time so far, so a slow job and a fast one share the time (and a build cut
short by ``--max-minutes`` covers each job).

Run ids are deterministic (job, setting, repeat) and a finished run is in the library exactly
once, so an interrupted build resumes where it stopped: run the same command again.
``--max-minutes`` stops starting new runs after that long (resume later the same way).

Example (the two tiny CPU presets for 15 minutes, half the time each; run it again to go on)::

    .venv/bin/python bench/build_library.py presets/cpu-demo.yaml presets/cpu-tool-use.yaml \
        --grid reference --steps 5 --max-minutes 15 --library cases/ --runs-dir runs/library
    .venv/bin/rltune eval --library cases/ --out runs/eval
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

# The knobs that matter on the reference workload and the values worth a run on the tiny CPU presets.
# sparse_delta and engine compile are left out: on the tiny CPU presets they fail or outlast the trial time-out.
REFERENCE_GRID: dict[str, list] = {
    "rl_mode": ["one_step_async", "fully_async"],
    "reuse_rollout_logprobs": [True],
    "micro_batch_size": [2, 32],
    "engine_max_concurrency": [4, 64],
    "sandbox_pool_size": [2, 32],
    "prebuilt_image": [True],
    "sync_transport": ["inprocess"],
}
# More than a 15-minute build reaches for the slow tool-use job: the time-fair order runs each job's
# plan from its start (baseline, single changes, repeats), so what is cut is the tail of combinations.
REFERENCE_COMBOS = 12
REFERENCE_REPEATS = 4
REFERENCE_REPEAT_SINGLES = 2


def parse_vary(items: list[str]) -> dict[str, list]:
    out: dict[str, list] = {}
    for item in items:
        knob, _, values = item.partition("=")
        if not values:
            raise SystemExit(f"--vary {item!r}: expected knob=v1,v2")
        out[knob] = [yaml.safe_load(v) for v in values.split(",")]
    return out


def settings_plan(vary: dict[str, list], combos: int, repeats: int, seed: int, repeat_singles: int = 0) -> list[dict]:
    """The settings to run, in order (see the module docstring); ``{}`` is the baseline."""
    rng = random.Random(seed)
    singles = [{knob: v} for knob, values in vary.items() for v in values]
    knobs = list(vary)
    combo_list: list[dict] = []
    seen = set()
    for _ in range(combos * 20):
        if len(seen) >= combos or len(knobs) < 2:
            break
        chosen = rng.sample(knobs, k=min(len(knobs), rng.choice((2, 3))))
        combo = {k: rng.choice(vary[k]) for k in sorted(chosen)}
        key = json.dumps(combo, sort_keys=True)
        if key not in seen:
            seen.add(key)
            combo_list.append(combo)
    repeats = max(repeats, 1)
    early_repeats = repeats // 2
    first = [{} for _ in range(early_repeats)] + singles + [dict(s) for s in rng.sample(singles, k=min(repeat_singles, len(singles)))]
    rng.shuffle(first)
    later = [{} for _ in range(repeats - 1 - early_repeats)] + combo_list
    rng.shuffle(later)
    return [{}, *first, *later]  # the baseline runs first: every later run has something to be forecast from


def interleave(plans: list[list]) -> list:
    """Round-robin over several jobs' plans, so a build cut short covers every job."""
    out = []
    for i in range(max((len(p) for p in plans), default=0)):
        out += [p[i] for p in plans if i < len(p)]
    return out


def run_id_of(job_name: str, overrides: dict, repeat: int) -> str:
    digest = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]
    label = "-".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "baseline"
    return f"{job_name}/{label}/{digest}/r{repeat}"


def job_plan(job, vary: dict[str, list], use_grid: bool, combos: int, repeats: int, repeat_singles: int, seed: int) -> list[dict]:
    knobs = {**(REFERENCE_GRID if use_grid else {}), **vary}
    mapped = set(job.launch.knob_map) | set(job.knobs)
    knobs = {k: [v for v in values if job.knobs.get(k) != v] for k, values in knobs.items() if k in mapped}
    knobs = {k: v for k, v in knobs.items() if v}
    return settings_plan(knobs, combos, repeats, seed, repeat_singles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", type=Path, nargs="+", help="job.yaml files (several interleave)")
    parser.add_argument("--library", type=Path, default=Path("cases"))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/library"))
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the job's limits.steps)")
    parser.add_argument("--grid", choices=["reference", "none"], default="none",
                        help="'reference': vary the knobs that matter on the reference workload (REFERENCE_GRID)")
    parser.add_argument("--vary", action="append", default=[], help="knob=v1,v2: values to try, each alone from the baseline")
    parser.add_argument("--combos", type=int, default=None, help="random combinations of 2-3 changes per job")
    parser.add_argument("--repeats", type=int, default=None, help="runs of the unchanged baseline per job")
    parser.add_argument("--repeat-singles", type=int, default=None, help="single changes run a second time per job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="stop after this many new runs")
    parser.add_argument("--max-minutes", type=float, default=None, help="start no new run after this many minutes")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)

    from rltune.contracts.job import load_job

    grid = args.grid == "reference"
    combos = args.combos if args.combos is not None else (REFERENCE_COMBOS if grid else 0)
    repeats = args.repeats if args.repeats is not None else (REFERENCE_REPEATS if grid else 2)
    repeat_singles = args.repeat_singles if args.repeat_singles is not None else (REFERENCE_REPEAT_SINGLES if grid else 0)
    vary = parse_vary(args.vary)
    jobs = [(path, load_job(path)) for path in args.jobs]
    plans = []
    for n, (path, job) in enumerate(jobs):
        counts: dict[str, int] = {}
        entries = []
        for overrides in job_plan(job, vary, grid, combos, repeats, repeat_singles, args.seed + n):
            key = json.dumps(overrides, sort_keys=True)
            counts[key] = counts.get(key, 0) + 1
            entries.append((path, job, overrides, run_id_of(job.name, overrides, counts[key] - 1)))
        plans.append(entries)
    if args.dry_run:
        for _, _, _, run_id in interleave(plans):
            print(run_id)
        print(f"{sum(len(p) for p in plans)} runs", file=sys.stderr)
        return 0

    from rltune.predict.forecast import forecast_setup
    from rltune.predict.library import CaseLibrary
    from rltune.tune.trial import measure_run, record_case

    library = CaseLibrary(args.library)
    begun = time.time()
    done = 0
    todo = [[entry for entry in p if not library.has(entry[3])] for p in plans]
    planned, left = sum(len(p) for p in plans), sum(len(t) for t in todo)
    print(f"{planned} runs planned, {planned - left} already in {args.library}, {left} to run", file=sys.stderr, flush=True)
    # Time-fair order: the next run goes to the job that has had the least wall time so far (its cases
    # in the library included), so a slow job (multi-turn tool use) and a fast one share a time budget.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spent = [sum(c.finished_at - c.started_at for c in library.load() if c.job == job.name) for _, job in jobs]
    while any(todo):
        if args.max_minutes is not None and time.time() - begun > 60 * args.max_minutes:
            print(f"stopped after {args.max_minutes:g} minutes; run the same command again to go on", file=sys.stderr)
            break
        turn = min((n for n in range(len(todo)) if todo[n]), key=lambda n: (spent[n], n))
        path, job, overrides, run_id = todo[turn].pop(0)
        steps = args.steps or job.limits.steps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cases = library.load(statuses=("ok",))
            forecast = forecast_setup(job, {**job.knobs, **overrides}, library, candidate=run_id) if cases else None
        run_dir = args.runs_dir / run_id.replace("/", "__")
        run = measure_run(job, path, run_dir, run_id, {**job.knobs, **overrides}, steps)
        spent[turn] += run.finished_at - run.started_at
        if not run.ok:
            print(f"{run_id}: {run.status} ({run.error}); recorded as such", file=sys.stderr)
        record_case(library, job, run, forecast)
        case = next(c for c in library.load() if c.run_id == run_id)
        started, finished = run.started_at, run.finished_at
        done += 1
        fc = f"forecast {forecast.step_s:.3f} s [{forecast.method}]" if forecast else "no forecast"
        got = f"measured {case.step_s:.3f} s" if case.status == "ok" else case.status
        print(f"[{done}/{left}] {run_id}: {got}, {fc}, {finished - started:.0f} s wall", file=sys.stderr, flush=True)
        if args.limit and done >= args.limit:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
