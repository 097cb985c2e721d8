"""``launcher: local``: the argv as a process group on this machine (see :mod:`rltune.launch.process`).

Identity: ``job_id`` is the group's id (its leader's pid), ``address`` this host's name, and
``extra`` holds the leader's start time in clock ticks since boot and the boot id, so that a
recycled pid is never taken for the job.

A local job does not outlive its submitter: its output goes through a pipe that closes when the
submitter dies, and the job fails at its next line. So :meth:`LocalLauncher.reattach` cannot follow
it; it gives a handle that reports the job ``lost`` once its group is gone and whose ``cancel()``
kills what is left of it, so that a resumed tuner can clear the way before it runs the job again.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rltune.launch import process
from rltune.launch.base import (
    CANCELLED,
    FAILED,
    LOST,
    NO_CODE,
    RUNNING,
    SUCCEEDED,
    JobHandle,
    JobIdentity,
    JobState,
    Launcher,
    Submission,
)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: when the process started, in clock ticks after boot (None if gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 else None


class LocalHandle(JobHandle):
    """A process group this process started and owns."""

    poll_s = 0.5

    def __init__(self, identity: JobIdentity, started: process.StartedProcess):
        super().__init__(identity)
        self._started = started

    def poll(self) -> JobState:
        if self._started.proc.poll() is None:
            return JobState(RUNNING, started_at=self.identity.submitted_at)
        code = self._started.finish()
        if self._cancel_requested:
            return JobState(CANCELLED, code, "killed by rltune")
        return JobState(SUCCEEDED if code == 0 else FAILED, code, f"exit code {code}")

    def _pause(self, seconds: float) -> None:
        try:  # wake as soon as the leader exits
            self._started.proc.wait(timeout=max(0.0, seconds))
        except subprocess.TimeoutExpired:
            pass

    def _request_cancel(self) -> None:
        process.kill_group(self._started.pgid)

    def stop_hint(self) -> str:
        return f"kill -- -{self.identity.job_id}"


class LocalOrphanHandle(JobHandle):
    """A process group started by a process that has since died: it can be waited out or killed, not followed."""

    poll_s = 0.5

    def poll(self) -> JobState:
        if _is_ours_and_alive(self.identity):
            return JobState(RUNNING, detail="its submitter is gone; output is no longer recorded",
                            started_at=self.identity.submitted_at)
        return JobState(LOST, NO_CODE, "a local job does not outlive the process that started it; run it again")

    def _request_cancel(self) -> None:
        if _is_ours_and_alive(self.identity):
            process.kill_group(int(self.identity.job_id))

    def stop_hint(self) -> str:
        return f"kill -- -{self.identity.job_id}"


def _is_ours_and_alive(identity: JobIdentity) -> bool:
    if identity.extra.get("host") != socket.gethostname() or identity.extra.get("boot_id") != _boot_id():
        return False
    pgid = int(identity.job_id)
    ticks = _start_ticks(pgid)
    if ticks is not None and ticks != identity.extra.get("start_ticks"):
        return False  # the pid now belongs to another process
    # With the leader gone, members still hold the group id, and Linux gives no new process that
    # id while they exist; so a live group of this id is still ours.
    return process.group_alive(pgid)


class LocalLauncher(Launcher):
    kind = "local"

    def submit(self, submission: Submission) -> JobHandle:
        started = process.start_process(submission.argv, cwd=submission.cwd, env=submission.env,
                                        log_path=submission.log_path, on_output=submission.on_output)
        now = time.time()
        identity = JobIdentity(
            launcher=self.kind, job_id=str(started.pgid), address=socket.gethostname(),
            run_dir=str(submission.run_dir), log_path=str(submission.log_path), submitted_at=now,
            timeout_s=submission.timeout_s, queue_timeout_s=submission.queue_timeout_s, argv=list(submission.argv),
            extra={"host": socket.gethostname(), "boot_id": _boot_id(), "start_ticks": _start_ticks(started.pgid)})
        handle = LocalHandle(identity, started)
        handle._t0 = started.started
        return handle

    def reattach(self, identity: JobIdentity, on_output: Callable[[str], None] | None = None) -> JobHandle:
        return LocalOrphanHandle(identity, on_output)


LAUNCHER = LocalLauncher
