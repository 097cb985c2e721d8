"""``rltune propose``: compose candidate setups that fix the bottleneck (and the next one) from the knowledge base."""

from __future__ import annotations

import typer

from rltune.errors import RltuneError

HELP = """Compose candidate setups that fix the bottleneck (and the next one) from the knowledge base.

Example:

  rltune propose runs/base/diagnosis.yaml --job job.yaml --out candidates.yaml
"""


def register(app: typer.Typer) -> None:
    @app.command(name="propose", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def propose_cmd(ctx: typer.Context) -> None:
        raise RltuneError("'rltune propose' is not built yet")
