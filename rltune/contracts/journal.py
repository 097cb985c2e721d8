"""journal.jsonl: the events of one ``rltune auto`` work directory, one schema per event kind.

Each line is one JSON object whose ``event`` names its kind; the other keys are that kind's fields
below. Paths are relative to the work directory. The ``start`` event opens every journal and
carries ``schema_version``; journals written before it did are version 1. A reader validates every
line against its kind's schema (unknown keys, wrong types, non-finite numbers, an unknown kind are
refused with the file, the line and the field), so the loop never acts on an event it misread.
:func:`rltune.tune.journal.replay` turns the events into the loop's state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from rltune.contracts.schema import FieldProblem, field

JOURNAL_SCHEMA_VERSION = 1

Role = Literal["baseline", "trial"]
Decision = Literal["keep", "reject", "failed"]


@dataclass
class StartEvent:
    """The loop was started on a job (the first event)."""

    event: Literal["start"] = field(doc="'start'")
    time: float = field(doc="Unix time the event was written", min=0)
    job: str = field(doc="path of the job.yaml tuned")
    job_name: str = field(doc="the job's name; a work dir tunes one job")
    gpus: int = field(doc="gpus.count of the job", min=0)
    device: str = field(doc="gpus.device of the job")
    rl_mode: str = field(doc="the job's RL mode")
    rounds: int = field(doc="--rounds asked for", min=0)
    trial_budget: int = field(doc="--trial-budget asked for", min=0)
    library: str = field(doc="the case library the runs join")
    steps: int | None = field(None, doc="steps of each baseline run (trials may run more)", min=1)
    baseline_runs: int | None = field(None, doc="limits.baseline_runs: untuned runs pooled for the noise", min=1)
    schema_version: int = field(1, doc="version of the journal's schemas (1)", min=1)


@dataclass
class RunStartEvent:
    """A real run is about to be launched."""

    event: Literal["run_start"] = field(doc="'run_start'")
    time: float = field(doc="Unix time", min=0)
    run_id: str = field(doc="the run's id, unique in the library")
    run_dir: str = field(doc="its run directory")
    role: Role = field(doc="baseline (the untuned job) or trial")
    round: int = field(doc="0 for the untuned baseline, else the round", min=0)
    knobs: dict[str, Any] = field(doc="every knob the run uses")
    steps: int | None = field(None, doc="steps it runs", min=1)
    metrics_path: str | None = field(None, doc="where the run writes its metrics (the live view reads it)")
    repeat: int | None = field(None, doc="baseline: which of the untuned runs", min=1)
    of: int | None = field(None, doc="baseline: of how many; trial: the trial budget", min=0)
    candidate: str | None = field(None, doc="trial: the candidate id")
    fixes: list[str] | None = field(None, doc="trial: the candidate's fixes")
    baseline_run: str | None = field(None, doc="trial: the baseline it is compared with")
    baseline_step_s: float | None = field(None, doc="trial: that baseline's mean step", min=0)
    worth: str | None = field(None, doc="trial: why it was worth a trial (point, range)")
    group: str | None = field(None, doc="trial: the technique group of its first fix")
    trial: int | None = field(None, doc="trial: its number in the budget", min=1)
    forecast: dict[str, Any] | None = field(None, doc="trial: its forecast.yaml entry (to resume it)")

    def validate(self) -> None:
        if self.role == "trial":
            for name in ("candidate", "fixes", "baseline_run", "group"):
                if getattr(self, name) is None:
                    raise FieldProblem(name, "missing; a trial's run_start names its candidate, fixes, baseline and group")


@dataclass
class RunSubmittedEvent:
    """The launcher accepted a run (its identity finds it again after a crash)."""

    event: Literal["run_submitted"] = field(doc="'run_submitted'")
    time: float = field(doc="Unix time", min=0)
    run_id: str = field(doc="the run")
    identity: dict[str, Any] = field(doc="the launcher's job identity (launch.json)")


@dataclass
class BaselineRunEvent:
    """One untuned run finished."""

    event: Literal["baseline_run"] = field(doc="'baseline_run'")
    time: float = field(doc="Unix time", min=0)
    run_id: str = field(doc="the run")
    run_dir: str = field(doc="its run directory")
    step_s: float | None = field(doc="its mean step", min=0)


@dataclass
class BaselineEvent:
    """A round's baseline: the untuned runs pooled (round 0)."""

    event: Literal["baseline"] = field(doc="'baseline'")
    time: float = field(doc="Unix time", min=0)
    round: int = field(doc="0", min=0)
    run_id: str = field(doc="the first run")
    run_dir: str = field(doc="its run directory")
    knobs: dict[str, Any] = field(doc="the knobs")
    step_s: float = field(doc="mean step over the pooled runs' measured steps", min=0)
    stages_s: dict[str, float] = field(doc="mean seconds per stage")
    limiting_stage: str = field(doc="the diagnosis' limiting stage")
    problems: list[str] = field(doc="the diagnosis' problem ids")
    run_ids: list[str] | None = field(None, doc="every pooled run")
    run_dirs: list[str] | None = field(None, doc="their run directories")
    step_median_s: float | None = field(None, doc="median step", min=0)
    noise_pct: float | None = field(None, doc="the measured run-to-run noise in %", min=0)
    noise: str | None = field(None, doc="how the noise was measured")

    @property
    def all_run_ids(self) -> list[str]:
        return list(self.run_ids or [self.run_id])

    @property
    def all_run_dirs(self) -> list[str]:
        return list(self.run_dirs or [self.run_dir])


