"""knowledge.yaml: for each problem profiling can find, the fixes that have worked and when."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rltune.contracts.job import KnobValue
from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml

KNOWLEDGE_SCHEMA_VERSION = 1

TheoryTerm = Literal["training", "rollout", "weight_sync", "sandbox", "old_logprob", "step"]
LimitName = Literal["gap", "sample_age", "trials_cut_off", "trials_failed", "memory", "reward"]


@dataclass
class KnobInfo:
    description: str = field(doc="what the knob does")
    type: Literal["int", "float", "bool", "str"] = field(doc="value type")
    choices: list[KnobValue] | None = field(None, doc="allowed values, if a fixed set")


@dataclass
class Fix:
    id: str = field(doc="stable fix id")
    title: str = field(doc="one line for a person")
    problems: list[str] = field(doc="problem ids this fix addresses")
    overrides: dict[str, KnobValue] = field(doc="abstract knob -> value; a string '*2' or '/2' scales the current value")
    applies_when: list[str] = field(default_factory=list, doc="conditions on knobs or job facts, e.g. 'rl_mode != fully_async', 'workload.kind == coding'")
    conflicts: list[str] = field(default_factory=list, doc="fix ids this fix cannot be combined with")
    needs: list[str] = field(default_factory=list, doc="resources it needs beyond the budget, e.g. 'extra_cpu_host'")
    moves: list[TheoryTerm] = field(default_factory=list, doc="theory terms the fix changes")
    risks: list[LimitName] = field(default_factory=list, doc="acceptance limits it may break")
    source: str = field("", doc="where the practice comes from (seed, verl, prime-rl, vLLM docs)")


@dataclass
class Knowledge:
    schema_version: int = field(doc="version of this schema (1)")
    knobs: dict[str, KnobInfo] = field(doc="every abstract knob fixes may set")
    problems: dict[str, str] = field(doc="problem id -> description")
    fixes: list[Fix] = field(doc="problem -> fix entries")

    def validate(self) -> None:
        ids = [f.id for f in self.fixes]
        for i, fix in enumerate(self.fixes):
            if ids.count(fix.id) > 1:
                raise FieldProblem(f"fixes[{i}].id", f"duplicate fix id {fix.id!r}")
            for p in fix.problems:
                if p not in self.problems:
                    raise FieldProblem(f"fixes[{i}].problems", f"unknown problem {p!r}; define it under 'problems'")
            for knob in fix.overrides:
                if knob not in self.knobs:
                    raise FieldProblem(f"fixes[{i}].overrides.{knob}", "unknown knob; define it under 'knobs'")
            for other in fix.conflicts:
                if other not in ids:
                    raise FieldProblem(f"fixes[{i}].conflicts", f"unknown fix {other!r}")


def load_knowledge(path: str | Path) -> Knowledge:
    return load_yaml(Knowledge, path, KNOWLEDGE_SCHEMA_VERSION)


def save_knowledge(knowledge: Knowledge, path: str | Path) -> None:
    dump_yaml(knowledge, path)
