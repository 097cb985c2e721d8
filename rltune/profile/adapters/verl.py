"""verl: console records ``step:N - key:value - ...``, the ``file`` logger's JSONL, and the progress bar.

**Console.** verl's console logger prints one record per step, ``step:N - key:value - key:value``,
each value through ``pprint.pformat``. Records come in three key generations, all read by the same
parser (the stage map picks the keys): the oldest uses ``timing/*`` and has no step timer; the
middle one ``timing_s/*`` with ``mfu/actor``, ``time_per_step`` and ``Tokens/Sec/GPU``; the current
one ``timing_s/*`` plus ``perf/*``, ``timing_s/generate_sequences`` inside ``timing_s/gen``, and
``timing_s/update_weights`` after ``timing_s/update_actor`` (older hybrid engines instead time the
FSDP -> vLLM hand-over as ``timing_s/reshard`` inside ``timing_s/gen``). What else current logs
look like:

- values under numpy 2 print as their repr: ``actor/pg_loss:np.float64(-0.00066)``,
  ``training/global_step:np.int64(3)``; ``nan`` and ``inf`` print bare. All are read; a NaN time
  reaches the stage table as null and the report says so.
- a record longer than the terminal is broken into several lines when it is copied from a
  terminal or a pager (no Ray prefix on the continuation lines, the break anywhere, even inside a
  key or a number); records may also arrive one ``key:value`` per line. Continuation lines are
  joined back while they look like the rest of a record: pair text with no other spaces, or a
  fragment of the key or number the previous line was cut in. Anything else ends the record.
- lines may carry Ray's ``(TaskRunner pid=N)`` prefix and colour codes; both are stripped.

A value that cannot be read as a number is left out of its record and counted in the report (a
timing key's unreadable value is named); a record cut off at its end (a log cut mid-line) is
skipped and counted. A ``step:0`` record with no timing key (the validation before training) is
skipped with its reason. When ``timing_s/testing`` or ``timing_s/save_checkpoint`` is present, the
report notes the steps whose step timer includes them (verl times checkpoint saving inside
``timing_s/step``, and older versions the validation pass too).

**File logger.** ``trainer.logger=['console','file']`` writes one JSON object per step to
``$VERL_FILE_LOGGER_PATH`` (default ``<project>/<experiment>.jsonl``), ``{"step":N,"data":{...}}``,
serialised by orjson: compact, numpy scalars as plain numbers, and NaN/inf as ``null`` — a timing
key whose value is null is counted in the report.

**Progress bar.** A log with neither (e.g. ``trainer.logger=[wandb]`` only) still shows the
``Training Progress`` bar: ``N/T [HH:MM:SS<..., X s/it]``. Its elapsed time at step N minus that at
step N-1 is the step's own wall time, to the bar's one-second resolution; that is all such a log
can give.

Real samples: tests/profiling/data/verl_*.log (see tests/profiling/data/README.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rltune.profile.adapters._text import ParsedLog, clean_line, flatten, hms_seconds, json_object, to_number
from rltune.profile.report import ParseReport

NAME = "verl"
_STEP_LINE = re.compile(r"(?:^|\s)step:(\d+)(?:\s+-\s+(.*)|\s*-?\s*)$")
_PROGRESS = re.compile(r"Training Progress:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)\s+\[((?:\d+:)?\d+:\d+)<")
_TIMING_PREFIXES = ("timing/", "timing_s/", "perf/time_per_step", "time_per_step")
_KEY = r"[^\s:]+"
# One value as verl prints it: a number, nan/inf, True/False, or a numpy scalar repr.
_VALUE = r"(?:(?:np|numpy)\.\w+\()?[-+]?(?:\d[\w.+\-]*|\.\d[\w.+\-]*|nan|inf|True|False)\)?"
# A whole line of complete pairs, e.g. "timing_s/gen:4.2" or "- a:1 - b:np.float64(2.0) -".
_PAIR_LINE = re.compile(rf"^(?:-\s+)?{_KEY}:{_VALUE}(?:\s+-\s+{_KEY}:{_VALUE})*(?:\s+-)?$")
# What a line cut by a terminal can continue with: pair text with no other whitespace.
_FRAGMENT = re.compile(r"^-?\s?\S+(?: - \S+)*(?: -)?$")
# The tail of a number or numpy repr cut across lines: digits, '.', exponent, ')'.
_NUMBER_TAIL = re.compile(r"^[\d.eE+\-]*\)?(?: - \S.*)?$")
_PAIR = re.compile(r"^(.+):\s*(\S+)$")
# Timers inside some versions' step timer that are no stage of the RL step (counted only in step_s).
_NON_STAGE_TIMERS = {"timing_s/testing": "the validation pass (timing_s/testing)",
                     "timing_s/save_checkpoint": "checkpoint saving (timing_s/save_checkpoint)"}
_FILE_LOGGER_START = re.compile(r'^\s*\{\s*"step"\s*:')


def _claims_line(line: str) -> bool:
    return bool(_STEP_LINE.search(line) or _PROGRESS.search(line))


def _file_logger_record(line: str) -> dict | None:
    obj = json_object(line)
    if obj is not None and "step" in obj and isinstance(obj.get("data"), dict):
        return obj
    return None


def claims(text: str) -> int:
    count = 0
    for raw in text.splitlines():
        line = clean_line(raw)
        if _claims_line(line) or _file_logger_record(line) is not None:
            count += 1
    return count


def _is_timing(key: str) -> bool:
    return key.startswith(_TIMING_PREFIXES)


@dataclass
class _Record:
    """One console record being assembled from one or more physical lines."""

    step: int
    text: str
    lines: int = 1


@dataclass
class _Unreadable:
    """Values left out of their records because they are not numbers."""

    count: int = 0
    timing: list[tuple[int, str, str]] = field(default_factory=list)
    first: tuple[int, str, str] | None = None


def _incomplete(text: str) -> bool:
    """True when a record's text ends mid-pair: a dangling separator, a key with no value, an open paren."""
    text = text.rstrip()
    if not text:
        return False
    if text.endswith(("-", ":", "(", ".")) or text.count("(") != text.count(")"):
        return True
    last = text.rsplit(" - ", 1)[-1]
    return ":" not in last


