"""``rltune profile``: time each stage of a job's step and diagnose what limits it."""

from __future__ import annotations

import typer

from rltune.errors import RltuneError

HELP = """Time each stage of a job's step and diagnose what limits it.

Example:

  rltune profile job.yaml --steps 10
  rltune profile --from-logs verl.log --format auto --out runs/verl-7b
"""


def register(app: typer.Typer) -> None:
    @app.command(name="profile", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def profile_cmd(ctx: typer.Context) -> None:
        from rltune.contracts.job import load_job

        for arg in ctx.args:
            if arg.endswith((".yaml", ".yml")):
                load_job(arg)
        raise RltuneError("'rltune profile' is not built yet")
