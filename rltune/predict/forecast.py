"""Forecast a setup's stage and step times from the case library and the theory model (the seed's method).

Public API::

    forecast_candidates(job, candidates, library, baseline_knobs=None) -> Forecast   # ranked fastest first
    forecast_setup(job, knobs, cases) -> CandidateForecast
    prepare(cases) -> Prepared          # fit theory + effects once, then forecast many setups

Three methods, tried in order:

1. **anchor** -- a measured run of the same job (same identity and RL mode -- or another RL mode
   where a measured pair gives that mode change) with a similar setup.
   Its measured times are adjusted for each differing setting: by the change earlier runs of this
   job measured (:mod:`rltune.predict.effects`; its step ratio for an RL-mode change -- with a wide
   doubt on a CPU-only job when another job measured it -- or for a setting no term reads measured
   from this very setup, else its stage ratios, recombined by the RL-mode rule), else by theory
   (``theory(changed) / theory(case)``, priced by the prior coefficients where no case ran the new
   value -- but for coefficients a measured column of their own pinned) if a term reads that
   setting, else by another job's measured change, else by a measured
   elasticity of a numeric setting, else not at all -- the
   setting is then *uncertain* and its similarity weight is added to the anchor's uncertainty. An
   anchor whose uncertainty exceeds :data:`ANCHOR_UNCERTAINTY_BUDGET`, or that needs more than
   :data:`MAX_ANCHOR_ADJUSTMENTS` adjustments, is not used. A measured change of a setting that
   terms read moves only the stages those terms belong to (the rest of the pair's difference is
   run-to-run noise). An identical anchor gives its measured step unchanged; the qualified anchors
   are averaged with weights ``score / (1 + uncertainty)`` divided by the variance of each one's
   estimate (run-to-run noise, its own median's sampling error, its adjustments' spread).
2. **similar** -- the nearest cases (distance from :mod:`rltune.predict.setup`, score
   ``exp(-d/2)``, weights = scores / their sum); each case's stage time is scaled by
   ``theory(target) / theory(case)`` (and by measured effects for settings theory does not read),
   and the forecast is the weighted average.
3. **theory** -- no usable case: the (fitted or prior) theory model alone.

Stage times combine into a step with :func:`rltune.steps.combine` under the target's RL mode; the
step keeps each case's measured overhead beyond that rule (``step / combine(stages)``). The range
is ``step x exp(+-z sigma)``, where sigma adds run-to-run noise (from repeated setups) of the
target and of the anchors it comes from, each adjustment's spread, and the disagreement between
cases; it is widened or narrowed by how well
the ranges stored with earlier cases covered what was then measured.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rltune.contracts.forecast import FORECAST_SCHEMA_VERSION, CandidateForecast, CaseWeight, Forecast
from rltune.contracts.identity import check_same_job
from rltune.contracts.knowledge import moves_group
from rltune.predict.effects import EPS_S, KnobEffects, knob_effects
from rltune.predict.library import CaseLibrary, as_cases
from rltune.predict.setup import (
    Setup,
    differences,
    score,
    setting_weight,
    setup_from_case,
    setup_from_job,
)
from rltune.predict.theory import (
    STAGES,
    TRAINER_ONLY_WORKLOAD,
    TheoryModel,
    case_step,
    device_class,
    known_stages,
    median_error,
    modelled_settings,
    pinned_coefficients,
    stages_reading,
    with_pinned,
)
from rltune.steps import combine

if TYPE_CHECKING:
    from rltune.contracts.candidates import Candidates
    from rltune.contracts.cases import CaseRecord
    from rltune.contracts.job import JobSpec

ANCHOR_UNCERTAINTY_BUDGET = 0.5
MAX_ANCHOR_ADJUSTMENTS = 3
MAX_ANCHOR_DISTANCE = 3.0  # beyond this a case is not 'a similar setup' of the same job
MAX_ANCHOR_CANDIDATES = 12
MAX_SIMILAR_CASES = 8
MAX_SIMILAR_DISTANCE = 8.0
RANGE_Z = 1.645  # two-sided 90 % of a normal in log space, before calibration
PUBLIC_DISTANCE_PENALTY = 4.0  # what a public run's distance carries: another project's job, on its software
THEORY_ONLY_SIGMA = 0.5
MIN_CALIBRATION_FORECASTS = 8
RL_MODE_SHARED_DEVICE_SIGMA = 0.4
THEORY_SEEN_SHARE = 0.25  # sigma of a theory adjustment per unit of log step change it makes, fitted coefficients
THEORY_UNSEEN_SHARE = 0.6  # the same where no case ran the new value: the coefficients are priors


class _SettingMatrix:
    """Settings of every case as 2-D arrays, so one target's distance to 1,000 cases is a few numpy ops.

    ``codes[i, j]`` is case i's value of setting j as an integer code (-1: the case lacks it),
    ``logs[i, j]`` its log2 when it is a positive number (NaN otherwise). :meth:`distances`
    reproduces :func:`rltune.predict.setup.distance` for every case at once.
    """

    def __init__(self, setups: Sequence[Setup]):
        self.n = len(setups)
        all_settings = [s.settings() for s in setups]
        self.names = sorted({k for s in all_settings for k in s})
        self.column = {name: j for j, name in enumerate(self.names)}
        self.codes_of: list[dict[str, int]] = [{} for _ in self.names]
        self.first_value: list[Any] = [None] * len(self.names)
        codes = np.full((self.n, len(self.names)), -1, dtype=np.int32)
        logs = np.full((self.n, len(self.names)), np.nan)
        for i, settings in enumerate(all_settings):
            for name, value in settings.items():
                if value is None:
                    continue
                j = self.column[name]
                table = self.codes_of[j]
                text = repr(value)
                code = table.get(text)
                if code is None:
                    code = table[text] = len(table)
                    if self.first_value[j] is None:
                        self.first_value[j] = value
                codes[i, j] = code
                if _positive(value):
                    logs[i, j] = math.log2(value)
        self.codes, self.logs = codes, logs
        self.missing = codes < 0
        self.numeric = ~np.isnan(logs)
        identities: dict[tuple, int] = {}
        self.identity = [s.identity() + (s.rl_mode,) for s in setups]
        self.identity_code = np.asarray([identities.setdefault(k, len(identities)) for k in self.identity], dtype=np.int64)
        self.identity_codes = identities
        jobs: dict[tuple, int] = {}
        self.job_code = np.asarray([jobs.setdefault(s.identity(), len(jobs)) for s in setups], dtype=np.int64)
        self.job_codes = jobs
        self.rl_modes = np.asarray([s.rl_mode for s in setups], dtype=object)

    def distances(self, target: Setup) -> np.ndarray:
        m = len(self.names)
        if self.n == 0:
            return np.zeros(0)
        target_settings = target.settings()
        code = np.full(m, -3, dtype=np.int32)  # -3: the target lacks the setting; never equals a case code
        weight = np.empty(m)
        numeric_target = np.zeros(m, dtype=bool)
        target_log = np.zeros(m)
        absent_weight = np.empty(m)  # what a setting present on one side only adds
        for j, name in enumerate(self.names):
            value = target_settings.get(name)
            kind, w = setting_weight(name, value if value is not None else self.first_value[j])
            weight[j] = w
            absent_weight[j] = w if kind == "cat" else 2 * w
            if value is not None:
                code[j] = self.codes_of[j].get(repr(value), -2)
                if kind == "num" and _positive(value):
                    numeric_target[j] = True
                    target_log[j] = math.log2(value)
        equal = self.codes == code
        add = np.where(equal, 0.0, weight)
        with np.errstate(invalid="ignore"):
            graded = weight * np.abs(self.logs - target_log)
        add = np.where(numeric_target & self.numeric & ~equal, graded, add)
        present = code != -3
        add = np.where(present, add, absent_weight)  # the target lacks it, the case has it
        add = np.where(self.missing, np.where(present, absent_weight, 0.0), add)
        d = add.sum(axis=1)
        for name, value in target_settings.items():
            if name not in self.column and value is not None:
                kind, w = setting_weight(name, value)
                d += w if kind == "cat" else 2 * w
        return d

    def same_identity(self, target: Setup) -> np.ndarray:
        """Mask of the cases of the same job (identity and RL mode) as the target."""
        code = self.identity_codes.get(target.identity() + (target.rl_mode,), -1)
        return self.identity_code == code

    def same_job_other_mode(self, target: Setup) -> dict[str, np.ndarray]:
        """RL mode -> mask of the cases of the same job (identity) run in that other mode."""
        same_job = self.job_code == self.job_codes.get(target.identity(), -1)
        return {str(mode): same_job & (self.rl_modes == mode) for mode in set(self.rl_modes[same_job].tolist()) if mode != target.rl_mode}


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@dataclass
class Prepared:
    """The library made ready to forecast many setups: fitted theory, effects, arrays."""

    cases: list[CaseRecord]
    setups: list[Setup]
    theory: TheoryModel
    effects: KnobEffects
    case_theory: dict[str, np.ndarray]
    matrix: _SettingMatrix
    range_scale: float
    modelled: set[str]
    seen: set[tuple[str, str, str]] = field(default_factory=set)  # (device class, setting, repr(value)) some case ran
    # the model before the fit, its priors -- but for the coefficients a measured column of their own pinned (see
    # theory.pinned_coefficients): what prices a value no case ran
    prior_theory: TheoryModel = field(default_factory=TheoryModel)
    stages_reading: dict[str, set[str]] = field(default_factory=dict)  # modelled setting -> the stages whose terms read it
    # each case's stages and step as the forecast uses them: measured, and where a public run did not publish a stage,
    # the theory's split of its measured step (:func:`case_times`)
    stages: list[dict[str, float]] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    # the public runs that stand behind forecasts of GPU jobs this library has no runs of (see :func:`forecast_prepared`),
    # made ready with this library's theory and effects; None: no prior
    prior: Prepared | None = None
    _theory_memo: dict | None = None

    def has_seen(self, device: str, name: str, value: Any) -> bool:
        """Whether some case of this device class ran ``name`` at ``value``, so the fit saw its term there."""
        return (device_class(device), name, repr(value)) in self.seen

    def theory_stages(self, setup: Setup, *, prior: bool = False) -> dict[str, float]:
        """Theory seconds per stage of one setup, memoised (anchor search asks for the same ones often).

        ``prior``: with the coefficients before the fit (:attr:`prior_theory`).
        """
        memo = self._memo(prior)
        key = setup.key()
        if key not in memo:
            memo[key] = (self.prior_theory if prior else self.theory).stages(setup)
        return memo[key]

    def _memo(self, prior: bool) -> dict:
        if self._theory_memo is None:
            self._theory_memo = {}
        return self._theory_memo.setdefault(prior, {})

    def remember_theory(self, setups: Sequence[Setup]) -> None:
        """Compute the theory of many setups in one vectorised pass (the targets of a candidate list), fitted and prior."""
        for prior in (False, True):
            memo = self._memo(prior)
            todo = {}
            for setup in setups:
                key = setup.key()
                if key not in memo:
                    todo[key] = setup
            if todo:
                many = (self.prior_theory if prior else self.theory).stages_many(list(todo.values()))
                for i, key in enumerate(todo):
                    memo[key] = {stage: float(values[i]) for stage, values in many.items()}

    def theory_ratio(self, target: Setup, case: Setup, *, prior: bool = False) -> dict[str, float]:
        t, c = self.theory_stages(target, prior=prior), self.theory_stages(case, prior=prior)
        return {s: t[s] / c[s] if c[s] > 0 else 1.0 for s in STAGES}

    def prior_ratio(self, target: Setup, case: Setup) -> dict[str, float]:
        """theory(target) / theory(case) with the coefficients before the fit, for a value no case ran (see :func:`_adjust`)."""
        return self.theory_ratio(target, case, prior=True)


def prepare(cases: Sequence[CaseRecord], theory: TheoryModel | None = None, *, fit: bool = True,
            cache_dir: str | os.PathLike | None = None, prior: PriorLibrary | None = None) -> Prepared:
    """Fit the theory to the usable cases (unless ``fit`` is False) and learn knob effects.

    Both depend only on the library's cases, so they are learned once per library: kept in
    memory, and -- given ``cache_dir`` (the library directory) -- in ``_model.json`` there, keyed
    by a hash of the cases and of the code's cache format. Appending a case changes the key; the
    next forecast learns again.

    ``prior`` (:func:`shipped_prior`): public runs that stand behind this library: the similar runs
    of a GPU job this library has no runs near, scaled to it by the theory fitted to them
    (:func:`forecast_prepared`). The library's own fit never leans on them -- a small job's few runs
    would otherwise inherit coefficients that 512-GPU jobs set -- so its own runs take over the
    forecast as soon as they are near (anchors, and similar runs that outweigh the public ones).
    """
    ok = [c for c in cases if c.usable and case_step(c) is not None]
    base = theory or TheoryModel()
    model = base
    setups = [setup_from_case(c) for c in ok]
    if ok:
        model, effects = _learned(base, ok, setups, cache_dir, fit)
    else:
        effects = knob_effects(ok)
    prepared = _prepared(ok, setups, model, effects, base, fit)
    if prior is not None and prior.cases:
        prepared.prior = prior.prepared()
    return prepared


def _prepared(cases: list[CaseRecord], setups: list[Setup], model: TheoryModel, effects: KnobEffects, base: TheoryModel, fit: bool,
              pinned_from: list[CaseRecord] | None = None) -> Prepared:
    case_theory = model.stages_many(setups) if setups else {s: np.zeros(0) for s in STAGES}
    times = [case_times(c, {s: float(case_theory[s][i]) for s in STAGES}) for i, c in enumerate(cases)]
    pinned = pinned_coefficients(pinned_from if pinned_from is not None else cases)
    return Prepared(
        cases=cases, setups=setups, theory=model, effects=effects, case_theory=case_theory,
        matrix=_SettingMatrix(setups), range_scale=range_calibration(cases), modelled=modelled_settings(),
        seen={(device_class(s.device), name, repr(value)) for s in setups for name, value in s.settings().items()},
        prior_theory=with_pinned(base, model, pinned) if (pinned_from or cases) and (fit or pinned_from is not None) else base,
        stages_reading=stages_reading(), stages=[t[0] for t in times], steps=[t[1] for t in times],
    )


def case_times(case: CaseRecord, theory: dict[str, float]) -> tuple[dict[str, float], float]:
    """(stages, step) of a case as the forecast uses them.

    A run rltune recorded measured all of them. A public run may have published the step alone (or
    some stages): its unknown stages take the theory's split (``theory``, its stages under its own
    setup), scaled by one factor so that the RL-mode rule gives back the step it measured -- the
    measured step is kept, and a change that moves one stage moves it by as much as theory says.
    """
    known = known_stages(case)
    step = case_step(case)
    unknown = [s for s in STAGES if known[s] is None]
    if not unknown:
        stages = {s: float(known[s]) for s in STAGES}
        return stages, float(step if step is not None else combine(case.rl_mode, *(stages[s] for s in STAGES))[0])

    def filled(scale: float) -> dict[str, float]:
        return {s: float(known[s]) if known[s] is not None else max(theory[s], 0.0) * scale for s in STAGES}

    if step is None:
        stages = filled(1.0)
        return stages, combine(case.rl_mode, *(stages[s] for s in STAGES))[0]
    lo, hi = 1e-6, 1e6
    if combine(case.rl_mode, *filled(lo).values())[0] >= step:
        return filled(0.0), step  # the published stages alone make the step: the unknown ones are (nearly) nothing
    if combine(case.rl_mode, *filled(hi).values())[0] <= step:
        return filled(hi), step
    for _ in range(60):  # the rule grows with the scale: bisect in log space
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if combine(case.rl_mode, *filled(mid).values())[0] < step else (lo, mid)
    return filled(math.sqrt(lo * hi)), step


@dataclass
class PriorLibrary:
    """Public runs and the theory fitted to them: what stands behind a library's forecasts of GPU jobs."""

    cases: list[CaseRecord]
    setups: list[Setup]
    model: TheoryModel
    _prepared: Prepared | None = None

    @property
    def run_ids(self) -> set[str]:
        return {c.run_id for c in self.cases}

    def prepared(self) -> Prepared:
        """The public runs made ready once: their fitted theory, and the changes their pairs measured (releases)."""
        if self._prepared is None:
            self._prepared = _prepared(self.cases, self.setups, self.model, knob_effects(self.cases, setups=self.setups),
                                       TheoryModel(), fit=True)
        return self._prepared


