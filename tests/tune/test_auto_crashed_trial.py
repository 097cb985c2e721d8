"""A real ``rltune auto`` whose trial crashes: recorded as failed with its log tail, and the loop goes on.

The job is the reference workload's CPU demo run with ``trainer.mini_batches=2``, a setting under
which the workload refuses sparse-delta weight sync (it publishes one optimizer step per weight
version) and exits 2. The knowledge base offers exactly two fixes -- sparse-delta sync, which
therefore crashes, and a larger micro-batch, which runs -- both standing in for whatever stage
limits the step, and the forecast gate is 0 %. So whichever the forecast ranks first, the sparse
setup is tried exactly once and fails, and nothing in what is asserted depends on measured times.
"""

from __future__ import annotations

import yaml

from rltune.contracts.journal import event_as_data
from rltune.contracts.verdict import load_verdict
from rltune.predict.library import CaseLibrary
from rltune.tune.auto import AutoLoop

from .helpers import DEMO

KNOWLEDGE = {
    "schema_version": 1,
    "knobs": {
        "sync_transport": {"description": "weight sync", "type": "str", "choices": ["filesystem", "sparse_delta"]},
        "micro_batch_size": {"description": "micro-batch", "type": "int", "min": 1, "max": 16},
    },
    "problems": {"never_found": "a problem no detector reports: both fixes stand in for the limiting stage"},
    "fixes": [
        {"id": "sparse_delta_sync", "title": "sparse deltas", "problems": ["never_found"],
         "overrides": {"sync_transport": "sparse_delta"}, "applies_when": ["sync_transport != sparse_delta"],
         "group": "weight_sync", "moves": ["rollout", "training", "old_logprob", "weight_sync", "sandbox"]},
        {"id": "larger_micro_batch", "title": "double the micro-batch", "problems": ["never_found"],
         "overrides": {"micro_batch_size": "*2"}, "group": "trainer",
         "moves": ["rollout", "training", "old_logprob", "weight_sync", "sandbox"]},
    ],
}


def test_a_crashed_trial_is_recorded_with_its_log_tail_and_the_loop_goes_on(tmp_path):
    data = yaml.safe_load(DEMO.read_text())
    data["name"] = "demo-that-crashes-on-sparse-sync"
    data["launch"]["command"] = [*data["launch"]["command"], "trainer.mini_batches=2"]
    data["launch"]["workdir"] = str(DEMO.parent.parent)
    data["limits"].update(min_forecast_gain_pct=0, baseline_runs=1)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    knowledge = tmp_path / "knowledge.yaml"
    knowledge.write_text(yaml.safe_dump(KNOWLEDGE, sort_keys=False))

    loop = AutoLoop(job, tmp_path / "tune", rounds=3, trial_budget=4, max_trials_per_round=3, steps=3,
                    knowledge=knowledge, tuned_dir=tmp_path / "tuned")
    result = loop.run()
    events = [event_as_data(e) for e in loop.journal.events()]  # the lines as written
    trials = [e for e in events if e["event"] == "trial"]
    failed = [t for t in trials if t["decision"] == "failed"]
    assert len(failed) == 1, [(t["fixes"], t["decision"]) for t in trials]
    assert failed[0]["knobs"]["sync_transport"] == "sparse_delta"
    verdict = load_verdict(tmp_path / "tune" / failed[0]["run_dirs"][0] / "verdict.yaml")
    assert verdict.decision == "failed" and "exited with code 2" in verdict.reason
    assert "mini_batches" in verdict.log_tail
    # the crash did not end the loop: it finished, with a tuned preset that keeps the transport that runs
    assert events[-1]["event"] == "finish" and result.best_knobs["sync_transport"] == "filesystem"
    assert yaml.safe_load(result.tuned_preset.read_text())["knobs"]["sync_transport"] == "filesystem"
    # the micro-batch fix ran as well (before or after the crash), and no setup ran twice
    assert any(t["decision"] != "failed" and t["knobs"]["micro_batch_size"] == 16 for t in trials)
    assert not any(t["knobs"]["sync_transport"] == "sparse_delta" for t in trials if t is not failed[0])
    tried = [tuple(sorted(t["knobs"].items())) for t in trials]
    assert len(tried) == len(set(tried))
    statuses = {r.run_id: r.status for r in CaseLibrary(tmp_path / "tune" / "cases").load()}
    assert statuses[failed[0]["run_id"]] == "failed"
