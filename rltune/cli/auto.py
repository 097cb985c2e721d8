"""``rltune auto``: profile, propose, predict and trial round after round; resumable."""

from __future__ import annotations

import typer

from rltune.errors import RltuneError

HELP = """Profile, propose, predict and trial round after round; resumable.

Example:

  rltune auto job.yaml --rounds 4 --workdir runs/tune
"""


def register(app: typer.Typer) -> None:
    @app.command(name="auto", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def auto_cmd(ctx: typer.Context) -> None:
        raise RltuneError("'rltune auto' is not built yet")
