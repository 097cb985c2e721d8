"""forecast.yaml: per candidate, forecast stage times, step time, range and how they were made.

Candidates are ranked in the order the tuner tries them: those worth a trial first -- by the
optimistic end of their range when the evidence is thin (no anchor, or settings neither
measurements nor theory could estimate), by the point forecast otherwise -- then the rest by
their point forecast. A candidate is worth a trial when its point forecast is at least
``limits.min_forecast_gain_pct`` faster than the baseline (``worth: point``), or when only its
range reaches that gate and it relieves the stage that limits the step: that stage's forecast
seconds drop, or the candidate changes a setting the forecast cannot estimate and its fixes move
that stage (``worth: range``: the tuner explores while it is unsure).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rltune.contracts.candidates import StageGroup
from rltune.contracts.job import KnobValue, RlMode
from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml
from rltune.contracts.stages import MAX_STAGE_S

FORECAST_SCHEMA_VERSION = 1


@dataclass
class CaseWeight:
    run_id: str = field(doc="case used")
    weight: float = field(doc="normalised weight (weights of one forecast sum to 1)", min=0, max=1)
    distance: float = field(0.0, doc="similarity distance to the target", min=0)


@dataclass
class CandidateForecast:
    candidate: str = field(doc="candidate id ('baseline' for the baseline itself)")
    overrides: dict[str, KnobValue] = field(doc="the candidate's overrides, copied so trial needs no other file")
    stages_s: dict[str, float] = field(doc="forecast seconds per stage: rollout, training, weight_sync (+ others)")
    step_s: float = field(doc="forecast step time under the candidate's RL mode", min=0, max=MAX_STAGE_S)
    range_s: list[float] = field(doc="[low, high] forecast range of the step time")
    limiting_stage: StageGroup = field(doc="stage forecast to limit the step")
    method: Literal["anchor", "similar", "theory"] = field(doc="how it was made")
    rl_mode: RlMode = field(doc="RL mode the stages were combined under")
    cases: list[CaseWeight] = field(default_factory=list, doc="cases used and their weights")
    uncertain: list[str] = field(default_factory=list, doc="differing settings neither measurements nor theory could estimate")
    gain_pct: float = field(0.0, doc="forecast % faster than the baseline (negative: slower)", max=100)
    optimistic_gain_pct: float = field(0.0, doc="% faster at the low end of the range", max=100)
    thin_evidence: bool = field(False, doc="no anchor, or uncertain settings: ranked by the optimistic end of its range")
    worth: Literal["point", "range", ""] = field("", doc="point: the forecast reaches the gate; range: only its range does and it relieves the limiting stage (or changes a setting the forecast cannot estimate, with fixes that move that stage); '': not worth a trial")
    worth_trial: bool = field(False, doc="worth a trial (worth is 'point' or 'range')")

    def validate(self) -> None:
        if len(self.range_s) != 2 or self.range_s[0] > self.range_s[1] or self.range_s[0] < 0:
            raise FieldProblem("range_s", f"expected [low, high] seconds with 0 <= low <= high, found {self.range_s}")
        _check_seconds("stages_s", self.stages_s)
        if self.worth_trial != bool(self.worth):
            raise FieldProblem("worth_trial", f"must be {str(bool(self.worth)).lower()} when worth is {self.worth!r}")


def _check_seconds(name: str, stages: dict[str, float]) -> None:
    for stage, value in stages.items():
        if not 0 <= value <= MAX_STAGE_S:
            raise FieldProblem(f"{name}.{stage}", f"expected seconds in [0, {MAX_STAGE_S:g}], found {value:g}")


@dataclass
class Forecast:
    schema_version: int = field(doc="version of this schema (1)")
    job: str = field(doc="path of the job.yaml")
    candidates_file: str = field(doc="candidates.yaml the forecasts were made for")
    library: str = field(doc="case library used")
    baseline_step_s: float = field(doc="the baseline's step time the gains are against (its own measured case when the library holds it)", min=0, max=MAX_STAGE_S)
    forecasts: list[CandidateForecast] = field(doc="in the order to try them (see the module docstring)")
    baseline_run: str | None = field(None, doc="run id of the baseline the forecasts compare against")
    baseline_method: str = field("", doc="how baseline_step_s was made: 'measured' (the baseline's own case), else anchor / similar / theory")
    baseline_stages_s: dict[str, float] = field(default_factory=dict, doc="the baseline's stage seconds, as forecast beside the candidates")
    limiting_stage: Literal[StageGroup, "unknown", ""] = field("", doc="the stage group that limits the baseline's step (from its diagnosis)")
    gate_pct: float = field(0.0, doc="limits.min_forecast_gain_pct: the gain a forecast (or its range) must reach", min=0, max=100)
    job_name: str | None = field(None, doc="name of the job the forecasts were made for; 'rltune trial' refuses the file with another job")

    def validate(self) -> None:
        _check_seconds("baseline_stages_s", self.baseline_stages_s)
        seen: set[str] = set()
        for i, fc in enumerate(self.forecasts):
            if fc.candidate in seen:
                raise FieldProblem(f"forecasts[{i}].candidate", f"duplicate candidate {fc.candidate!r}")
            seen.add(fc.candidate)


def load_forecast(path: str | Path) -> Forecast:
    return load_yaml(Forecast, path, FORECAST_SCHEMA_VERSION)


def save_forecast(forecast: Forecast, path: str | Path) -> None:
    dump_yaml(forecast, path)