_PRIORS: dict[str, PriorLibrary] = {}
PRIOR_CACHE_FORMAT = 1


def prior_library(cases: Sequence[CaseRecord], cache_dir: str | os.PathLike | None = None) -> PriorLibrary:
    """The prior made of ``cases`` (usable ones): their fitted theory, learned once per process (and kept in
    ``cache_dir``/_prior_model.json where given)."""
    usable = [c for c in cases if c.usable and case_step(c) is not None]
    h = hashlib.sha256(json.dumps([PRIOR_CACHE_FORMAT, MODEL_CACHE_FORMAT, sorted((c.run_id, c.measured) for c in usable)],
                                  sort_keys=True, default=str).encode()).hexdigest()
    if h not in _PRIORS:
        setups = [setup_from_case(c) for c in usable]
        model = _cached_prior_model(h, usable, setups, cache_dir)
        _PRIORS[h] = PriorLibrary(usable, setups, model)
    return _PRIORS[h]


def _cached_prior_model(key: str, cases: list[CaseRecord], setups: list[Setup], cache_dir: str | os.PathLike | None) -> TheoryModel:
    path = Path(cache_dir) / "_prior_model.json" if cache_dir is not None else None
    if path is not None and path.exists():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
            if stored.get("key") == key:
                return TheoryModel(stored["coefficients"], stored["fitted_on"], {})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged cache is only a slower forecast
    model = TheoryModel().fit(cases, setups=setups)
    if path is not None and path.parent.is_dir() and os.access(path.parent, os.W_OK):
        from rltune.contracts.schema import atomic_write_text

        atomic_write_text(path, json.dumps({"key": key, "coefficients": model.coefficients, "fitted_on": model.fitted_on}))
    return model


