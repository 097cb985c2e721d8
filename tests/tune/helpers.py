"""Builders for the tuning tests: a job with the seed's Figure 3 knobs and a diagnosis of it."""

from __future__ import annotations

from pathlib import Path

import yaml

from rltune.contracts.diagnosis import Diagnosis, Problem, StageSummary
from rltune.contracts.job import JobSpec, load_job

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "presets" / "cpu-demo.yaml"


def figure3_job(tmp_path: Path, **knob_changes) -> JobSpec:
    """The seed's illustrative 16-GPU fully-async coding job, with the knobs its fixes a-f set."""
    data = yaml.safe_load(DEMO.read_text())
    data["name"] = "figure3-coding"
    data["workload"]["kind"] = "coding"
    data["gpus"] = {"count": 16, "device": "B300", "trainer": 4, "rollout": 12, "cpu_hosts": 2}
    data["knobs"] = {"rl_mode": "fully_async", "micro_batch_size": 1, "trainer_tp": 4, "rollout_gpus": 12,
                     "chunked_prefill": False, "pd_disaggregation": False, "sandbox_hosts": 2,
                     "prebuilt_image": False, **knob_changes}
    data["launch"]["knob_map"] = {knob: f"cfg.{knob}" for knob in data["knobs"]}
    path = tmp_path / "figure3.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_job(path)


def stage(median: float) -> StageSummary:
    return StageSummary(median_s=median, p10_s=median * 0.95, p90_s=median * 1.05)


def figure3_diagnosis() -> Diagnosis:
    """Rollout 620 s limits the step; one problem in the trainer, the engines and the sandboxes."""
    return Diagnosis(
        schema_version=1, run_id="base", source="rltune", rl_mode="fully_async", steps_used=[2, 3, 4],
        step_median_s=620.0, step_model_s=620.0, limiting_stage="rollout",
        stages={"rollout_s": stage(620.0), "training_s": stage(450.0), "weight_sync_s": stage(30.0)},
        problems=[
            Problem(id="decode_interrupted_by_prefill", stage="rollout", component="engine",
                    summary="decode pauses to prefill", severity=120.0),
            Problem(id="sandbox_hosts_overloaded", stage="rollout", component="sandbox",
                    summary="setup takes 180 s", severity=180.0),
            Problem(id="trainer_underbusy", stage="training", component="trainer",
                    summary="GPUs busy half the time", severity=150.0),
        ],
    )


# Neutral values for the fields each journal event requires, so a test writes only the fields it is about.
_EVENT_FILL = {
    "start": dict(job="job.yaml", job_name="tiny", gpus=0, device="cpu", rl_mode="sync", rounds=1, trial_budget=1,
                  library="cases"),
    "baseline": dict(round=0, run_id="base", run_dir="runs/base", knobs={}, step_s=1.0, stages_s={},
                     limiting_stage="rollout", problems=[]),
    "trial": dict(round=1, run_dirs=[], candidate="c1", fixes=["packing"], group="other", knobs={}, decision="keep",
                  reason="", step_s=1.0, baseline_step_s=1.0, gain_pct=0.0, forecast_step_s=1.0,
                  forecast_range_s=[1.0, 1.0], within_forecast_range=None, stages_s={}, remeasured=False,
                  failed_limits=[], verdict="runs/r/verdict.yaml"),
    "finish": dict(reason="", untuned_run="base", untuned_step_s=1.0, best_run="base", best_step_s=1.0, best_knobs={},
                   trials=0, savings={}, tuned_preset="tuned.yaml"),
}


def add_event(journal, kind: str, **fields):
    """Append one valid event of ``kind`` to ``journal``: ``fields`` over neutral values for the rest."""
    from rltune.tune.journal import make_event

    values = {**_EVENT_FILL.get(kind, {}), **fields}
    if kind == "trial":
        values.setdefault("run_id", f"r1-t{len(journal.events())}")
    return journal.append(make_event(kind, 1.0, **values))
