"""Where a command may write: never over its own inputs, another run or a recorded file.

Every command calls :func:`check_output` on each path it is about to write, before anything runs, so
a bad ``--out`` is one line (exit 2) instead of a lost record or a ``FileExistsError`` traceback:

- an output that is (resolves to the same file as) one of the command's inputs is refused;
- a file output never replaces a recorded file: a journal, a case or stage table (``*.parquet``), a
  reward check, or one of the files a run directory holds (its verdict, diagnosis, resolved job, ...);
- a run directory (``expect="run_dir"``) that already holds another run's stage table, diagnosis,
  verdict or launch record is refused unless ``force``;
- an output that exists as the wrong kind (a directory where a file goes, a file where a directory
  goes, or a file in the way of a folder above it) is refused, naming the flag, the path and the fix.

Names taken from files (a job's name, a run id, a candidate id) become path parts only through
:func:`safe_name`, so every write stays under its directory. Pure: no typer, no heavy imports.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from rltune.contracts.rundir import JOB_NAME, LOG_NAME, PARSE_REPORT_NAME, RUN_MARKERS, RunDir
from rltune.errors import RltuneError

RUN_FILES = RUN_MARKERS + (JOB_NAME, LOG_NAME, PARSE_REPORT_NAME, "metrics.jsonl")
"""The files of a run directory that no other command's output may replace."""

RECORD_NAMES = ("journal.jsonl", "reward_check.yaml")
"""Recorded files protected wherever they lie (an ``auto`` work dir's journal, a reward check's decision)."""

RECORD_SUFFIXES = (".parquet",)
"""Case files and stage tables: no command writes a single Parquet file through an output flag."""

KINDS = ("file", "dir", "run_dir")


class OutputPathError(RltuneError):
    """An output path would replace an input or a recorded file, or exists as the wrong kind."""

    exit_code = 2


def safe_name(name: str, default: str = "run", limit: int = 100) -> str:
    """``name`` as one path part: letters, digits, ``_ . -`` only; never empty, ``.`` or ``..``.

    A job named ``../../tmp/x`` becomes ``tmp-x``: a name read from a file can never make a write
    leave the directory it is meant for.
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(name)).strip("-.")[:limit].strip("-.")
    return safe or default


def is_run_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory holding a recorded run (see :data:`RUN_MARKERS`)."""
    return Path(path).is_dir() and RunDir(path).is_run()


def _same(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def _blocking_ancestor(path: Path) -> Path | None:
    """The nearest existing folder above ``path`` when it is not a directory (a file in the way)."""
    for parent in path.resolve().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_output(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = (), expect: str = "file",
                 flag: str = "--out", force: bool = False, writes: Iterable[str] = (), run_ok: bool = False,
                 workdir_ok: bool = False) -> Path:
    """Refuse ``path`` as an output unless writing it loses nothing; return it as a :class:`Path`.

    ``inputs`` are the files and directories the command reads (``None`` entries are skipped);
    ``expect`` is ``"file"``, ``"dir"`` or ``"run_dir"`` (a directory that becomes one run's
    directory); ``flag`` names the option in messages; ``force`` lets a run directory replace
    another run's (it never lets an output replace an input); ``writes`` are the names a directory
    output receives, so an input among them is refused too. A plain directory output (``"dir"``) is
    never a recorded run's directory (unless ``run_ok``: a job writing into the run dir rltune made
    for it) nor an ``auto`` work dir (unless ``workdir_ok``: ``auto --workdir`` resuming one).
    """
    if expect not in KINDS:
        raise ValueError(f"expect must be one of {KINDS}, not {expect!r}")
    path = Path(path)
    where = f"{flag} {path}"
    given = [Path(p) for p in inputs if p is not None]
    blocked = _blocking_ancestor(path)
    if blocked is not None:
        raise OutputPathError(f"{where}: {blocked} is a file, so nothing can be written under it; "
                              f"give {flag} a path under a directory")
    for source in given:
        if _same(path, source):
            raise OutputPathError(f"{where}: is an input of this command; writing there would replace it, "
                                  f"give {flag} another path")
    if expect == "file":
        if path.is_dir():
            raise OutputPathError(f"{where}: is a directory; give {flag} the path of a file")
        if path.exists() and _is_record(path):
            raise OutputPathError(f"{where}: is a recorded file ({_record_kind(path)}) that must not be replaced; "
                                  f"give {flag} a new file")
        return path
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{where}: is a file, not a directory; give {flag} a new or existing directory")
    for name in writes:
        for source in given:
            if _same(path / name, source):
                raise OutputPathError(f"{where}: would replace its input {source} ({name}); "
                                      f"give {flag} another directory")
    if expect == "dir" and not run_ok and is_run_dir(path):
        held = ", ".join(name for name in RUN_MARKERS if (path / name).exists())
        raise OutputPathError(f"{where}: is the directory of a recorded run ({held}); give {flag} a directory of "
                              f"its own")
    if expect != "file" and not workdir_ok and (path / "journal.jsonl").exists():
        raise OutputPathError(f"{where}: is an 'rltune auto' work dir (it holds journal.jsonl); give {flag} a "
                              f"directory of its own")
    if expect == "run_dir" and not force and is_run_dir(path):
        held = ", ".join(name for name in RUN_MARKERS if (path / name).exists())
        raise OutputPathError(f"{where}: already holds another run ({held}); give {flag} a new directory, "
                              f"or add --force to replace that run")
    return path


def _is_record(path: Path) -> bool:
    if path.name in RECORD_NAMES or path.suffix in RECORD_SUFFIXES:
        return True
    return path.name in RUN_FILES and is_run_dir(path.parent)


def _record_kind(path: Path) -> str:
    if path.name == "journal.jsonl":
        return "an 'rltune auto' journal"
    if path.suffix == ".parquet":
        return "a case or stage table"
    if path.name == "reward_check.yaml":
        return "a reward check's decision"
    return f"the {path.name} of the run in {path.parent}"
