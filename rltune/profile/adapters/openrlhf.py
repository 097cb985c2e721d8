"""OpenRLHF: ``Global step N: {'reward': ..., 'timing/...': ...}`` dict lines, one per global step."""

from __future__ import annotations

import re

from rltune.profile.adapters._text import ParsedLog, clean_line, flatten, literal_dict
from rltune.profile.report import ParseReport

NAME = "openrlhf"
_LINE = re.compile(r"(?:^|\s)Global step (\d+): (\{.*)$")


def claims(text: str) -> int:
    return sum(1 for raw in text.splitlines() if _LINE.search(clean_line(raw)))


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    for _, text in sources:
        for raw in text.splitlines():
            report.lines_total += 1
            match = _LINE.search(clean_line(raw))
            if match is None:
                continue
            value = literal_dict(match.group(2))
            if value is None:
                report.skip("truncated or malformed 'Global step N: {...}' line")
                continue
            parsed.add(int(match.group(1)), flatten(value))
            report.lines_used += 1
    return parsed
