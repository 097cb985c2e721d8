"""The live view of ``rltune auto`` fits an 80-column terminal and shows progress, budget and ranges."""

from __future__ import annotations

import io
import json

from rich.console import Console

from rltune.cli.auto import _LiveView


def test_the_live_view_fits_80_columns_and_shows_the_running_steps_the_budget_and_each_range(tmp_path):
    metrics = tmp_path / "runs" / "r0-untuned" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("".join(json.dumps({"step": i, "step_s": 1.0}) + "\n" for i in range(3)))
    view = _LiveView(enabled=False, budget=12)
    view.console = Console(file=io.StringIO(), width=200)  # the line-per-event log is not under test here
    view.workdir = tmp_path
    long_fixes = ["more_engines", "sequence_packing", "larger_micro_batch", "fully_async", "reuse_rollout_logprobs"]
    view.update({"event": "baseline", "run_id": "r0-untuned", "step_s": 9.39, "limiting_stage": "rollout"})
    view.update({"event": "proposed", "round": 1, "limiting_stage": "rollout", "picked": "r1-c11", "candidates": [
        {"id": f"r1-c{i}", "fixes": long_fixes, "step_s": 9.5 - i * 0.1, "range_s": [7.21, 12.61], "gain_pct": 14.29,
         "worth": "range", "limiting_stage": "rollout", "method": "similar"} for i in range(1, 9)]})
    view.update({"event": "trial", "run_id": "r1-c11-a1-with-a-long-name", "decision": "keep", "step_s": 4.88,
                 "forecast_range_s": [7.21, 12.61], "reason": "48.0% faster than the baseline (noise 6.1%) and every "
                                                                "measured limit holds"})
    view.update({"event": "run_start", "run_id": "r2-c3-a1", "role": "trial", "trial": 2, "of": 12, "steps": 10,
                 "metrics_path": "runs/r0-untuned/metrics.jsonl"})
    out = Console(file=io.StringIO(), width=80, record=True)
    out.print(view._render())
    text = out.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "trials 1/12" in text and "trial 2 of 12" in text and "step 3 of 10" in text and "ETA" in text
    assert "7.21-12.6" in text and "4.88" in text and "1.92x" in text
