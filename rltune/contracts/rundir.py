"""The run directory: what one real run leaves on disk, and the one place its file names are spelled.

A run directory holds, as its run goes: ``job.yaml`` (the resolved job: knobs as run, steps set),
``launch.json`` (the launcher's identity, then the result), ``launch.log``, the job's metrics,
``stages.parquet`` (one row per step), ``diagnosis.yaml`` and, for a trial, ``verdict.yaml``.
Everything that rebuilds a run from its directory (the tuner's resume, the reward check's reuse of
finished runs, ``predict``'s baseline case, ``trial`` and the report) reads it through
:class:`RunDir`, and a file that is missing or cannot be read is one located line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltune.errors import MalformedFileError

JOB_NAME = "job.yaml"
LAUNCH_NAME = "launch.json"
LOG_NAME = "launch.log"
STAGES_NAME = "stages.parquet"
DIAGNOSIS_NAME = "diagnosis.yaml"
VERDICT_NAME = "verdict.yaml"
PARSE_REPORT_NAME = "parse_report.json"

# Set in a launched job's environment to the run directory rltune made for it: the job may write its
# outputs there, whatever rltune (launch.json, job.yaml) or an earlier attempt of the same run left in it.
RUN_DIR_ENV = "RLTUNE_RUN_DIR"

# The files whose presence makes a directory a recorded run's: no command writes another run into it.
RUN_MARKERS = (STAGES_NAME, DIAGNOSIS_NAME, VERDICT_NAME, LAUNCH_NAME)


@dataclass(frozen=True)
class RunDir:
    """One run's directory."""

    path: Path

    def __init__(self, path: str | os.PathLike):
        object.__setattr__(self, "path", Path(path))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def stages_path(self) -> Path:
        return self.path / STAGES_NAME

    @property
    def diagnosis_path(self) -> Path:
        return self.path / DIAGNOSIS_NAME

    @property
    def verdict_path(self) -> Path:
        return self.path / VERDICT_NAME

    @property
    def job_path(self) -> Path:
        return self.path / JOB_NAME

    @property
    def launch_path(self) -> Path:
        return self.path / LAUNCH_NAME

    @property
    def log_path(self) -> Path:
        return self.path / LOG_NAME

    def is_run(self) -> bool:
        """Whether a run left any of its files here."""
        return any((self.path / name).exists() for name in RUN_MARKERS)

    def has_stages(self) -> bool:
        return self.stages_path.is_file()

    def rows(self) -> list[dict[str, Any]]:
        """The stage table's rows (validated as ``stages.parquet``)."""
        from rltune.contracts.stages import read_stages

        return read_stages(self.stages_path).to_pylist()

    def table(self) -> Any:
        from rltune.contracts.stages import read_stages

        return read_stages(self.stages_path)

    def diagnosis(self) -> Any:
        from rltune.contracts.diagnosis import load_diagnosis

        return load_diagnosis(self.diagnosis_path)

    def verdict(self) -> Any:
        from rltune.contracts.verdict import load_verdict

        return load_verdict(self.verdict_path)

    def job(self) -> Any:
        """The resolved job the run ran (knobs as run, steps set)."""
        from rltune.contracts.job import load_job

        return load_job(self.job_path)

    def launch_record(self) -> dict[str, Any]:
        """launch.json: the launcher's identity and, once the job ended, its result."""
        try:
            data = json.loads(self.launch_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise MalformedFileError(str(self.launch_path), "", "no such file; the run was never submitted") from None
        except (OSError, UnicodeDecodeError, ValueError):
            raise MalformedFileError(str(self.launch_path), "", "not a JSON object; the run's launch record is "
                                                                 "damaged: run it again") from None
        if not isinstance(data, dict):
            raise MalformedFileError(str(self.launch_path), "", "expected a JSON object")
        return data

    def finished_ok(self) -> bool:
        """Whether launch.json records the job exiting 0 within its time."""
        try:
            record = self.launch_record()
        except MalformedFileError:
            return False
        return record.get("returncode") == 0 and not record.get("timed_out")

    def wall_s(self) -> float:
        """The job's wall time from launch.json (0 when it is not recorded)."""
        try:
            value = self.launch_record().get("wall_s")
        except MalformedFileError:
            return 0.0
        return float(value) if isinstance(value, (int, float)) and value >= 0 else 0.0


__all__ = ["DIAGNOSIS_NAME", "JOB_NAME", "LAUNCH_NAME", "LOG_NAME", "PARSE_REPORT_NAME", "RUN_DIR_ENV", "RUN_MARKERS", "RunDir",
           "STAGES_NAME", "VERDICT_NAME"]
