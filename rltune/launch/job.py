"""Launch one job from its job.yaml: the argv, the run, the resolved job.

What runs is the job's knobs: :func:`run_job` fills ``{run_dir}`` and ``{steps}`` into
``launch.command``, appends the step-count override (``limits.steps`` unless a step count is
given) and *every* mapped knob of the job -- its ``knobs:`` with the overrides applied --
translated through ``launch.knob_map`` and spelled in ``launch.dialect``. A tuned or hand-edited
preset therefore reproduces its run, and the resolved job.yaml written into the run directory
(knobs as run, steps set, absolute working directory) says exactly what ran. A knob without a
``knob_map`` entry only describes the job; overriding it to another value is an error. The argv
is wrapped in the launcher and started through it (:mod:`rltune.launch.launchers`: a process group
here, a SLURM batch job, a Ray job). launch.json in the run directory holds the job's identity from
the moment it is submitted, and the result once it has ended. A crash is not an exception here: it
comes back as a non-zero :attr:`LaunchResult.returncode`; callers decide.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rltune.contracts.job import JobSpec, KnobValue, save_job
from rltune.contracts.rundir import JOB_NAME, LOG_NAME, RUN_DIR_ENV
from rltune.errors import RltuneError
from rltune.launch.base import RESULT_NAME as RESULT_NAME  # its old home; launch.json is written by base
from rltune.launch.base import LaunchResult, Submission, result_record, write_record
from rltune.launch.dialects import render_overrides
from rltune.launch.launchers import launcher_argv, make_launcher

# Steps a run may be asked for: a count past this is a typo, not a job.
MAX_STEPS = 1_000_000


class LaunchInputError(RltuneError):
    """The job cannot be started as given (bad input): refused before anything runs or is recorded."""

    exit_code = 2


class UnmappedKnobError(LaunchInputError):
    """An override names an abstract knob the job's launch.knob_map does not translate."""


def _fill(text: str, run_dir: Path, steps: int) -> str:
    # str.replace, not str.format: other braces in the argv (JSON values, hydra interpolations) stay as they are.
    return text.replace("{run_dir}", str(run_dir)).replace("{steps}", str(steps))


def run_knobs(job: JobSpec, overrides: Mapping[str, KnobValue] | None = None) -> dict[str, KnobValue]:
    """The knob values a run uses: the job's ``knobs`` with ``overrides`` applied."""
    return {**job.knobs, **dict(overrides or {})}


def run_steps(job: JobSpec, steps: int | None = None) -> int:
    """The step count of a run: ``steps`` if given, else the job's ``limits.steps``."""
    return int(steps if steps is not None else job.limits.steps)


def check_steps(steps: int | None, flag: str = "--steps") -> None:
    """Refuse a step count no run can have (bad input, exit 2)."""
    if steps is None:
        return
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        shown = str(steps) if len(str(steps)) <= 24 else str(steps)[:21] + "..."
        raise LaunchInputError(f"{flag} {shown}: give a step count from 1 to {MAX_STEPS}")


def check_launch(job: JobSpec, job_path: Path, overrides: Mapping[str, KnobValue] | None = None,
                 steps: int | None = None) -> None:
    """Refuse, before anything runs or is recorded, a job that cannot start as given: a step count out of
    range, an override its knob_map cannot pass, a working directory or a program that does not exist.

    A job refused here is the user's input to fix (exit 2), never a run that failed.
    """
    check_steps(steps)
    argv = build_argv(job, job_path, Path(job_path).resolve().parent / "run", overrides, steps)
    workdir = workdir_of(job, job_path)
    if not workdir.is_dir():
        raise LaunchInputError(f"{job_path}: launch.workdir: {workdir} is not a directory; it is relative to the job file")
    env = _child_env(job)
    if os.sep not in argv[0] and shutil.which(argv[0], path=env["PATH"]) is None:
        raise LaunchInputError(f"{job_path}: launch.command[0]: {argv[0]!r} is not on PATH; give a full path or "
                               f"install it")
    if os.sep in argv[0] and "{" not in job.launch.command[0] and job.launch.launcher in ("local", "torchrun"):
        program = Path(argv[0]) if Path(argv[0]).is_absolute() else workdir / argv[0]
        if not program.is_file():
            raise LaunchInputError(f"{job_path}: launch.command[0]: {argv[0]!r} does not exist (looked for {program}); "
                                   f"give the program's path")


def resolve_overrides(job: JobSpec, job_path: Path, overrides: Mapping[str, KnobValue] | None,
                      steps: int | None) -> dict[str, KnobValue]:
    """The job's own override keys and values: the step count first, then every mapped knob as it runs."""
    resolved: dict[str, KnobValue] = {}
    if job.launch.steps_override:
        resolved[job.launch.steps_override] = run_steps(job, steps)
    for knob, value in run_knobs(job, overrides).items():
        key = job.launch.knob_map.get(knob)
        if key is not None:
            resolved[key] = value
        elif knob not in job.knobs or job.knobs[knob] != value:
            known = ", ".join(sorted(job.launch.knob_map)) or "none"
            raise UnmappedKnobError(f"{job_path}: launch.knob_map: no entry for knob {knob!r} (mapped: {known}); "
                                    f"add '{knob}: <the job's config key>' under launch.knob_map")
    return resolved