def shipped_prior(cache_dir: str | os.PathLike | None = None) -> PriorLibrary:
    """The public runs that install with rltune (:func:`rltune.predict.public.shipped_cases`) as a prior."""
    from rltune.predict.public import shipped_cases

    return prior_library(shipped_cases(), cache_dir)


_LEARNED_CACHE: dict[str, tuple[TheoryModel, KnobEffects]] = {}
_FIT_CACHE = _LEARNED_CACHE  # older name, still cleared by callers that want a cold start
MODEL_CACHE_NAME = "_model.json"
THEORY_CACHE_NAME = MODEL_CACHE_NAME
MODEL_CACHE_FORMAT = 10  # bump when the fit or the effects change meaning: old caches are then refit


def _learned_key(model: TheoryModel, cases: Sequence[CaseRecord], fit: bool) -> str:
    from rltune.predict.theory import TERMS

    h = hashlib.sha256()
    h.update(json.dumps([MODEL_CACHE_FORMAT, fit, model.coefficients, sorted((t.stage, t.name) for t in TERMS)], sort_keys=True).encode())
    # A run id is in the library at most once with one content, so id, finish time and medians identify a case.
    h.update(json.dumps(sorted([c.run_id, c.finished_at, c.measured] for c in cases), sort_keys=True).encode())
    return h.hexdigest()


