"""README.md's exit-code table holds for every command: each code a command can return, from a real input.

The table under "### Exit codes" in README.md is the one source; it is parsed here, and every case
below names the code it expects by looking it up there. Good runs (0) use the files of one real
``rltune profile presets/cpu-demo.yaml --steps 3`` made once for the module. Jobs that fail (4) are
copies of the real presets whose ``launch.command`` is a real Python process that exits 1.
Trial's 0 (kept) and 3 (rejected) come from real trials in tests/tune/test_chain_by_hand.py
(``test_the_readme_chain_runs_by_hand_and_the_report_reads_its_run_directories``); which of the two
a trial gives depends on measured times, so it is not chosen here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rltune.cli.main import main

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "presets" / "cpu-demo.yaml"
LEARN = REPO / "presets" / "cpu-math-learn.yaml"
WORKLOAD = REPO / "presets" / "workload" / "tiny-math.yaml"
ESTIMATE = REPO / "presets" / "sync" / "estimate" / "qwen3-235b-a22b.yaml"
EXITS_1 = ["python3", "-c", "import sys; sys.exit(1)"]


def readme_exit_codes() -> dict[int, str]:
    """The README's exit-code table: code -> meaning."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*(.+?)\s*\|\s*$", section, flags=re.M)
    return {int(code): meaning for code, meaning in rows}


CODES = readme_exit_codes()


def code(meaning: str) -> int:
    """The README's code for the row whose meaning starts with ``meaning``."""
    found = [c for c, m in CODES.items() if m.startswith(meaning)]
    assert len(found) == 1, f"README's exit-code table has no single row starting {meaning!r}: {CODES}"
    return found[0]


DONE, BAD_INPUT, REJECTED, JOB_FAILED, INTERRUPTED = (code("done"), code("bad input"), code("a trial was rejected"),
                                                      code("the job itself failed"), code("interrupted"))


def test_readme_table_has_each_code_once_with_its_meaning():
    assert CODES.keys() == {0, 2, 3, 4, 130}
    assert (DONE, BAD_INPUT, REJECTED, JOB_FAILED, INTERRUPTED) == (0, 2, 3, 4, 130)


def job_copy(tmp: Path, source: Path, name: str, command: list[str]) -> Path:
    """A copy of a real preset whose launch runs ``command`` from the repository."""
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    data["launch"]["command"] = command
    data["launch"]["workdir"] = str(REPO)
    path = tmp / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A real profile of the CPU demo (3 steps) with its case, candidates and forecast."""
    root = tmp_path_factory.mktemp("chain")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(["profile", str(DEMO), "--steps", "3", "--out", "runs/base", "--library", "cases"]) == DONE
        assert main(["propose", "runs/base/diagnosis.yaml", "--job", str(DEMO)]) == DONE
        assert main(["predict", "runs/base/candidates.yaml", "--library", "cases",
                     "--out", "runs/base/forecast.yaml"]) == DONE
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture(scope="module")
def crashed_trial(chain, tmp_path_factory):
    """A real trial of the chain's first candidate whose job exits 1 after starting; its runs root."""
    root = tmp_path_factory.mktemp("crashed")
    job = job_copy(root, DEMO, "crash.yaml", EXITS_1)
    forecast = yaml.safe_load((chain / "runs/base/forecast.yaml").read_text())
    rc = main(["trial", str(chain / "runs/base/forecast.yaml"), "--job", str(job), "--steps", "3",
               "--candidate", forecast["forecasts"][0]["candidate"], "--runs-root", str(root / "runs"),
               "--library", str(root / "cases")])
    return rc, root


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rltune: "), err
    assert "Traceback" not in err and "Error:" not in err and "[Errno" not in err, err
    return lines[0]


# -- 2: one bad input for every command, each one line --------------------------------------------------
BAD_INPUTS = {
    "profile": (["profile", "{DEMO}", "--steps", "0"], "--steps 0"),
    "propose": (["propose", "{chain}/runs/base/diagnosis.yaml", "--job", "{DEMO}", "--max", "-3"], "--max -3"),
    "predict": (["predict", "{chain}/runs/base/candidates.yaml", "--library", "{chain}/cases",
                 "--out", "{chain}/runs/base/candidates.yaml"], "is an input of this command"),
    "trial": (["trial", "{chain}/runs/base/forecast.yaml", "--job", "{DEMO}", "--steps", "99999999999999999999999"],
              "--steps 99999999999999999999999"),
    "auto": (["auto", "{DEMO}", "--workdir", "{chain}/runs/base/stages.parquet"], "is a file, not a directory"),
    "report": (["report", "{chain}/runs", "--out", "{chain}/runs/base/a-folder"], "is a directory"),
    "reward-check": (["reward-check", "{LEARN}", "--against", "{LEARN}", "--steps", "-1"], "--steps -1"),
    "eval": (["eval", "--library", "{chain}/cases", "--out", "{chain}/runs/base/job.yaml"], "is a file"),
    "sync-bench": (["sync-bench", "--device", "tpu"], "--device 'tpu'"),
    "workload run": (["workload", "run", "{WORKLOAD}", "--steps", "0"], "--steps 0"),
    "library import": (["library", "import", "{chain}/runs/base/job.yaml", "--library", "{chain}/cases"], "header, column"),
}


