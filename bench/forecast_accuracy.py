"""Forecast accuracy on public measured runs and on rltune's own case libraries, in one report layout.

Public runs: each CSV rltune ships (``rltune/predict/public/``) is imported through the real
``rltune library import`` path (:func:`rltune.predict.public.import_public_runs`) into a library of
its own, and every case is forecast leave-one-out (:func:`rltune.predict.evaluate.evaluate_library`):

- ``same_or_earlier``: from every other case of the source of the same release or an earlier one;
- ``same``: from the cases of its own release only.

prime-rl is scored on its latest baselines (``prime_rl.csv``, one commit) alone, and again with the
earlier versions of the baselines (``prime_rl_history.csv``) in the library: an earlier commit's
measurement may then forecast a later one, never the reverse. No prior library is used for public
runs (the shipped prior holds the very rows being forecast).

rltune's own libraries (``bench/cases-cpu*``, ``bench/cases-h200-small``) are scored as before
(rule ``before_start``: each run from the runs finished before it started), with the shipped
public prior behind GPU forecasts and without it.

Hyper-parameters are fixed in the code before scoring (prior weights, distance penalty, range
formula); nothing is chosen by looking at a held-out case. Each held-out case takes no part in
any fit of its own forecast.

Writes one self-describing JSON record (config, device, versions, git SHA, timings, every score
and every forecast) to ``--out``.

Example::

    PYTHONPATH=. .venv/bin/python bench/forecast_accuracy.py --out bench/results/forecast_accuracy.json
    PYTHONPATH=. .venv/bin/python bench/forecast_accuracy.py --only nemo_rl --out /tmp/nemo.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PUBLIC = {  # name -> (CSV files imported into its library, rules)
    "nemo_rl": (("nemo_rl.csv",), ("same_or_earlier", "same")),
    "prime_rl": (("prime_rl.csv",), ("same_or_earlier",)),
    "prime_rl_with_history": (("prime_rl.csv", "prime_rl_history.csv"), ("same_or_earlier",)),
    "easyr1": (("easyr1.csv",), ("same_or_earlier", "same")),
    "torchtitan": (("torchtitan.csv",), ("same_or_earlier",)),
}
OWN = ("cases-cpu", "cases-cpu-2", "cases-cpu-3", "cases-h200-small")


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, str]:
    import numpy
    import pyarrow
    import scipy

    return {"python": platform.python_version(), "numpy": numpy.__version__, "scipy": scipy.__version__, "pyarrow": pyarrow.__version__}


def public_scores(name: str, latest_only: bool) -> dict:
    from rltune.predict.evaluate import evaluate_library
    from rltune.predict.library import CaseLibrary
    from rltune.predict.public import SHIPPED_DIR, import_public_runs

    files, rules = PUBLIC[name]
    out: dict = {"files": list(files), "imports": [], "rules": {}}
    with tempfile.TemporaryDirectory() as tmp:
        lib = CaseLibrary(Path(tmp) / name)
        for file in files:
            out["imports"].append(import_public_runs(SHIPPED_DIR / file, lib).summary())
        cases = lib.load()
        only = None
        if latest_only and name == "prime_rl_with_history":  # score the latest baselines; the history only forecasts them
            latest = {c.run_id for c in cases if c.provenance and c.provenance.get("file") == "prime_rl.csv"}
            only = sorted(latest)
        for rule in rules:
            started = time.perf_counter()
            scores = evaluate_library(cases, rule=rule, prior=None, only=only)
            out["rules"][rule] = {"seconds": round(time.perf_counter() - started, 1), **scores.to_dict()}
            print(f"{name} {rule}: {json.dumps(scores.scores.get('all'), default=lambda o: o.__dict__)}", file=sys.stderr, flush=True)
    return out


def own_scores(name: str) -> dict:
    from rltune.predict.evaluate import evaluate
    from rltune.predict.library import CaseLibrary

    out = {}
    for label, prior in (("with_public_prior", "shipped"), ("without_prior", None)):
        started = time.perf_counter()
        report = evaluate(CaseLibrary(ROOT / "bench" / name), prior=prior)
        out[label] = {"seconds": round(time.perf_counter() - started, 1), "median_abs_error_pct": report.median_abs_error_pct,
                      "within_10pct": report.within_10pct, "range_coverage": report.range_coverage,
                      "training_median_abs_error_pct": report.training_median_abs_error_pct, "evaluated": report.evaluated,
                      "scores": report.scores.to_dict()}
        print(f"{name} {label}: step {report.median_abs_error_pct} %, coverage {report.range_coverage}, "
              f"sharpness {report.scores.scores['all']['step'].range_sharpness}", file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON record to write")
    parser.add_argument("--only", nargs="*", default=None, help=f"names to run (public: {', '.join(PUBLIC)}; own: {', '.join(OWN)})")
    args = parser.parse_args()
    chosen = args.only or [*PUBLIC, *OWN]
    unknown = [n for n in chosen if n not in PUBLIC and n not in OWN]
    if unknown:
        parser.error(f"unknown names {unknown}")
    record: dict = {"benchmark": "forecast_accuracy", "git_sha": git_sha(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "device": {"machine": platform.machine(), "processor": platform.processor() or "", "cpus": os.cpu_count()},
                    "versions": versions(), "config": {"public": {k: PUBLIC[k][0] for k in chosen if k in PUBLIC},
                                                       "own": [k for k in chosen if k in OWN]},
                    "public": {}, "own": {}}
    started = time.perf_counter()
    for name in chosen:
        if name in PUBLIC:
            record["public"][name] = public_scores(name, latest_only=True)
        else:
            record["own"][name] = own_scores(name)
    record["seconds"] = round(time.perf_counter() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1, default=lambda o: o.__dict__), encoding="utf-8")
    print(f"wrote {args.out} ({record['seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
