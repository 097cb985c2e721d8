"""reward_check.yaml: does a tuned setup learn like the untuned one over a long run?

Written by ``rltune reward-check`` (and by ``rltune auto --reward-check``) into its output
directory, beside the run directories it made. The rule is fixed before any run and recorded here
with every number it used:

- each run's reward is smoothed with a trailing moving average of ``window`` steps (full windows
  only: the first value is at step ``window - 1``);
- the untuned setup runs with ``len(seeds)`` seeds (at least 2) on the same task order; at every
  step their moving averages have a mean (the band's centre) and a sample standard deviation;
  ``band.seed_sd`` is the root mean square of those standard deviations over the steps, and
  ``band.sd`` the larger of it and ``band.step_noise_sd`` (what one run's moving average moves from
  its own step-to-step noise: two seeds can agree by chance);
- the band's half-width is ``band.z x sd x sqrt(1 + 1/K)`` for K untuned seeds: the spread one
  more run of the untuned setup would have around the mean of K runs, ``z`` of them;
- the tuned setup passes when its moving average stays within centre +- half-width at every step
  (``within_band``) and its final-window mean is not below the untuned final-window mean by more
  than the half-width (``final_window``).

Run directories are stored relative to this file's directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rltune.contracts.job import KnobValue
from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml

REWARD_CHECK_SCHEMA_VERSION = 1
REWARD_CHECK_NAME = "reward_check.yaml"

CheckDecision = Literal["pass", "fail", "failed"]
RunRole = Literal["untuned", "tuned", "reverted"]


@dataclass
class RewardBand:
    z: float = field(doc="how many seed standard deviations the half-width spans (3: a run of the untuned setup leaves it at a given step about 3 times in 1000)", min=0)
    seed_sd: float = field(doc="root mean square over the steps of the untuned seeds' per-step standard deviation of the moving average", min=0)
    step_noise_sd: float = field(doc="how much one run's moving average moves from its own step-to-step noise: RMS over the seeds of sqrt(mean squared step-to-step reward difference / 2) / sqrt(window)", min=0)
    sd: float = field(doc="the spread used: the larger of seed_sd and step_noise_sd (two seeds can agree by chance)", min=0)
    half_width: float = field(doc="z x sd x sqrt(1 + 1/K): how far the tuned moving average may lie from the untuned mean", min=0)
    first_step: int = field(doc="first step with a full window (window - 1): where the band starts", min=0)
    step0_mean: float = field(doc="the untuned seeds' mean reward at step 0, before any update")
    centre_first: float = field(doc="the untuned seeds' mean moving average at first_step (their first-window mean)")
    centre_final: float = field(doc="the untuned seeds' mean moving average at the last step (their final-window mean)")
    rise: float = field(doc="centre_final - centre_first: how much the untuned setup learned over the run")
    rise_in_bands: float | None = field(None, doc="rise / half_width (null when the half-width is 0): below 3 the untuned curve hardly rises above its own noise and a pass says little")


@dataclass
class RewardRun:
    run_id: str = field(doc="the run's id (its directory name)")
    role: RunRole = field(doc="untuned (a seed of the band), tuned (the setup checked) or reverted (the tuned setup with one kept change undone)")
    seed: int = field(doc="value of the job's 'seed' knob for this run")
    run_dir: str = field(doc="the run directory (job.yaml, launch.log, metrics, stages.parquet with reward, gap and sample age per step), relative to this file")
    status: Literal["ok", "failed", "timed_out"] = field(doc="how the job ended")
    overrides: dict[str, KnobValue] = field(default_factory=dict, doc="knobs set on the untuned job for this run, seeds included")
    steps: int = field(0, doc="steps with a reward", min=0)
    first_window_mean: float | None = field(None, doc="mean reward of steps 0..window-1")
    final_window_mean: float | None = field(None, doc="mean reward of the last window steps")
    max_deviation: float | None = field(None, doc="largest absolute deviation of the moving average from the band centre over the band's steps (tuned and reverted runs)")
    max_deviation_step: int | None = field(None, doc="the step where max_deviation is reached")
    gap_mean: float | None = field(None, doc="mean trainer-rollout gap over the run's steps")
    sample_age_mean: float | None = field(None, doc="mean sample age over the run's steps")
    sample_age_max: float | None = field(None, doc="oldest sample of the run")
    step_s_mean: float | None = field(None, doc="mean step time over the run's measured steps")
    error: str = field("", doc="why the job failed, with the tail of its log")


@dataclass
class RewardRule:
    name: Literal["within_band", "final_window"] = field(doc="which part of the rule")
    value: float | None = field(doc="within_band: the largest absolute deviation from the centre; final_window: tuned final-window mean - untuned final-window mean")
    threshold: float | None = field(doc="within_band: the half-width; final_window: minus the half-width")
    passed: bool | None = field(doc="the part holds (null: not decided, a job failed)")
    detail: str = field("", doc="how value and threshold were computed, for a person")


@dataclass
class RevertedChange:
    change: str = field(doc="the kept change undone: the journal's trial and fixes, or the knob when no journal was given")
    reverted: dict[str, KnobValue] = field(doc="knobs set back to their value before that change")
    run_id: str = field(doc="the run of the tuned setup without this change")
    passed: bool | None = field(doc="that run passes the rule (null: the job failed)")
    max_deviation: float | None = field(None, doc="its largest absolute deviation from the band centre")
    final_delta: float | None = field(None, doc="its final-window mean - the untuned final-window mean")


@dataclass
class RewardCheck:
    schema_version: int = field(doc="version of this schema (1)")
    decision: CheckDecision = field(doc="pass (both parts hold), fail (a part fails) or failed (a job crashed, timed out or reported no reward)")
    reason: str = field(doc="one line: why this decision")
    tuned_job: str = field(doc="the tuned job.yaml; its knobs are the setup checked")
    untuned_job: str = field(doc="the untuned job.yaml; every run, tuned ones too, goes through its launch (command, workload), so the runs differ only in knobs")
    tuned_overrides: dict[str, KnobValue] = field(doc="knobs the tuned job sets differently from the untuned one (seed knobs excluded): the change under test")
    steps: int = field(doc="steps of every run", min=2)
    window: int = field(doc="moving-average window in steps; steps >= 2 x window", min=1)
    seeds: list[int] = field(doc="values of the 'seed' knob of the untuned runs (at least 2); the tuned run uses the first")
    task_seed: KnobValue | None = field(doc="value of the 'task_seed' knob every run used: the same tasks in the same order")
    rule: str = field(doc="the decision rule, as fixed before the runs")
    band: RewardBand | None = field(None, doc="the untuned seeds' band (null when an untuned run failed)")
    checks: list[RewardRule] = field(default_factory=list, doc="each part of the rule with its value, threshold and result")
    runs: list[RewardRun] = field(default_factory=list, doc="every run: the untuned seeds, the tuned run, then reverted runs")
    attribution: list[RevertedChange] = field(default_factory=list, doc="for a failing check: the tuned setup re-run with each kept change undone in turn")
    blamed: list[str] = field(default_factory=list, doc="kept changes whose undoing makes the tuned setup pass: the change(s) to blame; a blamed change of several knobs is then undone one knob at a time, and each knob that alone makes it pass is listed as 'change: knob'")
    notes: list[str] = field(default_factory=list, doc="anything a reader should know (an untuned curve that hardly rises, a seed knob the tuned job set, ...)")
    wall_s: float | None = field(None, doc="wall time of the whole check, seconds", min=0)

    def validate(self) -> None:
        if self.steps < 2 * self.window:
            raise FieldProblem("window", f"steps ({self.steps}) must be at least 2 x window ({self.window})")
        if len(self.seeds) < 2:
            raise FieldProblem("seeds", "the band needs at least 2 untuned seeds")
        if self.decision == "pass" and any(c.passed is not True for c in self.checks):
            raise FieldProblem("decision", "'pass' needs every part of the rule to hold")

    @property
    def passed(self) -> bool:
        return self.decision == "pass"


def load_reward_check(path: str | Path) -> RewardCheck:
    return load_yaml(RewardCheck, path, REWARD_CHECK_SCHEMA_VERSION)


def save_reward_check(check: RewardCheck, path: str | Path) -> None:
    dump_yaml(check, path)
