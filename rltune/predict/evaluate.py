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
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.predict.effects import knob_effects
from rltune.predict.forecast import forecast_prepared, prepare
from rltune.predict.library import CaseLibrary, as_cases
from rltune.predict.setup import setup_from_case
from rltune.predict.theory import measured_stages

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, Any]:
        out = self.to_dict()
        out.pop("rows")
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


def evaluate(library: CaseLibrary | Sequence[CaseRecord] | str, *, theory: TheoryModel | None = None) -> EvalReport:
    """Forecast each run from the runs finished before it started; see the module docstring."""
    lib = library if isinstance(library, CaseLibrary) else (CaseLibrary(library) if isinstance(library, (str, Path)) else None)
    cases = as_cases(lib if lib is not None else list(library))
    cases = sorted(cases, key=lambda c: (c.started_at, c.run_id))
    rows: list[EvalRow] = []
    without: list[str] = []
    for case in cases:
        history = [c for c in cases if c.finished_at <= case.started_at and c.run_id != case.run_id]
        if not history:
            without.append(case.run_id)
            continue
        fc = forecast_prepared(prepare(history, theory), setup_from_case(case), case.run_id)
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
    )


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


__all__ = ["EvalReport", "EvalRow", "evaluate", "plot"]
