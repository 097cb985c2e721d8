"""Retrospective forecast accuracy, the seed's test of the predictor.

``evaluate(library) -> EvalReport``: for every ok run in order of start time, forecast it from
only the runs that had *finished before it started* (as when it was planned), and compare with
what it measured. Runs with no earlier run are listed but left out of the figures (there was
nothing to forecast from). The report gives the median |error| of the step time overall, per
workload and per method, the share within 10 %, the median |error| of training time (the trainer's
whole time per step, old-logprob pass included, as the forecast's training stage is), and range
coverage (share of measured steps inside the forecast range). ``plot(report, path)`` draws
predicted against measured with the +-10 % band (matplotlib, Agg backend).

The report also states the library's own noise: the run-to-run spread of the step among setups
measured more than once (pooled, log space: :func:`rltune.predict.effects.knob_effects`), and what
a forecast with no error of its own would score against runs that noisy, were each run's noise
independent -- its median |error| and its share within 10 %. That is the scale the figures above
can be read against (runs close in time can share their noise, so a forecast may beat it).

``evaluate_library(library, rule=...) -> LibraryScores`` is the same test in one report for any
library, rltune's own or imported public runs: each usable case is forecast from the others a rule
allows, and the report gives, per source and per measure (step, each published stage, and for a
source that publishes only throughput, its tokens/s/GPU), the median |error|, the share within
10 %, range coverage and range sharpness (the median of high / low). Rules:

- ``before_start``: only the runs that finished before the case started (rltune's own runs, as
  :func:`evaluate`);
- ``same_or_earlier``: leave one out -- every other case, but of the case's own source only those of
  the same release or an earlier one (software gets faster across releases);
- ``same``: leave one out within the case's release only.

A stage's range is the step's, relative: ``stage x range / step``. A throughput's forecast is
``tokens_per_step / (training x GPUs)`` and its range the training range's, inverted.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.predict.effects import knob_effects
from rltune.predict.forecast import PriorLibrary, forecast_prepared, prepare, resolve_prior
from rltune.predict.library import CaseLibrary, as_cases
from rltune.predict.setup import setup_from_case
from rltune.predict.theory import (
    STAGE_COLUMN,
    TRAINER_ONLY_WORKLOAD,
    case_step,
    device_class,
    known_stages,
    measured_stages,
)

if TYPE_CHECKING:
    from rltune.contracts.cases import CaseRecord
    from rltune.predict.theory import TheoryModel

BAND = 0.10


@dataclass
class EvalRow:
    run_id: str
    workload: str
    rl_mode: str
    history: int
    method: str
    predicted_step_s: float
    measured_step_s: float
    low_s: float
    high_s: float
    error_pct: float
    predicted_training_s: float
    measured_training_s: float
    training_error_pct: float
    in_range: bool
    limiting_predicted: str


@dataclass
class EvalReport:
    runs: int
    evaluated: int
    without_history: list[str]
    median_abs_error_pct: float | None
    within_10pct: float | None
    within_10pct_count: int
    training_median_abs_error_pct: float | None
    range_coverage: float | None
    by_workload: dict[str, float] = field(default_factory=dict)
    by_method: dict[str, dict[str, float]] = field(default_factory=dict)
    rows: list[EvalRow] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    # the library's noise: pooled repeat spread of the step (log sd, %), how many setups ran more
    # than once, and a perfect forecast's median |error| (%) and share within 10 % against that spread
    repeat_noise_pct: float | None = None
    repeat_groups: int = 0
    perfect_forecast_median_abs_error_pct: float | None = None
    perfect_forecast_within_10pct: float | None = None
    # the same forecasts scored per measure, as :func:`evaluate_library` reports them (rule before_start)
    scores: LibraryScores | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, Any]:
        out = self.to_dict()
        out.pop("rows")
        if out.get("scores"):
            out["scores"].pop("rows")
        return out


def _median_abs(values: Sequence[float]) -> float | None:
    return round(statistics.median(abs(v) for v in values), 4) if values else None


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def perfect_forecast(sigma: float) -> tuple[float, float]:
    """A perfect forecast against runs whose log step carries N(0, sigma) noise: its median
    |relative error| and its share within 10 %. The relative error of a forecast p of a run that
    measured m is p / m - 1 = exp(-e) - 1 with e the run's noise, so it is within x when e lies in
    [-log(1 + x), -log(1 - x)] (no upper end for x >= 1)."""
    def share_within(x: float) -> float:
        above = _normal_cdf(-math.log(1.0 - x) / sigma) if x < 1.0 else 1.0
        return above - _normal_cdf(-math.log(1.0 + x) / sigma)

    lo, hi = 0.0, 1.0  # at x = 1 the share is Phi(log 2 / sigma) > 1/2: the median lies below
    for _ in range(60):  # share_within grows with x: bisect for the median
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share_within(mid) < 0.5 else (lo, mid)
    return (lo + hi) / 2, share_within(BAND)


def evaluate(library: CaseLibrary | Sequence[CaseRecord] | str, *, theory: TheoryModel | None = None,
             prior: PriorLibrary | None | str = "shipped") -> EvalReport:
    """Forecast each run from the runs finished before it started; see the module docstring.

    ``prior``: the public runs that stand behind the forecasts of GPU jobs (``"shipped"``: those that
    install with rltune; None: none), as a user's forecasts have them.
    """
    lib = library if isinstance(library, CaseLibrary) else (CaseLibrary(library) if isinstance(library, (str, Path)) else None)
    cases = as_cases(lib if lib is not None else list(library))
    prior = _resolve_prior(prior, cases)
    cases = sorted(cases, key=lambda c: (c.started_at, c.run_id))
    rows: list[EvalRow] = []
    scored: list[ScoredForecast] = []
    without: list[str] = []
    for case in cases:
        history = [c for c in cases if c.finished_at <= case.started_at and c.run_id != case.run_id]
        if not history:
            without.append(case.run_id)
            continue
        fc = forecast_prepared(prepare(history, theory, prior=prior), setup_from_case(case), case.run_id)
        scored.extend(_scored(case, fc, len(history)))
        measured = case.step_s
        training = measured_stages(case)["training"]  # the trainer's whole time, as the forecast defines its training stage
        rows.append(EvalRow(
            run_id=case.run_id, workload=case.workload, rl_mode=case.rl_mode, history=len(history), method=fc.method,
            predicted_step_s=fc.step_s, measured_step_s=measured, low_s=fc.range_s[0], high_s=fc.range_s[1],
            error_pct=round(100.0 * (fc.step_s - measured) / measured, 4),
            predicted_training_s=fc.stages_s["training"], measured_training_s=training,
            training_error_pct=round(100.0 * (fc.stages_s["training"] - training) / training, 4) if training > 0 else 0.0,
            in_range=fc.range_s[0] <= measured <= fc.range_s[1], limiting_predicted=fc.limiting_stage,
        ))
    errors = [r.error_pct for r in rows]
    within = sum(1 for e in errors if abs(e) <= 100 * BAND)
    by_workload = {w: _median_abs([r.error_pct for r in rows if r.workload == w]) for w in sorted({r.workload for r in rows})}
    by_method = {}
    for m in sorted({r.method for r in rows}):
        subset = [r for r in rows if r.method == m]
        by_method[m] = {"count": len(subset), "median_abs_error_pct": _median_abs([r.error_pct for r in subset]),
                        "range_coverage": round(sum(r.in_range for r in subset) / len(subset), 4)}
    effects = knob_effects(cases)
    perfect = perfect_forecast(effects.repeat_noise) if effects.repeat_groups else None
    return EvalReport(
        runs=len(cases), evaluated=len(rows), without_history=without,
        median_abs_error_pct=_median_abs(errors), within_10pct=round(within / len(rows), 4) if rows else None,
        within_10pct_count=within, training_median_abs_error_pct=_median_abs([r.training_error_pct for r in rows]),
        range_coverage=round(sum(r.in_range for r in rows) / len(rows), 4) if rows else None,
        by_workload=by_workload, by_method=by_method, rows=rows,
        skipped_files=[f"{path}: {reason}" for path, reason in (lib.skipped if lib is not None else [])],
        repeat_noise_pct=round(100 * effects.repeat_noise, 4) if perfect else None, repeat_groups=effects.repeat_groups,
        perfect_forecast_median_abs_error_pct=round(100 * perfect[0], 4) if perfect else None,
        perfect_forecast_within_10pct=round(perfect[1], 4) if perfect else None,
        scores=_library_scores(str(lib.path) if lib is not None else "", "before_start", prior is not None, len(cases), scored,
                               [f"{r}: no earlier run to forecast it from" for r in without]),
    )


def _resolve_prior(prior: PriorLibrary | None | str, cases: Sequence[CaseRecord]) -> PriorLibrary | None:
    """The prior for a library's forecasts: the shipped public runs only where some case is a GPU job."""
    gpu = next((c.device for c in cases if device_class(c.device) != "cpu"), "cpu")
    return resolve_prior(prior, gpu)