@pytest.mark.parametrize("command", sorted(BAD_INPUTS))
def test_a_bad_input_exits_with_the_bad_input_code_and_one_line(command, chain, capsys):
    (chain / "runs/base/a-folder").mkdir(exist_ok=True)
    argv, says = BAD_INPUTS[command]
    argv = [a.format(DEMO=DEMO, LEARN=LEARN, WORKLOAD=WORKLOAD, chain=chain) for a in argv]
    before = {p: p.read_bytes() for p in chain.rglob("*") if p.is_file()}
    capsys.readouterr()
    rc = main(argv)
    line = one_line(capsys.readouterr().err)
    assert rc == BAD_INPUT
    assert says in line
    assert {p: p.read_bytes() for p in chain.rglob("*") if p.is_file()} == before  # nothing written or changed


# -- 0: good runs, where they are cheap ----------------------------------------------------------------
def test_profile_propose_predict_exit_done(chain):
    """The module fixture ran them; here their files are checked to be what a good run leaves."""
    base = chain / "runs/base"
    assert {"stages.parquet", "diagnosis.yaml", "candidates.yaml", "forecast.yaml"} <= {p.name for p in base.iterdir()}
    assert yaml.safe_load((base / "forecast.yaml").read_text())["forecasts"]


def test_eval_on_the_chains_library_exits_done(chain, tmp_path):
    assert main(["eval", "--library", str(chain / "cases"), "--out", str(tmp_path / "eval")]) == DONE
    assert (tmp_path / "eval" / "eval.json").is_file()


def test_report_of_a_runs_root_with_a_trial_exits_done(crashed_trial, tmp_path):
    _, root = crashed_trial
    out = tmp_path / "report.html"
    assert main(["report", str(root / "runs"), "--out", str(out)]) == DONE
    assert "<html>" in out.read_text()


def test_sync_bench_estimate_exits_done(capsys):
    assert main(["sync-bench", "--estimate", str(ESTIMATE)]) == DONE


def test_workload_run_of_one_step_exits_done(tmp_path):
    assert main(["workload", "run", str(WORKLOAD), "--steps", "1", "--run-dir", str(tmp_path / "w")]) == DONE
    assert (tmp_path / "w" / "metrics.jsonl").read_text().count("\n") == 1


# -- 4: a job that starts and exits 1 --------------------------------------------------------------------
def test_profile_of_a_job_that_exits_1_exits_job_failed(tmp_path, capsys):
    job = job_copy(tmp_path, DEMO, "crash.yaml", EXITS_1)
    rc = main(["profile", str(job), "--steps", "3", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == JOB_FAILED
    assert "exited with code 1" in err and "Traceback" not in err


def test_trial_of_a_job_that_exits_1_exits_job_failed(crashed_trial):
    rc, root = crashed_trial
    assert rc == JOB_FAILED
    [verdict] = list((root / "runs").glob("*/verdict.yaml"))
    assert yaml.safe_load(verdict.read_text())["decision"] == "failed"


def test_reward_check_of_a_job_that_exits_1_exits_job_failed(tmp_path):
    job = job_copy(tmp_path, LEARN, "crash.yaml", EXITS_1)
    assert main(["reward-check", str(job), "--against", str(job), "--steps", "4", "--out", str(tmp_path / "rc")]) \
        == JOB_FAILED


def test_auto_whose_untuned_baseline_exits_1_exits_job_failed(tmp_path):
    job = job_copy(tmp_path, DEMO, "crash.yaml", EXITS_1)
    assert main(["auto", str(job), "--workdir", str(tmp_path / "wd"), "--steps", "3", "--no-live",
                 "--tuned-dir", str(tmp_path / "tuned")]) == JOB_FAILED


# -- a program that is not there: bad input, refused before anything runs, in every command -------------
def test_profile_refuses_a_launch_program_not_on_path_as_bad_input(tmp_path, capsys):
    job = job_copy(tmp_path, DEMO, "missing.yaml", ["no-such-program-rltune"])
    rc = main(["profile", str(job), "--steps", "3", "--out", str(tmp_path / "run")])
    assert rc == BAD_INPUT
    assert "launch.command[0]" in one_line(capsys.readouterr().err)


def test_trial_refuses_a_launch_program_not_on_path_as_bad_input(chain, tmp_path):
    job = job_copy(tmp_path, DEMO, "missing.yaml", ["no-such-program-rltune"])
    forecast = yaml.safe_load((chain / "runs/base/forecast.yaml").read_text())
    assert main(["trial", str(chain / "runs/base/forecast.yaml"), "--job", str(job), "--steps", "3",
                 "--candidate", forecast["forecasts"][0]["candidate"], "--runs-root", str(tmp_path / "runs"),
                 "--library", str(tmp_path / "cases")]) == BAD_INPUT


# -- 130: interrupted ------------------------------------------------------------------------------------
def test_profile_interrupted_while_its_job_runs_exits_interrupted(tmp_path):
    job = job_copy(tmp_path, DEMO, "sleeps.yaml", ["python3", "-c", "import time; time.sleep(120)"])
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "rltune.cli.main", "profile", str(job), "--out", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "launch.json").exists():  # the job has been started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == INTERRUPTED, err
    assert "Traceback" not in err


def test_every_command_has_a_bad_input_case():
    from rltune.cli.main import COMMANDS

    groups = {"workload": "workload run", "library": "library import"}  # a command group: its first subcommand
    assert set(BAD_INPUTS) == {groups.get(c, c.replace("_", "-")) for c in COMMANDS}
    assert shutil.which("python3"), "the failing jobs run python3"
