"""Many engine readers on one store directory while a writer publishes (the full form of the CI test).

Runs ``rltune.sync.bench.readers`` (``rltune sync-bench --readers``) with a preset of
presets/sync/readers/ and writes its record (``sync-readers.json``: config, machine, git SHA, load
averages, per storage x cache x N min/median/max) and every row under ``--out``. Take it when the
machine is quietest: the figures are noisy on a shared machine, and the record keeps the load
average beside each trial.

Usage::

    .venv/bin/python bench/sync_readers.py --preset cpu --out bench/results/sync_readers-cpu-<git>
    .venv/bin/python bench/sync_readers.py --preset ci --readers 1,2 --out /tmp/readers
    .venv/bin/python bench/sync_readers.py --markdown bench/results/sync_readers-cpu-<git>/sync-readers.json
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


def markdown(record: dict) -> str:
    """docs/BENCHMARKS.md's table of one record: a row per storage x cache x N (medians, ms)."""
    def ms(stat, key="median"):
        return "-" if not stat else f"{stat[key] * 1e3:.0f}" if stat[key] >= 0.1 else f"{stat[key] * 1e3:.1f}"

    lines = ["| storage | N | read + decode ms, median (min-max) | its CPU ms | CPU / wall | file reads ms | x N=1 | "
             "agg MB/s | publish ms (x writer alone) | publish overlapping reads | anchor load ms | load avg | verified |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in record["trials"]:
        p = t["prefetch_s"]
        share = t.get("prefetch_cpu_share")
        lines.append(" | ".join([
            f"| {t['storage']}/{t['cache']}", str(t["readers"]),
            "-" if not p else f"{ms(p)} ({ms(p, 'min')}-{ms(p, 'max')})",
            ms(t.get("prefetch_cpu_s")), "-" if not share else f"{share['median']:.2f}", ms(t["read_s"]),
            "-" if "prefetch_over_one_reader" not in t else f"{t['prefetch_over_one_reader']:.2f}",
            "-" if not t["aggregate_GBps"] else f"{t['aggregate_GBps']['median'] * 1e3:.0f}",
            ms(t["publish_s"]) + ("" if "publish_over_alone" not in t else f" ({t['publish_over_alone']:.2f})"),
            "-" if not t["publish_overlap"] else f"{t['publish_overlap']['median'] * 100:.0f} %",
            ms(t["anchor_load_s"]), " ".join(f"{x:.1f}" for x in t["load"]["start"]),
            f"{t['verified']}/{t['updates']} |"]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", help="presets/sync/readers/<name>.yaml or a YAML path")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--markdown", type=Path, nargs="+", help="print the table of these sync-readers.json records")
    ap.add_argument("--readers", help="comma list of reader counts (overrides the preset)")
    ap.add_argument("--storage", help="comma list of disk,shm (overrides the preset)")
    ap.add_argument("--cache", help="comma list of warm,cold (overrides the preset)")
    ap.add_argument("--steps", type=int)
    args = ap.parse_args()
    if args.markdown:
        import json

        for path in args.markdown:
            record = json.loads(path.read_text())
            print(f"{path} (git {record['git_sha'][:7]}, {record['config']['name']})\n")
            print(markdown(record) + "\n")
        return 0
    if args.out is None:
        ap.error("--out is required to run the benchmark")
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
