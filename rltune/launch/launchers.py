"""Turn a job's argv into the argv that starts it under its launcher: local, torchrun or slurm.

- ``local``    – the argv as it is.
- ``torchrun`` – ``python -m torch.distributed.run --standalone --nproc-per-node N <script> ...``; the
                 job's command names the script (``train.py ...``) or a module (``-m pkg.train ...``),
                 with or without a leading ``python``.
- ``slurm``    – ``srun --kill-on-bad-exit=1 <launch.slurm_args> <argv>``; the inner argv is the local
                 one (use ``srun``'s own ``--ntasks-per-node`` for several ranks). Only the argv is built
                 here; running it needs a slurm allocation.

All three return a list of strings; nothing is ever joined into a shell command.
"""

from __future__ import annotations

import os
import sys

from rltune.errors import LaunchError

LAUNCHERS = ("local", "torchrun", "slurm")
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
    if launcher == "local":
        return list(argv)
    if launcher == "torchrun":
        script = _strip_python(list(argv))
        if not script:
            raise LaunchError("launch.command has no script after 'python'; torchrun needs a script or '-m module'")
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}", *script]
    if launcher == "slurm":
        return ["srun", "--kill-on-bad-exit=1", *slurm_args, *argv]
    raise LaunchError(f"unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")