def _learned(model: TheoryModel, cases: Sequence[CaseRecord], setups: Sequence[Setup], cache_dir: str | os.PathLike | None,
             fit: bool) -> tuple[TheoryModel, KnobEffects]:
    key = _learned_key(model, cases, fit)
    if key in _LEARNED_CACHE:
        return _LEARNED_CACHE[key]
    path = Path(cache_dir) / MODEL_CACHE_NAME if cache_dir is not None else None
    if path is not None and path.exists():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
            if stored.get("key") == key:
                learned = (TheoryModel(stored["coefficients"], stored["fitted_on"], stored.get("job_coefficients", {})),
                           KnobEffects.from_json(stored["effects"]))
                _LEARNED_CACHE[key] = learned
                return learned
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged cache is only a slower forecast: learn again below and overwrite it
    fitted = model.fit(cases, setups=setups) if fit else model
    learned = (fitted, knob_effects(cases, setups=setups))
    _LEARNED_CACHE[key] = learned
    if path is not None and os.access(path.parent, os.W_OK):
        from rltune.contracts.schema import atomic_write_text

        atomic_write_text(path, json.dumps({"format": MODEL_CACHE_FORMAT, "key": key, "coefficients": fitted.coefficients,
                                            "fitted_on": fitted.fitted_on, "job_coefficients": fitted.job_coefficients,
                                            "effects": learned[1].to_json()}))
    return learned


def range_calibration(cases: Sequence[CaseRecord]) -> float:
    """Factor on sigma so that the stored ranges of earlier forecasts would have covered 85 %."""
    ratios = []
    for c in cases:
        f = c.forecast or {}
        if f.get("step_s") and f.get("low_s") and f.get("high_s") and f["high_s"] > f["low_s"] > 0:
            half = math.log(f["high_s"] / f["low_s"]) / 2
            if half > 0:
                ratios.append(abs(math.log(c.step_s / f["step_s"])) / half)
    if len(ratios) < MIN_CALIBRATION_FORECASTS:
        return 1.0
    return float(min(max(np.quantile(ratios, 0.85), 0.75), 3.0))


@dataclass
class _Estimate:
    stages: dict[str, float]
    step: float
    sigma: float
    uncertain: list[str]
    weights: list[tuple[str, float, float]]  # run id, weight, distance


def _overhead(p: Prepared, index: int) -> float:
    """How the case's measured step relates to its stages combined by its RL mode."""
    stages = p.stages[index]
    combined, _ = combine(p.cases[index].rl_mode, stages["rollout"], stages["training"], stages["weight_sync"])
    return p.steps[index] / combined if combined > 0 else 1.0


