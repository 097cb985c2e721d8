"""``rltune report``: write one self-contained HTML page of a tuning run."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Write one self-contained HTML page of a tuning run.

Step time per round, stage split per round, forecast vs measured, savings by technique and
GPU-seconds per step, with plots embedded: it opens in a browser with no network.

Example:

\b
  rltune report runs/tune
"""


def register(app: typer.Typer) -> None:
    @app.command(name="report", help=HELP)
    def report_cmd(
        run_dir: Path = typer.Argument(..., help="the --workdir of an 'rltune auto' run"),
        out: Path = typer.Option(None, "--out", help="where to write the page (default RUN_DIR/report.html)"),
    ) -> None:
        from rltune.contracts.outputs import check_output
        from rltune.tune.report import build_report

        check_output(out if out is not None else run_dir / "report.html", inputs=[run_dir])
        typer.echo(str(build_report(run_dir, out)))
