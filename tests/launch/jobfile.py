"""A job.yaml around a small real Python script, for the launch and profile tests."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml


def write_job(tmp_path: Path, script: str, *, launch: dict | None = None, knobs: dict | None = None,
              name: str = "job.yaml") -> Path:
    """Write ``script`` to tmp_path/job.py and a job.yaml that runs it; return the job file's path."""
    (tmp_path / "job.py").write_text(script)
    data = {
        "schema_version": 1,
        "name": "launch-test",
        "model": {"name": "m", "total_params": 1e6, "active_params": 1e6, "layers": 1, "hidden": 8,
                  "kv_heads": 1, "head_dim": 8, "dtype": "fp32"},
        "workload": {"kind": "math", "tasks_per_batch": 1, "trials_per_task": 1, "answer_cap_tokens": 4,
                     "context_limit_tokens": 8},
        "gpus": {"count": 0, "device": "cpu"},
        "knobs": {"rl_mode": "sync", "micro_batch_size": 4, **(knobs or {})},
        "launch": {"command": [sys.executable, "job.py", "--run-dir", "{run_dir}", "--steps", "{steps}"],
                   "launcher": "local", "dialect": "rltune",
                   "knob_map": {"micro_batch_size": "trainer.micro_batch_size", "rl_mode": "orchestrator.rl_mode"},
                   "steps_override": "orchestrator.steps", "timeout_s": 60, **(launch or {})},
        "limits": {"steps": 4, "warmup_steps": 1},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


