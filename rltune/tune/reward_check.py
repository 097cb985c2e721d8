"""Reward parity: does the tuned setup learn like the untuned one over a long run?

A kept change is faster beyond noise and within the numerical limits over a 10-step trial; that
does not show it learns as well. The reward check runs both setups for many steps on the same task
order and seeds and compares their reward curves against the untuned setup's own seed-to-seed
spread. The rule is fixed before any run:

1. Every run's per-step reward is smoothed with a trailing moving average of ``W`` steps, full
   windows only (values at steps W-1 .. N-1).
2. The untuned setup runs with K >= 2 seeds. At each step t its seeds' moving averages have a
   mean c(t), the band's centre, and a sample standard deviation s(t). The seed spread is
   ``seed_sd = sqrt(mean_t s(t)^2)``, pooled over the steps because K is small (two seeds give one
   degree of freedom per step; one step of two seeds that happen to cross would give a band of 0).
3. Two seeds can also agree by chance over a whole run: on the learning tiny math job two seeds'
   moving averages (30 steps) stayed within 0.0016 of each other while a third ran 0.02 ahead for
   50 steps. So the spread used is never less than what one run's moving average moves from its
   own step-to-step noise: ``step_noise_sd = s / sqrt(W)`` with ``s^2`` half the mean squared
   step-to-step difference of a run's rewards (RMS over the seeds), and ``sd = max(seed_sd,
   step_noise_sd)``.
4. The band's half-width is ``h = z x sd x sqrt(1 + 1/K)``: the standard deviation of one more
   untuned run around the mean of K of them is sd x sqrt(1 + 1/K), and z = 3 leaves a run of the
   untuned setup outside at a given step about 3 times in 1000 -- over the ~N/W nearly independent
   windows of a run, a few per cent of neutral changes, against every one that moves the curve by
   more than the seeds do.
5. The tuned setup (the first seed) passes when its moving average stays within c(t) +- h at every
   step (``within_band``: two-sided, since learning *differently* is what the check looks for) and
   its final-window mean is not below the untuned final-window mean by more than h
   (``final_window``: the number a user adopting the setup reads; (1) covers it at the last step,
   it is reported on its own line).

Every run goes through the *untuned* job's launch (command, workload file, fixed overrides) with
knobs as overrides -- the tuned one with the knobs the tuned job sets differently -- so the runs
differ only in knobs. The job must map a ``seed`` knob (the run's seed: sampling; seed, seed + 1,
... for the untuned runs) and a ``task_seed`` knob (held at the job's value in every run, so all
runs see the same tasks in the same order); :func:`plan_reward_check` refuses a job without them.
The model's initial weights are not a seed here: a real job starts from the same checkpoint
whatever its seed, so the reference workload's presets leave ``model.seed`` fixed.

A failing check is attributed: the tuned setup runs again with each kept change undone in turn (as
the auto journal lists them, else one knob at a time); a change whose undoing makes it pass is
blamed, and a blamed change of several knobs (a bundle kept in one trial) is undone one knob at a
time to say which of them it is. Runs write stages.parquet (reward, gap and sample age per step) into their directories;
``reward_check.yaml`` (:mod:`rltune.contracts.reward_check`) holds the band and the verdict. A run
directory that already holds a finished run of the same knobs and steps is reused, so a check
interrupted by a kill goes on where it stopped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.contracts.job import JobSpec, KnobValue, load_job
from rltune.contracts.outputs import safe_name
from rltune.contracts.reward_check import (
    REWARD_CHECK_NAME,
    REWARD_CHECK_SCHEMA_VERSION,
    RevertedChange,
    RewardBand,
    RewardCheck,
    RewardRule,
    RewardRun,
    load_reward_check,
    save_reward_check,
)
from rltune.errors import RltuneError

if TYPE_CHECKING:
    from rltune.contracts.journal import RewardCheckEvent
    from rltune.tune.journal import JournalState

SEED_KNOB, TASK_SEED_KNOB = "seed", "task_seed"
SEED_KNOBS = (SEED_KNOB, TASK_SEED_KNOB)
BAND_Z = 3.0
MIN_SEEDS = 2
# Exit codes, as 'rltune trial': 0 pass, 3 fail, 4 a job failed; 2 is bad input.
EXIT_PASS, EXIT_FAIL, EXIT_JOB_FAILED = 0, 3, 4
RULE = ("tuned moving average (trailing, {W} steps) within untuned centre +- h at every step, and tuned "
        "final-window mean >= untuned final-window mean - h; h = {z:g} x sd x sqrt(1 + 1/K), sd = the larger of "
        "the RMS over steps of the per-step sd of the K = {K} untuned seeds' moving averages and the moving "
        "average's own step-noise sd (RMS step-to-step difference / sqrt(2 W))")


class RewardCheckInputError(RltuneError):
    """The reward check cannot be planned: a job without seed knobs, a window too long for the steps, ..."""


# -- the rule (pure functions of reward lists) -----------------------------------------------------

def default_window(steps: int) -> int:
    """The window when none is given: a tenth of the run, at least 2 steps."""
    return max(2, steps // 10)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean of ``window`` values, full windows only: element i covers values i .. i+window-1."""
    if window < 1 or len(values) < window:
        return []
    out, total = [], sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out


