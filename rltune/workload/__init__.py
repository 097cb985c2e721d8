"""The reference GRPO workload: engines in their own processes, math and sandboxed tool-use
environments, a GRPO trainer (torchrun-ready), weight sync and three RL modes.

``run(config, run_dir)`` runs it and returns the path of ``metrics.jsonl`` (one record per step,
the stage table's core columns plus extras). Heavy libraries load only when a run starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rltune.workload.config import WorkloadConfig


def run(config_path_or_obj: str | os.PathLike | WorkloadConfig, run_dir: str | os.PathLike,
        steps: int | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Path:
    """Run the workload for ``steps`` steps (default: the config's); return ``run_dir/metrics.jsonl``.

    ``config_path_or_obj`` is a config file or a :class:`WorkloadConfig`; ``overrides`` are
    ``dotted.key=value`` strings. With ``trainer.launcher: torchrun`` the trainer processes (rank 0
    running the orchestrator) are started under torchrun and this call waits for them.
    """
    import copy

    from rltune.contracts.schema import to_data
    from rltune.workload.config import WorkloadConfig, config_from_data, load_workload_config

    if isinstance(config_path_or_obj, WorkloadConfig):
        file = "<config object>"
        cfg = config_from_data(copy.deepcopy(to_data(config_path_or_obj)), file, overrides)
    else:
        file = str(config_path_or_obj)
        cfg = load_workload_config(config_path_or_obj, overrides)
    if cfg.engine.backend == "vllm":
        from rltune.workload.engine_vllm import check_engine_args

        check_engine_args(cfg, file)  # vLLM's own validation, before any process starts
    if cfg.trainer.launcher == "torchrun":
        from rltune.workload.launch import run_under_torchrun

        return run_under_torchrun(cfg, Path(run_dir), steps)
    from rltune.workload.orchestrator import run_job

    return run_job(cfg, run_dir, steps=steps)


__all__ = ["run"]
