"""slime: ``perf N: {'perf/rollout_time': ..., ...}`` lines, one per rollout id.

slime prints its per-rollout performance dict after each training step; ``N`` is the rollout id,
which is the step. Keys are ``perf/<timer>_time`` (rollout, train, actor_train, log_probs,
ref_log_probs, update_weights, train_wait, ...) plus throughput figures.
"""

from __future__ import annotations

import re

from rltune.profile.adapters._text import ParsedLog, count_matching, parse_step_dict_lines
from rltune.profile.report import ParseReport

NAME = "slime"
_LINE = re.compile(r"(?:^|\s)perf (\d+): (\{.*)$")


def claims(text: str) -> int:
    return count_matching(text, _LINE)


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    return parse_step_dict_lines(sources, report, _LINE, "'perf N: {...}'")
