"""A real ``rltune auto`` whose trial crashes: recorded as failed with its log tail, and the loop goes on."""

from __future__ import annotations

import yaml

from rltune.contracts.verdict import load_verdict
from rltune.tune.auto import AutoLoop

from .helpers import DEMO


def test_a_crashed_trial_is_recorded_with_its_log_tail_and_the_round_goes_on(tmp_path):
    # The demo job with one knob mapped to a key the workload does not have (a real user mistake):
    # the baseline, which overrides nothing, runs; every setup that changes num_engines exits 2.
    data = yaml.safe_load(DEMO.read_text())
    data["name"] = "demo-with-a-bad-key"
    data["launch"]["knob_map"]["num_engines"] = "engine.num_engine"
    data["launch"]["workdir"] = str(DEMO.parent.parent)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    loop = AutoLoop(job, tmp_path / "tune", rounds=1, trial_budget=3, max_trials_per_round=3, steps=3,
                    tuned_dir=tmp_path / "tuned")
    loop.run()
    trials = [e for e in loop.journal.events() if e["event"] == "trial"]
    failed = [t for t in trials if t["decision"] == "failed"]
    assert failed, [(t["fixes"], t["decision"]) for t in trials]
    assert all(t["knobs"]["num_engines"] != 1 for t in failed)
    verdict = load_verdict(failed[0]["run_dirs"][0] + "/verdict.yaml")
    assert "exited with code 2" in verdict.reason and "engine.num_engine" in verdict.log_tail
    # the round went on to a setup that leaves num_engines alone, and never re-ran a crashed combination
    after = trials[trials.index(failed[0]) + 1:]
    assert after and any(t["decision"] != "failed" and t["knobs"]["num_engines"] == 1 for t in after)
    tried = [tuple(sorted(t["knobs"].items())) for t in trials]
    assert len(tried) == len(set(tried))