RULES = ("before_start", "same_or_earlier", "same")
MEASURES = ("step", "rollout", "training", "weight_sync", "tokens_per_s_per_gpu")


@dataclass
class ScoredForecast:
    """One forecast of one measure of a case, against what the case measured."""

    run_id: str
    source: str
    release: str | None
    workload: str
    rl_mode: str
    measure: str
    method: str
    history: int
    predicted: float
    measured: float
    low: float
    high: float
    error_pct: float
    in_range: bool
    cases: list[str] = field(default_factory=list)  # the cases the forecast leaned on most (run ids, heaviest first)


@dataclass
class Score:
    """The figures of a set of forecasts of one measure."""

    count: int
    median_abs_error_pct: float | None
    within_10pct: float | None
    within_10pct_count: int
    range_coverage: float | None
    range_sharpness: float | None  # median of high / low

    @classmethod
    def of(cls, rows: Sequence[ScoredForecast]) -> Score:
        if not rows:
            return cls(0, None, None, 0, None, None)
        within = sum(1 for r in rows if abs(r.error_pct) <= 100 * BAND)
        widths = [r.high / r.low for r in rows if r.low > 0]
        return cls(len(rows), _median_abs([r.error_pct for r in rows]), round(within / len(rows), 4), within,
                   round(sum(r.in_range for r in rows) / len(rows), 4), round(statistics.median(widths), 4) if widths else None)