def _adjust(p: Prepared, index: int, target: Setup, *, use_theory_for_all: bool,
            collect: list[Setup] | None = None) -> tuple[dict[str, float], float, float, list[str], float, int]:
    """Move case ``index`` to the target: (stages, step, sigma^2 of adjustments, uncertain, load, adjustments).

    With ``collect`` the setups whose theory the move needs are appended there and the theory is
    not evaluated (the result is then meaningless): the caller computes them all in one vectorised
    pass (:meth:`Prepared.remember_theory`) and calls again. Which setups are needed depends only
    on the settings and the measured effects, never on the times.
    """
    setup = p.setups[index]
    stages = dict(p.stages[index])
    step = p.steps[index]
    var = 0.0
    uncertain: list[str] = []
    load = 0.0
    diffs = differences(target, setup)
    identity = setup.identity()
    current = setup
    if use_theory_for_all:
        t = p.theory_stages(target)
        ratio = {s: t[s] / p.case_theory[s][index] if p.case_theory[s][index] > 0 else 1.0 for s in STAGES}
        before = combine(target.rl_mode, *(stages[s] for s in STAGES))[0]
        stages = {s: stages[s] * ratio[s] for s in STAGES}
        after = combine(target.rl_mode, *(stages[s] for s in STAGES))[0]
        step = step * (after / before if before > 0 else 1.0)
        var += sum((0.15 * math.log(max(r, 1e-9))) ** 2 for r in ratio.values()) / len(ratio)
    for name, (a, b) in diffs.items():
        effect = p.effects.lookup(name, a, b, identity)
        if use_theory_for_all and name in p.modelled:
            continue  # already scaled by theory(target) / theory(case)
        if effect is not None and not effect.same_job and name in p.modelled and target.workload != TRAINER_ONLY_WORKLOAD:
            # Another job's ratios carry that job's mix of work (a decode-bound math rollout against a
            # sandbox-bound tool-use one); the theory, fitted to both jobs' runs, already learned the
            # change in seconds and splits it by this job's own terms. A trainer benchmark has one stage,
            # so no mix: there another job's measured change is kept (the theory's term may miss the effect,
            # as LoRA's that prices the skipped weight gradients and not the adapters' own kernels).
            effect = None
        if effect is not None:
            before = combine(current.rl_mode, *(stages[s] for s in STAGES))[0]
            touched = p.stages_reading.get(name)
            for s in STAGES:
                # A stage no term of a modelled setting reads did not change in the pair but by run-to-run noise
                # (a faster transport cannot speed up the rollout before it): only the stages it touches move.
                if touched is None or s in touched:
                    stages[s] = (stages[s] + EPS_S) * math.exp(effect.log_ratio[s]) - EPS_S
            if name == "rl_mode" or (touched is None and current.key() in effect.contexts):
                # This setup measured the change on its step directly (a setting no term reads). An RL-mode change
                # is taken as a step ratio from any setup: the mode changes what the stage columns mean (overlapped
                # wall time). Another job's ratio says little of how much a CPU-only job's stages overlap: that
                # depends on its own mix of work (sandboxes that load every core leave the trainer none to overlap).
                step = (step + EPS_S) * math.exp(effect.log_ratio["step"]) - EPS_S
                if name == "rl_mode" and not effect.same_job and current.gpus == 0:
                    var += RL_MODE_SHARED_DEVICE_SIGMA ** 2
            else:
                # The stage ratios transfer; the step follows the stages as they weigh here (a micro-batch
                # change that was 30 % of a 0.7 s step is 10 % of a concurrency-starved 1.1 s one).
                after = combine(current.rl_mode, *(max(stages[s], 0.0) for s in STAGES))[0]
                step = step * (after / before if before > 0 else 1.0)
            var += effect.spread ** 2
            current = current.with_setting(name, b)
            continue
        if name in p.modelled and not use_theory_for_all:
            moved = current.with_setting(name, b)
            if collect is not None:
                collect += (moved, current)
                current = moved
                continue
            seen = p.has_seen(target.device, name, b)
            stages, before, after = _theory_move(p, moved, current, stages, seen, moved.rl_mode)
            step = step * (after / before if before > 0 else 1.0)
            # The doubt is in proportion to how far theory moves the step (a stage too small to matter may
            # move a lot); more where no case ever ran the new value, so its coefficients are only priors.
            moved_step = abs(math.log(after / before)) if before > 0 and after > 0 else 0.0
            share = THEORY_SEEN_SHARE if seen else THEORY_UNSEEN_SHARE
            var += (0.05 + share * moved_step) ** 2
            current = moved
            continue
        slope = p.effects.elasticity(name, identity) if _positive(a) and _positive(b) else None
        if slope is not None:
            span = math.log(float(b) / float(a))
            for s in STAGES:
                stages[s] = (stages[s] + EPS_S) * math.exp(slope[s] * span) - EPS_S
            step = (step + EPS_S) * math.exp(slope["step"] * span) - EPS_S
            var += (0.03 + 0.3 * abs(slope["step"] * span)) ** 2
            current = current.with_setting(name, b)
            continue
        if name == "rl_mode":  # the rule itself says how stages combine under another mode
            moved = current.with_setting(name, b)
            if collect is not None:
                collect += (moved, current)
                current = moved
                continue
            # The theory moves the stages the mode changes: the fitted overlap slowdowns, and in fully
            # async mode the rollout that runs ahead (several batches generated at once).
            stages, before, after = _theory_move(p, moved, current, stages, p.has_seen(target.device, name, b), str(a))
            step = step * (after / before if before > 0 else 1.0)
            # The rule assumes rollout and training overlap on separate devices; on a CPU-only job they
            # share the same cores, so how much they overlap is unknown until a pair measures it.
            var += (RL_MODE_SHARED_DEVICE_SIGMA if current.gpus == 0 else 0.1) ** 2
            current = current.with_setting(name, b)
            continue
        uncertain.append(name)
        kind, weight = setting_weight(name, a if a is not None else b)
        load += weight
        var += (0.1 * weight) ** 2
    stages = {s: max(v, 0.0) for s, v in stages.items()}
    return stages, max(step, 0.0), var, uncertain, load, len(diffs)


