"""``rltune eval``: retrospective forecast accuracy over a case library."""

from __future__ import annotations

import typer

from rltune.errors import RltuneError

HELP = """Retrospective forecast accuracy over a case library.

Example:

  rltune eval --library cases/
"""


def register(app: typer.Typer) -> None:
    @app.command(name="eval", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def eval_cmd(ctx: typer.Context) -> None:
        raise RltuneError("'rltune eval' is not built yet")
