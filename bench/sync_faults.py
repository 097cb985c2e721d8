"""The seeded fault campaign of tests/sync/fault_campaign.py as a record: faults, detected, healed.

Runs every fault of the campaign (the same code the tests run, one fault at a time, each bounded in
time and memory) and writes a self-describing JSON record: per fault class and in all, how many
faults were detected (a typed error of the expected kind, a fallback the report names, or the
correct weights despite the fault), silently wrong, raw exceptions, hangs, and healed to the
trainer's weights bit for bit; per fault its outcome, detail and seconds; the machine, versions and
git SHA; the wall time. docs/BENCHMARKS.md summarises it.

Usage (CPU; the Triton kernels in the interpreter, as the tests run them)::

    TRITON_INTERPRET=1 python bench/sync_faults.py --out bench/results/sync_faults-cpu.json
    TRITON_INTERPRET=1 python bench/sync_faults.py --only cancelling --out /tmp/faults.json   # one class
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "sync")]
os.environ.setdefault("TRITON_INTERPRET", "1")

from fault_campaign import CASE_RSS_GROWTH_MIB, CASE_TIMEOUT_S, FAULTS, build_world, run_fault, summary  # noqa: E402

from rltune.sync.bench import device_info, git_sha  # noqa: E402

COLUMNS = ("faults", "detected", "silently_wrong", "raw", "hang", "unexpected", "healed", "prefetch_raised")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON record to write")
    ap.add_argument("--only", default=None, help="comma-separated fault classes to run (default: all)")
    args = ap.parse_args()
    chosen = [f for f in FAULTS if args.only is None or f.klass in args.only.split(",")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rltune-faults-") as tmp:
        world = build_world(Path(tmp) / "world")
        world_s = time.perf_counter() - t0
        outcomes = []
        for k, fault in enumerate(chosen):
            case_dir = Path(tmp) / f"case-{k}"
            case_dir.mkdir()
            outcomes.append(run_fault(fault, world, case_dir))
            o = outcomes[-1]
            print(f"{o.result:>14} {'healed' if o.healed else 'NOT HEALED':>10} {o.seconds:6.2f} s  {o.name}: "
                  f"{o.detail[:110]}", file=sys.stderr)
    wall = time.perf_counter() - t0
    table = summary(outcomes)
    record = dict(benchmark="sync_faults", git_sha=git_sha(REPO), device=device_info("cpu"),
                  time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), wall_s=wall, world_s=world_s,
                  case_timeout_s=CASE_TIMEOUT_S, case_rss_growth_limit_mib=CASE_RSS_GROWTH_MIB,
                  load_average=os.getloadavg(), table=table,
                  max_case_s=max(o.seconds for o in outcomes), max_rss_growth_mib=max(o.rss_growth_mib for o in outcomes),
                  faults=[o.__dict__ for o in outcomes])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(f"{'class':<12}" + "".join(f"{c:>16}" for c in COLUMNS))
    for klass, row in sorted(table.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        print(f"{klass:<12}" + "".join(f"{row[c]:>16}" for c in COLUMNS))
    print(f"wall {wall:.1f} s (world {world_s:.1f} s), slowest fault {record['max_case_s']:.2f} s")
    bad = table["all"]
    return 0 if bad["detected"] == bad["healed"] == bad["faults"] and not bad["prefetch_raised"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
