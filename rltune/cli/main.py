"""Entry point of the ``rltune`` command.

Each command lives in its own module under ``rltune.cli`` and exposes ``register(app)``. Those
modules import only typer at import time; torch, triton, scipy and pyarrow load inside a command's
body, so ``rltune --help`` stays fast. Every :class:`~rltune.errors.RltuneError` that reaches here
becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import importlib
import sys

import typer

from rltune.errors import RltuneError

COMMANDS = ("profile", "propose", "predict", "trial", "auto", "report", "eval", "sync_bench", "workload")

app = typer.Typer(
    name="rltune",
    help="Make LLM RL post-training steps faster on the GPUs you already have.\n\n"
    "Stages talk through files: profile → stages.parquet + diagnosis.yaml → propose → candidates.yaml "
    "→ predict → forecast.yaml → trial → verdict.yaml + cases/. 'auto' runs the loop.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

for _name in COMMANDS:
    importlib.import_module(f"rltune.cli.{_name}").register(app)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the process exit code."""
    try:
        app(args=argv, prog_name="rltune", standalone_mode=False)
    except RltuneError as exc:
        print(f"rltune: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rltune: interrupted", file=sys.stderr)
        return 130
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:  # click's own exits (e.g. --help)
        return int(exc.code or 0)
    except Exception as exc:  # click usage errors carry their own exit code
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            return exc.exit_code
        if isinstance(exc, click.exceptions.Abort):
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