@dataclass
class LibraryScores:
    """What :func:`evaluate_library` measured: scores per source and measure ('all' pools the sources)."""

    library: str
    rule: str
    prior: bool
    runs: int
    evaluated: int
    scores: dict[str, dict[str, Score]] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)  # 'run id: why' for each case no forecast was scored on
    rows: list[ScoredForecast] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, Any]:
        out = self.to_dict()
        out.pop("rows")
        return out


def release_order(cases: Sequence[CaseRecord]) -> dict[tuple[str, str], tuple]:
    """(source, release) -> a key that orders a source's releases: a version ('v0.5') by its numbers; a commit by the
    latest time a measurement published at it was made (public cases hold it where the source gives one)."""
    latest: dict[tuple[str, str], float] = {}
    for c in cases:
        if c.release is not None:
            key = (c.source or "", c.release)
            latest[key] = max(latest.get(key, 0.0), c.finished_at)
    out = {}
    for (source, release), when in latest.items():
        version = re.fullmatch(r"v?(\d+(?:\.\d+)*)", release)
        out[(source, release)] = (0, tuple(int(x) for x in version.group(1).split("."))) if version else (1, (when,))
    return out


def allowed_history(case: CaseRecord, others: Sequence[CaseRecord], rule: str, order: dict[tuple[str, str], tuple]) -> list[CaseRecord]:
    """The cases ``rule`` lets forecast ``case`` (see the module docstring); never the case itself."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; expected one of {', '.join(RULES)}")
    if rule == "before_start":
        return [c for c in others if c.finished_at <= case.started_at and c.run_id != case.run_id]
    mine = order.get((case.source or "", case.release)) if case.release is not None else None
    out = []
    for c in others:
        if c.run_id == case.run_id:
            continue
        if mine is not None and c.release is not None and (c.source or "") == (case.source or ""):
            theirs = order[(c.source or "", c.release)]
            if (theirs != mine) if rule == "same" else (theirs > mine or (theirs[0] != mine[0])):
                continue
        out.append(c)
    return out


def measured_values(case: CaseRecord) -> dict[str, float]:
    """The measures a case can be scored on: its step and each stage it measured (published, for a public run); a
    trainer benchmark's training alone (its step is its training); tokens/s/GPU where a source published only that."""
    if not case.public:
        stages = measured_stages(case)
        return {"step": case.step_s, **{s: v for s, v in stages.items()}}
    known = known_stages(case)
    out: dict[str, float] = {}
    if case.workload == TRAINER_ONLY_WORKLOAD:
        published = any(case.measured.get(col) is not None for col in ("step_s", "training_s"))
        if published and known["training"] is not None:
            out["training"] = float(known["training"])
        elif case.measured.get("tokens_per_s_per_gpu"):
            out["tokens_per_s_per_gpu"] = float(case.measured["tokens_per_s_per_gpu"])
        return out
    step = case_step(case)
    if step is not None:
        out["step"] = step
    for stage, column in STAGE_COLUMN.items():
        if case.measured.get(column) is not None:
            out[stage] = float(known[stage])
    return out


def _scored(case: CaseRecord, fc: Any, history: int) -> list[ScoredForecast]:
    rows = []
    rel_low, rel_high = (fc.range_s[0] / fc.step_s, fc.range_s[1] / fc.step_s) if fc.step_s > 0 else (1.0, 1.0)
    for measure, measured in measured_values(case).items():
        if measure == "step":
            predicted, low, high = fc.step_s, fc.range_s[0], fc.range_s[1]
        elif measure == "tokens_per_s_per_gpu":
            training = fc.stages_s["training"]
            tokens = float(case.facts["tokens_per_step"])
            predicted = tokens / (training * case.gpus) if training > 0 else math.inf
            low, high = predicted / rel_high, predicted / rel_low
        else:
            predicted = fc.stages_s[measure]
            low, high = predicted * rel_low, predicted * rel_high
        if measured <= 0:
            continue
        rows.append(ScoredForecast(
            run_id=case.run_id, source=case.source or "", release=case.release, workload=case.workload, rl_mode=case.rl_mode,
            measure=measure, method=fc.method, history=history, predicted=round(predicted, 6), measured=measured,
            low=round(low, 6), high=round(high, 6), error_pct=round(100.0 * (predicted - measured) / measured, 4),
            in_range=low <= measured <= high, cases=[c.run_id for c in sorted(fc.cases, key=lambda c: -c.weight)[:3]]))
    return rows


