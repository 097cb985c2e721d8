"""Shared helpers of the log adapters: cleaning console lines, reading numbers and dict literals.

Every adapter parses into :class:`ParsedLog`: ``records`` maps a step number to the source's own
metric names and values (nothing renamed yet; the stage map does that), and the report counts
used and skipped lines.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field

from rltune.profile.report import ParseReport

# Terminal colour codes (Ray colours actor prefixes, verl colours nothing, rich colours everything).
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Ray's per-actor prefix: "(TaskRunner pid=678203)" or "(WorkerDict pid=1, ip=10.0.0.1)", possibly repeated.
_RAY_PREFIX = re.compile(r"^\s*\((?:[A-Za-z_][\w.:\-]*\s+)?pid=\d+(?:,\s*ip=[\d.:a-fA-F]+)?\)\s?")
_NAN_TOKENS = re.compile(r"(?<![\w'\"])(nan|NaN|inf|-inf|Infinity|-Infinity)(?![\w'\"])")
# numpy 2 prints scalars through repr(): np.float64(12.3), np.int64(7), np.float32(nan).
_NUMPY_REPR = re.compile(r"^(?:np|numpy)\.(?:float|int|uint|half|single|double|longdouble)\w*\((.*)\)$")
# 'key': nan inside a printed dict, to count the values a dict line had as NaN.
_NAN_ITEM = re.compile(r"'([^']+)':\s*(?:nan|NaN)(?![\w'\"])")


def clean_line(line: str) -> str:
    """A console line without colour codes, Ray actor prefixes or a trailing newline."""
    line = _ANSI.sub("", line.rstrip("\r\n"))
    while True:
        stripped = _RAY_PREFIX.sub("", line, count=1)
        if stripped == line:
            return line
        line = stripped


def to_number(text: str) -> float | None:
    """A float from text such as '252.485', '1e-6', '19.8%', 'nan' or 'np.float64(12.3)'; None if not a number.

    NaN and infinities are returned as such: the stage table reports them (they are never used as times).
    """
    text = text.strip()
    numpy_repr = _NUMPY_REPR.match(text)
    if numpy_repr is not None:
        text = numpy_repr.group(1).strip()
    if text in ("True", "False"):
        return float(text == "True")
    text = text.rstrip("%").strip()
    if text.endswith("s") and not text.endswith(("ns", "ms", "us")):
        text = text[:-1]
    try:
        return float(text)
    except ValueError:
        return None


def hms_seconds(text: str) -> int:
    """'H:MM:SS' (or 'MM:SS', 'SS') as seconds."""
    seconds = 0
    for part in text.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


def number_or_none(value: object) -> float | None:
    """A JSON/literal value as a float (NaN and infinities kept, for the table to report); None if not numeric."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def literal_dict(text: str) -> dict | None:
    """Parse a Python dict literal as frameworks print it ({'a': 1.0, 'b': nan}); None if it is not one."""
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    safe = _NAN_TOKENS.sub(lambda m: "None" if "nan" in m.group(1).lower() else
                           ("-1e999" if m.group(1).startswith("-") else "1e999"), text)
    try:
        value = ast.literal_eval(safe)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def json_object(text: str) -> dict | None:
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def flatten(mapping: dict, prefix: str = "") -> dict[str, float]:
    """Nested dict -> {'a/b': number} for every numeric leaf (names joined with '/', as the loggers do)."""
    out: dict[str, float] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        else:
            number = number_or_none(value)
            if number is not None:
                out[name] = number
    return out


@dataclass
class ParsedLog:
    """What an adapter read: step -> {source metric name: value}, and its report."""

    report: ParseReport
    records: dict[int, dict[str, float]] = field(default_factory=dict)
    run_ids: dict[int, str] = field(default_factory=dict)

    def add(self, step: int, metrics: dict[str, float]) -> None:
        """Merge ``metrics`` into ``step``'s record; a key seen twice with another value keeps the first."""
        record = self.records.setdefault(step, {})
        for key, value in metrics.items():
            both_nan = math.isnan(record.get(key, 0.0)) and math.isnan(value)
            if key in record and record[key] != value and not both_nan:
                self.report.note(f"some steps repeat a metric with another value (e.g. step {step} '{key}'); kept the first")
                continue
            record[key] = value


def count_matching(text: str, line_re: re.Pattern) -> int:
    """How many cleaned lines of ``text`` match ``line_re`` (an adapter's ``claims``)."""
    return sum(1 for raw in text.splitlines() if line_re.search(clean_line(raw)))


def parse_step_dict_lines(sources: list[tuple[str, str]], report: ParseReport, line_re: re.Pattern,
                          what: str) -> ParsedLog:
    """Parse ``<prefix> N: {python dict literal}`` lines: group 1 is the step, group 2 the dict.

    ``what`` names the line shape in skip reasons, e.g. ``'perf N: {...}'``.
    """
    parsed = ParsedLog(report)
    nan_values = 0
    first_nan: tuple[int, str] | None = None
    for _, text in sources:
        for raw in text.splitlines():
            report.lines_total += 1
            match = line_re.search(clean_line(raw))
            if match is None:
                continue
            value = literal_dict(match.group(2))
            if value is None:
                report.skip(f"truncated or malformed {what} line")
                continue
            step = int(match.group(1))
            nan_keys = _NAN_ITEM.findall(match.group(2))
            if nan_keys:
                nan_values += len(nan_keys)
                first_nan = first_nan or (step, nan_keys[0])
            parsed.add(step, flatten(value))
            report.lines_used += 1
    if nan_values:
        report.note(f"{nan_values} value{'s' if nan_values != 1 else ''} printed as nan "
                    f"(e.g. step {first_nan[0]} '{first_nan[1]}') are null in the table")
    return parsed
