"""Outputs never replace inputs, records or another run; one output convention in every command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rltune.cli.main import COMMANDS, main
from rltune.contracts.outputs import RUN_MARKERS, OutputPathError, check_output, safe_name

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "presets" / "cpu-demo.yaml"


@pytest.mark.parametrize("name, safe", [("tiny-math-cpu", "tiny-math-cpu"), ("../../../../tmp/x", "tmp-x"),
                                        ("..", "run"), ("", "run"), (".", "run"), ("/abs/path", "abs-path"),
                                        ("a b\tc", "a-b-c"), ("r1-c2", "r1-c2"), ("x" * 300, "x" * 100)])
def test_safe_name_keeps_one_path_part(name, safe):
    assert safe_name(name) == safe
    assert "/" not in safe_name(name) and safe_name(name) not in (".", "..")


def test_a_job_named_with_dots_and_slashes_is_refused_before_anything_is_written(tmp_path, capsys):
    """The job file is refused where it is read; the tuned preset's file name goes through safe_name as well."""
    import yaml

    data = yaml.safe_load(DEMO.read_text())
    data["name"] = "../../../../tmp/x"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    capsys.readouterr()
    assert main(["auto", str(job), "--workdir", str(tmp_path / "wd"), "--tuned-dir", str(tmp_path / "tuned"),
                 "--no-live"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{job}: name: '../../../../tmp/x' is not a plain name" in err[0]
    assert not (tmp_path / "tuned").exists() and not (tmp_path / "wd").exists()
    assert safe_name(data["name"]) == "tmp-x"


# -- check_output, every rule ----------------------------------------------------------------------------
def test_an_output_that_is_an_input_is_refused_even_through_another_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "diagnosis.yaml").write_text("x")
    (tmp_path / "sub").mkdir()
    for spelling in ("diagnosis.yaml", "sub/../diagnosis.yaml", str(tmp_path / "diagnosis.yaml")):
        with pytest.raises(OutputPathError, match="is an input of this command"):
            check_output(spelling, inputs=["diagnosis.yaml"])
    os.symlink(tmp_path / "diagnosis.yaml", tmp_path / "link.yaml")
    with pytest.raises(OutputPathError, match="is an input"):
        check_output("link.yaml", inputs=["diagnosis.yaml"])


@pytest.mark.parametrize("name", ["journal.jsonl", "stages.parquet", "case-abc.parquet", "reward_check.yaml"])
def test_a_recorded_file_is_never_replaced(tmp_path, name):
    (tmp_path / name).write_text("recorded")
    with pytest.raises(OutputPathError, match="recorded file"):
        check_output(tmp_path / name)
    assert (tmp_path / name).read_text() == "recorded"


@pytest.mark.parametrize("name", ["verdict.yaml", "diagnosis.yaml", "job.yaml", "launch.log", "metrics.jsonl"])
def test_a_file_of_a_run_directory_is_never_replaced_but_the_same_name_elsewhere_may_be(tmp_path, name):
    run = tmp_path / "run"
    run.mkdir()
    (run / "stages.parquet").write_bytes(b"PAR1")
    (run / name).write_text("run's")
    with pytest.raises(OutputPathError, match=f"the {re.escape(name)} of the run"):
        check_output(run / name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / name).write_text("mine")
    if name in RUN_MARKERS:  # a verdict or diagnosis makes its folder a run: never replaced anywhere
        with pytest.raises(OutputPathError, match="recorded file"):
            check_output(elsewhere / name)
    else:
        assert check_output(elsewhere / name) == elsewhere / name


@pytest.mark.parametrize("marker", ["stages.parquet", "diagnosis.yaml", "verdict.yaml", "launch.json"])
def test_another_runs_directory_needs_force(tmp_path, marker):
    (tmp_path / marker).write_text("x")
    with pytest.raises(OutputPathError, match=f"already holds another run \\({re.escape(marker)}\\).*--force"):
        check_output(tmp_path, expect="run_dir")
    assert check_output(tmp_path, expect="run_dir", force=True) == tmp_path
    with pytest.raises(OutputPathError, match="is the directory of a recorded run"):
        check_output(tmp_path, expect="dir")            # a plain output folder is never a recorded run's
    assert check_output(tmp_path, expect="dir", run_ok=True) == tmp_path  # a job's own run dir, as rltune made it


def test_force_never_lets_a_run_directory_replace_its_own_input(tmp_path):
    (tmp_path / "stages.parquet").write_bytes(b"PAR1")
    with pytest.raises(OutputPathError, match="would replace its input"):
        check_output(tmp_path, inputs=[tmp_path / "stages.parquet"], expect="run_dir", force=True,
                     writes=("stages.parquet",))


def test_an_output_of_the_wrong_kind_is_one_line_naming_the_flag(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    with pytest.raises(OutputPathError, match=r"^--library .*afile: is a file, not a directory"):
        check_output(tmp_path / "afile", expect="dir", flag="--library")
    with pytest.raises(OutputPathError, match=r"^--out .*adir: is a directory"):
        check_output(tmp_path / "adir")
    with pytest.raises(OutputPathError, match=r"afile is a file, so nothing can be written under it"):
        check_output(tmp_path / "afile" / "deeper" / "x.yaml")
    with pytest.raises(OutputPathError, match=r"afile is a file"):
        check_output(tmp_path / "afile" / "run", expect="run_dir")


def test_new_paths_pass(tmp_path):
    assert check_output(tmp_path / "a" / "b.yaml", inputs=[None, tmp_path / "c.yaml"]) == tmp_path / "a" / "b.yaml"
    assert check_output(tmp_path / "new", expect="run_dir") == tmp_path / "new"


# -- the commands ----------------------------------------------------------------------------------------
def test_report_refuses_to_write_over_the_journal_it_reads(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    journal = work / "journal.jsonl"
    journal.write_text('{"event": "start", "time": 0}\n')
    rc = main(["report", str(work), "--out", str(journal)])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (f"rltune: --out {journal}: is a recorded file (an 'rltune auto' "
                                               "journal) that must not be replaced; give --out a new file")
    assert journal.read_text() == '{"event": "start", "time": 0}\n'


@pytest.mark.parametrize("argv, says", [
    (["--warmup", "2"], "--warmup does nothing without --from-logs"),
    (["--run-id", "r1"], "--run-id does nothing without --from-logs"),
    (["--format", "verl"], "--format does nothing without --from-logs"),
    (["--steps", "0"], "--steps 0: give a step count from 1 to 1000000"),
    (["--steps", "1000001"], "--steps 1000001: give a step count from 1 to 1000000"),
    (["--steps", "99999999999999999999999"], "--steps 99999999999999999999999: give a step count"),
    (["--set", "micro_batch_size=abc"], "cpu-demo.yaml): micro_batch_size: expected an integer, found string 'abc'"),
    (["--set", "micro_batch_size=8.5"], "cpu-demo.yaml): micro_batch_size: expected an integer, found 8.5"),
    (["--set", "packing=1"], "cpu-demo.yaml): packing: expected true or false, found 1"),
    (["--set", "micro_batch_size=4", "--set", "micro_batch_size=8"],
     "cpu-demo.yaml): micro_batch_size: given twice (4, then 8); give it once"),
    (["--set", "no_such_knob=1"], "cpu-demo.yaml): no_such_knob: not a knob of job 'tiny-math-cpu'"),
])
def test_profile_refuses_flags_it_cannot_use_before_running(argv, says, tmp_path, capsys):
    rc = main(["profile", str(DEMO), "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, says", [
    (["--steps", "3"], "--steps does nothing with --from-logs"),
    (["--set", "micro_batch_size=8"], "--set does nothing with --from-logs"),
    (["--warmup", "-1"], "--warmup -1: the warm-up step count must be at least 0"),
])
def test_profile_from_logs_refuses_flags_it_cannot_use(argv, says, tmp_path, capsys):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 0, "step_s": 1.0}\n')
    rc = main(["profile", "--from-logs", str(log), "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, says", [
    (["--readers", "1,,2"], "--readers '1,,2': give a comma list without empty items"),
    (["--readers", "1,x"], "'x' is not an integer"),
    (["--readers", "2,2"], "'2' is given twice"),
    (["--readers", "-1"], "-1 is below 0"),
    (["--readers", "1", "--storage", "disk,tape"], "'tape' is not one of disk, shm"),
    (["--readers", "1", "--device", "cpu"], "--device does nothing in many-readers mode"),
    (["--transports", "sparse,,filesystem"], "--transports 'sparse,,filesystem'"),
    (["--device", "tpu"], "--device 'tpu': choose auto, cpu or cuda"),
    (["--steps", "0"], "--steps 0"),
    (["--estimate", "x.yaml", "--steps", "3"], "--steps does nothing with --estimate"),
])
def test_sync_bench_reads_its_flags_strictly(argv, says, tmp_path, capsys):
    rc = main(["sync-bench", "--out", str(tmp_path / "out"), *argv] if "--estimate" not in argv else
              ["sync-bench", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and err.count("\n") == 1, err


def test_sync_bench_refuses_cuda_where_torch_sees_no_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --device cuda is valid here")
    assert main(["sync-bench", "--device", "cuda", "--out", str(tmp_path / "out")]) == 2
    assert "--device cuda: torch sees no GPU here" in capsys.readouterr().err


# -- one output convention --------------------------------------------------------------------------------
def test_a_corrupt_library_index_is_one_rltune_warning_line(tmp_path, capsys):
    library = tmp_path / "cases"
    library.mkdir()
    (library / "_index.parquet").write_bytes(b"PAR1 not a parquet file")   # a cache: ignored, rebuilt, told
    main(["eval", "--library", str(library)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "_index.parquet" in line]
    assert len(lines) == 1 and lines[0].startswith("rltune: warning: "), err
    assert "CorruptCaseWarning" not in err and "warnings.warn" not in err


def _help(*command: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="80")
    out = subprocess.run([sys.executable, "-m", "rltune.cli.main", *command, "--help"], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("command", [*(c.replace("_", "-") for c in COMMANDS if c not in ("workload", "library")),
                                     "workload", "workload run", "workload check", "library", "library import"])
def test_every_help_example_keeps_its_own_line(command):
    shown = [line.strip() for line in _help(*command.split()).splitlines()]
    examples = [line.strip() for line in _source_help(command).splitlines() if line.startswith("  rltune ")]
    assert examples
    for example in examples:  # whole, on a line of its own: not rewrapped into the paragraph around it
        assert example in shown, f"{example!r} is not a line of 'rltune {command} --help'"


def _source_help(command: str) -> str:
    import importlib

    module = importlib.import_module("rltune.cli." + command.split()[0].replace("-", "_"))
    if command == "workload run":
        return module.RUN_HELP
    if command == "workload check":
        return module.CHECK_HELP
    if command == "library import":
        return module.IMPORT_HELP
    return module.HELP


def test_no_cli_message_spells_an_exception_class_or_errno_text():
    sources = "\n".join(p.read_text() for p in (REPO / "rltune" / "cli").glob("*.py"))
    assert "__class__.__name__" not in sources and "type(exc).__name__" not in sources