@dataclass
class Band:
    """The untuned seeds' band: centre per full-window step, the two spreads, the sd used and the half-width."""

    centre: list[float]
    seed_sd: float
    step_noise_sd: float
    half_width: float
    window: int
    seeds: int
    z: float

    @property
    def first_step(self) -> int:
        return self.window - 1

    @property
    def sd(self) -> float:
        return max(self.seed_sd, self.step_noise_sd)


def step_noise_sd(rewards: Sequence[float], window: int) -> float:
    """How much one run's moving average moves from its own step-to-step noise: s / sqrt(window), where
    s^2 = mean of squared step-to-step differences / 2 (a step's variance, were steps independent)."""
    diffs = [b - a for a, b in zip(rewards, rewards[1:], strict=False)]
    if not diffs:
        return 0.0
    return math.sqrt(sum(d * d for d in diffs) / len(diffs) / 2.0) / math.sqrt(window)


def seed_band(untuned_rewards: Sequence[Sequence[float]], window: int, z: float = BAND_Z) -> Band:
    """The band of K >= 2 untuned runs' per-step rewards (equal lengths): see the module docstring."""
    if len(untuned_rewards) < MIN_SEEDS:
        raise ValueError(f"a band needs at least {MIN_SEEDS} untuned runs, got {len(untuned_rewards)}")
    curves = [moving_average(r, window) for r in untuned_rewards]
    length = min(len(c) for c in curves)
    if length == 0:
        raise ValueError(f"runs of {min(len(r) for r in untuned_rewards)} steps hold no full window of {window}")
    k = len(curves)
    centre, variances = [], []
    for t in range(length):
        column = [c[t] for c in curves]
        mean = sum(column) / k
        centre.append(mean)
        variances.append(sum((x - mean) ** 2 for x in column) / (k - 1))
    seed_sd = math.sqrt(sum(variances) / length)
    noise_sd = math.sqrt(sum(step_noise_sd(r, window) ** 2 for r in untuned_rewards) / k)
    return Band(centre, seed_sd, noise_sd, z * max(seed_sd, noise_sd) * math.sqrt(1.0 + 1.0 / k), window, k, z)


@dataclass
class CurveJudgement:
    """How one run's curve compares with the band."""

    max_deviation: float
    max_deviation_step: int
    final_delta: float
    rules: list[RewardRule]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rules)


def judge_curve(rewards: Sequence[float], band: Band) -> CurveJudgement:
    """Both parts of the rule for one run's per-step rewards (as long as the untuned runs')."""
    curve = moving_average(rewards, band.window)
    if len(curve) < len(band.centre):
        raise ValueError(f"the run has {len(rewards)} steps; the band covers {len(band.centre) + band.window - 1}")
    deviations = [curve[t] - band.centre[t] for t in range(len(band.centre))]
    worst = max(range(len(deviations)), key=lambda t: abs(deviations[t]))
    max_dev = abs(deviations[worst])
    final_delta = deviations[-1]
    h = band.half_width
    side = "above" if deviations[worst] > 0 else "below"
    rules = [
        RewardRule(name="within_band", value=max_dev, threshold=h, passed=max_dev <= h,
                   detail=f"largest |moving average - untuned centre| {max_dev:.4g} at step {worst + band.first_step} "
                          f"({side} the centre), half-width {h:.4g}"),
        RewardRule(name="final_window", value=final_delta, threshold=-h, passed=final_delta >= -h,
                   detail=f"final-window mean {curve[len(band.centre) - 1]:.4g} vs untuned {band.centre[-1]:.4g}: "
                          f"{final_delta:+.4g}, may not be below -{h:.4g}"),
    ]
    return CurveJudgement(max_dev, worst + band.first_step, final_delta, rules)


