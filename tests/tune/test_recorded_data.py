"""What ``auto`` and ``trial`` have recorded is never lost or changed by a bad input.

One real ``rltune auto`` of the CPU demo (one untuned run, one trial) makes a finished work dir; each
test copies it and feeds it what a user could: a journal an editor saved without its final newline,
a journal emptied, a second work dir sharing the library, a trial whose input is wrong. Every file
that was there before is hashed, and the hashes must hold wherever the command refuses.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from rltune.cli.main import main
from rltune.predict.library import CaseLibrary

from .helpers import DEMO


def _snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` but the library's index, a cache any read may rebuild."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "_index.parquet"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _job(folder: Path, name: str = "demo", **changes) -> Path:
    data = yaml.safe_load(DEMO.read_text())
    data["name"] = name
    data["launch"]["workdir"] = str(DEMO.parent.parent)
    data["limits"].update(baseline_runs=1)
    for key, value in changes.items():
        section, field = key.split("__")
        data[section][field] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """(job, work dir) of a finished real auto run: one untuned run, one trial."""
    root = tmp_path_factory.mktemp("finished")
    job = _job(root)
    argv = ["auto", str(job), "--workdir", str(root / "tune"), "--trials", "1", "--steps", "3", "--tuned-dir",
            str(root / "tuned"), "--no-live"]
    assert main(argv) == 0
    return job, root / "tune"


def _copy(finished: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    job, workdir = finished
    shutil.copytree(workdir, tmp_path / "tune")
    return job, tmp_path / "tune"


def _auto(job: Path, workdir: Path, tmp_path: Path, *extra: str) -> int:
    return main(["auto", str(job), "--workdir", str(workdir), "--trials", "1", "--steps", "3", "--tuned-dir",
                 str(tmp_path / "tuned"), "--no-live", *extra])


def test_a_journal_saved_without_its_final_newline_resumes_from_its_last_event(finished, tmp_path, capsys):
    """The issue's case: the round-0 baseline is the last line, complete, with no newline. It is kept,
    the loop goes on from it (no untuned run again), and every earlier line stays byte for byte."""
    job, workdir = _copy(finished, tmp_path)
    path = workdir / "journal.jsonl"
    events = _lines(path)
    cut = next(i for i, e in enumerate(events) if e["event"] == "baseline") + 1
    kept = "\n".join(json.dumps(e) for e in events[:cut])          # no final newline, as an editor saves it
    path.write_text(kept)
    assert _auto(job, workdir, tmp_path) == 0
    text = path.read_text()
    assert text.startswith(kept + "\n")                            # the baseline was ended, not cut
    resumed = _lines(path)
    assert [e["event"] for e in resumed].count("baseline") == 1
    assert [e["run_id"] for e in resumed if e["event"] == "run_start" and e["role"] == "baseline"] == \
        [e["run_id"] for e in events if e["event"] == "run_start" and e["role"] == "baseline"]
    assert resumed[-1]["event"] == "finish"


@pytest.mark.parametrize("how", ["empty", "missing", "whitespace"])
def test_a_finished_work_dir_whose_journal_was_lost_is_refused_and_left_as_it_was(finished, tmp_path, capsys, how):
    job, workdir = _copy(finished, tmp_path)
    path = workdir / "journal.jsonl"
    if how == "missing":
        path.unlink()
    else:
        path.write_text("" if how == "empty" else "\n\n")
    before = _snapshot(workdir)
    capsys.readouterr()
    assert _auto(job, workdir, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rltune: ") and "journal.jsonl" in err[0] and "runs/" in err[0]
    assert "Traceback" not in err[0]
    assert _snapshot(workdir) == before


def test_a_journal_that_is_binary_is_refused_naming_its_line(finished, tmp_path, capsys):
    job, workdir = _copy(finished, tmp_path)
    path = workdir / "journal.jsonl"
    raw = path.read_bytes()
    first = raw.index(b"\n") + 1
    path.write_bytes(raw[:first] + b"\xff\xfe\x00\x01 binary\n" + raw[first:])   # a second line of bytes
    before = _snapshot(workdir)
    capsys.readouterr()
    assert _auto(job, workdir, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "journal.jsonl: line 2: not text" in err[0] and "UnicodeDecodeError" not in err[0]
    assert _snapshot(workdir) == before


def test_a_second_work_dir_sharing_the_library_gives_its_runs_their_own_ids(finished, tmp_path):
    """Run ids are unique across work dirs that share one library: the second baseline is not refused."""
    job, first = _copy(finished, tmp_path)
    library = first / "cases"
    before = _snapshot(library)
    other = _job(tmp_path / "other", name="demo")
    code = main(["auto", str(other), "--workdir", str(tmp_path / "second"), "--library", str(library), "--trials",
                 "1", "--steps", "3", "--tuned-dir", str(tmp_path / "tuned2"), "--no-live"])
    assert code == 0
    second = _lines(tmp_path / "second" / "journal.jsonl")
    baseline = next(e for e in second if e["event"] == "baseline")
    assert baseline["run_id"] == "r0-untuned-x2"
    after = _snapshot(library)
    assert {k: v for k, v in after.items() if k in before and not k.startswith("_")} == \
        {k: v for k, v in before.items() if not k.startswith("_")}                     # every earlier case as it was
    ids = [r.run_id for r in CaseLibrary(library).load()]
    assert ids.count("r0-untuned") == 1 and ids.count("r0-untuned-x2") == 1


def test_an_untuned_baseline_that_crashes_exits_4_and_is_recorded_as_failed(tmp_path, capsys):
    job = _job(tmp_path, launch__command=[sys.executable, "-c", "import sys; print('boom'); sys.exit(1)"])
    capsys.readouterr()
    assert main(["auto", str(job), "--workdir", str(tmp_path / "tune"), "--steps", "3", "--tuned-dir",
                 str(tmp_path / "tuned"), "--no-live"]) == 4
    err = capsys.readouterr().err
    assert "rltune: the untuned baseline failed (exited with code 1); fix the job first" in err and "boom" in err
    events = _lines(tmp_path / "tune" / "journal.jsonl")
    assert [e["event"] for e in events][-1] == "run_abandoned"
    assert [r.status for r in CaseLibrary(tmp_path / "tune" / "cases").load()] == ["failed"]


@pytest.mark.parametrize("argv, problem", [
    (["--steps", "0"], "--steps 0: give a step count from 1"),
    (["--steps", "-1"], "--steps -1: give a step count from 1"),
    (["--steps", "2"], "--steps 2: a trial is timed on the steps after limits.warmup_steps (2)"),
    (["--steps", "99999999999999999999999"], "steps"),
    (["--job", "{missing_program}"], "launch.command[0]: 'no-such-program-here' is not on PATH"),
])
def test_a_trial_refused_for_its_input_records_nothing(finished, tmp_path, capsys, argv, problem):
    """Input errors are the user's to fix: exit 2 before launch, no run dir, no case -- so the next
    'trial' does not skip candidates as if they had crashed."""
    job, workdir = _copy(finished, tmp_path)
    forecast = next(workdir.glob("rounds/r1/forecast-a*.yaml"))
    if "{missing_program}" in argv:
        data = yaml.safe_load(job.read_text())
        data["launch"]["command"] = ["no-such-program-here", *data["launch"]["command"][1:]]
        broken = tmp_path / "broken.yaml"
        broken.write_text(yaml.safe_dump(data, sort_keys=False))
        argv = ["--job", str(broken)]
    else:
        argv = ["--job", str(job), *argv]
    before = _snapshot(workdir)
    cases_before = [r.run_id for r in CaseLibrary(workdir / "cases").load()]
    capsys.readouterr()
    code = main(["trial", str(forecast), "--runs-root", str(tmp_path / "trials"), "--library", str(workdir / "cases"),
                 *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("rltune: ") and problem in err[0]
    assert _snapshot(workdir) == before
    assert [r.run_id for r in CaseLibrary(workdir / "cases").load()] == cases_before
    assert not (tmp_path / "trials").exists() or not any((tmp_path / "trials").iterdir())
