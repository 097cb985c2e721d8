"""rltune: the reference workload's ``metrics.jsonl``, one JSON object per step.

Each object's keys are the stage table's core column names (``step``, ``step_s``, ``rollout_s``,
...) plus extra numeric keys; ``run_id`` may be present. It maps onto the table one to one.
"""

from __future__ import annotations

from rltune.contracts.stages import CORE_NAMES
from rltune.profile.adapters._text import ParsedLog, clean_line, flatten, json_object
from rltune.profile.report import ParseReport

NAME = "rltune"
# Keys only the rltune format has together: a step number and a core stage time.
_MARKERS = ("step_s", "rollout_s", "training_s", "weight_sync_s")


def _row(line: str) -> dict | None:
    obj = json_object(line)
    if obj is not None and isinstance(obj.get("step"), int) and any(k in obj for k in _MARKERS):
        return obj
    return None


def claims(text: str) -> int:
    return sum(1 for raw in text.splitlines() if _row(clean_line(raw)) is not None)


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    for _, text in sources:
        for raw in text.splitlines():
            report.lines_total += 1
            line = clean_line(raw).strip()
            if not line:
                continue
            row = _row(line)
            if row is None:
                report.skip("truncated or malformed JSON line" if line.startswith("{") else "not a JSON object")
                continue
            step = row["step"]
            if isinstance(row.get("run_id"), str):
                parsed.run_ids[step] = row["run_id"]
            metrics = flatten({k: v for k, v in row.items() if k not in ("step", "run_id", "warmup")})
            if isinstance(row.get("warmup"), bool):
                metrics["warmup"] = float(row["warmup"])
            parsed.add(step, metrics)
            report.lines_used += 1
    unknown_core = [n for n in CORE_NAMES if n not in ("run_id", "step", "warmup")]
    if parsed.records and not any(k in rec for rec in parsed.records.values() for k in unknown_core):
        report.note("no core column in any row")
    return parsed