# -- planning --------------------------------------------------------------------------------------

@dataclass
class RewardCheckPlan:
    """What a check runs: the untuned job every run goes through, the step count, seeds and window."""

    against: Path
    job: JobSpec
    steps: int
    seeds: list[int]
    window: int
    z: float = BAND_Z

    def seed_overrides(self, seed: int) -> dict[str, KnobValue]:
        return {SEED_KNOB: seed}

    def setup_of(self, knobs: dict[str, KnobValue]) -> dict[str, KnobValue]:
        """The knobs of ``knobs`` that differ from the untuned job's, seed knobs left out (the check sets those)."""
        return {k: v for k, v in knobs.items() if k not in SEED_KNOBS and self.job.knobs.get(k) != v}

    def check_mapped(self, knobs: dict[str, KnobValue], source: str) -> None:
        """Refuse knobs that ``source`` sets differently from the untuned job and its knob_map cannot pass."""
        self.require_mapped(self.setup_of(knobs), source)

    def require_mapped(self, names, source: str) -> None:
        unmapped = sorted(k for k in names if k not in SEED_KNOBS and k not in self.job.launch.knob_map)
        if unmapped:
            raise RewardCheckInputError(
                f"{self.against}: launch.knob_map: no entry for {', '.join(map(repr, unmapped))}, which {source} "
                f"sets; every run goes through this job's launch, so map them under launch.knob_map")


def plan_reward_check(against: str | Path, steps: int, seeds: int = MIN_SEEDS, window: int | None = None,
                      z: float = BAND_Z) -> RewardCheckPlan:
    """Check the inputs before anything runs; raise :class:`RewardCheckInputError` naming the file or option."""
    against = Path(against)
    job = load_job(against)
    window = default_window(steps) if window is None else window
    if window < 1:
        raise RewardCheckInputError(f"--window: {window}; give a window of at least 1 step")
    if steps < 2 * window:
        raise RewardCheckInputError(f"--steps: {steps} is too few for a {window}-step window; the first and final "
                                    f"windows must not overlap: give --steps >= {2 * window} or a smaller --window")
    if seeds < MIN_SEEDS:
        raise RewardCheckInputError(f"--seeds: {seeds}; the band is the untuned setup's seed-to-seed spread and "
                                    f"needs at least {MIN_SEEDS} seeds")
    for knob, what in ((SEED_KNOB, "the run's seed (sampling; the check gives each untuned run its own)"),
                       (TASK_SEED_KNOB, "the task order (held fixed, so every run sees the same tasks in the same order)")):
        if knob not in job.launch.knob_map:
            raise RewardCheckInputError(
                f"{against}: knobs.{knob}: the reward check needs a '{knob}' knob for {what}; add '{knob}: 0' under "
                f"knobs and '{knob}: <the job's config key>' under launch.knob_map (the reference workload: "
                f"seed: orchestrator.seed, task_seed: env.seed)")
    base = job.knobs[SEED_KNOB]
    if isinstance(base, bool) or not isinstance(base, int):
        raise RewardCheckInputError(f"{against}: knobs.seed: expected an integer, found {base!r}")
    if not job.launch.steps_override:
        raise RewardCheckInputError(f"{against}: launch.steps_override: not set; the check runs {steps} steps and "
                                    f"needs the job's override key for the step count")
    return RewardCheckPlan(against, job, steps, [base + i for i in range(seeds)], window, z)


# -- running ---------------------------------------------------------------------------------------

@dataclass
class KeptChange:
    """One kept change as the check can undo it: a label and the knob values from before it."""

    label: str
    reverted: dict[str, KnobValue]


