"""``rltune predict`` and ``rltune eval`` end to end on a small hand-made library (not measurements)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from predict_casekit import make_case

from rltune.cli.main import main
from rltune.contracts.forecast import load_forecast
from rltune.contracts.job import load_job
from rltune.predict.library import CaseLibrary, case_file_name, job_facts

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "presets" / "cpu-demo.yaml"


@pytest.fixture
def setup_files(tmp_path):
    job = load_job(JOB)
    lib = CaseLibrary(tmp_path / "cases")
    common = dict(job=job.name, facts=job_facts(job), defaults=False)
    lib.append(make_case("base", rollout=1.0, training=2.0, weight_sync=0.2, knobs=dict(job.knobs), t=0, **common))
    lib.append(make_case("mb4", rollout=1.0, training=1.4, weight_sync=0.2, knobs={**job.knobs, "micro_batch_size": 4}, t=100, **common))
    lib.append(make_case("async", rollout=1.1, training=2.1, weight_sync=0.2, knobs={**job.knobs, "rl_mode": "one_step_async"}, t=200, **common))
    candidates = {
        "schema_version": 1, "job": str(JOB), "baseline_run": "base", "baseline_knobs": dict(job.knobs), "limiting_stage": "training",
        "candidates": [
            {"id": "c-mb4", "fixes": ["smaller-mb"], "overrides": {"micro_batch_size": 4}, "rationale": "fewer, fuller micro-batches"},
            {"id": "c-async-mb4", "fixes": ["async", "smaller-mb"], "overrides": {"rl_mode": "one_step_async", "micro_batch_size": 4},
             "rationale": "overlap rollout with training"},
            {"id": "c-static", "fixes": ["static"], "overrides": {"engine_batching": "static"}, "rationale": "worse, on purpose"},
        ],
    }
    path = tmp_path / "candidates.yaml"
    path.write_text(yaml.safe_dump(candidates))
    return tmp_path, path


def test_predict_ranks_marks_and_writes_forecast_yaml(setup_files, capsys):
    tmp_path, candidates = setup_files
    out = tmp_path / "forecast.yaml"
    rc = main(["predict", str(candidates), "--library", str(tmp_path / "cases"), "--out", str(out), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads(captured.out)
    fc = load_forecast(out)
    assert fc.baseline_step_s == pytest.approx(3.2)
    assert [f.candidate for f in fc.forecasts] == ["c-async-mb4", "c-mb4", "c-static"]
    assert [f["candidate"] for f in summary["forecasts"]] == ["c-async-mb4", "c-mb4", "c-static"]
    by_id = {f.candidate: f for f in fc.forecasts}
    assert by_id["c-mb4"].step_s == pytest.approx(2.6) and by_id["c-mb4"].method == "anchor" and by_id["c-mb4"].worth_trial
    assert by_id["c-async-mb4"].rl_mode == "one_step_async" and by_id["c-async-mb4"].worth_trial
    assert not by_id["c-static"].worth_trial and by_id["c-static"].gain_pct < 5
    assert "c-mb4" in captured.err and "forecast against baseline" in captured.err


def test_predict_refuses_a_library_with_a_corrupt_case_naming_it(setup_files, capsys):
    tmp_path, candidates = setup_files
    bad = tmp_path / "cases" / case_file_name("broken")
    bad.write_bytes(b"PAR1 torn write")
    rc = main(["predict", str(candidates), "--library", str(tmp_path / "cases"), "--json"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rltune: {bad}: ") and "move it out of the library" in lines[0]


def test_predict_with_a_missing_candidates_file_is_exit_2(tmp_path, capsys):
    rc = main(["predict", str(tmp_path / "nope.yaml"), "--library", str(tmp_path)])
    assert rc == 2 and "nope.yaml" in capsys.readouterr().err


def test_predict_imports_neither_torch_nor_triton(setup_files):
    tmp_path, candidates = setup_files
    code = ("import sys; from rltune.cli.main import main; "
            f"rc = main(['predict', {str(candidates)!r}, '--library', {str(tmp_path / 'cases')!r}]); "
            "print('RC', rc, 'HEAVY', [m for m in ('torch', 'triton') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert "RC 0 HEAVY []" in out.stdout, out.stdout + out.stderr


def test_eval_writes_json_and_png(setup_files, capsys):
    tmp_path, _ = setup_files
    rc = main(["eval", "--library", str(tmp_path / "cases"), "--out", str(tmp_path / "ev"), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["runs"] == 3 and summary["evaluated"] == 2 and summary["without_history"] == ["base"]
    full = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert [r["run_id"] for r in full["rows"]] == ["mb4", "async"]
    assert (tmp_path / "ev" / "eval.png").read_bytes()[:4] == b"\x89PNG"
    assert "median |step error|" in captured.err


def test_eval_of_a_missing_library_is_exit_2(tmp_path, capsys):
    rc = main(["eval", "--library", str(tmp_path / "none")])
    assert rc == 2 and "no case library" in capsys.readouterr().err
