"""A tiny real job for the campaign: it writes the rltune metrics file the way the reference workload does.

    python fake_job.py MODE --run-dir DIR [key=value ...]

The overrides are the rltune dialect's ``key=value`` items (``orchestrator.steps=3`` sets the step
count); the step times are a fixed function of the knobs, so nothing here depends on the machine.
MODE says how the job behaves:

- ``ok``: one metrics line per step, then exit 0;
- ``crash``: two lines, then exit 1 with a message on stderr;
- ``hang``: one line, then sleep far past any time-out;
- ``nan`` / ``negative`` / ``inf`` / ``huge``: every step's times NaN / negative / inf / 1e300;
- ``garbage``: lines that are not JSON;
- ``empty``: exit 0 having written nothing.

A run of more than 100 steps writes 100 and then waits to be stopped, as a long job would: its
launch time-out ends it, and the metrics file stays small.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    run_dir = Path(rest[rest.index("--run-dir") + 1])
    overrides = dict(item.split("=", 1) for item in rest if "=" in item and not item.startswith("--"))
    knobs = {k: _value(v) for k, v in overrides.items()}
    steps = int(knobs.get("orchestrator.steps", 8))
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    micro = float(knobs.get("trainer.micro_batch_size", 8))
    reuse = knobs.get("trainer.reuse_rollout_logprobs", False) is True
    with metrics.open("w") as out:
        if mode == "empty":
            return 0
        for step in range(steps):
            if step == 100:
                time.sleep(3600)
            if mode == "crash" and step == 2:
                print("fake_job: CUDA error: an illegal memory access was encountered", file=sys.stderr)
                return 1
            if mode == "hang" and step == 1:
                time.sleep(3600)
            if mode == "garbage":
                out.write("step took some time, not sure how much\n")
                out.flush()
                continue
            rollout, training = 1.0, 0.6 * 8 / micro ** 0.5 / 8 ** 0.5 + 0.2
            old_logprob = 0.0 if reuse else 0.3
            sync = 0.1
            row = {"step": step, "step_s": rollout + training + old_logprob + sync, "rollout_s": rollout,
                   "training_s": training, "old_logprob_s": old_logprob, "weight_sync_s": sync,
                   "trainer_busy_frac": 0.4, "reward": 0.1 * step}
            bad = {"nan": float("nan"), "negative": -0.5, "inf": float("inf"), "huge": 1e300}.get(mode)
            if bad is not None:
                row.update({k: bad for k in ("step_s", "rollout_s", "training_s", "old_logprob_s", "weight_sync_s")})
            out.write(json.dumps(row) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