def exit_code_of(decision: str) -> int:
    """0 pass, 3 fail, 4 a job failed (as 'rltune trial')."""
    return {"pass": EXIT_PASS, "fail": EXIT_FAIL}.get(decision, EXIT_JOB_FAILED)


@dataclass
class RewardCheckOutcome:
    check: RewardCheck
    path: Path

    @property
    def exit_code(self) -> int:
        return exit_code_of(self.check.decision)


@dataclass
class _Run:
    summary: RewardRun
    rewards: list[float] = field(default_factory=list)
    carried: int = 0  # steps that carry the reward of the batch they train (see _rewards)


def _long_run_job(job: JobSpec, steps: int) -> JobSpec:
    """The job with its time-out scaled to ``steps``: launch.timeout_s is for a run of limits.steps steps."""
    import copy

    out = copy.deepcopy(job)
    out.launch.timeout_s = job.launch.timeout_s * max(1.0, steps / max(1, job.limits.steps))
    return out


def _finished_rows(run_dir: Path, knobs: dict[str, KnobValue], steps: int) -> list[dict] | None:
    """The rows of a finished run of exactly these knobs and steps in ``run_dir``, else None."""
    from rltune.contracts.rundir import RunDir

    run = RunDir(run_dir)
    if not run.finished_ok():
        return None
    try:
        ran = run.job()
        rows = run.rows()
    except RltuneError:
        return None
    if ran.knobs != knobs or ran.limits.steps != steps:
        return None
    return rows


def _rewards(rows: list[dict], steps: int) -> tuple[list[float], list[int], int]:
    """Per-step rewards of the run's ``steps`` steps, the steps that have none, and how many were carried.

    Steps are taken in the order the run numbers them, from its first (TRL counts from 1, the
    reference workload from 0). A step that reports no reward of its own after one that did trains
    on the batch that step generated -- batch reuse and multi-step generation log a reward only when
    they generate -- so it carries that batch's reward; a run whose first step has none is missing it.
    """
    from rltune.profile.stats import number

    by_step = {int(r["step"]): number(r.get("reward")) for r in rows}
    first = min(by_step, default=0)
    out, missing, carried, last = [], [], 0, None
    for step in range(first, first + steps):
        value = by_step.get(step)
        if value is None and step in by_step and last is not None:
            value, carried = last, carried + 1
        if value is None:
            missing.append(step)
        out.append(0.0 if value is None else value)
        last = value if value is not None else last
    return out, missing, carried


def _summary(run_id: str, role: str, seed: int, run_dir: Path, rel: str, overrides: dict, status: str, rows: list[dict],
             rewards: list[float], window: int, error: str = "") -> RewardRun:
    from rltune.profile.stats import mean_over, number

    def all_values(column: str) -> list[float]:  # every step, warm-up included: learning starts at step 0
        return [v for r in rows for v in [number(r.get(column))] if v is not None]

    def over_all(column: str) -> float | None:
        values = all_values(column)
        return sum(values) / len(values) if values else None

    return RewardRun(run_id=run_id, role=role, seed=seed, run_dir=rel, status=status, overrides=dict(overrides),
                     steps=len(rewards), error=error,
                     first_window_mean=sum(rewards[:window]) / window if len(rewards) >= window else None,
                     final_window_mean=sum(rewards[-window:]) / window if len(rewards) >= window else None,
                     gap_mean=over_all("gap"), sample_age_mean=over_all("sample_age_mean"),
                     sample_age_max=max(all_values("sample_age_max"), default=None),
                     step_s_mean=mean_over(rows, "step_s"))