def _joins(record: _Record, line: str) -> str | None:
    """The record's text with ``line`` appended if ``line`` continues it, else None."""
    stripped = line.strip()
    if not stripped or _STEP_LINE.search(stripped) or _PROGRESS.search(stripped):
        return None
    text = record.text.rstrip()
    if _PAIR_LINE.match(stripped):
        if _incomplete(text) and not stripped.startswith("-"):
            return _glue(text, stripped)
        pairs = stripped[1:].strip() if stripped.startswith("-") else stripped
        return f"{text} - {pairs}" if text and not text.endswith("-") else f"{text} {pairs}".strip()
    if _FRAGMENT.match(stripped) and (_incomplete(text) or stripped.startswith("- ") or " - " in stripped
                                      or _NUMBER_TAIL.match(stripped)):
        return _glue(text, stripped)
    return None


def _glue(text: str, fragment: str) -> str:
    """Join a record cut by a terminal: the break may have eaten the space of a ' - ' separator."""
    if text.endswith(" -") or fragment.startswith("- "):
        return f"{text} {fragment}"
    return text + fragment


def _parse_pairs(record: _Record, unreadable: _Unreadable) -> dict[str, float] | None:
    """The record's pairs; None when its last pair is cut off (a truncated record)."""
    metrics: dict[str, float] = {}
    if not record.text.strip():
        return metrics
    chunks = [c.strip() for c in record.text.strip().rstrip("-").split(" - ")]
    for position, chunk in enumerate(chunks):
        match = _PAIR.match(chunk)
        value = to_number(match.group(2)) if match is not None else None
        if value is None:
            if position == len(chunks) - 1:
                return None
            key = match.group(1).strip() if match is not None else chunk
            shown = match.group(2) if match is not None else ""
            unreadable.count += 1
            unreadable.first = unreadable.first or (record.step, key, shown)
            if _is_timing(key):
                unreadable.timing.append((record.step, key, shown))
            continue
        metrics[match.group(1).strip()] = value
    return metrics


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    progress: list[tuple[int, int]] = []  # (step, elapsed seconds)
    unreadable = _Unreadable()
    joined = 0
    non_stage: list[tuple[int, list[str]]] = []
    null_timings: list[tuple[int, str]] = []

    def close(record: _Record | None) -> None:
        nonlocal joined
        if record is None:
            return
        metrics = _parse_pairs(record, unreadable)
        if metrics is None:
            report.skip("truncated or malformed 'key:value' pair", record.lines)
            return
        if not any(_is_timing(k) for k in metrics):
            report.skip("step with no timing keys (validation-only line)", record.lines)
            return
        inside = [name for key, name in _NON_STAGE_TIMERS.items() if key in metrics]
        if inside:
            non_stage.append((record.step, inside))
        parsed.add(record.step, metrics)
        report.lines_used += record.lines
        joined += record.lines - 1

    for _, text in sources:
        record: _Record | None = None
        for raw in text.splitlines():
            report.lines_total += 1
            line = clean_line(raw)
            if record is not None:
                extended = _joins(record, line)
                if extended is not None:
                    record.text = extended
                    record.lines += 1
                    continue
                close(record)
                record = None
            file_record = _file_logger_record(line)
            if file_record is not None:
                _read_file_record(parsed, file_record, null_timings)
                continue
            if _FILE_LOGGER_START.match(line):
                report.skip("truncated or malformed file-logger JSON line" if json_object(line) is None
                            else "JSON line without a 'data' object (not verl's file logger)")
                continue
            match = _STEP_LINE.search(line)
            if match is not None:
                record = _Record(step=int(match.group(1)), text=(match.group(2) or "").strip())
                continue
            match = _PROGRESS.search(line)
            if match is not None:
                progress.append((int(match.group(1)), hms_seconds(match.group(3))))
        close(record)
    _report(report, unreadable, joined, non_stage, null_timings)
    if not parsed.records and progress:
        _from_progress(parsed, progress)
    elif progress:
        report.note("progress-bar lines ignored: the metric lines carry the step times")
    return parsed


