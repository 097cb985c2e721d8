"""``rltune predict``: forecast each candidate's stage and step times from the case library and the theory model."""

from __future__ import annotations

import typer

from rltune.errors import RltuneError

HELP = """Forecast each candidate's stage and step times from the case library and the theory model.

Example:

  rltune predict candidates.yaml --library cases/ --out forecast.yaml
"""


def register(app: typer.Typer) -> None:
    @app.command(name="predict", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def predict_cmd(ctx: typer.Context) -> None:
        raise RltuneError("'rltune predict' is not built yet")
