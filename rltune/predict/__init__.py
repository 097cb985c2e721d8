"""Forecast a candidate setup's stage and step times before any GPU is spent.

Ingredients: the case library (:mod:`rltune.predict.library`, every real run's setup, measured
stage medians and pre-run forecast) and the theory model (:mod:`rltune.predict.theory`, one
formula per stage, coefficients fitted to the library). :mod:`rltune.predict.forecast` combines
them as the seed does -- anchor, else similar runs, else theory -- and
:mod:`rltune.predict.evaluate` measures how good that is, retrospectively.

Public API (stable names others call):

- ``CaseLibrary(path)``: ``.append(record)``, ``.load(before=None)``, ``.has(run_id)``
- ``case_from_run(job, knobs, table, run_id, started_at, finished_at, status, forecast, warmup_steps)``
- ``forecast_candidates(job, candidates, library, baseline_knobs=None) -> Forecast``
- ``forecast_setup(job, knobs, cases) -> CandidateForecast``
- ``evaluate(library) -> EvalReport`` and ``plot(report, path)``
- ``TheoryModel``, ``register_term``, ``knob_effects``
"""

from rltune.predict.effects import knob_effects
from rltune.predict.evaluate import EvalReport, evaluate, plot
from rltune.predict.forecast import forecast_candidates, forecast_setup, prepare
from rltune.predict.library import CaseLibrary, case_from_run
from rltune.predict.theory import TheoryModel, register_term

__all__ = ["CaseLibrary", "EvalReport", "TheoryModel", "case_from_run", "evaluate", "forecast_candidates", "forecast_setup",
           "knob_effects", "plot", "prepare", "register_term"]
