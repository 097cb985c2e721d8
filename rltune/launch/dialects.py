"""Override dialects: how one ``key = value`` override is spelled on a job's command line.

A job's config system decides the spelling; rltune only ever appends argv items, never a shell
string, so a value can hold spaces or quotes without being interpreted by a shell.

- ``rltune``   – the reference workload: ``a.b=v`` (value parsed as YAML by the workload)
- ``hydra``    – verl, NeMo-RL: ``a.b=v`` or, for a key the config does not define, ``+a.b=v``;
                 string values that hydra's grammar would read as something else are quoted
- ``prime-rl`` – pydantic-settings CLI: ``--a.b v``; the special key ``@`` loads a TOML file (``@ file.toml``)
- ``argparse`` – OpenRLHF, TRL, slime: ``--flag v`` (booleans as ``true``/``false``; a job whose flag is a
                 bare ``store_true`` switch should map the knob to a wrapper that accepts a value)

Public API: :func:`render_overrides` (dialect, ``{key: value}``) -> ``list[str]``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from rltune.errors import RltuneError

DIALECTS = ("rltune", "hydra", "prime-rl", "argparse")

# A dotted config key: segments of letters, digits, '_' and '-', optionally a leading '+' (hydra append)
# or '++' (hydra force-add). Anything else (spaces, '=', a leading '-') would change the argv's meaning.
_KEY = re.compile(r"^(\+{1,2})?[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*$")
# Hydra reads unquoted values with these characters as lists, sweeps, interpolations or escapes.
_HYDRA_PLAIN = re.compile(r"^[A-Za-z0-9_./:\-+@]*$")


class OverrideError(RltuneError):
    """An override key or value cannot be spelled in the job's dialect."""


def render_value(value: object) -> str:
    """The text of one value: booleans lower-case, floats without needless digits."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise OverrideError(f"override value {value!r} is not a finite number; give a real value")
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if "\n" in value or "\x00" in value:
            raise OverrideError(f"override value {value!r} holds a newline or NUL; use a single-line value")
        return value
    raise OverrideError(f"override value {value!r} has type {type(value).__name__}; use a number, string or boolean")


def _hydra_value(value: object) -> str:
    text = render_value(value)
    if isinstance(value, str) and (text == "" or not _HYDRA_PLAIN.match(text)):
        escaped = text.replace("\\", "\\\\").replace("'", "\\'")
        return f"'{escaped}'"
    return text


def _check_key(dialect: str, key: str) -> None:
    if key == "@" and dialect == "prime-rl":
        return
    if not isinstance(key, str) or not _KEY.match(key):
        raise OverrideError(f"override key {key!r} is not a dotted config key (letters, digits, '_', '-', '.'); "
                            "fix launch.knob_map / launch.steps_override in the job file")
    if key.startswith("+") and dialect != "hydra":
        raise OverrideError(f"override key {key!r}: a leading '+' only means something in the hydra dialect")


def render_overrides(dialect: str, overrides: Mapping[str, object]) -> list[str]:
    """Spell ``overrides`` ({key: value}, in order) as argv items of ``dialect``."""
    if dialect not in DIALECTS:
        raise OverrideError(f"unknown override dialect {dialect!r}; expected one of {', '.join(DIALECTS)}")
    argv: list[str] = []
    for key, value in overrides.items():
        _check_key(dialect, key)
        if dialect == "rltune":
            argv.append(f"{key}={render_value(value)}")
        elif dialect == "hydra":
            argv.append(f"{key}={_hydra_value(value)}")
        elif dialect == "prime-rl":
            if key == "@":
                argv += ["@", render_value(value)]
            else:
                argv += [f"--{key}", render_value(value)]
        else:  # argparse
            argv += [f"--{key}", render_value(value)]
    return argv
