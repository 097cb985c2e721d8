"""A tuned preset's changes, on the learning variant of its job: what 'rltune reward-check' checks.

A tuned preset is its untuned job with other knob values. Its learning is checked on a variant of
that job that learns within a few hundred steps (same knobs, an easier task: presets/*-learn.yaml).
This writes that variant with the knobs the tuned preset sets differently from its untuned job --
only those, each one the learning job maps -- under the learning job's name, so that

    rltune reward-check OUT --against LEARN --steps N

runs the tuned setup's changes and nothing else. A knob the tuned preset changed that the learning
job does not map is refused: the check would not run what was tuned.

Usage::

    python bench/learning_variant.py --tuned bench/results/auto-trl-h200-25f2256/tuned/trl-grpo-h200.yaml \\
        --untuned presets/trl-grpo-h200.yaml --learn presets/trl-grpo-cpu-learn.yaml --out runs/trl-learn/tuned.yaml
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

from rltune.contracts.job import load_job
from rltune.contracts.schema import atomic_write_text, to_data


def learning_variant(tuned_path: Path, untuned_path: Path, learn_path: Path, out: Path) -> dict:
    """Write ``out``; return the knobs changed."""
    tuned, untuned, learn = load_job(tuned_path), load_job(untuned_path), load_job(learn_path)
    if tuned.name != untuned.name:
        raise SystemExit(f"{tuned_path}: tuned from job {tuned.name!r}, not {untuned.name!r} ({untuned_path})")
    changed = {k: v for k, v in tuned.knobs.items() if untuned.knobs.get(k) != v}
    unmapped = sorted(k for k in changed if k not in learn.launch.knob_map)
    if unmapped:
        raise SystemExit(f"{learn_path}: launch.knob_map: no entry for {', '.join(unmapped)}, which {tuned_path} changed")
    variant = copy.deepcopy(learn)
    variant.knobs = {**learn.knobs, **changed}
    # The launch directory is the learning job's, seen from where the variant is written.
    variant.launch.workdir = str(Path((learn_path.resolve().parent / learn.launch.workdir).resolve()))
    header = [f"# {learn_path} with the knobs {tuned_path} sets differently from {untuned_path}:"]
    header += [f"#   {k}: {untuned.knobs.get(k)!r} -> {v!r}" for k, v in changed.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "\n".join(header) + "\n" + yaml.safe_dump(to_data(variant), sort_keys=False, width=100))
    load_job(out)
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tuned", type=Path, required=True, help="the tuned preset 'rltune auto' wrote")
    ap.add_argument("--untuned", type=Path, required=True, help="the job it was tuned from")
    ap.add_argument("--learn", type=Path, required=True, help="the learning variant of that job (its knobs)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    changed = learning_variant(args.tuned, args.untuned, args.learn, args.out)
    print(f"{args.out}: {', '.join(f'{k}={v!r}' for k, v in changed.items()) or 'no knob changed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
