"""Sync test setup.

tests/profile is a package named ``profile``; with tests/ on sys.path it shadows the standard
library's ``profile``, which ``cProfile`` (imported by transformers) needs. Import the real
``cProfile`` once here, with the standard ``profile`` behind it, and put the shadow back.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path


def _load_stdlib_cprofile() -> None:
    if "cProfile" in sys.modules:
        return
    shadow = sys.modules.pop("profile", None)
    try:
        spec = importlib.util.spec_from_file_location("profile", Path(sysconfig.get_paths()["stdlib"]) / "profile.py")
        stdlib_profile = importlib.util.module_from_spec(spec)
        sys.modules["profile"] = stdlib_profile
        spec.loader.exec_module(stdlib_profile)
        import cProfile  # noqa: F401  (binds the standard profile module)
    finally:
        if shadow is not None:
            sys.modules["profile"] = shadow


_load_stdlib_cprofile()
