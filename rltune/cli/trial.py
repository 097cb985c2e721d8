"""``rltune trial``: run a forecast candidate for real and keep it only if it beats noise within the limits."""

from __future__ import annotations

import typer

from rltune.errors import RltuneError

HELP = """Run a forecast candidate for real and keep it only if it beats noise within the limits.

Example:

  rltune trial forecast.yaml --job job.yaml --candidate r1-c2
"""


def register(app: typer.Typer) -> None:
    @app.command(name="trial", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def trial_cmd(ctx: typer.Context) -> None:
        raise RltuneError("'rltune trial' is not built yet")
