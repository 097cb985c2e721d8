"""Fixtures of the workload tests, and one guard for in-process model tests.

tests/conftest.py puts ``tests/`` on sys.path, where the ``tests/profile`` package shadows the
standard library's ``profile`` module; ``torch._dynamo`` (imported by transformers) imports
``cProfile``, which needs the real one. Import cProfile against the standard library's module
once, then put back whatever ``profile`` meant before, so the profile tests are unaffected.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path

if "cProfile" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("profile", Path(sysconfig.get_paths()["stdlib"]) / "profile.py")
    _stdlib_profile = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_stdlib_profile)
    _saved = sys.modules.get("profile")
    sys.modules["profile"] = _stdlib_profile
    try:
        import cProfile  # noqa: F401
    finally:
        if _saved is not None:
            sys.modules["profile"] = _saved
        else:
            del sys.modules["profile"]