class _Runner:
    """Runs (or reuses) one N-step run of the untuned job with some knob overrides."""

    def __init__(self, plan: RewardCheckPlan, out_dir: Path, on_run: Callable[[str, str, str], None] | None,
                 on_output: Callable[[str], None] | None):
        self.plan, self.out_dir = plan, out_dir
        self.job = _long_run_job(plan.job, plan.steps)
        self.on_run = on_run or (lambda run_id, state, detail: None)
        self.on_output = on_output

    def run(self, run_id: str, role: str, seed: int, setup: dict[str, KnobValue]) -> _Run:
        from rltune.launch.job import run_knobs
        from rltune.tune.trial import measure_run

        overrides = {**setup, **self.plan.seed_overrides(seed)}
        run_dir = self.out_dir / "runs" / run_id
        rel = str(Path("runs") / run_id)
        knobs = run_knobs(self.job, overrides)
        rows = _finished_rows(run_dir, knobs, self.plan.steps)
        if rows is not None:
            self.on_run(run_id, "reused", "")
            status, error = "ok", ""
        else:
            self.on_run(run_id, "start", f"{self.plan.steps} steps, seed {seed}")
            recorded = measure_run(self.job, self.plan.against, run_dir, run_id, overrides, self.plan.steps,
                                   self.on_output)
            rows = recorded.rows
            status = recorded.status if recorded.status in ("ok", "failed", "timed_out") else "failed"
            error = "" if recorded.ok else f"{recorded.error}\n{recorded.log_tail}".strip()
        rewards, missing, carried = _rewards(rows, self.plan.steps)
        if status == "ok" and missing:
            status = "failed"
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            error = (f"no reward at step(s) {shown} of {self.plan.steps}; the check needs the job's metrics to "
                     f"report a reward every step")
        summary = _summary(run_id, role, seed, run_dir, rel, overrides, status, rows, rewards, self.plan.window, error)
        self.on_run(run_id, "done", status)
        return _Run(summary, rewards if status == "ok" else [], carried)


def _failed_check(common: dict, runs: list[RewardRun], started: float) -> RewardCheck:
    bad = next(r for r in runs if r.status != "ok")
    first_line = bad.error.splitlines()[0] if bad.error else bad.status
    return RewardCheck(decision="failed", reason=f"run {bad.run_id} {bad.status.replace('_', ' ')}: {first_line}",
                       runs=runs, wall_s=time.time() - started, **common)


