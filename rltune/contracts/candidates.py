"""candidates.yaml: complete setups composed from knowledge-base fixes, each with its rationale."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rltune.contracts.job import KnobValue
from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml

CANDIDATES_SCHEMA_VERSION = 1

# The step-time groups a bottleneck can be ('training+weight_sync' in fully async mode).
StageGroup = Literal["rollout", "training", "weight_sync", "training+weight_sync"]


@dataclass
class Candidate:
    id: str = field(doc="candidate id, unique in the file (e.g. 'r1-c3')")
    fixes: list[str] = field(doc="fix ids combined; the first is the main change (the savings matrix counts the candidate under its group)")
    overrides: dict[str, KnobValue] = field(doc="abstract knob -> new absolute value, for the knobs that differ from the baseline")
    rationale: str = field(doc="why this setup: which bottleneck each fix targets")
    needs: list[str] = field(default_factory=list, doc="resources beyond the budget")
    targets: list[str] = field(default_factory=list, doc="problem ids the setup fixes")
    risks: list[str] = field(default_factory=list, doc="acceptance limits the setup's fixes may break")
    moves: list[str] = field(default_factory=list, doc="theory terms the setup's fixes move (the knowledge base's moves): where a forecast cannot estimate a setting, what the tuner expects it to relieve")

    def validate(self) -> None:
        if not self.id.strip():
            raise FieldProblem("id", "a candidate needs an id (e.g. 'r1-c3')")
        if not self.fixes:
            raise FieldProblem("fixes", "a candidate combines at least one fix")


@dataclass
class Candidates:
    schema_version: int = field(doc="version of this schema (1)")
    job: str = field(doc="path of the job.yaml the candidates apply to")
    baseline_run: str = field(doc="run id of the profiled baseline")
    baseline_knobs: dict[str, KnobValue] = field(doc="knob values of the baseline")
    limiting_stage: Literal[StageGroup, "unknown"] = field(doc="bottleneck the candidates target ('unknown': the diagnosis could not tell)")
    candidates: list[Candidate] = field(doc="composed setups")
    next_stage: StageGroup | None = field(None, doc="stage expected to limit the step once the bottleneck is fixed")
    baseline_dir: str | None = field(None, doc="run directory of the baseline (its stages.parquet times the trial's comparison)")
    untuned_dir: str | None = field(None, doc="run directory of the untuned baseline (its gap sets the gap limit); default baseline_dir")
    unfixed: list[str] = field(default_factory=list, doc="problems found that no applicable fix addresses")
    job_name: str | None = field(None, doc="name of the job the candidates were composed for; 'rltune predict' and 'rltune trial' refuse the file with another job")

    def validate(self) -> None:
        if not self.baseline_run.strip():
            raise FieldProblem("baseline_run", "the candidates need their baseline's run id (the run they are forecast "
                                               "and judged against)")
        seen = set()
        for i, c in enumerate(self.candidates):
            if c.id in seen:
                raise FieldProblem(f"candidates[{i}].id", f"duplicate candidate id {c.id!r}")
            seen.add(c.id)


def load_candidates(path: str | Path) -> Candidates:
    return load_yaml(Candidates, path, CANDIDATES_SCHEMA_VERSION)


def save_candidates(candidates: Candidates, path: str | Path) -> None:
    dump_yaml(candidates, path)
