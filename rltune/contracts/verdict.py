"""verdict.yaml: the decision on one trial, with every acceptance limit's value, threshold and result.

The limits come from job.yaml ``limits`` and are fixed before the run. The trial is timed on the
same step indices as its baseline (warm-up steps left out), so the step times compare like with
like. A trial whose job crashed or ran past its time-out gets ``decision: failed`` and the tail of
its log.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rltune.contracts.job import KnobValue
from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml
from rltune.contracts.stages import MAX_STAGE_S

VERDICT_SCHEMA_VERSION = 2  # 2: a limit may be not measured (passed: null); mean steps, measured noise

LimitId = Literal["speed", "gap", "sample_age_mean", "sample_age_max", "trials_cut_off", "trials_failed"]
Decision = Literal["keep", "reject", "failed"]


@dataclass
class LimitCheck:
    name: LimitId = field(doc="which limit")
    value: float | None = field(doc="the candidate's measured value (null: the run did not report it)")
    threshold: float | None = field(doc="the bound it is held to (null: nothing to compare with)")
    passed: bool | None = field(doc="the limit holds (null: not measured -- no run reported the value it needs)")
    detail: str = field("", doc="how value and threshold were computed, for a person")


@dataclass
class Verdict:
    schema_version: int = field(doc="version of this schema (2)")
    run_id: str = field(doc="the trial's run id")
    candidate: str = field(doc="candidate id")
    job: str = field(doc="job.yaml the trial ran")
    baseline_run: str = field(doc="run the trial is compared with")
    untuned_run: str = field(doc="untuned baseline whose gap sets the gap limit")
    overrides: dict[str, KnobValue] = field(doc="knobs the trial set, relative to the job's baseline knobs")
    decision: Decision = field(doc="keep (all limits pass), reject (a limit fails) or failed (the job crashed or timed out)")
    reason: str = field(doc="one line: why this decision")
    knobs: dict[str, KnobValue] = field(default_factory=dict, doc="every knob as the trial ran it (the job's knobs with the overrides applied)")
    steps_compared: list[int] = field(default_factory=list, doc="step indices both runs were timed on (warm-up excluded)")
    baseline_step_s: float | None = field(None, doc="baseline mean step time over steps_compared (what a step costs)", min=0, max=MAX_STAGE_S)
    step_s: float | None = field(None, doc="trial mean step time over steps_compared", min=0, max=MAX_STAGE_S)
    baseline_median_s: float | None = field(None, doc="baseline median step time over steps_compared, for comparison", min=0, max=MAX_STAGE_S)
    median_s: float | None = field(None, doc="trial median step time over steps_compared, for comparison", min=0, max=MAX_STAGE_S)
    gain_pct: float | None = field(None, doc="% by which the trial's mean step beats the baseline's (negative: slower)")
    noise_pct: float | None = field(None, doc="% the gain had to exceed: the baseline's measured spread, floored at limits.noise_pct")
    noise_source: str = field("", doc="where noise_pct came from")
    remeasured: bool = field(False, doc="the gain was below the recheck bar (limits.recheck_below_pct, default 2 x the noise), so the trial ran again and both runs count")
    limits: list[LimitCheck] = field(default_factory=list, doc="every limit's value, threshold and pass / fail / not measured")
    stages_s: dict[str, float] = field(default_factory=dict, doc="trial mean seconds per stage over steps_compared")
    forecast_step_s: float | None = field(None, doc="step time forecast before the run", min=0, max=MAX_STAGE_S)
    forecast_range_s: list[float] | None = field(None, doc="[low, high] forecast range")
    forecast_error_pct: float | None = field(None, doc="(measured - forecast) / measured, in %")
    within_forecast_range: bool | None = field(None, doc="measured step inside the forecast range; a miss is recorded for recalibration")
    log_tail: str = field("", doc="last lines of the job's log when it failed")
    run_dirs: list[str] = field(default_factory=list, doc="run directories the trial measured (two when remeasured)")

    def validate(self) -> None:
        if not self.run_id.strip():
            raise FieldProblem("run_id", "the verdict needs its trial's run id")
        if self.forecast_range_s is not None and (len(self.forecast_range_s) != 2 or self.forecast_range_s[0] > self.forecast_range_s[1]):
            raise FieldProblem("forecast_range_s", f"expected [low, high] with low <= high, found {self.forecast_range_s}")
        if self.decision == "keep" and any(check.passed is False for check in self.limits):
            raise FieldProblem("decision", "'keep' needs no limit to fail")

    @property
    def kept(self) -> bool:
        return self.decision == "keep"


def load_verdict(path: str | Path) -> Verdict:
    return load_yaml(Verdict, path, VERDICT_SCHEMA_VERSION)


def save_verdict(verdict: Verdict, path: str | Path) -> None:
    dump_yaml(verdict, path)
