"""learning-checks.yaml: what the reward checks of a case library's jobs found, and what they ban.

``rltune auto`` writes it into the case library's directory (beside the cases, which it ignores as
it reads only ``*.parquet``) each time it checks a tuned preset's learning before writing it
(``--reward-check``). One record per check: the job, the verdict and, for a check that failed, the
knob values the tuner stops proposing for that job -- the change the check blamed. Any later
``auto`` of the same job on the same library (a resumed one, or a fresh work directory given
``--library``) reads the bans before its first round and never runs a setup that holds one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rltune.contracts.schema import dump_yaml, field, load_yaml

LEARNING_SCHEMA_VERSION = 1
LEARNING_CHECKS_NAME = "learning-checks.yaml"


@dataclass
class LearningBan:
    change: str = field(doc="the kept change the check blamed, as it names it ('<trial> (<fixes>)', or '...: <knob>' for one knob of a bundle)")
    knobs: dict[str, Any] = field(doc="knob values the tuner no longer proposes for the job: a setup holding all of them is not run")


@dataclass
class LearningCheckRecord:
    job_name: str = field(doc="the job (job.yaml name) whose tuned preset was checked")
    decision: Literal["pass", "fail"] = field(doc="the reward check's decision")
    reason: str = field(doc="its one-line reason")
    verdict: str = field(doc="its reward_check.yaml, relative to this file's directory")
    steps: int = field(doc="steps of each of its runs", min=1)
    tuned_knobs: dict[str, Any] = field(doc="the knobs of the setup checked")
    time: float = field(doc="Unix time the record was written", min=0)
    banned: list[LearningBan] = field(default_factory=list, doc="for a failed check: what the tuner stops proposing for this job")


@dataclass
class LearningChecks:
    schema_version: int = field(doc="version of this schema (1)")
    learning_checks: list[LearningCheckRecord] = field(default_factory=list, doc="every check recorded, oldest first")


def learning_checks_path(library: str | os.PathLike) -> Path:
    return Path(library) / LEARNING_CHECKS_NAME


def load_learning_checks(library: str | os.PathLike) -> LearningChecks:
    """The library's record (empty when there is none yet); a damaged file is refused, naming it."""
    path = learning_checks_path(library)
    if not path.exists():
        return LearningChecks(schema_version=LEARNING_SCHEMA_VERSION)
    return load_yaml(LearningChecks, path, LEARNING_SCHEMA_VERSION)


def record_learning_check(library: str | os.PathLike, record: LearningCheckRecord) -> Path:
    """Add ``record`` to the library's file (written whole, atomically) and return its path."""
    path = learning_checks_path(library)
    checks = load_learning_checks(library)
    checks.learning_checks.append(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    dump_yaml(checks, path)
    return path


def banned_for(checks: LearningChecks, job_name: str) -> list[dict[str, Any]]:
    """Every knob set banned for ``job_name`` by the recorded checks."""
    return [dict(ban.knobs) for record in checks.learning_checks if record.job_name == job_name
            for ban in record.banned]


__all__ = ["LEARNING_CHECKS_NAME", "LEARNING_SCHEMA_VERSION", "LearningBan", "LearningCheckRecord", "LearningChecks",
           "banned_for", "learning_checks_path", "load_learning_checks", "record_learning_check"]
