"""``rltune workload``: run the reference GRPO workload, or check a config without running it."""

from __future__ import annotations

import typer

HELP = """Run the reference GRPO workload (engines, environments, trainer, weight sync).

A run directory gets config.yaml (the resolved config) and metrics.jsonl (one record per step).
Overrides are dotted.key=value (value read as YAML); docs/workload.md lists every key.

Example:

\b
  rltune workload run presets/workload/tiny-math.yaml --steps 5
  rltune workload run presets/workload/tiny-tool-use.yaml orchestrator.rl_mode=fully_async env.sandbox_pool_size=4
  rltune workload check presets/workload/small-math.yaml
"""

RUN_HELP = """Run the workload and write config.yaml + metrics.jsonl into the run directory.

Example:

\b
  rltune workload run presets/workload/tiny-math.yaml --steps 5 trainer.packing=true
"""

CHECK_HELP = """Validate a config (with overrides) and count the model's parameters without building weights.

With engine.backend: vllm, vLLM itself checks the engine arguments (nothing starts) and the
summary holds what it resolved (max_num_seqs, block_size, ...).

Example:

\b
  rltune workload check presets/workload/small-math.yaml
"""

SUMMARY_KEYS = ("step_s", "rollout_s", "training_s", "weight_sync_s", "old_logprob_s", "wait_s",
                "engine_queue_s", "engine_decode_s", "engine_preemptions", "kv_cache_usage", "sandbox_setup_s",
                "sandbox_exec_s", "sandbox_queue_s", "sandbox_fs_s", "sandbox_host_load", "trainer_busy_frac", "padding_frac", "gap",
                "sample_age_mean", "sample_age_max", "trial_s_max", "trials_cut_off", "trials_failed", "reward")


def register(app: typer.Typer) -> None:
    workload = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False, rich_markup_mode=None)

    @workload.command(name="run", help=RUN_HELP)
    def run_cmd(
        config: str = typer.Argument(..., help="workload config file (schema_version 1)"),
        overrides: list[str] = typer.Argument(None, help="dotted.key=value overrides"),
        steps: int = typer.Option(None, "--steps", help="steps to run, 1 to 1000000 (default: orchestrator.steps)"),
        run_dir: str = typer.Option(None, "--run-dir", help="output directory (default: runs/workload/<name>-<time>)"),
        force: bool = typer.Option(False, "--force", help="run into a --run-dir that holds a finished run of rltune's"),
        as_json: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json
        import statistics
        import sys
        import time
        from pathlib import Path

        from rltune.cli.options import check_steps
        from rltune.contracts.outputs import check_output, safe_name
        from rltune.workload import run
        from rltune.workload.config import load_workload_config

        check_steps(steps)
        if run_dir is not None:
            # Only the kind is checked: a job may run the workload into the same directory every time (its
            # metrics at a fixed path the job's metrics.path names), and rltune's launchers rerun in place.
            check_output(run_dir, inputs=[config], expect="dir", flag="--run-dir", run_ok=True,
                         writes=("config.yaml", "metrics.jsonl"))
            _refuse_a_finished_run(Path(run_dir), force)
        cfg = load_workload_config(config, overrides or [])  # fail fast, before any process starts
        if run_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = str(Path("runs") / "workload" / f"{safe_name(cfg.name, default='workload')}-{stamp}")
        start = time.perf_counter()
        metrics_path = run(config, run_dir, steps=steps, overrides=list(overrides or []))
        records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        medians = {}
        for key in SUMMARY_KEYS:
            values = [r[key] for r in records[1:] or records if r.get(key) is not None]
            medians[key] = statistics.median(values) if values else None
        summary = {"run_dir": str(run_dir), "metrics": str(metrics_path), "steps": len(records),
                   "wall_s": time.perf_counter() - start, "median_after_first_step": medians}
        if as_json:
            print(json.dumps(summary))
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{cfg.name}: {len(records)} steps, {cfg.orchestrator.rl_mode} (median after step 0)")
        table.add_column("stage")
        table.add_column("value", justify="right")
        for key, value in medians.items():
            table.add_row(key, "-" if value is None else f"{value:.4g}")
        console = Console(file=sys.stderr)
        console.print(table)
        console.print(f"metrics: {metrics_path}")

    @workload.command(name="check", help=CHECK_HELP)
    def check_cmd(
        config: str = typer.Argument(..., help="workload config file"),
        overrides: list[str] = typer.Argument(None, help="dotted.key=value overrides"),
    ) -> None:
        import json

        from rltune.workload.config import load_workload_config
        from rltune.workload.model import count_parameters

        cfg = load_workload_config(config, overrides or [])
        summary = {"config": config, "name": cfg.name, "preset": cfg.model.preset,
                   "params": count_parameters(cfg.model.preset), "batch_size": cfg.batch_size,
                   "rl_mode": cfg.orchestrator.rl_mode}
        if cfg.engine.backend == "vllm":
            from rltune.workload.engine_vllm import check_engine_args

            summary["vllm"] = check_engine_args(cfg, config)  # vLLM's own validation and resolved defaults
        print(json.dumps(summary))

    app.add_typer(workload, name="workload")


def _refuse_a_finished_run(run_dir, force: bool) -> None:
    """A --run-dir holding a finished run rltune recorded (its stage table, diagnosis or verdict) is not
    overwritten: unless --force, or rltune launched this job into it (a run redone in place). A directory
    the job reuses for its own metrics every time holds none of those files and is left to the job."""
    import os
    from pathlib import Path

    from rltune.contracts.outputs import OutputPathError
    from rltune.contracts.rundir import DIAGNOSIS_NAME, RUN_DIR_ENV, STAGES_NAME, VERDICT_NAME

    launched_into = os.environ.get(RUN_DIR_ENV)
    if force or (launched_into and Path(launched_into).resolve() == Path(run_dir).resolve()):
        return
    held = [name for name in (STAGES_NAME, DIAGNOSIS_NAME, VERDICT_NAME) if (Path(run_dir) / name).exists()]
    if held:
        raise OutputPathError(f"--run-dir {run_dir}: holds a run rltune recorded ({', '.join(held)}); give --run-dir "
                              f"a new directory, or add --force to replace that run")

