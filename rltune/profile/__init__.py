"""Profile and diagnose: stage tables from jobs rltune runs and from framework logs, and what limits the step.

Public API:

- ``stage_table_from_logs(path, format='auto', run_id=None, warmup_steps=0) -> (pyarrow.Table, ParseReport)``
- ``diagnose(table, rl_mode, warmup_steps=0, run_id=None) -> Diagnosis``
- ``profile_job(job_path, run_dir, steps=None, overrides=None, on_output=None) -> ProfileResult``
  (run_dir, table, diagnosis, launch)
- ``describe_stage_map() -> str`` (markdown for docs/artifacts.md); ``PROBLEM_IDS``.
"""

from rltune.profile.detectors import PROBLEM_IDS
from rltune.profile.diagnose import NotDiagnosableError, diagnose, infer_rl_mode
from rltune.profile.report import ParseReport
from rltune.profile.run import ProfileResult, profile_job
from rltune.profile.stage_map import STAGE_MAP, describe_stage_map
from rltune.profile.table import stage_table_from_logs

__all__ = [
    "PROBLEM_IDS",
    "STAGE_MAP",
    "NotDiagnosableError",
    "ParseReport",
    "ProfileResult",
    "describe_stage_map",
    "diagnose",
    "infer_rl_mode",
    "profile_job",
    "stage_table_from_logs",
]