def _theory_move(p: Prepared, moved: Setup, current: Setup, stages: dict[str, float], seen: bool,
                 mode_before: str) -> tuple[dict[str, float], float, float]:
    """Stages scaled by theory(moved) / theory(current); (stages, step before, step after) by the RL-mode rule.

    A value no case ran (``seen`` false) left the coefficients that price it unidentified: the fit
    may have bent them to explain other runs (a micro-batch cost constant over the library trades
    freely with a fixed cost), so the change is priced by the physical priors instead.
    """
    ratio = p.theory_ratio(moved, current) if seen else p.prior_ratio(moved, current)
    before = combine(mode_before, *(stages[s] for s in STAGES))[0]
    stages = {s: stages[s] * ratio[s] for s in STAGES}
    return stages, before, combine(moved.rl_mode, *(stages[s] for s in STAGES))[0]


def _anchor(p: Prepared, target: Setup, distances: np.ndarray) -> _Estimate | None:
    allowed = p.matrix.same_identity(target)
    # A run of the same job in another RL mode may anchor only where a pair measured that mode change:
    # the rule alone cannot say how much the stages overlap (they share devices on a CPU).
    for mode, mask in p.matrix.same_job_other_mode(target).items():
        if p.effects.lookup("rl_mode", mode, target.rl_mode, target.identity()) is not None:
            allowed = allowed | mask
    near = np.flatnonzero((distances <= MAX_ANCHOR_DISTANCE) & allowed)
    same = [int(i) for i in near[np.argsort(distances[near], kind="stable")]][:MAX_ANCHOR_CANDIDATES]
    # The anchors used are the qualified ones with the fewest differing settings, so candidates are
    # adjusted group by group, fewest differences first, and the first group with a qualified one wins.
    by_count: dict[int, list[int]] = {}
    for i in same:
        by_count.setdefault(len(differences(target, p.setups[i])), []).append(i)
    chosen = []
    for count in sorted(by_count):
        needed: list[Setup] = []
        for i in by_count[count]:
            _adjust(p, i, target, use_theory_for_all=False, collect=needed)
        p.remember_theory(needed)
        for i in by_count[count]:
            stages, step, var, uncertain, load, n_adjust = _adjust(p, i, target, use_theory_for_all=False)
            if load <= ANCHOR_UNCERTAINTY_BUDGET and n_adjust - len(uncertain) <= MAX_ANCHOR_ADJUSTMENTS:
                chosen.append((n_adjust, load, float(distances[i]), i, stages, step, var, uncertain))
        if chosen:
            break
    if not chosen:
        return None
    noise = p.effects.noise_for(target.identity())
    # Each anchor's estimate of the target is as good as its own measurement (run-to-run noise plus the
    # sampling error of its median) and its adjustments: weigh by that precision as well as by similarity.
    scores = np.asarray([score(q[2]) / (1.0 + q[1]) / max(noise ** 2 + median_error(p.cases[q[3]]) ** 2 + q[6], 1e-8)
                         for q in chosen])
    weights = scores / scores.sum()
    stages = {s: float(sum(w * q[4][s] for w, q in zip(weights, chosen, strict=True))) for s in STAGES}
    step = float(sum(w * q[5] for w, q in zip(weights, chosen, strict=True)))
    var = float(sum(w * q[6] for w, q in zip(weights, chosen, strict=True))) / max(1.0, math.sqrt(len(chosen)))
    spread = _log_spread([q[5] for q in chosen], weights)
    # The target run will carry run-to-run noise, and so did the anchors it is forecast from: their measurement
    # error, averaged over them by precision, adds to the target's own (an identical single anchor: twice the variance).
    anchor_noise = 1.0 / sum(1.0 / max(noise ** 2 + median_error(p.cases[q[3]]) ** 2, 1e-8) for q in chosen)
    sigma = math.sqrt(noise ** 2 + anchor_noise + var + spread ** 2)
    uncertain = sorted({u for q in chosen for u in q[7]})
    return _Estimate(stages, step, sigma, uncertain, [(p.cases[q[3]].run_id, float(w), q[2]) for w, q in zip(weights, chosen, strict=True)])


