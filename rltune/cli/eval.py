"""``rltune eval``: retrospective forecast accuracy over a case library."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Retrospective forecast accuracy over a case library.

Each run is forecast from only the runs that had finished before it started, as when it was
planned, and compared with what it measured: median |error| of the step (overall, per workload,
per method), share within 10 %, training-time error and range coverage, and the library's noise
(the spread of setups run more than once, and what a forecast without error of its own would
score against it). --out DIR gets
eval.json (every forecast) and eval.png (predicted against measured, with the +-10 % band).

Example:

\b
  rltune eval --library cases/ --out runs/eval
"""


def register(app: typer.Typer) -> None:
    @app.command(name="eval", help=HELP)
    def eval_cmd(
        library: Path = typer.Option(Path("cases"), "--library", help="case library directory"),
        out: Path = typer.Option(None, "--out", help="directory for eval.json and eval.png"),
        json_out: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json
        import warnings

        from rltune.contracts.outputs import check_output
        from rltune.errors import RltuneError
        from rltune.predict.evaluate import evaluate, plot
        from rltune.predict.library import CaseLibrary, CorruptCaseWarning

        if not library.is_dir():
            raise RltuneError(f"{library}: no case library there; pass --library DIR (a directory of case files)")
        if out is not None:
            check_output(out, inputs=[library], expect="dir", writes=("eval.json", "eval.png"))
        with warnings.catch_warnings():  # every skipped case is told (rltune.cli.main formats the lines)
            warnings.simplefilter("always", CorruptCaseWarning)
            report = evaluate(CaseLibrary(library))
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "eval.json").write_text(json.dumps(report.to_dict(), indent=1), encoding="utf-8")
            plot(report, out / "eval.png")
        _print_summary(report)
        if json_out:
            print(json.dumps(report.summary()))


def _print_summary(report) -> None:
    from rich.console import Console
    from rich.table import Table

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} %"

    table = Table(title=f"retrospective forecasts: {report.evaluated} of {report.runs} runs (first runs had no history)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("median |step error|", pct(report.median_abs_error_pct))
    table.add_row("within 10 %", "-" if report.within_10pct is None else f"{report.within_10pct_count} ({100 * report.within_10pct:.0f} %)")
    table.add_row("median |training error|", pct(report.training_median_abs_error_pct))
    table.add_row("range coverage", "-" if report.range_coverage is None else f"{100 * report.range_coverage:.0f} %")
    if report.repeat_groups:
        table.add_row(f"repeat noise ({report.repeat_groups} setups run again)", pct(report.repeat_noise_pct))
        table.add_row("  a perfect forecast: median |error|", pct(report.perfect_forecast_median_abs_error_pct))
        table.add_row("  a perfect forecast: within 10 %", f"{100 * report.perfect_forecast_within_10pct:.0f} %")
    for workload, err in report.by_workload.items():
        table.add_row(f"  {workload}", pct(err))
    for method, m in report.by_method.items():
        table.add_row(f"  {method} ({m['count']})", f"{pct(m['median_abs_error_pct'])}, coverage {100 * m['range_coverage']:.0f} %")
    Console(stderr=True).print(table)
