"""OpenRLHF: ``Global step N: {'reward': ..., 'timing/...': ...}`` dict lines, one per global step."""

from __future__ import annotations

import re

from rltune.profile.adapters._text import ParsedLog, count_matching, parse_step_dict_lines
from rltune.profile.report import ParseReport

NAME = "openrlhf"
_LINE = re.compile(r"(?:^|\s)Global step (\d+): (\{.*)$")


def claims(text: str) -> int:
    return count_matching(text, _LINE)


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    return parse_step_dict_lines(sources, report, _LINE, "'Global step N: {...}'")