@dataclass
class ProposedEvent:
    """An attempt of a round proposed and forecast its candidates and picked what to run."""

    event: Literal["proposed"] = field(doc="'proposed'")
    time: float = field(doc="Unix time", min=0)
    round: int = field(doc="the round", min=1)
    attempt: int = field(doc="the attempt within the round", min=1)
    baseline_run: str = field(doc="the round's baseline")
    baseline_step_s: float = field(doc="its mean step", min=0)
    limiting_stage: str = field(doc="what limits the baseline")
    next_stage: str = field(doc="the stage that limits once it is relieved")
    candidates_file: str = field(doc="candidates.yaml")
    forecast_file: str = field(doc="forecast-a<K>.yaml")
    candidates: list[dict[str, Any]] = field(doc="each forecast: id, fixes, step_s, range_s, gain_pct, worth, ...")
    forecast_baseline_s: float | None = field(None, doc="the forecast's baseline step", min=0)
    picked: str | None = field(None, doc="the first candidate picked (null: none)")
    picks: list[str] | None = field(None, doc="every candidate picked for this attempt")


@dataclass
class TrialEvent:
    """A trial's verdict."""

    event: Literal["trial"] = field(doc="'trial'")
    time: float = field(doc="Unix time", min=0)
    round: int = field(doc="the round", min=1)
    run_id: str = field(doc="the trial's first run")
    run_dirs: list[str] = field(doc="its run directories (two when remeasured)")
    candidate: str = field(doc="the candidate")
    fixes: list[str] = field(doc="its fixes")
    group: str = field(doc="technique group of its first fix")
    knobs: dict[str, Any] = field(doc="every knob it ran with")
    decision: Decision = field(doc="keep, reject or failed")
    reason: str = field(doc="why")
    step_s: float | None = field(doc="mean step over the compared steps", min=0)
    baseline_step_s: float | None = field(doc="the baseline's on the same steps", min=0)
    gain_pct: float | None = field(doc="% faster than the baseline")
    forecast_step_s: float = field(doc="the forecast made before it ran", min=0)
    forecast_range_s: list[float] = field(doc="the forecast's range")
    within_forecast_range: bool | None = field(doc="whether the measured step fell in it")
    stages_s: dict[str, float] = field(doc="mean seconds per stage")
    remeasured: bool = field(doc="measured twice because the gain was small")
    failed_limits: list[str] = field(doc="limits it broke")
    verdict: str = field(doc="its verdict.yaml")
    worth: str = field("", doc="why it was worth a trial")
    median_s: float | None = field(None, doc="median step", min=0)
    noise_pct: float | None = field(None, doc="the noise it had to beat, in %", min=0)
    unmeasured_limits: list[str] = field(default_factory=list, doc="limits its metrics could not measure")


@dataclass
class RunAbandonedEvent:
    """A run that will not be finished (interrupted before its case was recorded, or a failed baseline)."""

    event: Literal["run_abandoned"] = field(doc="'run_abandoned'")
    time: float = field(doc="Unix time", min=0)
    run_id: str = field(doc="the run")
    reason: str = field(doc="why")


