"""What every campaign case shares: the case record, the file mutations, the snapshot and the run.

A case is one command line run in-process through ``rltune.cli.main.main`` inside a fresh copy of
the session's work area (a real ``profile -> propose -> predict`` chain of the CPU demo, the same
chain of a fast job, and a finished ``auto`` work dir). Before the command every file under the
area is hashed; after it, each case asserts:

- nothing escaped ``main`` (an escaping exception is what a user sees as a traceback);
- the exit code the README's table gives (2 bad input, 4 the launched job failed, 0 accepted);
- for a refusal, exactly one line on stderr, ``rltune: ...``, naming the file (or flag) and field;
- no exception class names or errno text anywhere on stderr;
- every file that existed before has the same sha256 after (or, for a journal a resume may append
  to, its complete lines still lead the file), and no new case or verdict was recorded by a refusal;
- nothing was written outside the area.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "presets"
DEMO = PRESETS / "cpu-demo.yaml"
FAKE_JOB = Path(__file__).resolve().parent / "fake_job.py"

# Exception names and errno text a user must never read (the list, and the general shape).
LEAKS = re.compile(r"Traceback|\[Errno|StopIteration|\b[A-Z]\w*(Error|Exception|Warning)\b")


@dataclasses.dataclass
class Case:
    """One bad (or, where a comment says so, valid after all) input through one command."""

    id: str
    argv: list[str]
    exit: int | tuple[int, ...] = 2
    names: tuple[str, ...] = ()          # substrings the refusal line must hold: the file or flag, the field
    prepare: Callable[[Path], None] | None = None   # mutate the copied area before the snapshot
    may_change: tuple[str, ...] = ()     # area-relative paths the command may rewrite (its own outputs)
    append_only: tuple[str, ...] = ()    # area-relative files whose complete lines must stay a prefix
    check: Callable[[Path], None] | None = None     # extra assertions on the area afterwards
    note: str = ""                       # why an accepted input is valid after all
    cwd: str = "."                       # area-relative directory the command runs in


# ---------------------------------------------------------------------------------------------------
# Snapshots


def snapshot(tree: Path) -> dict[str, str]:
    """sha256 of every file under ``tree``, by path relative to it."""
    out = {}
    for path in sorted(Path(tree).rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[path.relative_to(tree).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def complete_lines(data: bytes) -> list[bytes]:
    """The lines of a JSON-lines file that parse (a torn tail is not a record)."""
    import json

    out = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError:
            continue
        out.append(line.strip())
    return out


def assert_records_intact(before: dict[str, str], tree: Path, contents: dict[str, bytes],
                          may_change: tuple[str, ...] = (), append_only: tuple[str, ...] = ()) -> None:
    """Every file of ``before`` still exists with the same hash, except the command's own outputs;
    a journal named in ``append_only`` may grow, but its complete lines must still lead it."""
    after = snapshot(tree)
    lost = [p for p in before if p not in after and not _under(p, may_change)]
    changed = []
    for path, digest in before.items():
        if path not in after or after[path] == digest or _under(path, may_change):
            continue
        if path in append_only:
            old, new = complete_lines(contents[path]), complete_lines((tree / path).read_bytes())
            if new[:len(old)] == old:
                continue
        changed.append(path)
    assert not lost and not changed, f"recorded data lost: {lost}; changed: {changed}"


# Derived caches a command may rebuild: the case library's index of its parts (library.py).
CACHES = ("/_index.parquet",)


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    if path.endswith(CACHES):
        return True
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


# ---------------------------------------------------------------------------------------------------
# Files


def fast_job_data(mode: str = "ok", base: Path = DEMO, name: str | None = None, timeout_s: float = 10) -> dict:
    """A real preset whose launch runs ``fake_job.py MODE``: the preset's schema, a job that takes a second."""
    data = yaml.safe_load(base.read_text())
    data["launch"]["command"] = [sys.executable, str(FAKE_JOB), mode, "--run-dir", "{run_dir}"]
    data["launch"]["workdir"] = str(FAKE_JOB.parent)
    data["launch"]["timeout_s"] = timeout_s
    data["launch"].pop("env", None)
    data["limits"].update(steps=3, warmup_steps=1, baseline_runs=1)
    if name is not None:
        data["name"] = name
    return data


