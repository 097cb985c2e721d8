"""Subprocess sandboxes for tool-use trials: a directory per trial, built from a task image, and
commands run under CPU-time, memory and wall-clock limits.

This is what one sandbox host runs (:mod:`rltune.workload.sandbox_host` serves a
:class:`SandboxPool` over a socket). A trial holds one sandbox from setup to teardown, so the pool's
size bounds how many trials a host runs at once; a trial that asks for one while all are taken
waits (its queue time). Setup is real work: building a task image writes the task's files and
byte-compiles its python modules in a subprocess; with a pre-built image the environment is built
once and each trial only copies it and writes its task's files. Every command runs in its own
process group, which is killed when the command ends or times out, and the trial directory is
removed at teardown: nothing is left behind.

Times kept per sandbox: ``setup_s`` (building or copying the image), ``exec_s`` (its commands),
``queue_s`` (waiting for a free sandbox) and ``fs_s`` (the host's own file-system work for it:
writing the task's files and modules, copying the image, removing the directory). A
:class:`ChildTracker` knows which command processes are alive, so the host can sample how many of
them are runnable per core (its load).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

RUNNER = Path(__file__).with_name("sandbox_runner.py")


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2
    memory_mb: int = 512
    wall_s: float = 5.0


@dataclass(frozen=True)
class ImageSpec:
    """What a trial's image holds besides its task's files: ``modules`` library modules, and whether
    the environment is built once and copied (``prebuilt``) or built for every trial."""

    modules: int = 24
    prebuilt: bool = False


@dataclass
class ExecResult:
    output: str
    returncode: int
    timed_out: bool
    seconds: float

    @property
    def killed(self) -> bool:
        """Ended by a signal: the wall-clock kill, or the kernel enforcing RLIMIT_CPU / RLIMIT_AS."""
        return self.timed_out or self.returncode < 0


class ChildTracker:
    """The command processes alive right now (pids), for a host's load sampler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pids: set[int] = set()

    def started(self, pid: int) -> None:
        with self._lock:
            self._pids.add(pid)

    def ended(self, pid: int) -> None:
        with self._lock:
            self._pids.discard(pid)

    def pids(self) -> list[int]:
        with self._lock:
            return list(self._pids)

    def runnable(self) -> int:
        """How many of them the kernel has running or ready to run (state R in /proc/PID/stat)."""
        count = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/stat", "rb") as handle:
                    stat = handle.read()
            except OSError:
                continue  # ended between the listing and the read
            # The state follows the command name, which is in parentheses and may itself hold spaces.
            state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
            count += state == b"R"
        return count