def run_reward_check(tuned: str | Path, plan: RewardCheckPlan, out_dir: str | Path, *,
                     changes: list[KeptChange] | None = None,
                     on_run: Callable[[str, str, str], None] | None = None,
                     on_output: Callable[[str], None] | None = None) -> RewardCheckOutcome:
    """Run the check of the tuned job's setup against ``plan`` and write ``out_dir/reward_check.yaml``.

    ``changes`` are the kept changes to undo one at a time if the check fails (default: each knob the
    tuned job changes). A job that fails is a ``failed`` check, not an exception.
    """
    tuned = Path(tuned)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    tuned_job = load_job(tuned)
    plan.check_mapped(tuned_job.knobs, str(tuned))
    setup = plan.setup_of(tuned_job.knobs)
    changes = changes if changes is not None else [KeptChange(k, {k: plan.job.knobs[k]}) for k in setup]
    for change in changes:
        plan.check_mapped({**tuned_job.knobs, **change.reverted}, f"undoing {change.label}")
    notes = []
    if tuned_job.launch.command != plan.job.launch.command:
        notes.append(f"the tuned job's launch.command differs from the untuned job's; its knobs ran on the untuned "
                     f"job's command ({' '.join(plan.job.launch.command)})")
    for knob in SEED_KNOBS:
        if knob in tuned_job.knobs and tuned_job.knobs[knob] != plan.job.knobs.get(knob):
            notes.append(f"the tuned job sets {knob}={tuned_job.knobs[knob]!r}; the check sets the seeds itself")
    if not setup:
        notes.append("the tuned job's knobs equal the untuned job's: the tuned run repeats the first untuned seed")
    started = time.time()
    common = dict(schema_version=REWARD_CHECK_SCHEMA_VERSION, tuned_job=str(tuned), untuned_job=str(plan.against),
                  tuned_overrides=setup, steps=plan.steps, window=plan.window, seeds=list(plan.seeds),
                  task_seed=plan.job.knobs.get(TASK_SEED_KNOB),
                  rule=RULE.format(W=plan.window, z=plan.z, K=len(plan.seeds)), notes=notes)
    runner = _Runner(plan, out_dir, on_run, on_output)
    path = out_dir / REWARD_CHECK_NAME

    untuned = [runner.run(f"untuned-s{seed}", "untuned", seed, {}) for seed in plan.seeds]
    tuned_run = runner.run(f"tuned-s{plan.seeds[0]}", "tuned", plan.seeds[0], setup)
    runs = [r.summary for r in [*untuned, tuned_run]]
    for run in (*untuned, tuned_run):
        if run.carried:
            notes.append(f"{run.summary.run_id}: {run.carried} of {plan.steps} steps report no reward of their own and "
                         f"carry the reward of the batch they train, generated at an earlier step (batch reuse or "
                         f"generating for several steps at once)")
    if any(r.status != "ok" for r in runs):
        check = _failed_check(common, runs, started)
        save_reward_check(check, path)
        return RewardCheckOutcome(check, path)

    band = seed_band([r.rewards for r in untuned], plan.window, plan.z)
    band_summary = RewardBand(z=plan.z, seed_sd=band.seed_sd, step_noise_sd=band.step_noise_sd, sd=band.sd,
                              half_width=band.half_width, first_step=band.first_step,
                              step0_mean=sum(r.rewards[0] for r in untuned) / len(untuned),
                              centre_first=band.centre[0], centre_final=band.centre[-1],
                              rise=band.centre[-1] - band.centre[0],
                              rise_in_bands=(band.centre[-1] - band.centre[0]) / band.half_width if band.half_width else None)
    for run in untuned:
        _mark(run.summary, judge_curve(run.rewards, band))
    judgement = judge_curve(tuned_run.rewards, band)
    _mark(tuned_run.summary, judgement)
    if band.half_width == 0:
        notes.append("the untuned seeds' curves are identical (half-width 0): only an identical tuned curve passes")
    elif band_summary.rise_in_bands is not None and band_summary.rise_in_bands < 3:
        notes.append(f"the untuned reward rose by only {band_summary.rise_in_bands:.2g} half-widths over the run: the "
                     f"check barely tells learning from noise; run more steps or a job that learns faster")

    attribution: list[RevertedChange] = []
    blamed: list[str] = []

    def undo(label: str, reverted: dict[str, KnobValue], run_id: str) -> RevertedChange:
        """The tuned setup with ``reverted`` set back, run (or, when that is the untuned setup, its first seed)."""
        reverted_setup = plan.setup_of({**tuned_job.knobs, **reverted})
        if reverted_setup:
            run = runner.run(run_id, "reverted", plan.seeds[0], reverted_setup)
            runs.append(run.summary)
            if run.summary.status != "ok":
                return RevertedChange(change=label, reverted=reverted, run_id=run_id, passed=None)
        else:
            run = untuned[0]  # undoing everything the tuned job changed leaves the untuned setup: that run
        verdict = judge_curve(run.rewards, band)
        if run.summary.role == "reverted":
            _mark(run.summary, verdict)
        return RevertedChange(change=label, reverted=reverted, run_id=run.summary.run_id, passed=verdict.passed,
                              max_deviation=verdict.max_deviation, final_delta=verdict.final_delta)

    if not judgement.passed:
        for number, change in enumerate(changes, 1):
            attribution.append(undo(change.label, change.reverted, f"without-{number}-s{plan.seeds[0]}"))
            if not attribution[-1].passed:
                continue
            blamed.append(change.label)
            if len(change.reverted) > 1:
                # A change kept as a bundle: which of its knobs is it? Undo each alone.
                for knob, value in change.reverted.items():
                    attribution.append(undo(f"{change.label}: {knob}", {knob: value},
                                            f"without-{number}-{safe_name(knob)}-s{plan.seeds[0]}"))
                    if attribution[-1].passed:
                        blamed.append(f"{change.label}: {knob}")
        if changes and not blamed:
            notes.append("undoing any one kept change alone does not make the tuned setup pass: the changes act "
                         "together, or the check failed on noise")

    if judgement.passed:
        decision = "pass"
        reason = (f"the tuned moving average stays within +-{band.half_width:.3g} of the untuned seeds' (largest "
                  f"deviation {judgement.max_deviation:.3g} at step {judgement.max_deviation_step}); final window "
                  f"{judgement.final_delta:+.3g}")
    else:
        decision = "fail"
        parts = [r.detail for r in judgement.rules if not r.passed]
        reason = "; ".join(parts) + (f"; to blame: {', '.join(blamed)}" if blamed else "")
    check = RewardCheck(decision=decision, reason=reason, band=band_summary, checks=judgement.rules, runs=runs,
                        attribution=attribution, blamed=blamed, wall_s=time.time() - started, **common)
    save_reward_check(check, path)
    return RewardCheckOutcome(check, path)


