"""Profile and diagnose: stage tables from jobs rltune runs and from framework logs, and what limits the step.

Public API:

- ``stage_table_from_logs(path, format='auto', run_id=None, warmup_steps=0) -> (pyarrow.Table, ParseReport)``
- ``diagnose(table, rl_mode, warmup_steps=0, run_id=None) -> Diagnosis``
- ``record_run(job_path, run_dir, overrides=None, steps=None, ...) -> RecordedRun``: the one run
  recorder behind profile, trial and auto (never raises for the job's own failure);
  ``record_logs(path, run_dir, ...)`` the same for existing logs; ``profile_job`` raises
  :class:`JobFailedError` when the job failed
- ``describe_stage_map() -> str`` (markdown for docs/artifacts.md); ``PROBLEM_IDS``.
"""

from rltune.profile.detectors import PROBLEM_IDS
from rltune.profile.diagnose import NotDiagnosableError, diagnose, infer_rl_mode
from rltune.profile.report import ParseReport
from rltune.profile.run import JobFailedError, RecordedRun, profile_job, record_logs, record_run
from rltune.profile.stage_map import STAGE_MAP, describe_stage_map
from rltune.profile.table import stage_table_from_logs

__all__ = [
    "PROBLEM_IDS",
    "STAGE_MAP",
    "NotDiagnosableError",
    "ParseReport",
    "JobFailedError",
    "RecordedRun",
    "describe_stage_map",
    "diagnose",
    "infer_rl_mode",
    "profile_job",
    "record_logs",
    "record_run",
    "stage_table_from_logs",
]
