"""``rltune sync-bench``: weight-sync transports side by side on the same model and optimizer steps."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Weight-sync transports side by side on the same model and optimizer steps.

Runs real optimizer steps on one model and, after each, hands the new weights to every transport:
full safetensors checkpoint over the filesystem, in-process full copy, sparse delta, and NCCL
broadcast (with --transports ...,nccl: NCCL on 2+ GPUs, gloo processes on a CPU). Every engine
update is verified bit for bit. A table goes to stderr; sync-bench.parquet (one row per step and
transport), sync-bench.json (config, device, versions, git SHA, min/median/max, ratios) and
config.yaml go under --out.

Example:

  rltune sync-bench --preset cpu

  rltune sync-bench --preset h200 --out runs/sync-h200 --transports filesystem,sparse,nccl
"""


def register(app: typer.Typer) -> None:
    @app.command(name="sync-bench", help=HELP)
    def sync_bench_cmd(
        preset: str = typer.Option("cpu", help="presets/sync/<name>.yaml (cpu, h200) or a YAML path"),
        out: Path = typer.Option(Path("runs/sync-bench"), help="directory for the Parquet, JSON record and config"),
        steps: int | None = typer.Option(None, min=1, help="measured steps (overrides the preset)"),
        warmup_steps: int | None = typer.Option(None, min=0, help="warm-up steps left out of the summary"),
        transports: str | None = typer.Option(None, help="comma list of filesystem,inprocess,sparse,nccl"),
        device: str | None = typer.Option(None, help="auto, cpu or cuda (overrides the preset)"),
        json_out: bool = typer.Option(False, "--json", help="print the JSON record on stdout"),
        quiet: bool = typer.Option(False, help="no per-step progress lines"),
    ) -> None:
        import json
        import sys

        from rich.console import Console
        from rich.table import Table

        from rltune.sync.bench import (
            SyncBenchError,
            load_sync_bench_config,
            resolve_preset,
            run_sync_bench,
            summary_lines,
            with_overrides,
        )

        console = Console(stderr=True, width=max(Console(stderr=True).width, 110))
        cfg = load_sync_bench_config(resolve_preset(preset))
        chosen = [t.strip() for t in transports.split(",") if t.strip()] if transports else None
        cfg = with_overrides(cfg, steps=steps, warmup_steps=warmup_steps, transports=chosen, device=device)
        progress = None if quiet else (lambda msg: console.print(f"[dim]{msg}[/dim]", highlight=False))
        result = run_sync_bench(cfg, out, progress=progress)
        record = result.record

        lines = summary_lines(record)
        table = Table(title=f"sync-bench {cfg.name}: {record['model']['params'] / 1e6:.1f} M params, "
                            f"{record['device']['name']}, medians over {cfg.steps} steps",
                      caption="blocking = dispatch-blocking engine update = pause + apply(+verify) or transfer + "
                              "resume; read = engine read + decode while serving; ok = updates bit-identical")
        for column in lines[0]:
            table.add_column(column, justify="left" if column == "transport" else "right")
        for line in lines:
            table.add_row(*line.values())
        console.print(table)
        for name, why in record["skipped"].items():
            console.print(f"skipped {name}: {why}")
        for key, value in record["ratios"].items():
            console.print(f"{key}: {value:.2f}x")
        console.print(f"wrote {result.parquet_path} and {result.record_path}")
        if json_out:
            sys.stdout.write(json.dumps(record, indent=2) + "\n")
        if not result.all_verified:
            bad = {n: f"{e['verified']}/{e['updates']}" for n, e in record["transports"].items()
                   if e["verified"] != e["updates"] or e["checksum_failures"]}
            raise SyncBenchError(f"{result.record_path}: updates failed verification ({bad}); the engine's weights "
                                 "differ from the trainer's")
