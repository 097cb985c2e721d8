"""The campaign's work area, built once per session from real presets and real commands.

``area/real``: ``rltune profile presets/cpu-demo.yaml --steps 3 --out runs/base --library cases`` (the
reference workload, for real), then ``propose`` and ``predict`` on it, as the README chains them.
``area/fast``: the same chain of the CPU demo preset whose launch runs ``fake_job.py`` (a second a
run), which ``trial`` cases launch. ``area/auto``: a finished ``rltune auto`` work dir of that fast job
(one baseline, one round, one trial). ``area/inputs``: copies of the presets the mutations start from.
Each case copies the area into its own temporary directory before touching anything.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from .kit import DEMO, FAKE_JOB, PRESETS, copy_area, fast_job_data, snapshot, write_yaml

AUTO_ARGS = ["--rounds", "1", "--trials", "1", "--per-round", "1", "--steps", "3", "--tuned-dir", "tuned", "--no-live"]


def _cli(argv: list[str], cwd: Path) -> None:
    import contextlib
    import io
    import os

    from rltune.cli.main import main

    here = os.getcwd()
    err = io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
    finally:
        os.chdir(here)
    assert rc == 0, f"setup: rltune {' '.join(argv)} -> {rc}\n{err.getvalue()[-3000:]}"


def _metrics_file(path: Path, mode: str) -> None:
    import subprocess
    import sys

    run_dir = path.parent / f"run-{mode}"
    subprocess.run([sys.executable, str(FAKE_JOB), mode, "--run-dir", str(run_dir), "orchestrator.steps=4"],
                   check=True, timeout=60)
    shutil.move(run_dir / "metrics.jsonl", path)
    shutil.rmtree(run_dir)


@pytest.fixture(scope="session")
def area_info(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("campaign-area") / "area"
    real, fast, auto, inputs = (root / n for n in ("real", "fast", "auto", "inputs"))
    for d in (real, fast, auto, inputs):
        d.mkdir(parents=True)

    _cli(["profile", str(DEMO), "--steps", "3", "--out", "runs/base", "--library", "cases"], real)
    _cli(["propose", "runs/base/diagnosis.yaml", "--job", str(DEMO), "--out", "runs/base/candidates.yaml"], real)
    _cli(["predict", "runs/base/candidates.yaml", "--library", "cases", "--out", "runs/base/forecast.yaml"], real)

    write_yaml(fast / "job.yaml", fast_job_data())
    write_yaml(fast / "other.yaml", fast_job_data(base=PRESETS / "cpu-tool-use.yaml", name="another-job"))
    for mode in ("crash", "hang", "nan", "negative", "inf", "huge", "garbage", "empty"):
        write_yaml(fast / f"job-{mode}.yaml", fast_job_data(mode, timeout_s=3 if mode == "hang" else 10))
    missing = fast_job_data()
    missing["launch"]["command"] = ["no-such-program-rltune-campaign", "--run-dir", "{run_dir}"]
    write_yaml(fast / "job-missing-program.yaml", missing)
    _cli(["profile", "job.yaml", "--steps", "3", "--out", "runs/base", "--library", "cases"], fast)
    _cli(["propose", "runs/base/diagnosis.yaml", "--job", "job.yaml", "--out", "runs/base/candidates.yaml"], fast)
    _cli(["predict", "runs/base/candidates.yaml", "--library", "cases", "--out", "runs/base/forecast.yaml"], fast)
    forecast = yaml.safe_load((fast / "runs/base/forecast.yaml").read_text())
    worth = [f for f in forecast["forecasts"] if f.get("worth_trial")] or forecast["forecasts"]
    candidate = worth[0]["candidate"]
    cand_index = [f["candidate"] for f in forecast["forecasts"]].index(candidate)

    learn = fast_job_data(base=PRESETS / "cpu-math-learn.yaml")
    write_yaml(fast / "learn.yaml", learn)

    write_yaml(auto / "job.yaml", fast_job_data(name="campaign-auto"))
    _cli(["auto", "job.yaml", "--workdir", "wd", *AUTO_ARGS], auto)
    events = [json.loads(line) for line in (auto / "wd/journal.jsonl").read_text().splitlines() if line.strip()]
    trial_dirs = [e["run_dirs"][0] for e in events if e["event"] == "trial" and e.get("run_dirs")]
    baseline_dirs = [e.get("run_dir") or e.get("run_dirs", [None])[0] for e in events if e["event"] == "baseline_run"]

    shutil.copy(PRESETS / "knowledge.yaml", inputs / "knowledge.yaml")
    shutil.copy(PRESETS / "workload/tiny-math.yaml", inputs / "workload.yaml")
    shutil.copy(PRESETS / "sync/estimate/qwen3-8b.yaml", inputs / "estimate.yaml")
    shutil.copy(PRESETS / "sync/cpu.yaml", inputs / "sync-preset.yaml")
    for mode in ("ok", "nan", "negative", "inf", "huge", "garbage"):
        _metrics_file(inputs / f"metrics-{mode}.jsonl", mode)

    return {"root": root, "candidate": candidate, "cand_index": cand_index, "events": events,
            "trial_dir": trial_dirs[0] if trial_dirs else None, "baseline_dir": baseline_dirs[0] if baseline_dirs else None,
            "snapshot": snapshot(root)}


@pytest.fixture
def area(area_info, tmp_path) -> Path:
    """A private copy of the session's area, five levels below the test's own temporary directory
    (so a name like '../../../../tmp/x' resolves inside that directory, never onto the machine's /tmp)."""
    return copy_area(area_info["root"], tmp_path / "l1" / "l2" / "l3" / "l4" / "area")
