"""The reference workload on a real vLLM engine with and without its frozen start-up heap, in one run.

``run_job`` runs the steps inside :func:`rltune.workload.heap.frozen_heap`: what start-up built
(torch, the model, the engine client) is frozen, so the cyclic collector's full collections stop
walking it. The baseline arm is the same code with the freeze replaced by nothing. Both arms run
``presets/workload/tiny-math-vllm-64x8.yaml`` (the untuned default of ``presets/cpu-vllm-demo.yaml``)
in this process, alternating per round, with the same seed and batches. Each run records its step
times and every full (generation-2) collection of this process once the steps began, with its
duration; the record has min / median / max per arm, the machine's load, device, versions and
git SHA.

Usage (CPU)::

    python bench/workload_gc_freeze.py --rounds 3 --out bench/results/workload_gc_freeze-cpu-<git>.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from workload_vllm_sync import REPO, LoadSampler, device, stats, versions

from rltune.sync.bench import git_sha

PRESET = REPO / "presets" / "workload" / "tiny-math-vllm-64x8.yaml"


class FullCollections:
    """Generation-2 collections of this process after :meth:`begin`, each (seconds since begin, duration)."""

    def __init__(self):
        self.began: float | None = None
        self.seen: list[tuple[float, float]] = []
        self._start = 0.0

    def begin(self) -> None:
        self.began = time.perf_counter()

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2 or self.began is None:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seen.append((self._start - self.began, time.perf_counter() - self._start))


def run_once(arm: str, run_dir: Path, args) -> dict:
    import rltune.workload as workload
    import rltune.workload.orchestrator as orchestrator
    from rltune.workload.heap import frozen_heap

    collections = FullCollections()

    @contextlib.contextmanager
    def timed(freeze: bool):
        with frozen_heap() if freeze else contextlib.nullcontext():
            collections.begin()  # after the freeze's own collection: only what happens during steps counts
            yield

    orchestrator.frozen_heap = lambda: timed(arm == "frozen")
    gc.callbacks.append(collections)
    try:
        with LoadSampler() as load:
            metrics = workload.run(PRESET, run_dir, steps=args.steps, overrides=args.set)
    finally:
        gc.callbacks.remove(collections)
        orchestrator.frozen_heap = frozen_heap
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = [r["step_s"] for r in recs if r["step"] >= args.warmup]
    return dict(arm=arm, load_1min=stats(load.samples), step_s=[r["step_s"] for r in recs],
                rollout_s=[r["rollout_s"] for r in recs], engine_decode_steps=[r.get("engine_decode_steps") for r in recs],
                mean_step_s=statistics.fmean(kept), stats=stats(kept),
                full_collections=[dict(at_s=round(a, 3), ms=round(1000 * d, 1)) for a, d in collections.seen])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the statistics (cpu-vllm-demo's warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each arm, alternating")
    ap.add_argument("--set", action="append", default=[], help="a workload override (dotted.key=value)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="rltune-gc-freeze-"))
    runs = []
    for r in range(args.rounds):
        for arm in ("frozen", "unfrozen") if r % 2 == 0 else ("unfrozen", "frozen"):
            runs.append(dict(round=r, **run_once(arm, workdir / f"r{r}-{arm}", args)))
            last = runs[-1]
            pauses = ", ".join(f"{c['ms']:.0f} ms" for c in last["full_collections"]) or "none"
            print(f"round {r} {arm}: mean step {last['mean_step_s']:.3f} s; full collections during steps: {pauses}",
                  flush=True)
    summary = {}
    for arm in ("frozen", "unfrozen"):
        mine = [run for run in runs if run["arm"] == arm]
        summary[arm] = dict(step_s=stats([v for run in mine for v in run["step_s"][args.warmup:]]),
                            run_means=[run["mean_step_s"] for run in mine],
                            full_collections_ms=[c["ms"] for run in mine for c in run["full_collections"]],
                            max_step_s=[max(run["step_s"][args.warmup:]) for run in mine])
    record = dict(bench="workload_gc_freeze", git=git_sha(REPO), device=device(), versions=versions(),
                  config=dict(preset=str(PRESET.relative_to(REPO)), **{k: v for k, v in vars(args).items() if k != "out"}),
                  summary=summary, runs=runs, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for arm, s in summary.items():
        print(f"{arm}: step_s {s['step_s']['min']:.3f} / {s['step_s']['median']:.3f} / {s['step_s']['max']:.3f}; "
              f"run means {', '.join(f'{m:.3f}' for m in s['run_means'])}; full collections {s['full_collections_ms']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