def evaluate_library(library: CaseLibrary | Sequence[CaseRecord] | str, *, rule: str | None = None,
                     prior: PriorLibrary | None | str = None, theory: TheoryModel | None = None,
                     only: Sequence[str] | None = None) -> LibraryScores:
    """Forecast each usable case from the cases ``rule`` allows and score every measure it has (module docstring).

    ``rule`` None: ``same_or_earlier`` for a library holding public runs, ``before_start`` for rltune's own.
    ``prior``: public runs behind GPU forecasts (``"shipped"``, None). Never give a library the prior it came from:
    its runs would forecast themselves. ``only``: score just these run ids (the rest still forecast them).
    """
    lib = library if isinstance(library, CaseLibrary) else (CaseLibrary(library) if isinstance(library, (str, Path)) else None)
    everything = lib.load() if lib is not None else list(library)
    cases = [c for c in everything if c.usable]
    prior = _resolve_prior(prior, cases)
    if rule is None:
        rule = "same_or_earlier" if any(c.public for c in cases) else "before_start"
    order = release_order(cases)
    left_out = [f"{c.run_id}: {c.excluded or c.status}" for c in everything if not c.usable]
    rows: list[ScoredForecast] = []
    for case in sorted(cases, key=lambda c: (c.started_at, c.run_id)):
        if only is not None and case.run_id not in only:
            continue
        if not measured_values(case):
            left_out.append(f"{case.run_id}: no measure to score (no published step, stage or throughput with its tokens)")
            continue
        history = allowed_history(case, cases, rule, order)
        if not any(case_step(c) is not None for c in history):
            left_out.append(f"{case.run_id}: no case to forecast it from under the rule {rule}")
            continue
        fc = forecast_prepared(prepare(history, theory, prior=prior), setup_from_case(case), case.run_id)
        rows.extend(_scored(case, fc, len(history)))
    return _library_scores(str(lib.path) if lib is not None else "", rule, prior is not None, len(cases), rows, left_out)


def _library_scores(library: str, rule: str, prior: bool, runs: int, rows: list[ScoredForecast], left_out: list[str]) -> LibraryScores:
    scores: dict[str, dict[str, Score]] = {}
    for source in sorted({r.source for r in rows}) + ["all"]:
        subset = [r for r in rows if source in ("all", r.source)]
        scores[source] = {m: Score.of([r for r in subset if r.measure == m]) for m in MEASURES if any(r.measure == m for r in subset)}
    return LibraryScores(library=library, rule=rule, prior=prior, runs=runs, evaluated=len({r.run_id for r in rows}), scores=scores,
                         left_out=left_out, rows=rows)


def plot(report: EvalReport, path: str | Path) -> Path:
    """Predicted against measured step time, with the +-10 % band; written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5.5, 5.0), dpi=120)
    values = [v for r in report.rows for v in (r.predicted_step_s, r.measured_step_s)] or [1.0]
    lo, hi = min(values) * 0.8, max(values) * 1.2
    xs = [lo, hi]
    ax.fill_between(xs, [x * (1 - BAND) for x in xs], [x * (1 + BAND) for x in xs], color="tab:blue", alpha=0.15, label="within 10 %")
    ax.plot(xs, xs, color="tab:blue", lw=1)
    markers = {"anchor": "o", "similar": "s", "theory": "^"}
    for method in sorted({r.method for r in report.rows}):
        rows = [r for r in report.rows if r.method == method]
        ax.errorbar([r.measured_step_s for r in rows], [r.predicted_step_s for r in rows],
                    yerr=[[r.predicted_step_s - r.low_s for r in rows], [r.high_s - r.predicted_step_s for r in rows]],
                    fmt=markers.get(method, "x"), ms=4, lw=0.6, alpha=0.8, label=f"{method} ({len(rows)})")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step (s)")
    ax.set_ylabel("predicted step (s)")
    mae = report.median_abs_error_pct
    ax.set_title(f"{report.evaluated} runs, median |error| {mae if mae is not None else float('nan'):.1f} %", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["EvalReport", "EvalRow", "LibraryScores", "RULES", "Score", "ScoredForecast", "allowed_history", "evaluate",
           "evaluate_library", "measured_values", "plot", "release_order"]
