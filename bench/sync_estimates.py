"""The cost model's projections for the four model sizes and its checks against published figures, as markdown.

Runs ``rltune.sync.estimate`` on presets/sync/estimate/*.yaml (8 B, 30 B-A3B, 235 B-A22B, 1 T, each in
bf16 and fp8) and presets/sync/estimate/checks/*.yaml (setups with published figures), writes the JSON
of every estimate and prints the tables docs/BENCHMARKS.md carries.

Usage::

    .venv/bin/python bench/sync_estimates.py --out bench/results/sync_estimates-<git>.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rltune.sync.bench import git_sha  # noqa: E402
from rltune.sync.estimate import estimate, fmt_range, load_model_spec, load_rates  # noqa: E402

HEADLINE = ["qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b", "kimi-k2-1t"]
COLUMNS = [("delta_MiB", "delta MiB/step"), ("trainer_publish_s", "trainer-blocking publish s"),
           ("diff_in_step_s", "diff in step s"), ("engine_read_s", "engine read while serving s"),
           ("dispatch_blocking_s", "dispatch-blocking update s"), ("anchor_write_s", "anchor write s (per interval)"),
           ("anchor_per_step_s", "anchor s/step"), ("anchor_load_s", "fresh worker anchor load s"),
           ("storage_GBps_sustained", "storage GB/s sustained"), ("storage_GBps_read_hidden", "read GB/s to hide fetch")]


def rates_cpu_only(rates) -> list[str]:
    return sorted(n for n, r in rates.rates.items() if r.cpu_only)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rates = load_rates()
    record = dict(benchmark="sync_estimates", git_sha=git_sha(), rates_version=rates.rates_version, headline={},
                  checks={})
    print("| model | dtype | layout | " + " | ".join(c for _, c in COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for name in HEADLINE:
        spec = load_model_spec(ROOT / "presets" / "sync" / "estimate" / f"{name}.yaml")
        result = estimate(spec, rates)
        record["headline"][name] = result
        layout = (f"{spec.trainer.ranks} ranks / {spec.trainer.nodes} nodes; {spec.engine.engines} x "
                  f"{spec.engine.workers} workers (TP{spec.engine.tp}, EP{spec.engine.ep}), "
                  f"{spec.engine.readers_per_node}/node")
        for dtype, d in result["by_dtype"].items():
            o = d["outputs"]
            cells = [fmt_range(o[k]["lo"], o[k]["hi"]) + ("\\*" if o[k]["cpu_only_inputs"] else "") for k, _ in COLUMNS]
            print(f"| {name} | {dtype} | {layout} | " + " | ".join(cells) + " |")
    print()
    cpu_only = rates_cpu_only(rates)
    print("\\* depends on a rate measured on the CPU only (" + ", ".join(cpu_only) + ")" if cpu_only
          else "no output depends on a rate measured on the CPU only")
    print()
    print("| setup | output | published | predicted | ratio | within 2x | largest term of the prediction | cause of a miss |")
    print("|---|---|---|---|---|---|---|---|")
    for path in sorted((ROOT / "presets" / "sync" / "estimate" / "checks").glob("*.yaml")):
        spec = load_model_spec(path)
        result = estimate(spec, rates)
        record["checks"][path.stem] = result
        for c in result["checks"]:
            pub = fmt_range(c["published"]["min"], c["published"]["max"])
            pred = fmt_range(c["predicted"]["lo"], c["predicted"]["hi"])
            cause = "" if c["within_2x"] else " ".join(c["cause"].split())
            term = ""
            seconds = [k for k in c["terms"] if k.endswith("_s")]
            shown = [max(seconds, key=lambda k: c["terms"][k]["hi"])] if seconds else list(c["terms"])
            term = ", ".join(f"{k} {fmt_range(c['terms'][k]['lo'], c['terms'][k]['hi'])}" for k in shown)
            if c["cpu_only_inputs"]:
                term += (" " if term else "") + "(CPU-only: " + ", ".join(c["cpu_only_inputs"]) + ")"
            print(f"| {path.stem} | {c['output']} ({c['unit']}) | {pub} | {pred} | {c['ratio']:.2f} x | "
                  f"{'yes' if c['within_2x'] else '**no**'} | {term} | {cause} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