def write_yaml(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def set_path(data: Any, dotted: str, value: Any) -> None:
    """Set ``a.b.0.c`` in a parsed YAML tree (list indices as numbers)."""
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def del_path(data: Any, dotted: str) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    del node[keys[-1]]


def dump_special(data: Any) -> str:
    """YAML text of ``data`` with NaN and inf written as YAML's .nan / .inf."""
    return yaml.safe_dump(data, sort_keys=False)


def field_name(dotted: str) -> str:
    """The last part of a dotted path: what a refusal line must name at least."""
    return dotted.split(".")[-1]


BINARY = bytes(range(256)) * 8 + b"\xff\xfe\x00\x81"


def generic_mutations(dup_line: str, other_kind: Path | None) -> list[tuple[str, Callable[[bytes], bytes], tuple[str, ...]]]:
    """(label, text -> text, field names the refusal must hold) for any YAML artifact."""

    def malformed(text: bytes) -> bytes:
        return text + b"\nextra_list: [1, 2\nnext: 3\n"

    def other(text: bytes) -> bytes:
        return other_kind.read_bytes()

    def unknown_key(text: bytes) -> bytes:
        return text + b"\nextra_key_nobody_defines: 1\n"

    def too_new(text: bytes) -> bytes:
        return re.sub(rb"(?m)^schema_version: *\d+", b"schema_version: 99", text, count=1)

    def no_version(text: bytes) -> bytes:
        return re.sub(rb"(?m)^schema_version: *\d+\n", b"", text, count=1)

    out = [
        ("malformed-yaml", malformed, ()),
        ("not-a-mapping", lambda t: b"- just\n- a list\n", ()),
        ("empty-file", lambda t: b"", ()),
        ("only-a-comment", lambda t: b"# nothing here\n", ()),
        ("binary-garbage", lambda t: BINARY, ()),
        ("truncated-half-way", lambda t: t[: len(t) // 2], ()),
        ("unknown-key", unknown_key, ("extra_key_nobody_defines",)),
        ("duplicate-key", lambda t: t + b"\n" + dup_line.encode() + b"\n", (dup_line.split(":")[0].strip(),)),
        ("schema-version-too-new", too_new, ("schema_version",)),
        ("schema-version-missing", no_version, ("schema_version",)),
        ("tab-indented", lambda t: t.replace(b"\n  ", b"\n\t", 1), ()),
    ]
    if other_kind is not None:
        out.append(("file-of-another-kind", other, ()))
    return out


NUMBER_VALUES = [("negative", -0.5), ("nan", math.nan), ("inf", math.inf), ("huge-1e300", 1e300)]


# ---------------------------------------------------------------------------------------------------
# Running a case


@dataclasses.dataclass
class Outcome:
    rc: int | None
    out: str
    err: str
    escaped: BaseException | None = None


def run_in_process(argv: list[str], capsys) -> Outcome:
    from rltune.cli.main import main

    capsys.readouterr()
    escaped, rc = None, None
    try:
        rc = main(argv)
    except BaseException as exc:  # noqa: BLE001 -- an escaping exception IS the finding (a traceback)
        escaped = exc
        if isinstance(exc, KeyboardInterrupt):
            raise
    captured = capsys.readouterr()
    return Outcome(rc, captured.out, captured.err, escaped)


def run_subprocess(argv: list[str], cwd: Path, timeout_s: float) -> Outcome:
    """The command as its own process group, killed whole past ``timeout_s`` (rc None: it hung)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    proc = subprocess.Popen([sys.executable, "-m", "rltune.cli.main", *argv], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return Outcome(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Outcome(None, out, err + f"\n[campaign: still running after {timeout_s} s; killed]")


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not line.startswith("rltune: warning:")]


def assert_outcome(case: Case, outcome: Outcome) -> None:
    cmd = "rltune " + " ".join(case.argv)
    if outcome.escaped is not None:
        exc = outcome.escaped
        raise AssertionError(f"traceback: {type(exc).__name__}: {str(exc)[:300]}\n  command: {cmd}")
    assert outcome.rc is not None, f"still running after the time-out (accepted and ran, or hung): {cmd}"
    expected = case.exit if isinstance(case.exit, tuple) else (case.exit,)
    tail = outcome.err.strip().splitlines()[-3:]
    assert outcome.rc in expected, f"wrong exit {outcome.rc} (expected {case.exit}): {cmd}\n  stderr tail: {tail}"
    leak = LEAKS.search(outcome.err)
    assert leak is None, f"leaks {leak.group(0)!r}: {cmd}\n  stderr tail: {tail}"
    if outcome.rc == 2:
        lines = error_lines(outcome.err)
        assert len(lines) == 1 and lines[0].startswith("rltune: "), (
            f"not one 'rltune: ' line ({len(lines)} lines): {cmd}\n  stderr: {lines[:4]}")
        missing = [n for n in case.names if n not in lines[0]]
        assert not missing, f"line does not name {missing}: {cmd}\n  line: {lines[0]}"
    elif outcome.rc == 4:
        missing = [n for n in case.names if n not in outcome.err]
        assert not missing, f"stderr does not name {missing}: {cmd}\n  stderr tail: {tail}"


def new_records(before: dict[str, str], tree: Path) -> list[str]:
    """Case parts and verdicts that appeared: what a refused command must never record."""
    return [p for p in snapshot(tree) if p not in before and
            (p.endswith("verdict.yaml") or ("cases/" in p and p.endswith(".parquet") and "/_" not in p))]


def files_outside(root: Path, area: Path) -> set[str]:
    """Paths of the files under ``root`` that lie outside ``area`` (listed, not hashed)."""
    area = area.resolve()
    return {p.relative_to(root).as_posix() for p in Path(root).rglob("*")
            if not p.is_dir() and not p.resolve().is_relative_to(area)}


def copy_area(src: Path, dst: Path) -> Path:
    """Copy the session's area and point every absolute path inside its text files at the copy."""
    shutil.copytree(src, dst, symlinks=True)
    old, new = str(src.resolve()).encode(), str(dst.resolve()).encode()
    for path in dst.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".jsonl", ".json", ".log"):
            data = path.read_bytes()
            if old in data:
                path.write_bytes(data.replace(old, new))
    return dst
