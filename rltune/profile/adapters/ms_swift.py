"""ms-swift: ``<output_dir>/logging.jsonl``, one JSON object per logging step.

ms-swift's progress callback appends every ``Trainer.log`` call to ``logging.jsonl``::

    {"loss": 0.0, ..., "reward": 0.0, "step_time": 17.67188024, "epoch": 0.0001,
     "global_step/max_steps": "1/10000", "elapsed_time": "36s", "remaining_time": "4d 3h 37m 48s",
     "memory(GiB)": 55.33, "train_speed(s/it)": 35.870414}

The step is the first number of ``global_step/max_steps`` (Megatron-SWIFT writes ``iteration``,
same shape). ``elapsed_time`` ("1d 0h 50m 28s", whole seconds) is kept as ``elapsed_s``;
``train_speed(s/it)`` (older versions ``train_speed(iter/s)``) is a running average since the start,
kept as an extra column only.

Stage columns: GRPO rows carry TRL's ``step_time`` (the sum of the optimizer step's
``training_step`` calls: generation, forward, backward; the optimizer update and logging fall
outside it), which fills ``step_s``; asynchronous TRL's ``iteration_time_s`` (end to end) wins
when present. A log with neither (SFT, older GRPO) gets ``elapsed/step_s``: the elapsed time
between two training rows divided by the steps between them (``logging_steps``), to one second —
marked derived in the report. ms-swift's stage timers (``profiling/Time taken: ...``) go only to
wandb/swanlab, never to this file, so no row has rollout or training times and the report says so.

Evaluation rows (``eval_*`` keys) and the final summary (``last_model_checkpoint``, ...) are not
training steps: skipped and counted. Rows whose training keys are absent on a step (with
``steps_per_generation`` > 1 the generation metrics appear only every few steps) are kept as they
are. ms-swift prints the same dicts to the console in Python syntax; that console form is read by
the TRL adapter, not this one.

Real samples: tests/profiling/data/ms_swift_grpo_logging_issue9261.jsonl (modelscope/ms-swift#9261)
and ms_swift_sft_logging_onevl_issue6.jsonl (xiaomi-research/onevl#6).
"""

from __future__ import annotations

import re

from rltune.profile.adapters._text import ParsedLog, clean_line, flatten, json_object
from rltune.profile.report import ParseReport

NAME = "ms-swift"
_STEP_KEYS = ("global_step/max_steps", "iteration")
_STEP_VALUE = re.compile(r"^(\d+)/(\d+)$")
_DURATION = re.compile(r"^(?:(\d+)d\s*)?(?:(\d+)h\s*)?(?:(\d+)m\s*)?(?:(\d+)s)?$")
_SUMMARY_KEYS = ("last_model_checkpoint", "best_model_checkpoint", "train_runtime")


def _row(line: str) -> dict | None:
    obj = json_object(line)
    if obj is None:
        return None
    if any(isinstance(obj.get(k), str) and _STEP_VALUE.match(obj[k]) for k in _STEP_KEYS):
        return obj
    if "last_model_checkpoint" in obj or "model_parameter_info" in obj:
        return obj
    return None


def claims(text: str) -> int:
    return sum(1 for raw in text.splitlines() if _row(clean_line(raw).strip()) is not None)


def duration_seconds(text: str) -> float | None:
    """ms-swift's format_time ('1d 0h 50m 28s', '6m 3s', '36s') as seconds; None if not that shape."""
    match = _DURATION.match(text.strip())
    if match is None or not any(match.groups()):
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    train_elapsed: list[tuple[int, float]] = []
    for _, text in sources:
        for raw in text.splitlines():
            report.lines_total += 1
            line = clean_line(raw).strip()
            if not line:
                continue
            row = _row(line)
            if row is None:
                if line.startswith("{"):
                    report.skip("truncated or malformed JSON line")
                continue
            step_text = next((row[k] for k in _STEP_KEYS if isinstance(row.get(k), str)), None)
            step_match = _STEP_VALUE.match(step_text) if step_text else None
            if step_match is None or any(k in row for k in _SUMMARY_KEYS):
                report.skip("end-of-training summary, not a step")
                continue
            if any(k.startswith("eval_") for k in row):
                report.skip("evaluation row, not a training step")
                continue
            step = int(step_match.group(1))
            metrics = flatten({k: v for k, v in row.items() if k not in _STEP_KEYS})
            elapsed = duration_seconds(row["elapsed_time"]) if isinstance(row.get("elapsed_time"), str) else None
            if elapsed is not None:
                metrics["elapsed_s"] = elapsed
                train_elapsed.append((step, elapsed))
            metrics["max_steps"] = float(step_match.group(2))
            parsed.add(step, metrics)
            report.lines_used += 1
    _derive_step_times(parsed, train_elapsed)
    if parsed.records:
        report.note("ms-swift's logging.jsonl has no stage timers (they go to wandb/swanlab only): "
                    "rows have step times and rewards, no rollout or training times")
    return parsed


def _derive_step_times(parsed: ParsedLog, train_elapsed: list[tuple[int, float]]) -> None:
    """elapsed/step_s between consecutive training rows, for logs without step_time."""
    if any("step_time" in rec or "iteration_time_s" in rec for rec in parsed.records.values()):
        return
    derived = 0
    for (step_a, t_a), (step_b, t_b) in zip(train_elapsed, train_elapsed[1:], strict=False):
        if step_b > step_a:
            parsed.records[step_b]["elapsed/step_s"] = (t_b - t_a) / (step_b - step_a)
            derived += 1
    if derived:
        parsed.report.note("no step_time in this log: step_s is derived from elapsed_time (whole seconds) "
                           "between logged rows, divided by the steps between them; the first row has none")
