"""``rltune report``: write one self-contained HTML page of a tuning run."""

from __future__ import annotations

import typer

from rltune.errors import RltuneError

HELP = """Write one self-contained HTML page of a tuning run.

Example:

  rltune report runs/tune
"""


def register(app: typer.Typer) -> None:
    @app.command(name="report", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def report_cmd(ctx: typer.Context) -> None:
        raise RltuneError("'rltune report' is not built yet")
