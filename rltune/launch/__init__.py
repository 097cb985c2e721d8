"""Launch jobs: argv building, launchers (local, torchrun, slurm, ray), override dialects, run dirs.

Public API:

- ``run_job(job, job_path, run_dir, overrides=None, steps=None, on_output=None, on_submit=None) -> LaunchResult``
  (fields argv, returncode, timed_out, wall_s, log_path, run_dir, state, identity; ``log_tail(n)``);
  ``on_submit(identity)`` gets the job's JSON identity as soon as it is submitted.
- ``resume_job(identity, on_output=None) -> LaunchResult``: the result of a run an earlier process
  submitted (read from its launch.json, or followed on its scheduler; ``lost`` when nobody has it).
- ``reattach(identity) -> JobHandle``: the job an identity names, from another process (after a crash);
  ``poll()``, ``wait(timeout)``, ``cancel()``, ``follow() -> LaunchResult``.
- ``make_launcher(launch_spec, where) -> Launcher``: ``submit(Submission) -> JobHandle``, ``reattach(JobIdentity)``.
- ``build_argv(job, job_path, run_dir, overrides=None, steps=None) -> list[str]``: what run_job starts.
- ``render_overrides(dialect, {key: value}) -> list[str]``.
- ``launcher_argv(launcher, argv, nproc_per_node=1, slurm_args=()) -> list[str]``.
- ``new_run_dir(name, root=Path('runs')) -> Path``.
- ``request_stop()``: every ``follow`` in this process cancels its job and raises ``Stopped``.
"""

from rltune.launch.base import (
    JobHandle,
    JobIdentity,
    JobState,
    Launcher,
    LaunchResult,
    Stopped,
    Submission,
    live_handles,
    request_stop,
    reset_stop,
)
from rltune.launch.dialects import DIALECTS, OverrideError, render_overrides
from rltune.launch.job import (
    LaunchInputError,
    UnmappedKnobError,
    build_argv,
    check_launch,
    resolved_job,
    resume_job,
    run_job,
)
from rltune.launch.launchers import LAUNCHERS, launcher_argv, make_launcher, reattach
from rltune.launch.rundir import new_run_dir, new_run_id

__all__ = [
    "DIALECTS",
    "LAUNCHERS",
    "JobHandle",
    "JobIdentity",
    "JobState",
    "LaunchResult",
    "Launcher",
    "OverrideError",
    "Stopped",
    "Submission",
    "LaunchInputError",
    "UnmappedKnobError",
    "check_launch",
    "build_argv",
    "launcher_argv",
    "live_handles",
    "make_launcher",
    "new_run_dir",
    "new_run_id",
    "reattach",
    "render_overrides",
    "request_stop",
    "reset_stop",
    "resolved_job",
    "resume_job",
    "run_job",
]
