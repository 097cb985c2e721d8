"""Run directories: one folder per run under ``runs/``, named so that a listing sorts by time.

A run id reads ``<UTC yyyymmdd-hhmmss>-<job name>-<4 hex>``; the random suffix keeps two runs
started in the same second apart.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from rltune.contracts.outputs import safe_name

DEFAULT_RUNS_ROOT = Path("runs")


def new_run_id(name: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{safe_name(name, limit=48)}-{secrets.token_hex(2)}"


def new_run_dir(name: str, root: Path = DEFAULT_RUNS_ROOT) -> Path:
    """Create and return a fresh, empty run directory under ``root``."""
    while True:
        path = Path(root) / new_run_id(name)
        try:
            path.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            continue
        return path