def _similar(p: Prepared, target: Setup, distances: np.ndarray) -> _Estimate | None:
    """The nearest cases scaled to the target by theory, averaged by similarity (the seed's second method).

    For a GPU job the public runs of the prior (:attr:`Prepared.prior`) join them, their distance
    raised by :data:`PUBLIC_DISTANCE_PENALTY` (another project's job, on other software): where no run
    of this library is within :data:`MAX_SIMILAR_DISTANCE`, the nearest public runs make the forecast
    whatever their distance; where some are, a public run joins only if it is as near after the
    penalty, and the library's own runs outweigh it.
    """
    pool = [(p, int(i), float(distances[i])) for i in np.flatnonzero(distances <= MAX_SIMILAR_DISTANCE)]
    prior = p.prior if p.prior is not None and device_class(target.device) != "cpu" else None
    if prior is not None and prior.cases:
        public = prior.matrix.distances(target) + PUBLIC_DISTANCE_PENALTY
        reach = MAX_SIMILAR_DISTANCE if pool else math.inf
        pool += [(prior, int(i), float(public[i])) for i in np.flatnonzero(public <= reach)]
    pool.sort(key=lambda x: x[2])
    chosen = pool[:MAX_SIMILAR_CASES]
    if not chosen:
        return None
    scores = np.asarray([score(d) for _, _, d in chosen])
    # far public runs have scores that underflow: weigh them relative to the nearest
    scores = np.asarray([score(d - chosen[0][2]) for _, _, d in chosen]) if scores.sum() <= 1e-300 else scores
    weights = scores / scores.sum()
    scaled = []
    for q, i, _ in chosen:
        stages, step, var, uncertain, _load, _n = _adjust(q, i, target, use_theory_for_all=True)
        scaled.append((stages, step, var, uncertain))
    stages = {s: float(sum(w * x[0][s] for w, x in zip(weights, scaled, strict=True))) for s in STAGES}
    combined = combine(target.rl_mode, stages["rollout"], stages["training"], stages["weight_sync"])[0]
    overhead = float(sum(w * _overhead(q, i) for w, (q, i, _) in zip(weights, chosen, strict=True)))
    step = combined * overhead
    spread = _log_spread([x[1] for x in scaled], weights)
    var = float(sum(w * x[2] for w, x in zip(weights, scaled, strict=True)))
    nearest = chosen[0][2]
    sigma = math.sqrt(p.effects.noise_for(target.identity()) ** 2 + spread ** 2 + var + (0.05 + 0.04 * nearest) ** 2)
    uncertain = sorted({u for w, x in zip(weights, scaled, strict=True) if w >= 0.1 for u in x[3]})
    return _Estimate(stages, step, sigma, uncertain, [(q.cases[i].run_id, float(w), d) for w, (q, i, d) in zip(weights, chosen, strict=True)])


def _log_spread(values: Sequence[float], weights: np.ndarray) -> float:
    logs = np.log(np.maximum(np.asarray(values, dtype=float), EPS_S))
    centre = float(np.dot(weights, logs))
    return float(math.sqrt(max(float(np.dot(weights, (logs - centre) ** 2)), 0.0)))


def forecast_prepared(p: Prepared, target: Setup, candidate: str = "baseline", overrides: dict[str, Any] | None = None) -> CandidateForecast:
    """Forecast one setup against a prepared library."""
    method = "theory"
    estimate = None
    if p.cases or p.prior is not None:
        distances = p.matrix.distances(target) if p.cases else np.zeros(0)
        estimate = _anchor(p, target, distances) if p.cases else None
        method = "anchor"
        if estimate is None:
            estimate = _similar(p, target, distances)
            method = "similar"
    if estimate is None:
        method = "theory"
        stages = p.theory.stages(target)
        step = combine(target.rl_mode, stages["rollout"], stages["training"], stages["weight_sync"])[0]
        estimate = _Estimate(stages, step, THEORY_ONLY_SIGMA, [], [])
    _, limiting = combine(target.rl_mode, estimate.stages["rollout"], estimate.stages["training"], estimate.stages["weight_sync"])
    half = RANGE_Z * estimate.sigma * p.range_scale
    return CandidateForecast(
        candidate=candidate, overrides=dict(overrides or {}),
        stages_s={s: round(v, 6) for s, v in estimate.stages.items()}, step_s=round(estimate.step, 6),
        range_s=[round(estimate.step * math.exp(-half), 6), round(estimate.step * math.exp(half), 6)],
        limiting_stage=limiting, method=method, rl_mode=target.rl_mode,
        cases=[CaseWeight(run_id=r, weight=round(w, 6), distance=round(d, 6)) for r, w, d in estimate.weights],
        uncertain=estimate.uncertain,
    )


def resolve_prior(prior: PriorLibrary | None | str, device: str, cache_dir: str | os.PathLike | None = None) -> PriorLibrary | None:
    """``"shipped"`` -> the public runs rltune ships, but only for a job on GPUs (they say nothing of a CPU job, and a
    CPU forecast never pays for reading them); a PriorLibrary or None as given."""
    if prior == "shipped":
        return shipped_prior(cache_dir) if device_class(device) != "cpu" else None
    if isinstance(prior, str):
        raise ValueError(f"prior must be a PriorLibrary, None or 'shipped', found {prior!r}")
    return prior


def _library_dir(library: Any) -> Path | None:
    return library.path if isinstance(library, CaseLibrary) and library.path.is_dir() else None


def forecast_setup(job: JobSpec, knobs: dict[str, Any], cases: CaseLibrary | Sequence[CaseRecord] | Prepared,
                   *, theory: TheoryModel | None = None, candidate: str = "baseline",
                   prior: PriorLibrary | None | str = "shipped") -> CandidateForecast:
    """Forecast ``job`` run with ``knobs`` (merged over the job's baseline knobs).

    ``prior``: the public runs behind a GPU job's forecasts (see :func:`prepare`); ``"shipped"`` (default): those
    that install with rltune, None: none.
    """
    p = cases if isinstance(cases, Prepared) else prepare(
        as_cases(cases if isinstance(cases, CaseLibrary) else list(cases)), theory, cache_dir=_library_dir(cases),
        prior=resolve_prior(prior, job.gpus.device, _library_dir(cases)))
    overrides = {k: v for k, v in knobs.items() if job.knobs.get(k) != v}
    return forecast_prepared(p, setup_from_job(job, knobs), candidate, overrides)


