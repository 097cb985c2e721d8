"""Launch jobs: argv building for local / torchrun / slurm, override dialects, process groups, run dirs.

Public API:

- ``run_job(job, job_path, run_dir, overrides=None, steps=None, on_output=None) -> LaunchResult``
  (fields argv, returncode, timed_out, wall_s, log_path, run_dir; ``log_tail(n)``).
- ``build_argv(job, job_path, run_dir, overrides=None, steps=None) -> list[str]``: what run_job starts.
- ``render_overrides(dialect, {key: value}) -> list[str]``.
- ``launcher_argv(launcher, argv, nproc_per_node=1, slurm_args=()) -> list[str]``.
- ``new_run_dir(name, root=Path('runs')) -> Path``.
"""

from rltune.launch.dialects import DIALECTS, OverrideError, render_overrides
from rltune.launch.job import LaunchResult, UnmappedKnobError, build_argv, resolved_job, run_job
from rltune.launch.launchers import LAUNCHERS, launcher_argv
from rltune.launch.rundir import new_run_dir, new_run_id

__all__ = [
    "DIALECTS",
    "LAUNCHERS",
    "LaunchResult",
    "OverrideError",
    "UnmappedKnobError",
    "build_argv",
    "launcher_argv",
    "new_run_dir",
    "new_run_id",
    "render_overrides",
    "resolved_job",
    "run_job",
]
