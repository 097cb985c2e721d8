"""``rltune sync-bench``: weight-sync transports side by side on the same model and optimizer steps."""

from __future__ import annotations

import typer

from rltune.errors import RltuneError

HELP = """Weight-sync transports side by side on the same model and optimizer steps.

Example:

  rltune sync-bench --preset cpu
"""


def register(app: typer.Typer) -> None:
    @app.command(name="sync-bench", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def sync_bench_cmd(ctx: typer.Context) -> None:
        raise RltuneError("'rltune sync-bench' is not built yet")
