"""``rltune library``: bring public measured runs into a case library (``rltune library import``)."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Work with a case library: import public measured runs into it.

A case library (cases/) holds one file per run. Runs rltune records get there by themselves; runs
that other projects measured and published (step and stage times of large jobs) enter through
'rltune library import', from the CSV layout of docs/artifacts.md ("public-runs CSV").

Example:

\b
  rltune library import nemo_rl.csv --library cases-public/
  rltune eval --library cases-public/
"""

IMPORT_HELP = """Import a public-runs CSV: each row becomes a case (origin: public).

The setup comes from the row's columns and settings, the times and throughput as published, and
the provenance (source, commit, release, the row's notes) is kept; what a row lacks stays unknown.
A failed row (no time, no throughput) is imported as failed, a row whose numbers contradict each
other as measured but left out of fits; both say why. Every row is read and checked before
anything is written: a malformed row is one line naming the file, the row and the column (exit 2),
and the library is left as it was. Importing the same file again changes nothing.

Example:

\b
  rltune library import nemo_rl.csv --library cases-public/
"""


def register(app: typer.Typer) -> None:
    library_app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False, rich_markup_mode=None)

    @library_app.command(name="import", help=IMPORT_HELP)
    def import_cmd(
        csv_file: Path = typer.Argument(..., help="public-runs CSV (docs/artifacts.md)"),
        library: Path = typer.Option(..., "--library", help="case library directory (created if absent)"),
        json_out: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json

        from rltune.contracts.outputs import check_output
        from rltune.predict.library import CaseLibrary
        from rltune.predict.public import import_public_runs

        check_output(library, inputs=[csv_file], expect="dir", flag="--library")
        report = import_public_runs(csv_file, CaseLibrary(library))
        _print_report(report, library)
        if json_out:
            print(json.dumps({**report.summary(), "library": str(library),
                              "row_results": [{"row": r, "run_id": i, "result": what} for r, i, what in report.rows]}))

    app.add_typer(library_app, name="library")


def _print_report(report, library: Path) -> None:
    from rich.console import Console

    console = Console(stderr=True)
    for row, run_id, what in report.rows:
        if what != "imported" and what != "already in the library":
            console.print(f"row {row}: {run_id}: {what}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"rltune: {report.file} -> {library}: {report.imported} imported ({report.failed} failed, "
                  f"{report.excluded} left out of fits), {report.already} already there, "
                  f"{report.duplicates} rows repeating a measurement", markup=False, highlight=False, soft_wrap=True)
