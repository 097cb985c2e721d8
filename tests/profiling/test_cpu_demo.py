"""The reference workload's CPU preset profiled end to end (slow: it trains a real model for a few steps)."""

from __future__ import annotations

import statistics

import pytest

from rltune.contracts.diagnosis import load_diagnosis
from rltune.contracts.stages import read_stages
from rltune.profile import profile_job


@pytest.mark.slow
def test_cpu_demo_profile_names_the_stage_a_reader_of_the_numbers_would(repo, tmp_path):
    result = profile_job(repo / "presets" / "cpu-demo.yaml", tmp_path / "run", steps=5)
    table = read_stages(tmp_path / "run" / "stages.parquet")
    assert table.column("step").to_pylist() == [0, 1, 2, 3, 4]
    rows = [r for r in table.to_pylist() if not r["warmup"]]
    assert len(rows) == 3 and all(r["step_s"] > 0 for r in rows)  # the preset keeps 2 warm-up steps

    def median(name):
        return statistics.median(r[name] or 0.0 for r in rows)

    # A person reading the table under the sync rule: the biggest of rollout, trainer work, weight sync.
    by_reader = max([("rollout", median("rollout_s")),
                     ("training", statistics.median((r["training_s"] or 0.0) + (r["old_logprob_s"] or 0.0) for r in rows)),
                     ("weight_sync", median("weight_sync_s"))], key=lambda kv: kv[1])[0]
    diagnosis = load_diagnosis(tmp_path / "run" / "diagnosis.yaml")
    assert diagnosis.limiting_stage == by_reader == result.diagnosis.limiting_stage
    # The stages account for the step: the RL-mode rule lands within 10 % of the measured median.
    assert diagnosis.step_model_s == pytest.approx(diagnosis.step_median_s, rel=0.10)