def _mark(summary: RewardRun, judgement: CurveJudgement) -> None:
    summary.max_deviation = judgement.max_deviation
    summary.max_deviation_step = judgement.max_deviation_step


# -- reading a check back (the report) ---------------------------------------------------------------

def curves_of(path: str | Path) -> tuple[RewardCheck, dict[str, list[float]]]:
    """A check and each run's per-step rewards, read from the run directories it names."""
    from rltune.contracts.stages import read_stages

    path = Path(path)
    check = load_reward_check(path)
    curves = {}
    for run in check.runs:
        stages = path.parent / run.run_dir / "stages.parquet"
        if run.status == "ok" and stages.exists():
            curves[run.run_id] = _rewards(read_stages(stages).to_pylist(), check.steps)[0]
    return check, curves


# -- after 'rltune auto' ---------------------------------------------------------------------------

def kept_changes(state: JournalState, untuned_knobs: dict[str, KnobValue],
                 best_knobs: dict[str, KnobValue]) -> list[KeptChange]:
    """The kept trials of an auto journal as undoable changes, in the order they were kept.

    A kept change is a trial whose round ended with it as the next baseline (with parallel trials a
    round may keep more than one; only the one it went on from counts). Its knobs are those its trial
    set differently from the baseline it started from; undoing it sets back those the best setup still
    holds at the trial's value (a later change that moved a knob again owns that knob).
    """
    made_baseline = state.made_baseline
    out, before = [], dict(untuned_knobs)
    for trial in state.trials:
        if trial.decision != "keep" or trial.run_id not in made_baseline:
            continue
        after = dict(trial.knobs)
        changed = {k: before.get(k) for k, v in after.items() if before.get(k) != v}
        reverted = {k: old for k, old in changed.items() if best_knobs.get(k) == after[k] and old is not None}
        if reverted:
            fixes = "+".join(trial.fixes) or trial.candidate
            out.append(KeptChange(f"{trial.run_id} ({fixes})", reverted))
        before = after
    return out


def check_after_tuning(plan: RewardCheckPlan, tuned_preset: Path, workdir: Path, state: JournalState,
                       untuned_knobs: dict[str, KnobValue], best_knobs: dict[str, KnobValue], *,
                       emit: Callable[..., Any], note: Callable[..., Any], rel: Callable[[Path], str],
                       on_output: Callable[[str], None] | None = None) -> RewardCheckOutcome:
    """``rltune auto --reward-check``: check the tuned preset in ``workdir/reward-check``, attribute a failure
    to the journal's kept changes, and journal one ``reward_check`` event (``emit``); ``note`` follows the
    runs in the live view. Runs finished before a kill are reused when the loop is run again."""
    changes = kept_changes(state, untuned_knobs, best_knobs)
    outcome = run_reward_check(tuned_preset, plan, workdir / "reward-check", changes=changes, on_output=on_output,
                               on_run=lambda run_id, state, detail: note("run", run_id=f"reward-check/{run_id}",
                                                                         state="done" if state != "start" else state))
    check = outcome.check
    emit("reward_check", decision=check.decision, reason=check.reason, verdict=rel(outcome.path), steps=check.steps,
         window=check.window, seeds=check.seeds, half_width=check.band.half_width if check.band else None,
         blamed=check.blamed, against=str(plan.against))
    return outcome


def last_reward_check(state: JournalState) -> RewardCheckEvent | None:
    """The journal's last ``reward_check`` event, if any."""
    return state.reward_check


__all__ = ["BAND_Z", "Band", "CurveJudgement", "KeptChange", "RewardCheckInputError", "RewardCheckOutcome",
           "RewardCheckPlan", "check_after_tuning", "curves_of", "default_window", "exit_code_of", "step_noise_sd", "judge_curve", "kept_changes",
           "last_reward_check", "moving_average", "plan_reward_check", "run_reward_check", "seed_band"]
