"""What kind of artifact a file is, and which job it was made for.

Every YAML artifact has keys no other kind has (its *signature*: a diagnosis has ``run_id``,
``steps_used`` and ``stages``; a candidates file ``baseline_knobs`` and ``candidates``). A loader
asked for one kind that is given a file holding another kind's whole signature and not its own says
so in one line, before any field is checked, instead of reporting the other kind's first key as
unknown:

    diag.yaml: this is a diagnosis (written by 'rltune profile'), not a candidates file; give
    'rltune predict' the candidates.yaml from 'rltune propose'

The signatures are required fields, so files written before this check (there is no ``kind:`` key
to add) are recognised just the same.

Diagnosis, candidates and forecast files carry the name of the job they were made for
(``job_name``); :func:`check_same_job` refuses such a file given with another job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rltune.errors import OtherJobError, WrongArtifactError

if TYPE_CHECKING:
    from rltune.contracts.job import JobSpec


@dataclass(frozen=True)
class ArtifactKind:
    """One kind of YAML file rltune reads."""

    noun: str  # 'a diagnosis': what the file is, in a sentence
    origin: str  # where such a file comes from
    wanted: str  # what to give instead when this kind was expected
    signature: frozenset[str]  # top-level keys every file of this kind has and no other kind has all of


KINDS: dict[str, ArtifactKind] = {
    "job": ArtifactKind(
        "a job file", "written by hand; presets/ holds examples",
        "give the job.yaml of the job (presets/ holds examples)",
        frozenset({"name", "model", "workload", "gpus", "launch"})),
    "diagnosis": ArtifactKind(
        "a diagnosis", "written by 'rltune profile'",
        "give 'rltune propose' the diagnosis.yaml from 'rltune profile'",
        frozenset({"run_id", "source", "steps_used", "limiting_stage", "stages"})),
    "knowledge": ArtifactKind(
        "a knowledge base", "written by hand; presets/knowledge.yaml is the shipped one",
        "give --knowledge a knowledge base like presets/knowledge.yaml",
        frozenset({"knobs", "problems", "fixes"})),
    "candidates": ArtifactKind(
        "a candidates file", "written by 'rltune propose'",
        "give 'rltune predict' the candidates.yaml from 'rltune propose'",
        frozenset({"baseline_run", "baseline_knobs", "candidates"})),
    "forecast": ArtifactKind(
        "a forecast", "written by 'rltune predict'",
        "give 'rltune trial' the forecast.yaml from 'rltune predict'",
        frozenset({"candidates_file", "library", "forecasts"})),
    "verdict": ArtifactKind(
        "a verdict", "written by 'rltune trial'",
        "give the verdict.yaml 'rltune trial' wrote into the trial's run directory",
        frozenset({"run_id", "candidate", "baseline_run", "untuned_run", "decision"})),
    "reward_check": ArtifactKind(
        "a reward check", "written by 'rltune reward-check'",
        "give the reward_check.yaml 'rltune reward-check' wrote",
        frozenset({"tuned_job", "untuned_job", "seeds", "window"})),
    "learning_checks": ArtifactKind(
        "a learning-checks record", "written by 'rltune auto --reward-check' into its case library",
        "give the learning-checks.yaml of a case library",
        frozenset({"learning_checks"})),
    "workload": ArtifactKind(
        "a workload config", "written by hand; presets/workload/ holds examples",
        "give 'rltune workload run' a workload config (presets/workload/ holds examples)",
        frozenset({"trainer", "orchestrator"})),
    "sync_bench": ArtifactKind(
        "a sync-bench config", "written by hand; presets/sync/ holds examples",
        "give 'rltune sync-bench' a config like presets/sync/cpu.yaml",
        frozenset({"transports", "optimizer"})),
    "sync_readers": ArtifactKind(
        "a sync-bench readers config", "written by hand; presets/sync/readers/ holds examples",
        "give 'rltune sync-bench --readers-config' a file like presets/sync/readers/cpu.yaml",
        frozenset({"readers", "storage", "steps"})),
    "sync_model": ArtifactKind(
        "a sync estimate model", "written by hand; presets/sync/estimate/ holds examples",
        "give 'rltune sync-bench --estimate' a file like presets/sync/estimate/qwen3-8b.yaml",
        frozenset({"params_total", "changed_fraction", "tensors"})),
    "sync_rates": ArtifactKind(
        "a rates file", "shipped as rltune/sync/data/rates.yaml",
        "give the rates file rltune/sync/data/rates.yaml",
        frozenset({"rates_version", "rates"})),
}

# The schema class each loader validates against -> its kind (module and name, so this module
# imports none of them).
KIND_OF_CLASS: dict[str, str] = {
    "rltune.contracts.job.JobSpec": "job",
    "rltune.contracts.diagnosis.Diagnosis": "diagnosis",
    "rltune.contracts.knowledge.Knowledge": "knowledge",
    "rltune.contracts.candidates.Candidates": "candidates",
    "rltune.contracts.forecast.Forecast": "forecast",
    "rltune.contracts.verdict.Verdict": "verdict",
    "rltune.contracts.reward_check.RewardCheck": "reward_check",
    "rltune.contracts.learning.LearningChecks": "learning_checks",
    "rltune.workload.config.WorkloadConfig": "workload",
    "rltune.sync.bench.run.SyncBenchConfig": "sync_bench",
    "rltune.sync.bench.readers.ReadersConfig": "sync_readers",
    "rltune.sync.estimate.ModelSpec": "sync_model",
    "rltune.sync.estimate.RatesFile": "sync_rates",
}


def kind_of(data: Any) -> str | None:
    """The kind whose whole signature ``data``'s top-level keys hold (the largest such), else None."""
    if not isinstance(data, dict):
        return None
    keys = set(data)
    matches = [name for name, kind in KINDS.items() if kind.signature <= keys]
    return max(matches, key=lambda name: len(KINDS[name].signature)) if matches else None


def check_kind(data: Any, file: str, expected: type | str) -> None:
    """Refuse ``data`` (read from ``file``) as one line when it is another kind than ``expected``.

    ``expected`` is a kind name or the schema class a loader validates against; a class this
    module does not know is not checked. A file holding its own kind's signature is never refused
    here (its fields are checked next), so a misspelt key is still reported as such.
    """
    name = expected if isinstance(expected, str) else KIND_OF_CLASS.get(f"{expected.__module__}.{expected.__qualname__}")
    if name is None or not isinstance(data, dict):
        return
    wanted = KINDS[name]
    if wanted.signature <= set(data):
        return
    found = kind_of(data)
    if found is None or found == name:
        return
    other = KINDS[found]
    raise WrongArtifactError(file, "", f"this is {other.noun} ({other.origin}), not {wanted.noun}; "
                                       f"{wanted.wanted}")


def check_same_job(file: str, artifact_job_name: str | None, job: JobSpec, job_path: str | None = None) -> None:
    """Refuse a file made for another job than ``job`` (its ``job_name`` differs from ``job.name``).

    A file without ``job_name`` (written before rltune recorded it, or from logs with no job) is
    not checked. ``job_path`` (the job file the user gave) is named in the message when known.
    """
    if artifact_job_name is None or artifact_job_name == job.name:
        return
    given = f"the job given ({job_path}) is {job.name!r}" if job_path else f"the job given is {job.name!r}"
    raise OtherJobError(str(file), "job_name",
                        f"made for job {artifact_job_name!r}, but {given}; give the job.yaml of "
                        f"{artifact_job_name!r}, or make this file again from a run of {job.name!r}")


__all__ = ["KINDS", "ArtifactKind", "check_kind", "check_same_job", "kind_of"]
