"""Subprocess sandboxes for tool-use trials: a directory per trial, built from a task image, and
commands run under CPU-time, memory and wall-clock limits.

A trial holds one sandbox from setup to teardown, so ``sandbox_pool_size`` bounds how many trials
run at once. Setup is real work: building a task image writes the task's files and byte-compiles
its python modules in a subprocess; with a pre-built image the environment is built once and each
trial only copies it and writes its task's files. Every command runs in its own process group, which is killed when the
command ends or times out, and the trial directory is removed at teardown: nothing is left behind.
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
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("sandbox_runner.py")


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2
    memory_mb: int = 512
    wall_s: float = 5.0


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


def _limit_child(limits: SandboxLimits):
    cpu = int(limits.cpu_s)
    memory = int(limits.memory_mb) * 1024 * 1024

    def apply() -> None:  # runs in the child between fork and exec: only async-signal-safe work
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def run_limited(argv: list[str], cwd: str | os.PathLike, limits: SandboxLimits) -> ExecResult:
    """Run ``argv`` in ``cwd`` under ``limits``; kill its whole process group when it ends or times out."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_limit_child(limits), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        out, _ = proc.communicate()
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


def build_image(dest: Path, files: dict[str, str], modules: int, limits: SandboxLimits) -> None:
    """Create a task image at ``dest``: the task's files plus ``modules`` python modules, byte-compiled."""
    dest.mkdir(parents=True)
    for name, text in files.items():
        (dest / name).write_text(text, encoding="utf-8")
    lib = dest / "lib"
    lib.mkdir()
    for index in range(modules):
        (lib / f"m{index}.py").write_text(_MODULE_TEMPLATE.format(index=index, size=200 + 10 * index), encoding="utf-8")
    if modules:
        result = run_limited([sys.executable, "-I", "-S", "-m", "compileall", "-q", "lib"], dest,
                             SandboxLimits(cpu_s=max(limits.cpu_s, 10), memory_mb=max(limits.memory_mb, 512), wall_s=60))
        if result.returncode != 0:
            raise OSError(f"building the task image failed: {result.output[:200]}")


@dataclass
class Sandbox:
    """One trial's directory and the limits its commands run under."""

    root: Path
    limits: SandboxLimits
    setup_s: float
    exec_s: float = 0.0

    def execute(self, turn_text: str) -> ExecResult:
        result = run_limited([sys.executable, "-I", "-S", str(RUNNER), turn_text], self.root, self.limits)
        self.exec_s += result.seconds
        return result


class SandboxPool:
    """At most ``size`` sandboxes at once; the image built per trial, or once and copied (``prebuilt``)."""

    def __init__(self, size: int, limits: SandboxLimits, prebuilt: bool, modules: int, workdir: str | None = None):
        self.size = size
        self.limits = limits
        self.prebuilt = prebuilt
        self.modules = modules
        self._slots = threading.BoundedSemaphore(size)
        self._root = Path(tempfile.mkdtemp(prefix="rltune-sandboxes-", dir=workdir))
        self._base: Path | None = None
        self._image_lock = threading.Lock()
        self._lock = threading.Lock()
        self._counter = 0
        self.slot_wait_s_total = 0.0
        self.images_built = 0  # full image builds (the work a pre-built image saves)

    def _base_image(self) -> Path:
        """The environment image (library modules, byte-compiled), built once and then only copied."""
        with self._image_lock:
            if self._base is None:
                path = self._root / "image"
                build_image(path, {}, self.modules, self.limits)
                self.images_built += 1
                self._base = path
            return self._base

    @contextmanager
    def sandbox(self, files: dict[str, str]):
        """Hold a slot, set up the trial directory, yield the :class:`Sandbox`, remove it all."""
        wait_start = time.perf_counter()
        self._slots.acquire()
        with self._lock:
            self.slot_wait_s_total += time.perf_counter() - wait_start
        try:
            with self._lock:
                self._counter += 1
                trial_dir = self._root / "trials" / f"t{self._counter}"
            start = time.perf_counter()
            if self.prebuilt:
                shutil.copytree(self._base_image(), trial_dir)
                for name, text in files.items():
                    (trial_dir / name).write_text(text, encoding="utf-8")
            else:
                build_image(trial_dir, files, self.modules, self.limits)
                with self._lock:
                    self.images_built += 1
            box = Sandbox(trial_dir, self.limits, time.perf_counter() - start)
            try:
                yield box
            finally:
                shutil.rmtree(trial_dir, ignore_errors=True)
        finally:
            self._slots.release()

    def take_slot_wait_s(self) -> float:
        """Total seconds trials waited for a slot since the last call (then reset)."""
        with self._lock:
            total, self.slot_wait_s_total = self.slot_wait_s_total, 0.0
        return total

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
