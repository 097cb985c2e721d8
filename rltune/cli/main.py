"""Entry point of the ``rltune`` command.

Each command lives in its own module under ``rltune.cli`` and exposes ``register(app)``. Those
modules import only typer at import time; torch, triton, scipy and pyarrow load inside a command's
body, so ``rltune --help`` stays fast. Every :class:`~rltune.errors.RltuneError` that reaches here
becomes one line on stderr and its exit code; every warning of rltune's own categories becomes one
``rltune: warning: ...`` line, whichever command or module raised it.

stdout holds only what a command prints for a machine (``--json``); logs, vLLM's included, go to stderr.

Exit codes: README.md's "Exit codes" table is the one source (tests/cli/test_exit_codes.py checks
every command against it).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import typer

from rltune.errors import RltuneError

COMMANDS = ("profile", "propose", "predict", "trial", "auto", "report", "reward_check", "eval", "sync_bench", "workload",
            "library")

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
    # stdout carries what a command prints for a machine (--json); vLLM logs to stdout unless told,
    # in this process and in the worker processes it starts
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with warnings.catch_warnings():  # restored on return: main() is also called in-process (tests)
        warnings.showwarning = _warning_printer(warnings.showwarning)
        return _run(argv)


def _warning_printer(fallback):
    """``warnings.showwarning`` that gives rltune's own warnings the one ``rltune: warning:`` form."""

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__module__.split(".")[0] == "rltune":
            print(f"rltune: warning: {message}", file=sys.stderr)
        else:
            fallback(message, category, filename, lineno, file, line)

    return show


def _run(argv: list[str] | None) -> int:
    try:
        # Outside standalone mode click returns the code of a typer.Exit instead of raising it.
        code = app(args=argv, prog_name="rltune", standalone_mode=False)
    except RltuneError as exc:
        print(f"rltune: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print("rltune: interrupted", file=sys.stderr)
        return 130
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:  # click's own exits (e.g. --help)
        return int(exc.code or 0)
    except Exception as exc:  # click usage errors carry their own exit code
        usage_errors, aborts = _click_error_types()
        if isinstance(exc, usage_errors):
            if isinstance(exc, _no_args_help_types()):  # 'rltune' alone: the help is the answer
                exc.show()
                return exc.exit_code
            # One line like every other refusal, not click's three-line usage block.
            ctx = getattr(exc, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            print(f"rltune: {exc.format_message()}{hint}", file=sys.stderr)
            return exc.exit_code
        if isinstance(exc, aborts):
            return 1
        raise
    return code if isinstance(code, int) else 0


def _no_args_help_types() -> tuple[type, ...]:
    """click's 'no arguments, so here is the help' error (click >= 8.2; typer may vendor its own)."""
    import click

    found = [getattr(click.exceptions, "NoArgsIsHelpError", None)]
    try:
        from typer._click import exceptions as vendored
    except ImportError:
        vendored = None
    found.append(getattr(vendored, "NoArgsIsHelpError", None))
    return tuple(t for t in found if isinstance(t, type))


def _click_error_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """Click's usage-error and abort classes: click's own, and those newer typer releases vendor."""
    import click
    import typer

    usage, aborts = [click.exceptions.ClickException], [click.exceptions.Abort]
    try:
        from typer._click import exceptions as vendored
    except ImportError:
        vendored = None
    if vendored is not None:
        usage.append(vendored.ClickException)
    if isinstance(getattr(typer, "Abort", None), type):
        aborts.append(typer.Abort)
    return tuple(usage), tuple(aborts)


if __name__ == "__main__":
    sys.exit(main())
