"""``launcher: ray``: each run is one Ray job, submitted to a running cluster through its jobs API.

Submission. ``JobSubmissionClient(launch.ray_address).submit_job(...)`` with the entrypoint::

    cd <workdir> && export PATH=<this rltune's bin>:"$PATH" PYTHONUNBUFFERED=1
      && exec timeout --kill-after=10 <launch.timeout_s + 30> <argv>

launch.env as the runtime environment's ``env_vars``, and ``launch.ray_args`` (spelled as for ``ray
job submit``) as the remaining keywords. The entrypoint runs on the cluster, so the working
directory and the argv's programs must exist there (a shared file system, or one image); no
working directory is uploaded. The submission id is ``rltune-<run id>-<6 hex>``; the job's metadata
names the run directory. rltune stops the job once it has run launch.timeout_s (from Ray's
start_time, the submission's: a PENDING job's wait counts; launch.queue_timeout_s bounds a longer
one); ``timeout`` ends it on the cluster if rltune is gone by then (exit code 124 after the limit
reads as timed out).

Following. ``get_job_info`` every poll_s seconds; the job's log (``get_job_logs``, all of it each
time) is copied into the run directory's launch.log from where this run's lines begin, and new
lines go to ``on_output``. Ray's states: PENDING/RUNNING, SUCCEEDED, FAILED (``driver_exit_code``),
STOPPED (cancelled). A job the cluster no longer knows (a restarted head) is ``lost``.

Stopping. ``stop_job``: Ray sends SIGTERM to the entrypoint's process group, then SIGKILL; cancel()
returns once the job is in a final state.

Identity. ``job_id``: the submission id; ``address``: the jobs API URL; ``extra``: the log's size at
submission.

Ray is imported only here, when a job uses this launcher (``pip install 'rltune[ray]'``).
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rltune.contracts.job import ray_submit_options
from rltune.contracts.rundir import RUN_DIR_ENV
from rltune.errors import LaunchError
from rltune.launch.base import (
    CANCELLED,
    FAILED,
    LOST,
    NO_CODE,
    PENDING,
    RUNNING,
    SUCCEEDED,
    TIMED_OUT,
    JobHandle,
    JobIdentity,
    JobState,
    Launcher,
    SchedulerUnreachable,
    Submission,
    file_size,
)

# The cluster-side limit trails rltune's own, so that rltune's cancel normally comes first.
BACKSTOP_GRACE_S = 30
TIMEOUT_EXIT_CODE = 124  # coreutils timeout's exit code when the limit ended the command


def _client(address: str, where: str) -> Any:
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise LaunchError(f"{where}: launch.launcher: ray needs the ray package here; pip install 'rltune[ray]' "
                          "(or 'ray[default]')") from None
    try:
        return JobSubmissionClient(address)
    except (ConnectionError, OSError, RuntimeError) as exc:
        raise LaunchError(f"{where}: launch.launcher: ray: no Ray jobs API answers at {address} ({exc}); start the "
                          "cluster's head with its dashboard (ray start --head --dashboard-host=...) or fix "
                          "launch.ray_address") from None


def entrypoint(submission: Submission) -> str:
    """The shell command the Ray job runs (see the module docstring)."""
    bin_dir = str(Path(sys.executable).parent)
    limit = int(submission.timeout_s) + BACKSTOP_GRACE_S
    return (f"cd {shlex.quote(str(submission.cwd))} && export PATH={shlex.quote(bin_dir)}:\"$PATH\" "
            f"PYTHONUNBUFFERED=1 && exec timeout --kill-after=10 {limit} {shlex.join(submission.argv)}")


class RayHandle(JobHandle):
    def __init__(self, identity: JobIdentity, client: Any, on_output: Callable[[str], None] | None = None,
                 timeout_s: float | None = None):
        super().__init__(identity, on_output)
        self.client = client
        self.timeout_s = identity.timeout_s if timeout_s is None else timeout_s
        self._offset = int(identity.extra.get("log_offset", 0))
        self._copied = 0        # characters of Ray's log already in launch.log
        self._partial = ""
        self._log_started = False

    def poll(self) -> JobState:
        from ray.job_submission import JobStatus

        try:
            info = self.client.get_job_info(self.identity.job_id)
        except RuntimeError as exc:  # the API answers 404 for a job it does not know
            if "does not exist" in str(exc) or "404" in str(exc):
                return JobState(LOST, NO_CODE, f"the Ray cluster at {self.identity.address} no longer knows job "
                                               f"{self.identity.job_id}")
            raise SchedulerUnreachable(f"ray: get_job_info {self.identity.job_id}: {exc}") from None
        except (ConnectionError, OSError) as exc:
            raise SchedulerUnreachable(f"ray: jobs API at {self.identity.address}: {exc}") from None
        status = info.status
        word = str(getattr(status, "value", status))
        if status == JobStatus.PENDING:
            return JobState(PENDING, None, word)
        if status == JobStatus.RUNNING:
            # Ray's start_time is the submission's: the run's limit counts from there, PENDING included.
            return JobState(RUNNING, None, word, (info.start_time or 0) / 1000.0 or None)
        code = info.driver_exit_code
        if status == JobStatus.SUCCEEDED:
            return JobState(SUCCEEDED, 0, word)
        if status == JobStatus.STOPPED:
            return JobState(CANCELLED, code if code else -15, f"{word} ({info.message})" if info.message else word)
        ran_s = ((info.end_time or 0) - (info.start_time or 0)) / 1000.0
        if code == TIMEOUT_EXIT_CODE and ran_s >= self.timeout_s:
            return JobState(TIMED_OUT, code, f"{word} (the cluster-side limit of {self.timeout_s:g} s ended it)")
        return JobState(FAILED, code if code is not None else NO_CODE, f"{word} ({info.error_type or 'error'})")

    def _pump(self) -> None:
        try:
            text = self.client.get_job_logs(self.identity.job_id)
        except (RuntimeError, ConnectionError, OSError):
            return  # the next poll says whether the cluster is gone
        if not self._log_started:
            # This run's lines begin at log_offset; a reattached handle rewrites them from Ray's copy.
            with open(self.identity.log_path, "ab") as log:
                log.truncate(self._offset)
            self._log_started = True
        new = text[self._copied:]
        if not new:
            return
        with open(self.identity.log_path, "a", encoding="utf-8") as log:
            log.write(new)
        self._copied = len(text)
        if self.on_output is not None:
            *lines, self._partial = (self._partial + new).split("\n")
            for line in lines:
                self.on_output(line)

    def _request_cancel(self) -> None:
        try:
            self.client.stop_job(self.identity.job_id)
        except (ConnectionError, OSError) as exc:
            raise SchedulerUnreachable(f"ray: stop_job {self.identity.job_id}: {exc}") from None
        except RuntimeError:
            pass  # already finished or unknown: the next poll says which

    def stop_hint(self) -> str:
        return f"ray job stop --address {self.identity.address} {self.identity.job_id}"


# How long a submission waits for a head's job agent that asks to try again later.
AGENT_WAIT_S = 60.0


class RayLauncher(Launcher):
    kind = "ray"

    def address(self) -> str:
        address = (self.spec.ray_address if self.spec is not None else None) or \
            os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
        if not address:
            raise LaunchError(f"{self.where}: launch.ray_address: not set, nor RAY_API_SERVER_ADDRESS or RAY_ADDRESS; "
                              "give the cluster's jobs API, e.g. http://HEAD:8265")
        return address

    def submit(self, submission: Submission) -> JobHandle:
        address = self.address()
        client = _client(address, self.where)
        options = ray_submit_options(list(self.spec.ray_args) if self.spec is not None else [])
        runtime_env = dict(options.pop("runtime_env", {}))
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **(self.spec.env if self.spec else {})}
        if RUN_DIR_ENV in submission.env:  # the run dir rltune made for the job, as the local launchers pass it
            runtime_env["env_vars"][RUN_DIR_ENV] = submission.env[RUN_DIR_ENV]
        metadata = {**options.pop("metadata", {}), "rltune_run": submission.name,
                    "rltune_run_dir": str(submission.run_dir)}
        job_id = f"rltune-{re.sub(r'[^A-Za-z0-9_-]+', '-', submission.name)[:80]}-{secrets.token_hex(3)}"
        log_offset = file_size(submission.log_path)
        submitted_at = time.time()
        try:
            # A head whose job agent is still starting (or busy) answers 'No available agent ... try again
            # later': that is the cluster asking for patience, not refusing the job.
            deadline = time.monotonic() + AGENT_WAIT_S
            while True:
                try:
                    client.submit_job(entrypoint=entrypoint(submission), submission_id=job_id, runtime_env=runtime_env,
                                      metadata={k: str(v) for k, v in metadata.items()}, **options)
                    break
                except RuntimeError as exc:
                    if "try again later" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)
        except (ConnectionError, OSError, RuntimeError, TypeError, ValueError) as exc:
            # RuntimeError: the API's refusal; TypeError/ValueError: the client's own check of runtime_env.
            raise LaunchError(f"{self.where}: launch.launcher: ray: the cluster at {address} refused the job: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; check launch.ray_args "
                              "and the cluster's resources (ray status)") from None
        identity = JobIdentity(
            launcher=self.kind, job_id=job_id, address=address, run_dir=str(submission.run_dir),
            log_path=str(submission.log_path), submitted_at=submitted_at,
            timeout_s=submission.timeout_s, queue_timeout_s=submission.queue_timeout_s, argv=list(submission.argv),
            extra={"log_offset": log_offset})
        return RayHandle(identity, client, submission.on_output, submission.timeout_s)

    def reattach(self, identity: JobIdentity, on_output: Callable[[str], None] | None = None) -> JobHandle:
        return RayHandle(identity, _client(identity.address, identity.run_dir), on_output)


LAUNCHER = RayLauncher
