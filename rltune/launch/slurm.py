"""``launcher: slurm``: each run is one batch job — sbatch submits it, scontrol follows it, scancel stops it.

Submission. rltune writes ``slurm-job.sh`` into the run directory: the run's argv (``srun
--kill-on-bad-exit=1 <slurm_args> <command>``, as :func:`rltune.launch.build_argv` spells it), then
a line that records its exit code in ``launch.exit``. It submits that as::

    sbatch --parsable --job-name=rltune-<run id> --output=<run dir>/launch.log --open-mode=append
           --chdir=<workdir> --time=<launch.timeout_s in minutes, rounded up> --no-requeue
           <slurm_args> <run dir>/slurm-job.sh

in the run's environment, which sbatch exports to the job (PATH leads to this rltune's Python
environment; launch.env is in it). The run directory must be on a file system the compute nodes
share with the submitting host: the job writes its log and exit file there. ``--no-requeue``: a
job whose node fails ends NODE_FAIL and the tuner decides; a requeued job would run the trial a
second time into the same log.

Following. ``scontrol -o show job ID`` gives JobState and ExitCode while the controller remembers
the job (until MinJobAge, 300 s by default, after its end). Past that, ``sacct`` answers where
accounting is configured (slurmdbd, ``AccountingStorageType=accounting_storage/slurmdbd``); where it
is not (sacct: "Slurm accounting storage is disabled"), the code the job left in ``launch.exit`` is
the answer, and a job that left none is ``lost``. The log is read from its file as the job writes it.

Time limit. rltune cancels the job once it has run launch.timeout_s, counted from the StartTime
slurm reports (time in the queue does not count; launch.queue_timeout_s bounds that); slurm's own
``--time`` ends it if rltune is gone by then. Either way the run reads as timed out.

Stopping. ``scancel ID``; :meth:`SlurmHandle.cancel` returns once the controller reports the job
out of RUNNING and COMPLETING, that is once slurmd has signalled and, after KillWait, killed every
process of its steps. (With ``ProctrackType=proctrack/linuxproc`` a process that leaves its
parent's tree, e.g. by daemonizing, escapes that; clusters use proctrack/cgroup.)

Identity. ``job_id``: the SLURM job id; ``address``: slurmctld's host:port from slurm.conf;
``extra``: cluster name, job name, the slurm.conf used (``SLURM_CONF``, if set), the exit file and
the log's size at submission (where this run's lines begin).
"""

from __future__ import annotations

import math
import os
import re
import secrets
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

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
    LogTail,
    SchedulerUnreachable,
    Submission,
    file_size,
)

SCRIPT_NAME = "slurm-job.sh"
EXIT_NAME = "launch.exit"
DEFAULT_CONF = "/etc/slurm/slurm.conf"
DEFAULT_PORT = 6817
# A slurm command that has not answered in this long is taken as an unreachable controller (sbatch
# itself gives up after about MessageTimeout, 10 s by default).
COMMAND_TIMEOUT_S = 60.0

# JobState -> our state. States not listed (PENDING, RUNNING, COMPLETING, SUSPENDED, ...) are not final.
_FINAL = {
    "COMPLETED": SUCCEEDED,
    "CANCELLED": CANCELLED,
    "TIMEOUT": TIMED_OUT,
    "FAILED": FAILED, "NODE_FAIL": FAILED, "OUT_OF_MEMORY": FAILED, "BOOT_FAIL": FAILED, "DEADLINE": FAILED,
    "PREEMPTED": FAILED, "SPECIAL_EXIT": FAILED, "REVOKED": FAILED,
}
_WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
_UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Connection refused",
                "Zero Bytes were transmitted", "Communication connection failure")


