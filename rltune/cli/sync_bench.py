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

\b
  rltune sync-bench --preset cpu
  rltune sync-bench --preset h200 --out runs/sync-h200 --transports filesystem,sparse,nccl

Many readers (--readers N,...): N engine-reader processes prefetch and apply the same steps from one
store directory (local disk, or a tmpfs with --storage shm) while a writer publishes; per-reader read
+ decode time, aggregate GB/s and the writer's publish time against N, every reader verified bit
for bit. Presets: presets/sync/readers/<name>.yaml (ci, cpu, cpu-overlap); sync-readers.json goes under --out.

\b
  rltune sync-bench --readers 1,2,4 --preset ci --storage disk,shm

Cost model (--estimate MODEL.yaml): per-step trainer-blocking publish, engine read while serving,
dispatch-blocking update, anchor cost and storage bandwidth for a model and layout, projected from
the rates measured on this CPU and the H200 (rltune/sync/data/rates.yaml), each with its range.

\b
  rltune sync-bench --estimate presets/sync/estimate/qwen3-235b-a22b.yaml
"""


def register(app: typer.Typer) -> None:
    @app.command(name="sync-bench", help=HELP)
    def sync_bench_cmd(
        preset: str = typer.Option("cpu", help="presets/sync/<name>.yaml (cpu, h200) or a YAML path"),
        out: Path | None = typer.Option(None, help="directory for the Parquet, JSON record and config (default runs/sync-bench)"),
        steps: int | None = typer.Option(None, help="measured steps, 1 to 1000000 (overrides the preset)"),
        warmup_steps: int | None = typer.Option(None, min=0, help="warm-up steps left out of the summary"),
        transports: str | None = typer.Option(None, help="comma list of filesystem,inprocess,sparse,nccl"),
        device: str | None = typer.Option(None, help="auto, cpu or cuda (overrides the preset; cuda needs a GPU torch sees)"),
        vllm: bool | None = typer.Option(None, "--vllm/--no-vllm",
                                         help="also take the sparse transport's files into a real vLLM engine (row sparse/vllm)"),
        json_out: bool = typer.Option(False, "--json", help="print the JSON record on stdout"),
        quiet: bool = typer.Option(False, help="no per-step progress lines"),
        readers: str | None = typer.Option(
            None, help="many-readers mode: comma list of reader counts (e.g. 1,2,4,8,16; 0 = the writer alone)"),
        storage: str | None = typer.Option(None, help="many-readers mode: comma list of disk,shm"),
        estimate: Path | None = typer.Option(
            None, help="cost model: a MODEL.yaml (params, dtype, changed fraction, layout, storage); prints the "
                       "projection"),
    ) -> None:
        import json
        import sys

        from rltune.cli.options import check_steps, parse_list, refuse_unused
        from rltune.contracts.outputs import check_output

        if estimate is not None:
            mode = "with --estimate (it runs nothing and writes nothing)"
            for flag, value in (("--out", out), ("--steps", steps), ("--warmup-steps", warmup_steps),
                                ("--transports", transports), ("--device", device), ("--vllm", vllm), ("--readers", readers),
                                ("--storage", storage)):
                refuse_unused(flag, value is not None, mode)
            _estimate(estimate, json_out)
            return
        check_steps(steps)
        out = check_output(out if out is not None else Path("runs/sync-bench"), inputs=[Path(preset)], expect="dir",
                           writes=("config.yaml", "sync-bench.json", "sync-bench.parquet", "sync-readers.json"))
        if readers is not None or storage is not None:
            mode = "in many-readers mode (--readers/--storage: readers run on the CPU, one transport)"
            refuse_unused("--transports", transports is not None, mode)
            refuse_unused("--device", device is not None, mode)
            refuse_unused("--vllm", vllm is not None, mode)
            _readers(preset, out, readers, storage, steps, warmup_steps, json_out, quiet)
            return
        chosen = parse_list("--transports", transports, example="filesystem,sparse") if transports is not None else None
        if device is not None:
            _check_device(device)

        from rich.console import Console

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
        cfg = with_overrides(cfg, steps=steps, warmup_steps=warmup_steps, transports=chosen, device=device, vllm=vllm)
        progress = None if quiet else (lambda msg: console.print(f"[dim]{msg}[/dim]", highlight=False))
        result = run_sync_bench(cfg, out, progress=progress)
        record = result.record

        _print_table(console, summary_lines(record),
                     title=f"sync-bench {cfg.name}: {record['model']['params'] / 1e6:.1f} M params, "
                           f"{record['device']['name']}, medians over {cfg.steps} steps",
                     caption="blocking = dispatch-blocking engine update = pause + apply(+verify) or transfer + "
                             "resume; read = engine read + decode while serving; ok = updates bit-identical")
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


def _print_table(console, lines: list[dict[str, str]], title: str, caption: str) -> None:
    """A summary's rows as one table: its first column left-aligned (the row's name), numbers right."""
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for k, column in enumerate(lines[0]):
        table.add_column(column, justify="left" if k == 0 else "right")
    for line in lines:
        table.add_row(*line.values())
    console.print(table)


def _check_device(device: str) -> None:
    """--device is one torch can run on here: a bench asked for the GPU never runs on the CPU instead."""
    from rltune.cli.options import OptionError

    if device not in ("auto", "cpu", "cuda"):
        raise OptionError(f"--device {device!r}: choose auto, cpu or cuda")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise OptionError("--device cuda: torch sees no GPU here; use --device cpu (or auto)")


def _readers(preset: str, out: Path, readers: str | None, storage: str | None, steps: int | None,
             warmup_steps: int | None, json_out: bool, quiet: bool) -> None:
    import json
    import sys

    from rich.console import Console

    from rltune.cli.options import parse_int_list, parse_list
    from rltune.sync.bench.readers import (
        ReadersBenchError,
        load_readers_config,
        readers_summary_lines,
        readers_with_overrides,
        resolve_readers_preset,
        run_readers_bench,
    )

    console = Console(stderr=True, width=max(Console(stderr=True).width, 130))
    cfg = load_readers_config(resolve_readers_preset(preset))
    chosen = parse_list("--storage", storage, choices=("disk", "shm")) if storage is not None else None
    counts = parse_int_list("--readers", readers, least=0) if readers is not None else None
    cfg = readers_with_overrides(cfg, readers=counts, storage=chosen,
                                 steps=steps, warmup_steps=warmup_steps)
    progress = None if quiet else (lambda msg: console.print(f"[dim]{msg}[/dim]", highlight=False))
    result = run_readers_bench(cfg, out, progress=progress)
    record = result.record
    _print_table(console, readers_summary_lines(record),
                 title=f"sync-bench readers {cfg.name}: {record['model']['params'] / 1e6:.1f} M params, "
                       f"{record['cpus']} CPUs, medians over {cfg.steps} steps",
                 caption="read+decode = one reader's prefetch of a step (cpu: that reader's CPU time in it); x N=1 = "
                         "its median over one reader's; "
                         "agg = bytes all readers read / the step's read window; load = load average at the start; "
                         "ok = reader updates bit-identical to the trainer")
    console.print(f"wrote {result.record_path}")
    if json_out:
        sys.stdout.write(json.dumps(record, indent=2) + "\n")
    if not result.all_verified:
        bad = {f"{t['storage']}/{t['cache']}/{t['readers']}": f"{t['verified']}/{t['updates']}"
               for t in record["trials"] if t["verified"] != t["updates"] or t["read_before_complete"]}
        raise ReadersBenchError(f"{result.record_path}: reader updates failed verification ({bad})")


def _estimate(path: Path, json_out: bool) -> None:
    import json
    import sys

    from rich.console import Console

    from rltune.sync.estimate import estimate, estimate_lines, load_model_spec, load_rates

    console = Console(stderr=True, width=max(Console(stderr=True).width, 130))
    spec = load_model_spec(path)
    result = estimate(spec, load_rates())
    _print_table(console, estimate_lines(result),
                 title=f"sync-bench estimate {spec.name}: {spec.params_total / 1e9:.1f} B params, "
                       f"{spec.changed_fraction.min * 100:.2g}-{spec.changed_fraction.max * 100:.2g} % changed per step",
                 caption="each output: low - high from the inputs' min/max (rates: rltune/sync/data/rates.yaml, "
                         "each with its record and git SHA)")
    for note in result["notes"]:
        console.print(f"- {note}", highlight=False)
    for c in result["checks"]:
        if not c["within_2x"] and c["cause"]:
            console.print(f"- {c['output']} ({c['dtype']}) misses by {c['ratio']:.2f}x: {c['cause']}", highlight=False)
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
