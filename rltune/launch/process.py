"""Run one argv in its own process group with a wall-clock limit, its output captured to a log.

The child is started with ``start_new_session=True``, so it and everything it spawns share one
process group that nothing else belongs to. When the run ends — normally, by crash, by time-out or
because the caller is interrupted — the whole group is sent SIGTERM, given a short grace period and
then SIGKILL, so a trainer's dataloader workers or an inference server it forked cannot outlive it.

stdout and stderr are merged into one log file, line by line, and each line is handed to an
optional ``on_output`` callback (for a live view).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rltune.errors import LaunchError

# Seconds a group gets between SIGTERM and SIGKILL: enough for a trainer to flush a log line, short
# enough that a hung job does not hold the tuner.
KILL_GRACE_S = 5.0
# Upper bound on waiting for SIGKILLed members to disappear.
REAP_WAIT_S = 2.0
# How long we wait for the log pipe to drain after the group is gone.
DRAIN_TIMEOUT_S = 5.0


@dataclass
class ProcessOutcome:
    returncode: int
    timed_out: bool
    wall_s: float


def group_alive(pgid: int) -> bool:
    """True while a member of the group is still running (zombies, which hold no resources, do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed credentials; it still exists
        return True
    proc_root = Path("/proc")
    if not proc_root.is_dir():  # no procfs: any member, zombie or not, counts
        return True
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # raced with the process exiting
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def kill_group(pgid: int, grace_s: float | None = None) -> None:
    """SIGTERM the process group, wait up to ``grace_s`` (default KILL_GRACE_S), then SIGKILL what is left."""
    grace_s = KILL_GRACE_S if grace_s is None else grace_s
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    # SIGKILL is delivered asynchronously; wait (briefly: an exited member may linger as a zombie until
    # its new parent reaps it) so that callers see the group gone when this returns.
    deadline = time.monotonic() + REAP_WAIT_S
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.02)


class StartedProcess:
    """A started argv: its process group, the thread that copies its output into the log, and cleanup."""

    def __init__(self, proc: subprocess.Popen, reader: threading.Thread, started: float):
        self.proc = proc
        self.pgid = proc.pid  # a new session's leader is its group's leader
        self.reader = reader
        self.started = started
        self._finished = False

    def finish(self) -> int:
        """Kill what is left of the group, reap the leader, drain the log; return the exit code (idempotent)."""
        if not self._finished:
            # Whatever happened, nothing of the job's group may survive it (children that ignored the
            # leader's exit, a forked server, a worker blocked on a pipe).
            kill_group(self.pgid)
            self.proc.wait()
            self.reader.join(DRAIN_TIMEOUT_S)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._finished = True
        return self.proc.returncode


def start_process(argv: list[str], *, cwd: Path, env: dict[str, str], log_path: Path,
                  on_output: Callable[[str], None] | None = None) -> StartedProcess:
    """Start ``argv`` in a new process group, its stdout and stderr appended to ``log_path`` line by line."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except FileNotFoundError as exc:
        raise LaunchError(f"cannot start {argv[0]!r}: {exc.strerror}; check launch.command[0] and PATH") from None
    except NotADirectoryError:
        raise LaunchError(f"working directory {cwd} does not exist; check launch.workdir") from None
    except PermissionError as exc:
        raise LaunchError(f"cannot start {argv[0]!r}: {exc.strerror}; make it executable") from None

    def pump() -> None:
        assert proc.stdout is not None
        with open(log_path, "ab", buffering=0) as log:
            try:
                for raw in iter(proc.stdout.readline, b""):
                    log.write(raw)
                    if on_output is not None:
                        on_output(raw.decode("utf-8", "replace").rstrip("\n"))
            except (ValueError, OSError):  # the pipe was closed under us after the drain time-out
                return

    reader = threading.Thread(target=pump, name="rltune-log-pump", daemon=True)
    reader.start()
    return StartedProcess(proc, reader, start)


def run_process(argv: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float, log_path: Path,
                on_output: Callable[[str], None] | None = None) -> ProcessOutcome:
    """Run ``argv`` to completion or time-out; return its exit code, whether it timed out, and wall time."""
    started = start_process(argv, cwd=cwd, env=env, log_path=log_path, on_output=on_output)
    timed_out = False
    try:
        try:
            started.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
    finally:
        returncode = started.finish()
    return ProcessOutcome(returncode=returncode, timed_out=timed_out, wall_s=time.monotonic() - started.started)


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
