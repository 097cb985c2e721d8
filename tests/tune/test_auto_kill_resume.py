"""kill -9 of a real 'rltune auto' mid-trial, then the same command again: it resumes and the case
library holds every finished run exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rltune.predict.library import CaseLibrary

from .helpers import DEMO, REPO


def _pids_mentioning(text: str) -> list[int]:
    """Processes this test started (their argv names the test's own temporary directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _events(workdir: Path) -> list[dict]:
    path = workdir / "journal.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


@pytest.mark.slow
def test_kill_9_mid_trial_then_rerun_records_every_finished_run_once(tmp_path):
    workdir = tmp_path / "tune"
    argv = [sys.executable, "-m", "rltune.cli.main", "auto", str(DEMO), "--workdir", str(workdir), "--rounds", "1",
            "--trials", "2", "--per-round", "2", "--steps", "4", "--tuned-dir", str(tmp_path / "tuned"), "--no-live"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    first = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 300
    killed_run = None
    while time.monotonic() < deadline and first.poll() is None:
        starts = [e for e in _events(workdir) if e["event"] == "run_start" and e["role"] == "trial"]
        if starts:
            killed_run = starts[0]["run_id"]
            time.sleep(3.0)                      # well inside the trial's run
            break
        time.sleep(0.5)
    assert killed_run is not None, "auto never started a trial"
    for pid in [first.pid, *_pids_mentioning(str(tmp_path))]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    assert not any(e["event"] == "trial" for e in _events(workdir))

    second = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "report:" in second.stdout

    events = _events(workdir)
    assert [e["event"] for e in events].count("start") == 1
    abandoned = [e["run_id"] for e in events if e["event"] == "run_abandoned"]
    assert abandoned == [killed_run]
    finished = [e["run_id"] for e in events if e["event"] in ("baseline_run", "trial")]
    again = [e["run_id"] + "-again" for e in events if e["event"] == "trial" and e["remeasured"]]
    records = CaseLibrary(workdir / "cases").load()
    ids = [r.run_id for r in records]
    assert len(ids) == len(set(ids))                       # no run twice
    assert sorted(ids) == sorted(finished + again)         # every finished run, and the killed one not at all
    assert killed_run not in ids
    assert len([e for e in events if e["event"] == "trial"]) >= 1
