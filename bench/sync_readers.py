"""Many engine readers on one store directory while a writer publishes (the full form of the CI test).

Runs ``rltune.sync.bench.readers`` (``rltune sync-bench --readers``) with a preset of
presets/sync/readers/ and writes its record (``sync-readers.json``: config, machine, git SHA, load
averages, per storage x cache x N min/median/max) and every row under ``--out``. Take it when the
machine is quietest: the figures are noisy on a shared machine, and the record keeps the load
average beside each trial.

Usage::

    .venv/bin/python bench/sync_readers.py --preset cpu --out bench/results/sync_readers-cpu-<git>
    .venv/bin/python bench/sync_readers.py --preset ci --readers 1,2 --out /tmp/readers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltune.sync.bench.readers import (  # noqa: E402
    load_readers_config,
    readers_summary_lines,
    readers_with_overrides,
    resolve_readers_preset,
    run_readers_bench,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", help="presets/sync/readers/<name>.yaml or a YAML path")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--readers", help="comma list of reader counts (overrides the preset)")
    ap.add_argument("--storage", help="comma list of disk,shm (overrides the preset)")
    ap.add_argument("--cache", help="comma list of warm,cold (overrides the preset)")
    ap.add_argument("--steps", type=int)
    args = ap.parse_args()
    cfg = load_readers_config(resolve_readers_preset(args.preset))

    def split(text: str | None) -> list[str] | None:
        return [x.strip() for x in text.split(",") if x.strip()] if text else None

    cfg = readers_with_overrides(cfg, readers=[int(x) for x in split(args.readers)] if args.readers else None,
                                 storage=split(args.storage), cache=split(args.cache), steps=args.steps)
    result = run_readers_bench(cfg, args.out, progress=lambda msg: print(msg, flush=True))
    for line in readers_summary_lines(result.record):
        print("  ".join(f"{k}={v}" for k, v in line.items()))
    print(f"all verified: {result.all_verified}; wrote {result.record_path}")
    return 0 if result.all_verified else 1


if __name__ == "__main__":
    sys.exit(main())
