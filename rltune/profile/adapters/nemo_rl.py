"""NeMo-RL: the console block printed after each GRPO step.

    ========================= Step 3/100 =========================
    ...
    📊 Training Results:
      • Loss: 0.0271
      • Avg Reward: 0.1016
    ⏱️  Timing:
      • Total step time: 94.87s
      • generation: 44.62s (47.0%)
      • policy_training: 30.21s (31.8%)

Bullets under "Timing" become ``timing/<name>`` (``Total step time`` -> ``timing/total_step_time``),
other bullets keep their label (``Avg Reward``). A block that never reaches its timing section (a
log cut mid-step) is skipped and counted.
"""

from __future__ import annotations

import re

from rltune.profile.adapters._text import ParsedLog, clean_line, to_number
from rltune.profile.report import ParseReport

NAME = "nemo-rl"
_HEADER = re.compile(r"^=+\s*Step (\d+)/(\d+)\s*=+\s*$")
_BULLET = re.compile(r"^\s*[•*\-]\s+([^:]+):\s+(\S+)")
_TIMING_TITLE = re.compile(r"Timing:\s*$")
_SECTION_TITLE = re.compile(r":\s*$")


def claims(text: str) -> int:
    return sum(1 for raw in text.splitlines() if _HEADER.match(clean_line(raw).strip()))


def _timing_key(label: str) -> str:
    return "timing/" + re.sub(r"\s+", "_", label.strip().lower())


def _close(parsed: ParsedLog, step: int | None, metrics: dict[str, float], used: int) -> None:
    if step is None:
        return
    if "timing/total_step_time" not in metrics:
        parsed.report.skip("step block without 'Total step time' (log cut mid-step?)", used)
        return
    parsed.add(step, metrics)
    parsed.report.lines_used += used


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    for _, text in sources:
        step: int | None = None
        metrics: dict[str, float] = {}
        in_timing = False
        used = 0
        for raw in text.splitlines():
            report.lines_total += 1
            line = clean_line(raw).strip()
            header = _HEADER.match(line)
            if header is not None:
                _close(parsed, step, metrics, used)
                step, metrics, in_timing, used = int(header.group(1)), {}, False, 1
                continue
            if step is None:
                continue
            if _TIMING_TITLE.search(line):
                in_timing = True
                continue
            bullet = _BULLET.match(line)
            if bullet is not None:
                value = to_number(bullet.group(2))
                if value is None:
                    continue
                label = bullet.group(1).strip()
                metrics[_timing_key(label) if in_timing else label] = value
                used += 1
            elif line and _SECTION_TITLE.search(line) and not line.startswith("▶"):
                in_timing = False
        _close(parsed, step, metrics, used)
    return parsed
