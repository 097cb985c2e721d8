"""The launcher factory, and the argv each launcher starts: local, torchrun, slurm or ray.

- ``local``    – the argv as it is, a process group here (:mod:`rltune.launch.local`).
- ``torchrun`` – ``python -m torch.distributed.run --standalone --nproc-per-node N <script> ...``; the
                 job's command names the script (``train.py ...``) or a module (``-m pkg.train ...``),
                 with or without a leading ``python``; run here (:mod:`rltune.launch.torchrun`).
- ``slurm``    – ``srun --kill-on-bad-exit=1 <launch.slurm_args> <argv>``, the step a batch job runs
                 inside its allocation (:mod:`rltune.launch.slurm` submits it with sbatch).
- ``ray``      – the argv as it is, the entrypoint of a Ray job (:mod:`rltune.launch.ray`).

All return a list of strings; nothing is ever joined into a shell command here (the slurm batch
script and the Ray entrypoint quote each item).

:func:`make_launcher` gives the :class:`~rltune.launch.base.Launcher` of a job's ``launch`` section;
:func:`reattach` turns a journalled identity back into a handle. Each launcher's module is imported
only when it is used (the ray one imports ray).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from rltune.errors import LaunchError
from rltune.launch.base import JobHandle, JobIdentity, Launcher

LAUNCHERS = ("local", "torchrun", "slurm", "ray")
_PYTHON_NAMES = ("python", "python3")


def _strip_python(argv: list[str]) -> list[str]:
    head = os.path.basename(argv[0]) if argv else ""
    if head in _PYTHON_NAMES or head.startswith("python3.") or argv[0] == sys.executable:
        return argv[1:]
    return argv


def launcher_argv(launcher: str, argv: list[str], *, nproc_per_node: int = 1, slurm_args: list[str] = (),
                  python: str = sys.executable) -> list[str]:
    """The full argv that starts ``argv`` under ``launcher``."""
    if not argv:
        raise LaunchError("launch.command is empty; give the job's argv, e.g. [python, train.py]")
    if launcher in ("local", "ray"):
        return list(argv)
    if launcher == "torchrun":
        script = _strip_python(list(argv))
        if not script:
            raise LaunchError("launch.command has no script after 'python'; torchrun needs a script or '-m module'")
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}", *script]
    if launcher == "slurm":
        return ["srun", "--kill-on-bad-exit=1", *slurm_args, *argv]
    raise LaunchError(f"unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")


def launcher_class(kind: str) -> type[Launcher]:
    if kind not in LAUNCHERS:
        raise LaunchError(f"unknown launcher {kind!r}; expected one of {', '.join(LAUNCHERS)}")
    return importlib.import_module(f"rltune.launch.{kind}").LAUNCHER


def make_launcher(spec: Any, where: str = "job.yaml") -> Launcher:
    """The launcher of a job's ``launch`` section (a LaunchSpec); ``where`` names the job file in errors."""
    return launcher_class(spec.launcher)(spec, where)


def reattach(identity: dict[str, Any] | JobIdentity, on_output: Callable[[str], None] | None = None) -> JobHandle:
    """A handle on the job a journalled identity names, in whatever state it is now.

    Running: ``follow()`` it to its end (its time limits still count from its start). Finished while
    nobody watched: ``poll()`` gives its exit state. Not found: the state is ``lost``.
    """
    if not isinstance(identity, JobIdentity):
        identity = JobIdentity.from_json(identity)
    return launcher_class(identity.launcher)(None, identity.run_dir).reattach(identity, on_output)
