"""Hand-made case records for the predictor's unit tests.

These are small synthetic case sets with known answers, written to test behaviour (distances,
weights, scaling, anchoring, atomic files). They are not measurements and no test presents them
as such.
"""

from __future__ import annotations

from typing import Any

from rltune.contracts.cases import CaseRecord
from rltune.steps import combine

CPU_FACTS = {
    "total_params": 2.0e6, "active_params": 2.0e6, "layers": 2.0, "hidden": 128.0, "kv_heads": 2.0, "head_dim": 32.0,
    "model_dtype": "fp32", "moe": 0.0, "tasks_per_batch": 8.0, "trials_per_task": 4.0, "answer_cap_tokens": 16.0,
    "context_limit_tokens": 96.0, "trainer_gpus": 0.0, "rollout_gpus": 0.0,
}
CPU_KNOBS = {"rl_mode": "sync", "micro_batch_size": 8, "packing": False, "engine_max_concurrency": 16, "num_engines": 1,
             "sync_transport": "filesystem"}


def make_case(run_id: str, *, rollout: float, training: float, weight_sync: float, knobs: dict[str, Any] | None = None,
              facts: dict[str, Any] | None = None, t: float = 0.0, job: str = "tiny-math-cpu", model: str = "qwen3-tiny",
              workload: str = "math", device: str = "cpu", gpus: int = 0, step: float | None = None,
              forecast: dict[str, Any] | None = None, status: str = "ok", defaults: bool = True) -> CaseRecord:
    """A case; ``defaults`` fills knobs and facts of the tiny CPU job that ``knobs``/``facts`` leave out."""
    knobs = {**(CPU_KNOBS if defaults else {}), **(knobs or {})}
    rl_mode = knobs["rl_mode"]
    if step is None:
        step = combine(rl_mode, rollout, training, weight_sync)[0]
    return CaseRecord(
        run_id=run_id, job=job, model=model, workload=workload, rl_mode=rl_mode, gpus=gpus, device=device, status=status,
        started_at=t, finished_at=t + 60.0, warmup_steps=1, measured_steps=5, facts={**(CPU_FACTS if defaults else {}), **(facts or {})},
        knobs=knobs, measured={"step_s": step, "rollout_s": rollout, "training_s": training, "weight_sync_s": weight_sync},
        forecast=forecast, step_noise_frac=0.02, source="rltune",
    )
