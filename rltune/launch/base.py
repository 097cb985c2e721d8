"""One base for every way rltune starts a run, and the handle a started run gives back.

A :class:`Launcher` turns a :class:`Submission` (argv, working directory, environment, run
directory, log path, time limit) into a running job and returns a :class:`JobHandle`. The handle's
:class:`JobIdentity` is plain JSON — launcher kind, the scheduler's job id, the scheduler's address,
run directory, log path, time limits — so a caller can journal it before it waits. After the caller
itself dies (``kill -9``), :func:`rltune.launch.launchers.reattach` turns the identity back into a
handle that finds the job on its scheduler: still running (follow it), finished (its exit state),
or gone (``lost``).

Every handle has:

- ``poll()`` -> :class:`JobState`; quick, never waits for the job;
- ``wait(timeout)`` -> the state once the job has finished, or when ``timeout`` has passed (then it
  is still running); the job's output is brought into the log and handed to ``on_output`` meanwhile;
- ``cancel()`` -> the final state: stops the job and waits, bounded, until the scheduler says it is
  gone (idempotent; a finished job is left as it ended);
- ``follow()`` -> :class:`LaunchResult`: waits for the end, cancels the job once it has run
  ``timeout_s`` (counted from when the scheduler started it: time in the queue does not count) or
  has waited ``queue_timeout_s`` in the queue (both: timed out), and cancels it whenever the caller
  is stopped — KeyboardInterrupt,
  SIGTERM (turned into :class:`Stopped` while a main-thread ``follow`` waits), any exception — so no
  job outlives the rltune that followed it.

One module per launcher (local, torchrun, slurm, ray); :mod:`rltune.launch.launchers` is the factory.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rltune.contracts.rundir import LAUNCH_NAME
from rltune.errors import LaunchError
from rltune.launch.process import tail

IDENTITY_VERSION = 1
RESULT_NAME = LAUNCH_NAME  # launch.json, named by the run-dir contract

# Job states, the same words for every launcher (the scheduler's own word goes in JobState.detail).
PENDING, RUNNING = "pending", "running"
SUCCEEDED, FAILED, CANCELLED, TIMED_OUT, LOST = "succeeded", "failed", "cancelled", "timed_out", "lost"
FINISHED = frozenset({SUCCEEDED, FAILED, CANCELLED, TIMED_OUT, LOST})
# The return code of a job that ended without one of its own (node failure, lost, cancelled while
# pending): not 0, so LaunchResult.ok is False exactly when the job did not succeed.
NO_CODE = 1


class Stopped(KeyboardInterrupt):
    """The caller was told to stop (SIGTERM, :func:`request_stop`); the job it followed was cancelled.

    A KeyboardInterrupt, not an RltuneError: it must pass through ``except RltuneError`` handlers
    that would otherwise record an interrupted run as a failed one.
    """


class SchedulerUnreachable(LaunchError):
    """The scheduler did not answer a status query; the job may still be running."""


@dataclass
class JobIdentity:
    """Everything needed to find a submitted job again from another process; JSON via to_json/from_json."""

    launcher: str            # local | torchrun | slurm | ray
    job_id: str              # the scheduler's id: a process group id, a SLURM job id, a Ray submission id
    address: str             # where the scheduler answers: host name, slurmctld host:port, jobs API URL
    run_dir: str
    log_path: str
    submitted_at: float      # Unix time
    timeout_s: float         # the run's limit, from when it starts running
    queue_timeout_s: float | None = None  # how long it may wait to start (None: no limit)
    argv: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # per launcher (see each module)

    def to_json(self) -> dict[str, Any]:
        return {"version": IDENTITY_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any, where: str = "identity") -> JobIdentity:
        """Read an identity written by :meth:`to_json`; LaunchError naming the field that does not fit."""
        if not isinstance(data, dict):
            raise LaunchError(f"{where}: expected a mapping with launcher, job_id, ..., found {type(data).__name__}")
        if data.get("version") != IDENTITY_VERSION:
            raise LaunchError(f"{where}: version: expected {IDENTITY_VERSION}, found {data.get('version')!r}; "
                              "it was written by another rltune")
        kinds = {"launcher": str, "job_id": str, "address": str, "run_dir": str, "log_path": str,
                 "submitted_at": (int, float), "timeout_s": (int, float), "queue_timeout_s": (int, float, type(None)),
                 "argv": list, "extra": dict}
        unknown = sorted(set(data) - set(kinds) - {"version"})
        if unknown:
            raise LaunchError(f"{where}: {unknown[0]}: unknown key; expected {', '.join(kinds)}")
        for key, kind in kinds.items():
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                raise LaunchError(f"{where}: {key}: missing or of the wrong type ({data.get(key)!r})")
        return cls(**{k: data[k] for k in kinds})


@dataclass(frozen=True)
class JobState:
    state: str                    # pending | running | succeeded | failed | cancelled | timed_out | lost
    returncode: int | None = None  # set once finished: the exit code, -N for signal N, NO_CODE for none
    detail: str = ""              # the scheduler's own word, e.g. 'NODE_FAIL (NodeDown)', 'STOPPED'
    started_at: float | None = None  # Unix time it began running, where the scheduler says

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


@dataclass
class Submission:
    """One run to start: what :meth:`Launcher.submit` needs."""

    argv: list[str]
    cwd: Path
    env: dict[str, str]
    run_dir: Path
    log_path: Path
    timeout_s: float
    name: str                                       # the run id; scheduler job names derive from it
    queue_timeout_s: float | None = None            # how long it may wait in the scheduler's queue
    on_output: Callable[[str], None] | None = None  # each log line as it arrives (a live view)


@dataclass
class LaunchResult:
    argv: list[str]
    returncode: int
    timed_out: bool
    wall_s: float
    log_path: Path
    run_dir: Path
    state: str = ""                              # the final JobState.state
    identity: dict[str, Any] | None = None       # JobIdentity.to_json() of the job

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def log_tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the job's combined stdout/stderr."""
        return tail(self.log_path, n)


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """launch.json, atomically (a resume may read it while nobody writes it)."""
    path = Path(run_dir) / RESULT_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def result_record(result: LaunchResult) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items()}