def _read_file_record(parsed: ParsedLog, record: dict, null_timings: list[tuple[int, str]]) -> None:
    report = parsed.report
    step = record["step"]
    if not isinstance(step, int) or isinstance(step, bool):
        report.skip("file-logger record whose 'step' is not an integer")
        return
    null_timings.extend((step, k) for k, v in record["data"].items() if v is None and _is_timing(k))
    metrics = flatten(record["data"])
    if not any(_is_timing(k) for k in metrics):
        if any(_is_timing(k) for k in record["data"]):
            report.skip("file-logger record whose timing values are all null")
        else:
            report.skip("step with no timing keys (validation-only record)")
        return
    parsed.add(step, metrics)
    report.lines_used += 1


def _report(report: ParseReport, unreadable: _Unreadable, joined: int, non_stage: list[tuple[int, list[str]]],
            null_timings: list[tuple[int, str]]) -> None:
    if joined:
        report.note(f"{joined} continuation line{'s' if joined != 1 else ''} joined to the record before "
                    "(records broken across lines by the terminal or printed one key per line)")
    if unreadable.count:
        step, key, shown = unreadable.first
        what = "value could not be read as a number" if unreadable.count == 1 else "values could not be read as numbers"
        report.note(f"{unreadable.count} {what}: not in the table (e.g. step {step} '{key}': {shown!r})")
    if unreadable.timing:
        step, key, shown = unreadable.timing[0]
        what = "is a timing value" if len(unreadable.timing) == 1 else "are timing values"
        report.note(f"{len(unreadable.timing)} of them {what} (e.g. step {step} '{key}': {shown!r}): "
                    "the stages built on it are null there")
    if null_timings:
        step, key = null_timings[0]
        report.note(f"{len(null_timings)} timing value{'s are' if len(null_timings) != 1 else ' is'} null in the "
                    f"file logger (e.g. step {step} '{key}'; orjson writes NaN as null): null in the table")
    for name in sorted({n for _, names in non_stage for n in names}):
        steps = [step for step, names in non_stage if name in names]
        shown = ", ".join(str(s) for s in steps[:5]) + (", ..." if len(steps) > 5 else "")
        report.note(f"timing_s/step includes {name} at step {shown}: those steps are longer than their stages")


def _from_progress(parsed: ParsedLog, progress: list[tuple[int, int]]) -> None:
    report = parsed.report
    elapsed: dict[int, int] = {}
    for step, seconds in progress:
        elapsed.setdefault(step, seconds)  # a repeated redraw of the same step keeps its first time
    for step in sorted(elapsed):
        if step - 1 not in elapsed:
            continue
        parsed.add(step, {"progress/elapsed_s": float(elapsed[step]),
                          "progress/step_s": float(elapsed[step] - elapsed[step - 1])})
        report.lines_used += 1
    report.note("no 'step:N - key:value' metric lines: step times come from the 'Training Progress' bar "
                "(1 s resolution) and no stage times are available; log with trainer.logger=[console] for stages")
