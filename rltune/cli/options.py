"""Checks of command-line values that several commands share: step counts, list flags, ``--set``.

click would answer a bad value with a usage block; these answer with the one line every rltune
error gets (``rltune: --steps 0: ...``, exit 2), the same in every command. Only typer-free,
light imports here: every command module imports this at call time.
"""

from __future__ import annotations

from typing import Any

from rltune.errors import RltuneError
from rltune.launch.job import MAX_STEPS, check_steps  # noqa: F401 - the one step-count check, shared with the launcher


class OptionError(RltuneError):
    """A command-line value rltune cannot use; the message names the flag, the value and the fix."""

    exit_code = 2


def check_at_least(value: int | None, least: int, flag: str, what: str) -> int | None:
    """``value`` if it is at least ``least`` (``None`` passes), else one line: ``--max -3: keep at least 1 ...``."""
    if value is not None and value < least:
        raise OptionError(f"{flag} {value}: {what} must be at least {least}")
    return value


def refuse_unused(flag: str, given: bool, mode: str) -> None:
    """A flag that does nothing in the mode the command runs in is refused, not ignored."""
    if given:
        raise OptionError(f"{flag} does nothing {mode}; leave it out")


def parse_list(flag: str, text: str, choices: tuple[str, ...] | None = None, example: str = "1,2,4") -> list[str]:
    """A comma list read strictly: no empty items (``1,,2``), no repeats, each among ``choices`` if given."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise OptionError(f"{flag} {text!r}: give a comma list without empty items, e.g. "
                          f"{','.join(choices[:2]) if choices else example}")
    if choices is not None:
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise OptionError(f"{flag} {text!r}: {unknown[0]!r} is not one of {', '.join(choices)}")
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise OptionError(f"{flag} {text!r}: {repeated[0]!r} is given twice; name each once")
    return items


def parse_int_list(flag: str, text: str, least: int = 0) -> list[int]:
    """A strict comma list of integers, each at least ``least`` (``--readers 1,2,4``)."""
    values = []
    for item in parse_list(flag, text):
        try:
            value = int(item)
        except ValueError:
            raise OptionError(f"{flag} {text!r}: {item!r} is not an integer; give a comma list of integers, "
                              f"e.g. 1,2,4") from None
        if value < least:
            raise OptionError(f"{flag} {text!r}: {value} is below {least}")
        values.append(value)
    return values


def parse_sets(values: list[str], flag: str = "--set") -> list[tuple[str, Any]]:
    """``knob=value`` pairs in the order given, each value read as a YAML scalar.

    The pairs, not a mapping: a knob given twice must reach
    :func:`rltune.contracts.job.check_knob_overrides`, which refuses it, instead of the last one winning.
    """
    import yaml

    out: list[tuple[str, Any]] = []
    for item in values:
        knob, sep, raw = item.partition("=")
        knob = knob.strip()
        if not sep or not knob:
            raise OptionError(f"{flag} {item!r}: expected knob=value, e.g. {flag} micro_batch_size=8")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if not isinstance(value, (int, float, str, bool)):
            value = raw
        out.append((knob, value))
    return out