def build_argv(job: JobSpec, job_path: Path, run_dir: Path, overrides: Mapping[str, KnobValue] | None = None,
               steps: int | None = None) -> list[str]:
    """The complete argv :func:`run_job` would start (launcher included)."""
    command = [_fill(part, run_dir, run_steps(job, steps)) for part in job.launch.command]
    command += render_overrides(job.launch.dialect, resolve_overrides(job, job_path, overrides, steps))
    return launcher_argv(job.launch.launcher, command, nproc_per_node=job.launch.nproc_per_node,
                         slurm_args=list(job.launch.slurm_args))


def resolved_job(job: JobSpec, job_path: Path, overrides: Mapping[str, KnobValue] | None = None,
                 steps: int | None = None) -> JobSpec:
    """A copy of ``job`` as it runs: knobs with the overrides applied, steps set, absolute workdir."""
    out = copy.deepcopy(job)
    out.knobs = run_knobs(job, overrides)
    out.launch.workdir = str(workdir_of(job, job_path))
    out.limits.steps = run_steps(job, steps)
    out.limits.warmup_steps = warmup_steps(job.limits.warmup_steps, out.limits.steps)
    return out


def warmup_steps(configured: int, steps: int) -> int:
    """The warm-up steps of a run of ``steps`` steps: the job's, but always leaving one step measured."""
    return max(0, min(int(configured), int(steps) - 1))


def workdir_of(job: JobSpec, job_path: Path) -> Path:
    return (Path(job_path).resolve().parent / job.launch.workdir).resolve()


def metrics_path_of(job: JobSpec, job_path: Path, run_dir: Path) -> Path:
    """Where a run in ``run_dir`` writes its metrics: ``metrics.path`` filled in, relative to the workdir."""
    path = Path(job.metrics.path.replace("{run_dir}", str(Path(run_dir).resolve())))
    return path if path.is_absolute() else workdir_of(job, job_path) / path


def _child_env(job: JobSpec) -> dict[str, str]:
    env = dict(os.environ)
    # The job runs in the same Python environment as rltune, so 'rltune' and 'python' in its argv
    # resolve to this installation even when its bin directory is not on the caller's PATH.
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"  # log lines arrive as they are printed, and survive a kill
    env.update(job.launch.env)
    return env


def run_job(job: JobSpec, job_path: Path, run_dir: Path, overrides: dict[str, KnobValue] | None = None,
            steps: int | None = None, on_output: Callable[[str], None] | None = None,
            on_submit: Callable[[dict[str, Any]], None] | None = None) -> LaunchResult:
    """Run ``job`` once in ``run_dir``; see the module docstring. Raises LaunchInputError if it cannot start as given.

    ``on_submit(identity)`` is called once the job is submitted, before it is waited for, with its
    JSON identity (:class:`~rltune.launch.base.JobIdentity`): journal it, and after a crash
    :func:`rltune.launch.reattach` finds the job again.
    """
    job_path = Path(job_path)
    check_launch(job, job_path, overrides, steps)
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = build_argv(job, job_path, run_dir, overrides, steps)
    env = _child_env(job)
    env[RUN_DIR_ENV] = str(run_dir)
    workdir = workdir_of(job, job_path)
    save_job(resolved_job(job, job_path, overrides, steps), run_dir / JOB_NAME)
    log_path = run_dir / LOG_NAME
    handle = make_launcher(job.launch, str(job_path)).submit(Submission(
        argv=argv, cwd=workdir, env=env, run_dir=run_dir, log_path=log_path, timeout_s=job.launch.timeout_s,
        name=run_dir.name, queue_timeout_s=job.launch.queue_timeout_s, on_output=on_output))
    try:
        write_record(run_dir, {"state": "submitted", "identity": handle.identity.to_json()})
        if on_submit is not None:
            on_submit(handle.identity.to_json())
    except BaseException:
        handle.cancel()
        raise
    result = handle.follow()
    write_record(run_dir, result_record(result))
    return result


def resume_job(identity: dict[str, Any], on_output: Callable[[str], None] | None = None) -> LaunchResult:
    """The result of a run submitted by an earlier process (rltune killed while it ran).

    A run whose launch.json already holds its result is read from there. A job still known to its
    scheduler is followed to its end (its limits count from its own start); one that finished while
    nobody watched gives its exit state. A job nobody can find any more (a local process group that
    died with rltune, a cluster that forgot it) comes back ``lost``: the caller runs it again.
    """
    from rltune.launch.launchers import reattach

    run_dir = Path(identity["run_dir"])
    try:
        record = json.loads((run_dir / RESULT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = {}
    if isinstance(record, dict) and isinstance(record.get("returncode"), int) and record.get("state"):
        return LaunchResult(argv=list(record.get("argv") or []), returncode=record["returncode"],
                            timed_out=bool(record.get("timed_out")), wall_s=float(record.get("wall_s") or 0.0),
                            log_path=Path(record.get("log_path") or run_dir / LOG_NAME), run_dir=run_dir,
                            state=record["state"], identity=record.get("identity") or identity)
    handle = reattach(identity, on_output)
    state = handle.poll()
    if state.finished:
        result = handle.result(state)
    else:
        result = handle.follow()
    write_record(run_dir, result_record(result))
    return result