def controller_of(env: dict[str, str]) -> tuple[str, str, str]:
    """(slurm.conf path, slurmctld host:port, cluster name) as the slurm commands in ``env`` will see them."""
    conf = env.get("SLURM_CONF") or DEFAULT_CONF
    host, port, cluster = "", str(DEFAULT_PORT), ""
    try:
        text = Path(conf).read_text(errors="replace")
    except OSError:
        return conf, "(slurm.conf unreadable)", ""
    for line in text.splitlines():
        key, _, value = line.split("#", 1)[0].strip().partition("=")
        key, value = key.strip().lower(), value.strip()
        if key in ("slurmctldhost", "controlmachine") and not host:
            host = value.split("(", 1)[0]
        elif key == "slurmctldport":
            port = value.split("-", 1)[0]
        elif key == "clustername":
            cluster = value
    return conf, f"{host or '?'}:{port}", cluster


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise LaunchError(f"launch.launcher: slurm: {argv[0]!r} is not on PATH; install the slurm client "
                          "(Debian: slurm-client) or run rltune on a node of the cluster") from None
    except subprocess.TimeoutExpired:
        raise SchedulerUnreachable(f"slurm: {argv[0]} did not answer in {COMMAND_TIMEOUT_S:g} s") from None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def _returncode(exit_code: str, final: str) -> int:
    """Slurm's 'code:signal' as one int: the code, else -signal, else 0 for COMPLETED and NO_CODE otherwise."""
    code, _, sig = exit_code.partition(":")
    code_i, sig_i = int(code or 0), int(sig or 0)
    if code_i:
        return code_i
    if sig_i:
        return -sig_i
    return 0 if final == SUCCEEDED else NO_CODE


def _state_of(word: str, exit_code: str, reason: str) -> JobState:
    word = word.split()[0].rstrip("+") if word else ""
    detail = word if reason in ("", "None") else f"{word} ({reason})"
    if word in _FINAL:
        final = _FINAL[word]
        return JobState(final, _returncode(exit_code, final), detail)
    return JobState(PENDING if word in _WAITING else RUNNING, None, detail)


class SlurmHandle(JobHandle):
    cancel_wait_s = 120.0  # slurm's KillWait is 30 s by default, and the epilog runs after it

    def __init__(self, identity: JobIdentity, env: dict[str, str], on_output: Callable[[str], None] | None = None):
        super().__init__(identity, on_output)
        self.env = env
        self._log = LogTail(Path(identity.log_path), int(identity.extra.get("log_offset", 0)))

    @property
    def job_name(self) -> str:
        return str(self.identity.extra.get("job_name", ""))

    def poll(self) -> JobState:
        job_id = self.identity.job_id
        shown = _run(["scontrol", "-o", "show", "job", job_id], self.env)
        if shown.returncode == 0 and "JobState=" in shown.stdout:
            text = shown.stdout
            name = re.search(r"\bJobName=(\S+)", text)
            if self.job_name and name is not None and name.group(1) != self.job_name:
                return JobState(LOST, NO_CODE, f"slurm job {job_id} is now {name.group(1)!r}, not {self.job_name!r}")
            word = re.search(r"\bJobState=(\S+)", text)
            code = re.search(r"\bExitCode=(\d+:\d+)", text)
            reason = re.search(r"\bReason=(\S+)", text)
            state = _state_of(word.group(1) if word else "", code.group(1) if code else "0:0",
                              reason.group(1) if reason else "")
            start = re.search(r"\bStartTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", text)
            if state.state == RUNNING and start is not None:
                # The controller's local time; rltune runs beside it (a login or head node of the cluster).
                started = time.mktime(time.strptime(start.group(1), "%Y-%m-%dT%H:%M:%S"))
                state = JobState(state.state, state.returncode, state.detail, started)
            return state
        message = shown.stderr.strip()
        if any(s in message for s in _UNREACHABLE) or "Invalid job id" not in message:
            raise SchedulerUnreachable(f"slurm: scontrol show job {job_id} at {self.identity.address}: "
                                       f"{_last_line(message)}")
        # The controller has forgotten the job (MinJobAge after its end, or a controller reset).
        return self._from_accounting() or self._from_exit_file()

    def _from_accounting(self) -> JobState | None:
        out = _run(["sacct", "-n", "-P", "-X", "-j", self.identity.job_id, "-o", "JobName,State,ExitCode"], self.env)
        if out.returncode != 0:  # 'Slurm accounting storage is disabled' where no slurmdbd is configured
            return None
        for line in out.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and (not self.job_name or parts[0] == self.job_name):
                return _state_of(parts[1], parts[2], "")
        return None

    def _from_exit_file(self) -> JobState:
        path = Path(str(self.identity.extra.get("exit_path", "")))
        try:
            job_id, code = path.read_text().split()
        except (OSError, ValueError):
            return JobState(LOST, NO_CODE, f"slurm no longer knows job {self.identity.job_id} and it left no {path}")
        if job_id != self.identity.job_id:
            return JobState(LOST, NO_CODE, f"{path} belongs to slurm job {job_id}, not {self.identity.job_id}")
        rc = int(code)
        return JobState(SUCCEEDED if rc == 0 else FAILED, rc, f"exit code {rc} from {path.name}")

    def _request_cancel(self) -> None:
        out = _run(["scancel", self.identity.job_id], self.env)
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            raise SchedulerUnreachable(f"slurm: scancel {self.identity.job_id}: {_last_line(out.stderr)}")

    def _pump(self) -> None:
        lines = self._log.read_lines()
        if self.on_output is not None:
            for line in lines:
                self.on_output(line)

    def stop_hint(self) -> str:
        return f"scancel {self.identity.job_id}"


