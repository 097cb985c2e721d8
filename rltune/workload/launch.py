"""Start the trainer under torchrun (``trainer.launcher: torchrun``) and wait for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from rltune.contracts.schema import dump_yaml
from rltune.errors import LaunchError
from rltune.workload.config import WorkloadConfig


def torchrun_argv(cfg: WorkloadConfig, config_path: Path, run_dir: Path, steps: int | None) -> list[str]:
    """argv of ``torchrun ... -m rltune.workload.trainer`` for this config (single node)."""
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    launcher = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    argv = [*launcher, "--standalone", f"--nproc_per_node={cfg.trainer_ranks}",
            "-m", "rltune.workload.trainer", str(config_path), "--run-dir", str(run_dir)]
    if steps is not None:
        argv += ["--steps", str(steps)]
    return argv


def run_under_torchrun(cfg: WorkloadConfig, run_dir: Path, steps: int | None, timeout_s: float | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "launch-config.yaml"
    dump_yaml(cfg, config_path)
    argv = torchrun_argv(cfg, config_path, run_dir, steps)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cfg.trainer.num_threads)))
    proc = subprocess.run(argv, env=env, timeout=timeout_s, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (run_dir / "torchrun.log").write_text(proc.stdout, encoding="utf-8")
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
        raise LaunchError(f"torchrun trainer exited with {proc.returncode} (log: {run_dir / 'torchrun.log'}): {tail}")
    return run_dir / "metrics.jsonl"
