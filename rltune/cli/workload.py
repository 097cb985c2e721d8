"""``rltune workload``: run the reference GRPO workload."""

from __future__ import annotations

import typer

from rltune.errors import RltuneError

HELP = """Run the reference GRPO workload.

Example:

  rltune workload run presets/workload/tiny-math.yaml --steps 5
"""


def register(app: typer.Typer) -> None:
    @app.command(name="workload", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def workload_cmd(ctx: typer.Context) -> None:
        raise RltuneError("'rltune workload' is not built yet")
