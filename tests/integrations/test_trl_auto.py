"""`rltune auto` on the real TRL job, CI-sized: a baseline and one trial of 4 steps each.

What the tuner decides depends on timings on a shared CPU, so the assertions hold for any outcome:
the loop finishes, every run it made is a real TRL run with a stage table, and the tuned preset it
writes loads, carries the best knobs, and TRL parses those knobs from its argv.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltune.cli.main import main
from rltune.contracts.job import load_job
from rltune.contracts.stages import read_stages
from rltune.launch import build_argv

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "trl-grpo-cpu.yaml"


@pytest.mark.slow
def test_auto_tunes_the_trl_job_and_writes_a_tuned_preset_trl_accepts(tmp_path, capsys):
    from rltune.integrations.trl_grpo import parse
    from rltune.profile import profile_job

    work, tuned_dir = tmp_path / "tune", tmp_path / "tuned"
    rc = main(["auto", str(PRESET), "--trials", "1", "--steps", "4", "--workdir", str(work),
               "--tuned-dir", str(tuned_dir), "--no-live", "--json"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    events = [json.loads(line) for line in (work / "journal.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "finish" and "baseline" in kinds
    assert sum(k == "trial" for k in kinds) <= 1
    for start in (e for e in events if e["event"] == "run_start"):
        run_dir = Path(start["run_dir"])
        run_dir = run_dir if run_dir.is_absolute() else work / run_dir  # the journal may hold it relative to --workdir
        rows = read_stages(run_dir / "stages.parquet").to_pylist()
        # --steps 4; a trial whose generation round feeds several steps gets two whole rounds more
        assert start["steps"] >= 4 and [r["step"] for r in rows] == list(range(1, start["steps"] + 1))
        assert all(r["step_s"] is not None and r["rollout_s"] is not None and r["training_s"] is not None for r in rows)
    tuned = load_job(summary["tuned_preset"])
    assert tuned.knobs == summary["best_knobs"] == events[-1]["best_knobs"]
    # The tuned setup as TRL reads it once every knob is passed at launch.
    every_knob = {knob: tuned.knobs[knob] for knob in tuned.launch.knob_map}
    argv = build_argv(tuned, Path(summary["tuned_preset"]), tmp_path / "r", overrides=every_knob)
    config, _ = parse(argv[3:])
    for knob, field in tuned.launch.knob_map.items():
        assert getattr(config, field) == tuned.knobs[knob]
    # ... and it runs.
    result = profile_job(summary["tuned_preset"], tmp_path / "tuned-run", steps=3)
    assert result.table.num_rows == 3
