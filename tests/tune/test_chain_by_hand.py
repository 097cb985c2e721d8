"""The README's stages chained by hand on the real CPU demo job: profile -> propose -> predict -> trial -> report.

Each stage is the CLI a user types; the job is the real reference workload. Which candidate wins
depends on measured times, so the assertions hold whichever it is: the exit code follows the
verdict, the forecast compares against the baseline's own measured run, the report reads the run
directories.
"""

from __future__ import annotations

import json

import pytest
import yaml

from rltune.cli.main import main
from rltune.contracts.forecast import load_forecast
from rltune.contracts.verdict import load_verdict
from rltune.predict.library import CaseLibrary

from .helpers import DEMO


def test_the_readme_chain_runs_by_hand_and_the_report_reads_its_run_directories(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = str(DEMO)
    assert main(["profile", job, "--steps", "5", "--out", "runs/base", "--library", "cases"]) == 0
    base_rows = CaseLibrary("cases").load()
    assert [r.run_id for r in base_rows] == ["base"] and base_rows[0].statistic == "mean"
    assert main(["propose", "runs/base/diagnosis.yaml", "--job", job, "--out", "runs/base/candidates.yaml"]) == 0
    assert main(["predict", "runs/base/candidates.yaml", "--library", "cases", "--out", "runs/base/forecast.yaml"]) == 0
    forecast = load_forecast("runs/base/forecast.yaml")
    # the gains are against the baseline's own measured run: its mean step, from its case
    assert forecast.baseline_run == "base" and forecast.baseline_method == "measured"
    assert forecast.baseline_step_s == pytest.approx(base_rows[0].step_s, rel=1e-5)
    capsys.readouterr()
    rc = main(["trial", "runs/base/forecast.yaml", "--job", job, "--steps", "5", "--no-remeasure", "--json"])
    summary = json.loads(capsys.readouterr().out)
    verdict = load_verdict(summary["verdict"])
    assert rc == {"keep": 0, "reject": 3, "failed": 4}[verdict.decision]
    assert verdict.baseline_run == "base" and verdict.noise_pct >= 5.0
    assert main(["report", "runs"]) == 0
    page = (tmp_path / "runs" / "report.html").read_text()
    assert verdict.run_id in page and "chained by hand" in page and "#1" in page
    assert "GPU-seconds" not in page                      # a CPU job has no GPU-seconds to show


def test_a_trial_whose_job_crashes_exits_4_with_its_log_tail(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", str(DEMO), "--steps", "3", "--out", "runs/base"]) == 0
    data = yaml.safe_load(DEMO.read_text())
    data["launch"]["workdir"] = str(DEMO.parent.parent)
    data["launch"]["command"] = [*data["launch"]["command"], "trainer.mini_batches=2"]  # refuses sparse deltas
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    knobs = yaml.safe_load((tmp_path / "runs/base/job.yaml").read_text())["knobs"]
    (tmp_path / "candidates.yaml").write_text(yaml.safe_dump({
        "schema_version": 1, "job": "job.yaml", "baseline_run": "base", "baseline_knobs": knobs,
        "limiting_stage": "rollout", "baseline_dir": str(tmp_path / "runs/base"),
        "candidates": [{"id": "c1", "fixes": ["sparse_delta_sync"], "overrides": {"sync_transport": "sparse_delta"},
                        "rationale": "by hand"}]}))
    (tmp_path / "forecast.yaml").write_text(yaml.safe_dump({
        "schema_version": 1, "job": "job.yaml", "candidates_file": "candidates.yaml", "library": "cases",
        "baseline_step_s": 1.0, "forecasts": [{"candidate": "c1", "overrides": {"sync_transport": "sparse_delta"},
                                               "stages_s": {}, "step_s": 0.9, "range_s": [0.5, 1.5],
                                               "limiting_stage": "rollout", "method": "theory", "rl_mode": "sync"}]}))
    capsys.readouterr()
    rc = main(["trial", "forecast.yaml", "--job", "job.yaml", "--candidate", "c1", "--steps", "3", "--json"])
    captured = capsys.readouterr()
    assert rc == 4
    verdict = load_verdict(json.loads(captured.out)["verdict"])
    assert verdict.decision == "failed" and "mini_batches" in verdict.log_tail and "mini_batches" in captured.err
