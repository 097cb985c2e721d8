"""diagnosis.yaml: what limits a run's step, per-stage medians, and the problems found."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rltune.contracts.job import RlMode
from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml
from rltune.contracts.stages import MAX_STAGE_S

DIAGNOSIS_SCHEMA_VERSION = 1

# What can limit a step: a stage, the training and weight-sync group of fully async mode, or
# 'unknown' when the source times only whole steps.
LimitingStage = Literal["rollout", "training", "weight_sync", "training+weight_sync", "unknown"]


@dataclass
class StageSummary:
    median_s: float = field(doc="median over the non-warm-up steps")
    p10_s: float = field(doc="10th percentile")
    p90_s: float = field(doc="90th percentile")

    def validate(self) -> None:
        if not self.p10_s <= self.median_s <= self.p90_s:
            raise FieldProblem("median_s", f"expected p10_s <= median_s <= p90_s, found {self.p10_s:g}, "
                                           f"{self.median_s:g}, {self.p90_s:g}")


@dataclass
class Problem:
    id: str = field(doc="stable problem id; knowledge.yaml refers to it (e.g. 'trainer_underbusy')")
    stage: Literal["rollout", "training", "weight_sync", "step"] = field(doc="stage the problem slows")
    component: Literal["trainer", "engine", "sandbox", "sync", "orchestrator"] = field(doc="part of the loop it lives in")
    summary: str = field(doc="one line for a person")
    severity: float = field(doc="estimated seconds per step it costs (0 if unknown)", min=0)
    evidence: dict[str, Any] = field(default_factory=dict, doc="the measured values that show it")


@dataclass
class Diagnosis:
    schema_version: int = field(doc="version of this schema (1)")
    run_id: str = field(doc="run diagnosed")
    source: str = field(doc="log format the stage table came from")
    rl_mode: RlMode = field(doc="RL mode used to combine stages")
    steps_used: list[int] = field(doc="the steps medians are taken over")
    step_median_s: float = field(doc="median measured step time", min=0, max=MAX_STAGE_S)
    step_model_s: float = field(doc="step time the RL-mode rule gives from the stage medians", min=0, max=MAX_STAGE_S)
    limiting_stage: LimitingStage = field(doc="'rollout', 'training', 'weight_sync', 'training+weight_sync' (fully async), or 'unknown' (the source times whole steps only)")
    stages: dict[str, StageSummary] = field(doc="per-column summary of every measured column")
    problems: list[Problem] = field(default_factory=list, doc="problems found, worst first")
    stage_medians_s: dict[str, float | None] = field(default_factory=dict, doc="rollout, training (incl. old-logprob pass), weight_sync medians the RL-mode rule used (null: not measured, counted as 0)")
    notes: list[str] = field(default_factory=list, doc="what a reader should know: stages not measured, derived columns, warm-up handling")
    step_mean_s: float | None = field(None, doc="mean measured step time: the wall time a step costs (null: the source has no step time)", min=0, max=MAX_STAGE_S)
    job: str | None = field(None, doc="resolved job.yaml of the run, if rltune launched it")
    job_name: str | None = field(None, doc="name of the job the run was made with (null: read from logs); 'rltune propose' refuses the file with another job")

    def validate(self) -> None:
        if not self.run_id.strip():
            raise FieldProblem("run_id", "the diagnosed run needs its id (the case library keys runs by it)")
        if not self.steps_used:
            raise FieldProblem("steps_used", "no step was diagnosed; profile the run again with more steps")
        for stage, value in self.stage_medians_s.items():
            if value is not None and not 0 <= value <= MAX_STAGE_S:
                raise FieldProblem(f"stage_medians_s.{stage}", f"expected seconds in [0, {MAX_STAGE_S:g}], found {value:g}")


def load_diagnosis(path: str | Path) -> Diagnosis:
    return load_yaml(Diagnosis, path, DIAGNOSIS_SCHEMA_VERSION)


def save_diagnosis(diagnosis: Diagnosis, path: str | Path) -> None:
    dump_yaml(diagnosis, path)