class SlurmLauncher(Launcher):
    kind = "slurm"

    def submit(self, submission: Submission) -> JobHandle:
        run_dir, env = Path(submission.run_dir), dict(submission.env)
        conf, address, cluster = controller_of(env)
        exit_path = run_dir / EXIT_NAME
        exit_path.unlink(missing_ok=True)
        script = run_dir / SCRIPT_NAME
        script.write_text(_batch_script(submission, exit_path), encoding="utf-8")
        job_name = "rltune-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", submission.name)[:100]
        minutes = max(1, math.ceil(submission.timeout_s / 60.0))
        sbatch_args = list(self.spec.slurm_args) if self.spec is not None else []
        argv = ["sbatch", "--parsable", f"--job-name={job_name}", f"--output={submission.log_path}",
                "--open-mode=append", f"--chdir={submission.cwd}", f"--time={minutes}", "--no-requeue",
                *sbatch_args, str(script)]
        log_offset = file_size(submission.log_path)
        submitted_at = time.time()
        try:
            out = _run(argv, env)
        except SchedulerUnreachable as exc:
            raise LaunchError(f"{self.where}: launch.launcher: slurm: {exc} at {address} (slurm.conf {conf}); the job "
                              f"may be queued all the same: look for it with squeue --name={job_name}") from None
        if out.returncode != 0:
            message = _last_line(out.stderr).removeprefix("sbatch: error: ")
            if any(s in message for s in _UNREACHABLE):
                fix = f"start slurmctld on {address.split(':')[0]} or point SLURM_CONF at the cluster's slurm.conf"
            else:
                fix = "check launch.slurm_args against the cluster (sinfo, scontrol show partition)"
            raise LaunchError(f"{self.where}: launch.launcher: slurm: sbatch could not submit to the controller at "
                              f"{address} (slurm.conf {conf}): {message}; {fix}")
        job_id = out.stdout.strip().split(";", 1)[0]
        if not job_id.isdigit():
            raise LaunchError(f"{self.where}: launch.launcher: slurm: sbatch answered {out.stdout.strip()!r}, "
                              "not a job id; check launch.slurm_args")
        identity = JobIdentity(
            launcher=self.kind, job_id=job_id, address=address, run_dir=str(run_dir),
            log_path=str(submission.log_path), submitted_at=submitted_at,
            timeout_s=submission.timeout_s, queue_timeout_s=submission.queue_timeout_s, argv=list(submission.argv),
            extra={"cluster": cluster, "job_name": job_name, "slurm_conf": env.get("SLURM_CONF"),
                   "exit_path": str(exit_path), "log_offset": log_offset, "time_limit_min": minutes})
        return SlurmHandle(identity, env, submission.on_output)

    def reattach(self, identity: JobIdentity, on_output: Callable[[str], None] | None = None) -> JobHandle:
        env = dict(os.environ)
        if identity.extra.get("slurm_conf"):
            env["SLURM_CONF"] = str(identity.extra["slurm_conf"])
        return SlurmHandle(identity, env, on_output)


def _batch_script(submission: Submission, exit_path: Path) -> str:
    # The exit file is written under a name of its own, then renamed: a reader sees all of it or nothing.
    tmp = shlex.quote(f"{exit_path}.") + "$SLURM_JOB_ID" + shlex.quote(f".{secrets.token_hex(2)}")
    return (
        "#!/bin/bash\n"
        f"# rltune run {submission.name}: the run's argv, then its exit code into {exit_path.name}.\n"
        f"{shlex.join(submission.argv)}\n"
        "rc=$?\n"
        f'echo "$SLURM_JOB_ID $rc" > {tmp} && mv -f {tmp} {shlex.quote(str(exit_path))}\n'
        'exit "$rc"\n'
    )


LAUNCHER = SlurmLauncher