@dataclass
class RoundEndEvent:
    """A round ended."""

    event: Literal["round_end"] = field(doc="'round_end'")
    time: float = field(doc="Unix time", min=0)
    round: int = field(doc="the round", min=1)
    outcome: Literal["kept", "none_kept", "none_worth", "no_candidates", "none_forecast"] = field(
        doc="how it ended (none_forecast: what journals written before 'none_worth' said for it)")
    baseline_run: str | None = field(None, doc="kept: the trial that is the next round's baseline")
    banned: list[str] | None = field(None, doc="none_worth: candidates worth a trial but holding settings that crashed, broke a limit or failed a reward check")
    unfixed: list[str] | None = field(None, doc="no_candidates: problems no fix applies to")

    def validate(self) -> None:
        if self.outcome == "kept" and not self.baseline_run:
            raise FieldProblem("baseline_run", "missing; a round that kept a trial names it")


@dataclass
class RewardCheckEvent:
    """The tuned preset's reward check (``auto --reward-check``)."""

    event: Literal["reward_check"] = field(doc="'reward_check'")
    time: float = field(doc="Unix time", min=0)
    decision: Literal["pass", "fail", "failed"] = field(doc="pass, fail, or failed (a run of the check crashed or timed out)")
    reason: str = field(doc="why")
    verdict: str = field(doc="its reward_check.yaml")
    steps: int = field(doc="steps of each run", min=1)
    window: int = field(doc="moving-average window", min=1)
    seeds: list[int] = field(doc="the untuned seeds")
    blamed: list[str] = field(doc="kept changes to blame")
    against: str = field(doc="the untuned job.yaml")
    half_width: float | None = field(None, doc="the band's half-width", min=0)


@dataclass
class FinishEvent:
    """The loop ended and wrote the tuned preset."""

    event: Literal["finish"] = field(doc="'finish'")
    time: float = field(doc="Unix time", min=0)
    reason: str = field(doc="why it stopped")
    untuned_run: str = field(doc="the untuned baseline")
    untuned_step_s: float = field(doc="its mean step", min=0)
    best_run: str = field(doc="the fastest kept setup's run")
    best_step_s: float = field(doc="its mean step", min=0)
    best_knobs: dict[str, Any] = field(doc="its knobs")
    trials: int = field(doc="trials run", min=0)
    savings: dict[str, Any] = field(doc="seconds saved by technique group")
    tuned_preset: str = field(doc="the tuned preset written")
    learning: Literal["unchanged", "unchecked", "pass", "fail"] | None = field(
        None, doc="what the kept changes do to learning: unchanged (none alters what is learned per fresh sample), "
                  "unchecked (one does; no --reward-check), pass or fail (its reward check)")
    learning_changes: list[str] | None = field(None, doc="the kept changes that alter what is learned per fresh sample")


EVENT_TYPES: dict[str, type] = {
    "start": StartEvent, "run_start": RunStartEvent, "run_submitted": RunSubmittedEvent,
    "baseline_run": BaselineRunEvent, "baseline": BaselineEvent, "proposed": ProposedEvent, "trial": TrialEvent,
    "run_abandoned": RunAbandonedEvent, "round_end": RoundEndEvent, "reward_check": RewardCheckEvent,
    "finish": FinishEvent,
}

Event = (StartEvent | RunStartEvent | RunSubmittedEvent | BaselineRunEvent | BaselineEvent | ProposedEvent | TrialEvent
         | RunAbandonedEvent | RoundEndEvent | RewardCheckEvent | FinishEvent)


def event_as_data(event: Any) -> dict[str, Any]:
    """An event as the JSON object its line holds: fields in schema order, unset optional fields left out."""
    out = {}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if value is None and has_default:
            continue
        out[f.name] = value
    return out


def describe_events() -> str:
    """docs/artifacts.md: one field table per event kind."""
    from rltune.contracts.schema import field_docs

    parts = []
    for kind, cls in EVENT_TYPES.items():
        parts.append(f"**`{kind}`** — {(cls.__doc__ or '').strip()}\n")
        parts.append("| field | type | meaning |\n|---|---|---|")
        for name, tname, doc in field_docs(cls):
            parts.append(f"| `{name}` | {tname} | {doc} |")
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


__all__ = ["EVENT_TYPES", "JOURNAL_SCHEMA_VERSION", "BaselineEvent", "BaselineRunEvent", "Event", "FinishEvent",
           "ProposedEvent", "RewardCheckEvent", "RoundEndEvent", "RunAbandonedEvent", "RunStartEvent",
           "RunSubmittedEvent", "StartEvent", "TrialEvent", "describe_events", "event_as_data"]