# -- stopping ----------------------------------------------------------------------------------------
_STOP = threading.Event()
_LIVE: set[JobHandle] = set()
_LIVE_LOCK = threading.Lock()


def request_stop() -> None:
    """Make every ``follow`` in this process cancel its job and raise :class:`Stopped` (any thread)."""
    _STOP.set()


def reset_stop() -> None:
    """Forget an earlier :func:`request_stop` (for a caller that goes on after handling it)."""
    _STOP.clear()


def live_handles() -> list[JobHandle]:
    """The jobs this process is following right now."""
    with _LIVE_LOCK:
        return list(_LIVE)


@contextmanager
def _registered(handle: JobHandle) -> Iterator[None]:
    with _LIVE_LOCK:
        _LIVE.add(handle)
    try:
        yield
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(handle)


@contextmanager
def _sigterm_stops() -> Iterator[None]:
    """While the main thread follows a job, SIGTERM raises Stopped there (and stops other followers).

    Only where SIGTERM still has its default action: a handler the application installed is its own.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        request_stop()
        raise Stopped("terminated by SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# -- handles and launchers ---------------------------------------------------------------------------
class JobHandle(ABC):
    """A submitted job; see the module docstring for the contract of each method."""

    poll_s: ClassVar[float] = 1.0          # status queries while waiting
    cancel_wait_s: ClassVar[float] = 60.0  # how long cancel() waits for the scheduler to report the job gone
    unreachable_limit_s: ClassVar[float] = 300.0  # a scheduler silent this long while we wait is an error

    def __init__(self, identity: JobIdentity, on_output: Callable[[str], None] | None = None):
        self.identity = identity
        self.on_output = on_output
        # Wall time counts from the submission, also for a handle reattached in another process.
        self._t0 = time.monotonic() - max(0.0, time.time() - identity.submitted_at)
        self._cancel_requested = False
        self._unreachable_since: float | None = None
        self._running_since: float | None = None  # Unix time: the scheduler's start time, or when first seen running

    @abstractmethod
    def poll(self) -> JobState:
        """The job's state now; raises SchedulerUnreachable if the scheduler does not answer."""

    @abstractmethod
    def _request_cancel(self) -> None:
        """Ask the scheduler to stop the job (returns at once)."""

    def _pump(self) -> None:  # noqa: B027 - optional: a launcher whose job writes the log itself has nothing to do
        """Bring new output into the log file and hand its lines to on_output (launchers that relay logs)."""

    def _pause(self, seconds: float) -> None:
        """Sleep between polls; a launcher that can be woken by the job's end overrides it."""
        time.sleep(max(0.0, seconds))

    def wait(self, timeout: float | None = None) -> JobState:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump()
            state = self._poll_or_unknown()
            if state.finished:
                self._pump()
                return state
            if _STOP.is_set():
                raise Stopped(f"asked to stop while following {self.identity.launcher} job {self.identity.job_id}")
            now = time.monotonic()
            if end is not None and now >= end:
                return state
            self._pause(self.poll_s if end is None else min(self.poll_s, end - now))

    def cancel(self) -> JobState:
        state = self._poll_or_unknown()
        if state.finished:
            return state
        self._cancel_requested = True
        end = time.monotonic() + self.cancel_wait_s
        asked = False
        while True:
            if not asked:
                try:
                    self._request_cancel()
                    asked = True
                except SchedulerUnreachable:
                    pass
            state = self._poll_or_unknown()
            if state.finished:
                self._pump()
                return state
            if time.monotonic() >= end:
                raise LaunchError(f"{self.identity.launcher} job {self.identity.job_id} at {self.identity.address} "
                                  f"was asked to stop {self.cancel_wait_s:g} s ago and is still {state.state}; "
                                  f"stop it by hand ({self.stop_hint()})")
            self._pause(min(0.5, self.poll_s))

    def stop_hint(self) -> str:
        """The command a person runs to stop this job by hand."""
        return f"kill the job {self.identity.job_id}"

    def follow(self) -> LaunchResult:
        timed_out = False
        with _registered(self), _sigterm_stops():
            try:
                while True:
                    state = self.wait(self.poll_s)
                    if state.finished:
                        break
                    if self.over_limit(state):
                        state = self.cancel()
                        timed_out = state.state != SUCCEEDED  # it may have ended well in the meantime
                        break
            except BaseException:
                # KeyboardInterrupt, Stopped, a failing on_output, a bug: the job must not outlive us.
                self.cancel()
                raise
        return self.result(state, timed_out)

    def over_limit(self, state: JobState) -> str:
        """Why the job is past its limits ('' while it is not): run time, or time waiting in the queue."""
        now = time.time()
        if state.state == RUNNING and "scheduler unreachable" not in state.detail:
            if self._running_since is None:
                self._running_since = state.started_at or now
            if now - self._running_since >= self.identity.timeout_s:
                return f"ran past its limit of {self.identity.timeout_s:g} s"
        elif state.state == PENDING and self.identity.queue_timeout_s is not None:
            if now - self.identity.submitted_at >= self.identity.queue_timeout_s:
                return f"waited in the queue past {self.identity.queue_timeout_s:g} s"
        elif self._running_since is not None and now - self._running_since >= self.identity.timeout_s:
            return f"ran past its limit of {self.identity.timeout_s:g} s"  # and the scheduler stopped answering
        return ""

    def result(self, state: JobState, timed_out: bool = False) -> LaunchResult:
        """The LaunchResult of a finished ``state``."""
        timed_out = timed_out or state.state == TIMED_OUT
        code = state.returncode if state.returncode is not None else NO_CODE
        if state.state != SUCCEEDED and code == 0:
            code = NO_CODE
        return LaunchResult(argv=list(self.identity.argv), returncode=code, timed_out=timed_out,
                            wall_s=time.monotonic() - self._t0, log_path=Path(self.identity.log_path),
                            run_dir=Path(self.identity.run_dir), state=TIMED_OUT if timed_out else state.state,
                            identity=self.identity.to_json())

    def _poll_or_unknown(self) -> JobState:
        """poll(), with an unreachable scheduler read as 'still running' until unreachable_limit_s passes."""
        try:
            state = self.poll()
        except SchedulerUnreachable as exc:
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
            if time.monotonic() - self._unreachable_since > self.unreachable_limit_s:
                raise LaunchError(f"{exc}; gave up after {self.unreachable_limit_s:g} s. The job may still be running: "
                                  f"{self.stop_hint()}") from None
            return JobState(RUNNING, detail=f"scheduler unreachable: {exc}")
        self._unreachable_since = None
        return state


class Launcher(ABC):
    """Starts runs one way; one subclass per module (local, torchrun, slurm, ray)."""

    kind: ClassVar[str]

    def __init__(self, spec: Any = None, where: str = "job.yaml"):
        self.spec = spec      # the job's LaunchSpec (None when only reattaching)
        self.where = where    # the job file, for error messages

    @abstractmethod
    def submit(self, submission: Submission) -> JobHandle:
        """Start the run; raises LaunchError (naming the launcher, where it looked and the fix) if it cannot."""

    @abstractmethod
    def reattach(self, identity: JobIdentity, on_output: Callable[[str], None] | None = None) -> JobHandle:
        """A handle on the job ``identity`` names, whatever state it is in now (``lost`` if none is found)."""


class LogTail:
    """Follows a log file that someone else appends to; hands out complete lines."""

    def __init__(self, path: Path, offset: int = 0):
        self.path = Path(path)
        self.offset = offset
        self._partial = b""

    def read_lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines]


def file_size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except FileNotFoundError:
        return 0
