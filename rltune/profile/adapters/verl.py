"""verl: console lines ``step:N - key:value - ...``, the file-logger JSONL, and the progress bar.

Console metric lines come in three key generations, all read by the same parser (the stage map
picks the keys): the oldest uses ``timing/*`` and has no step timer; the middle one ``timing_s/*``
with ``mfu/actor``, ``time_per_step`` and ``Tokens/Sec/GPU``; the current one ``timing_s/*`` plus
``perf/*`` with ``timing_s/generate_sequences`` and ``timing_s/reshard``. Lines may carry Ray's
``(TaskRunner pid=N)`` prefix and colour codes; both are stripped. A ``step:0`` line with no timing
(the validation before training) is skipped with its reason.

verl's ``FileLogger`` writes one JSON object per step, ``{"step": N, "data": {key: value}}``.

A log holding neither (e.g. ``trainer.logger=[wandb]`` only) still shows the ``Training Progress``
bar: ``N/T [HH:MM:SS<..., X s/it]``. Its elapsed time at step N minus that at step N-1 is the
step's own wall time, to the bar's one-second resolution; that is all such a log can give.
"""

from __future__ import annotations

import re

from rltune.profile.adapters._text import ParsedLog, clean_line, flatten, hms_seconds, json_object, to_number
from rltune.profile.report import ParseReport

NAME = "verl"
_STEP_LINE = re.compile(r"(?:^|\s)step:(\d+)\s+-\s+(.*)$")
_PAIR = re.compile(r"^(.+?):\s*(\S+)$")
_PROGRESS = re.compile(r"Training Progress:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)\s+\[((?:\d+:)?\d+:\d+)<")
_TIMING_PREFIXES = ("timing/", "timing_s/", "perf/time_per_step", "time_per_step")


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


def _parse_pairs(body: str) -> dict[str, float] | None:
    metrics: dict[str, float] = {}
    for chunk in body.split(" - "):
        match = _PAIR.match(chunk.strip())
        if match is None:
            return None
        value = to_number(match.group(2))
        if value is None:
            return None
        metrics[match.group(1).strip()] = value
    return metrics


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    progress: list[tuple[int, int]] = []  # (step, elapsed seconds)
    for _, text in sources:
        for raw in text.splitlines():
            report.lines_total += 1
            line = clean_line(raw)
            record = _file_logger_record(line)
            if record is not None:
                step = record["step"]
                if not isinstance(step, int) or isinstance(step, bool):
                    report.skip("file-logger record whose 'step' is not an integer")
                    continue
                metrics = flatten(record["data"])
                if not any(k.startswith(_TIMING_PREFIXES) for k in metrics):
                    report.skip("step with no timing keys (validation-only record)")
                    continue
                parsed.add(step, metrics)
                report.lines_used += 1
                continue
            match = _STEP_LINE.search(line)
            if match is not None:
                metrics = _parse_pairs(match.group(2))
                if metrics is None:
                    report.skip("truncated or malformed 'key:value' pair")
                    continue
                if not any(k.startswith(_TIMING_PREFIXES) for k in metrics):
                    report.skip("step with no timing keys (validation-only line)")
                    continue
                parsed.add(int(match.group(1)), metrics)
                report.lines_used += 1
                continue
            match = _PROGRESS.search(line)
            if match is not None:
                progress.append((int(match.group(1)), hms_seconds(match.group(3))))
    if not parsed.records and progress:
        _from_progress(parsed, progress)
    elif progress:
        report.note("progress-bar lines ignored: the metric lines carry the step times")
    return parsed


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