def _load_prctl():
    """libc's prctl on Linux (None elsewhere): a command is told to die with the process that started it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _limit_child(limits: SandboxLimits):
    cpu = int(limits.cpu_s)
    memory = int(limits.memory_mb) * 1024 * 1024

    def apply() -> None:  # runs in the child between fork and exec: only async-signal-safe work
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if _PRCTL is not None:
            # A command runs in its own session; should its host be killed, it must not live on.
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return apply


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def run_limited(argv: list[str], cwd: str | os.PathLike, limits: SandboxLimits,
                tracker: ChildTracker | None = None) -> ExecResult:
    """Run ``argv`` in ``cwd`` under ``limits``; kill its whole process group when it ends or times out."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_limit_child(limits), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    if tracker is not None:
        tracker.started(proc.pid)
    timed_out = False
    try:
        try:
            out, _ = proc.communicate(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            out, _ = proc.communicate()
    finally:
        if tracker is not None:
            tracker.ended(proc.pid)
    # Children the command left running (e.g. backgrounded) die with the group.
    _kill_group(proc.pid)
    return ExecResult(out.decode("utf-8", errors="replace"), proc.returncode, timed_out, time.perf_counter() - start)


_MODULE_TEMPLATE = '''"""Task library module {index}."""


def helper_{index}(values):
    total = 0
    for position, value in enumerate(values):
        total += (position + {index}) * value % 97
    return total


def main():
    return helper_{index}(list(range({size})))
'''


def write_files(dest: Path, files: dict[str, str]) -> float:
    """Write a task's files into ``dest``; the seconds it took (file-system time)."""
    start = time.perf_counter()
    for name, text in files.items():
        (dest / name).write_text(text, encoding="utf-8")
    return time.perf_counter() - start


def build_image(dest: Path, files: dict[str, str], modules: int, limits: SandboxLimits,
                tracker: ChildTracker | None = None) -> float:
    """Create a task image at ``dest``: the task's files plus ``modules`` python modules, byte-compiled.

    Returns the file-system seconds of it (the writes; the compile subprocess is counted as setup).
    """
    start = time.perf_counter()
    dest.mkdir(parents=True)
    lib = dest / "lib"
    lib.mkdir()
    for index in range(modules):
        (lib / f"m{index}.py").write_text(_MODULE_TEMPLATE.format(index=index, size=200 + 10 * index), encoding="utf-8")
    fs_s = time.perf_counter() - start + write_files(dest, files)
    if modules:
        result = run_limited([sys.executable, "-I", "-S", "-m", "compileall", "-q", "lib"], dest,
                             SandboxLimits(cpu_s=max(limits.cpu_s, 10), memory_mb=max(limits.memory_mb, 512), wall_s=60),
                             tracker)
        if result.returncode != 0:
            raise OSError(f"building the task image failed: {result.output[:200]}")
    return fs_s


@dataclass
class Sandbox:
    """One trial's directory and the limits its commands run under."""

    root: Path
    limits: SandboxLimits
    setup_s: float
    queue_s: float = 0.0
    fs_s: float = 0.0
    exec_s: float = 0.0
    tracker: ChildTracker | None = field(default=None, repr=False)

    def execute(self, turn_text: str, tests: int = 0, wall_s: float | None = None) -> ExecResult:
        """Run one model turn's command, then ``tests`` of the task's test cases, in one limited process.

        ``wall_s`` tightens the wall-clock limit for this command (a trial near its time-out).
        """
        limits = self.limits
        if wall_s is not None and wall_s < limits.wall_s:
            limits = SandboxLimits(limits.cpu_s, limits.memory_mb, max(0.01, wall_s))
        argv = [sys.executable, "-I", "-S", str(RUNNER), turn_text]
        if tests > 0:
            argv += ["--tests", str(int(tests))]
        result = run_limited(argv, self.root, limits, self.tracker)
        self.exec_s += result.seconds
        return result


class SandboxPool:
    """At most ``size`` sandboxes at once on this host; an image built per trial, or once and copied.

    ``prebuilt``, ``modules`` and ``limits`` are the defaults of :meth:`open`, which may name its own
    (a host serves trials of any image). Pre-built base images are kept per module count.
    """

    def __init__(self, size: int, limits: SandboxLimits = SandboxLimits(), prebuilt: bool = False, modules: int = 24,
                 workdir: str | None = None, tracker: ChildTracker | None = None):
        self.size = size
        self.limits = limits
        self.image = ImageSpec(modules, prebuilt)
        self.tracker = tracker
        self._slots = threading.BoundedSemaphore(size)
        self._root = Path(tempfile.mkdtemp(prefix="rltune-sandboxes-", dir=workdir))
        self._bases: dict[int, Path] = {}
        self._image_lock = threading.Lock()
        self._lock = threading.Lock()
        self._counter = 0
        self.waiting = 0
        self.open_now = 0
        self.slot_wait_s_total = 0.0
        self.images_built = 0  # full image builds (the work a pre-built image saves)

    @property
    def root(self) -> Path:
        return self._root

    def _base_image(self, modules: int, limits: SandboxLimits) -> tuple[Path, float]:
        """The environment image (library modules, byte-compiled), built once per module count; (path, fs_s)."""
        with self._image_lock:
            if modules not in self._bases:
                path = self._root / f"image-{modules}"
                fs_s = build_image(path, {}, modules, limits, self.tracker)
                self.images_built += 1
                self._bases[modules] = path
                return path, fs_s
            return self._bases[modules], 0.0

    def open(self, files: dict[str, str], image: ImageSpec | None = None,
             limits: SandboxLimits | None = None) -> Sandbox:
        """Wait for a free slot, set up the trial's directory and return its :class:`Sandbox`."""
        image = image or self.image
        limits = limits or self.limits
        wait_start = time.perf_counter()
        with self._lock:
            self.waiting += 1
        self._slots.acquire()
        queue_s = time.perf_counter() - wait_start
        with self._lock:
            self.waiting -= 1
            self.open_now += 1
            self.slot_wait_s_total += queue_s
            self._counter += 1
            trial_dir = self._root / "trials" / f"t{self._counter}"
        try:
            start = time.perf_counter()
            if image.prebuilt:
                base, fs_s = self._base_image(image.modules, limits)
                copy_start = time.perf_counter()
                shutil.copytree(base, trial_dir)
                fs_s += time.perf_counter() - copy_start + write_files(trial_dir, files)
            else:
                fs_s = build_image(trial_dir, files, image.modules, limits, self.tracker)
                with self._lock:
                    self.images_built += 1
            return Sandbox(trial_dir, limits, time.perf_counter() - start, queue_s=queue_s, fs_s=fs_s,
                           tracker=self.tracker)
        except BaseException:
            shutil.rmtree(trial_dir, ignore_errors=True)
            self._release()
            raise

    def close(self, box: Sandbox | None = None) -> float:
        """Remove ``box``'s directory and free its slot (the seconds the removal took); with no
        ``box``, remove everything this pool made."""
        if box is None:
            shutil.rmtree(self._root, ignore_errors=True)
            return 0.0
        start = time.perf_counter()
        shutil.rmtree(box.root, ignore_errors=True)
        seconds = time.perf_counter() - start
        box.fs_s += seconds
        self._release()
        return seconds

    def _release(self) -> None:
        with self._lock:
            self.open_now -= 1
        self._slots.release()

    @contextmanager
    def sandbox(self, files: dict[str, str], image: ImageSpec | None = None, limits: SandboxLimits | None = None):
        """Hold a slot, set up the trial directory, yield the :class:`Sandbox`, remove it all."""
        box = self.open(files, image, limits)
        try:
            yield box
        finally:
            self.close(box)

    def take_slot_wait_s(self) -> float:
        """Total seconds trials waited for a slot since the last call (then reset)."""
        with self._lock:
            total, self.slot_wait_s_total = self.slot_wait_s_total, 0.0
        return total