def forecast_candidates(job: JobSpec, candidates: Candidates, library: CaseLibrary | Sequence[CaseRecord] | Prepared,
                        baseline_knobs: dict[str, Any] | None = None, *, theory: TheoryModel | None = None,
                        job_path: str = "", candidates_file: str = "", library_path: str = "",
                        prior: PriorLibrary | None | str = "shipped") -> Forecast:
    """Forecast every candidate and the baseline beside them; rank them in the order to try them.

    Gains are against the baseline as the same library forecasts it -- which, when the library
    holds the baseline's own run (as ``auto`` and ``predict`` make sure), is its measured step.
    Candidates composed for another job are refused (``candidates_file`` names them in the message).
    A GPU job's forecasts lean on the public runs rltune ships where the library has no runs near
    (``prior``, see :func:`prepare`); each forecast names the runs it used, public ones by their
    ``public/...`` run ids.
    """
    check_same_job(candidates_file or "candidates", candidates.job_name, job)
    p = library if isinstance(library, Prepared) else prepare(
        as_cases(library if isinstance(library, CaseLibrary) else list(library)), theory, cache_dir=_library_dir(library),
        prior=resolve_prior(prior, job.gpus.device, _library_dir(library)))
    base_knobs = {**job.knobs, **(baseline_knobs if baseline_knobs is not None else candidates.baseline_knobs)}
    base_setup = setup_from_job(job, base_knobs)
    targets = [setup_from_job(job, {**base_knobs, **cand.overrides}) for cand in candidates.candidates]
    p.remember_theory([base_setup, *targets])
    baseline = forecast_prepared(p, base_setup, "baseline", {})
    gate = job.limits.min_forecast_gain_pct
    forecasts = [finish(forecast_prepared(p, target, cand.id, cand.overrides), baseline, gate, candidates.limiting_stage,
                        aimed=moves_group(cand.moves, candidates.limiting_stage))
                 for cand, target in zip(candidates.candidates, targets, strict=True)]
    forecasts.sort(key=rank_key)
    measured = bool(baseline.cases) and all(c.distance == 0 for c in baseline.cases)
    return Forecast(schema_version=FORECAST_SCHEMA_VERSION, job=job_path or job.name, candidates_file=candidates_file,
                    library=library_path or str(getattr(library, "path", "")), baseline_step_s=baseline.step_s,
                    baseline_run=candidates.baseline_run, baseline_method="measured" if measured else baseline.method,
                    baseline_stages_s=dict(baseline.stages_s), limiting_stage=candidates.limiting_stage, gate_pct=gate,
                    forecasts=forecasts, job_name=job.name)


def group_seconds(fc: CandidateForecast, group: str) -> float | None:
    """Forecast seconds of a step-time group ('rollout', 'training', 'training+weight_sync', ...)."""
    parts = [fc.stages_s.get(name) for name in group.split("+")]
    return None if any(v is None for v in parts) else float(sum(parts))


def finish(fc: CandidateForecast, baseline: CandidateForecast | float, min_gain_pct: float,
           limiting_stage: str = "", *, aimed: bool = False) -> CandidateForecast:
    """Set the gains against the baseline and whether (and why) the candidate is worth a trial.

    Worth a trial: the point forecast reaches the gate ('point'); or only the optimistic end of
    its range does, and it relieves the stage that limits the baseline (that group's forecast
    seconds drop) or its point forecast is still faster ('range'). A change the forecast cannot
    estimate (a setting of the candidate's own in ``uncertain``) leaves its stages where they were,
    so there the knowledge base decides: ``aimed`` (the candidate's fixes move the limiting stage)
    counts as relieving it -- the tuner explores what it cannot forecast rather than stopping.
    """
    base_step = baseline if isinstance(baseline, (int, float)) else baseline.step_s
    fc.gain_pct = round(100.0 * (base_step - fc.step_s) / base_step, 4) if base_step > 0 else 0.0
    fc.optimistic_gain_pct = round(100.0 * (base_step - fc.range_s[0]) / base_step, 4) if base_step > 0 else 0.0
    fc.thin_evidence = fc.method != "anchor" or bool(fc.uncertain)
    relieves = fc.gain_pct > 0
    if not relieves and limiting_stage and not isinstance(baseline, (int, float)):
        ours, theirs = group_seconds(fc, limiting_stage), group_seconds(baseline, limiting_stage)
        relieves = ours is not None and theirs is not None and ours < theirs
    if not relieves and aimed:
        relieves = bool(set(fc.uncertain) & set(fc.overrides))
    fc.worth = "point" if fc.gain_pct >= min_gain_pct else "range" if fc.optimistic_gain_pct >= min_gain_pct and relieves else ""
    fc.worth_trial = bool(fc.worth)
    return fc


def rank_key(fc: CandidateForecast) -> tuple:
    """Order of trial: worth a trial first, by the optimistic end when the evidence is thin, else by the point."""
    if fc.worth_trial:
        return (0, fc.range_s[0] if fc.thin_evidence else fc.step_s, fc.step_s, fc.candidate)
    return (1, fc.step_s, fc.step_s, fc.candidate)


__all__ = ["ANCHOR_UNCERTAINTY_BUDGET", "Prepared", "PriorLibrary", "case_times", "finish", "prior_library", "resolve_prior",
           "shipped_prior", "forecast_candidates", "forecast_prepared", "forecast_setup",
           "group_seconds", "prepare", "range_calibration", "rank_key"]
