"""Regenerate the field tables of docs/artifacts.md from the schemas.

Run ``python -m rltune.contracts.docs`` after changing a schema; a test fails while the document
and the code disagree. Each table sits between ``<!-- fields:NAME -->`` and ``<!-- /fields -->``.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "artifacts.md"

# marker name -> (module, attribute): a dataclass (YAML artifact) or a callable returning markdown.
TABLES = {
    "job": ("rltune.contracts.job", "JobSpec"),
    "stages": ("rltune.contracts.stages", "describe_columns"),
    "diagnosis": ("rltune.contracts.diagnosis", "Diagnosis"),
    "knowledge": ("rltune.contracts.knowledge", "Knowledge"),
    "candidates": ("rltune.contracts.candidates", "Candidates"),
    "forecast": ("rltune.contracts.forecast", "Forecast"),
    "cases": ("rltune.contracts.cases", "describe_columns"),
    "public_runs": ("rltune.contracts.public_runs", "describe_columns"),
    "verdict": ("rltune.contracts.verdict", "Verdict"),
    "reward_check": ("rltune.contracts.reward_check", "RewardCheck"),
    "learning_checks": ("rltune.contracts.learning", "LearningChecks"),
    "journal": ("rltune.contracts.journal", "describe_events"),
    "stage_map": ("rltune.profile.stage_map", "describe_stage_map"),
    "sync_readers": ("rltune.sync.bench.readers", "ReadersConfig"),
    "sync_estimate_model": ("rltune.sync.estimate", "ModelSpec"),
    "sync_estimate_rates": ("rltune.sync.estimate", "RatesFile"),
}


def render(name: str) -> str | None:
    module_name, attr = TABLES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        return None
    obj = getattr(module, attr, None)
    if obj is None:
        return None
    if isinstance(obj, type):
        from rltune.contracts.schema import field_docs

        lines = ["| field | type | meaning |", "|---|---|---|"]
        lines += [f"| `{n}` | {t} | {d} |" for n, t, d in field_docs(obj)]
        return "\n".join(lines)
    return obj()


def regenerate(text: str) -> str:
    def fill(match: re.Match) -> str:
        body = render(match.group(1))
        if body is None:
            return match.group(0)
        return f"<!-- fields:{match.group(1)} -->\n{body}\n<!-- /fields -->"

    return re.sub(r"<!-- fields:(\w+) -->.*?<!-- /fields -->", fill, text, flags=re.S)


def main() -> int:
    text = DOC.read_text(encoding="utf-8")
    new = regenerate(text)
    if new != text:
        DOC.write_text(new, encoding="utf-8")
        print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
