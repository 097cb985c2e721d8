"""prime-rl: trainer and orchestrator ``metrics.jsonl``, console ``SUCCESS Step N | Time: ...`` lines,
and the trainer's ``--bench`` result JSON.

metrics.jsonl rows are ``{"step": N, "time/step": ..., ...}``; the trainer and the orchestrator
each write their own, with overlapping names (both have ``time/step``). A row is the trainer's
when it carries a trainer-only key (``time/forward_backward``, ``time/wait_for_batch``,
``time/broadcast_weights``, ``perf/mfu``); otherwise it is the orchestrator's and its keys are
prefixed ``orchestrator/``. Rows of the same step are merged.

Console lines ``SUCCESS Step N | Time: 73.77s | Reward: ... | Throughput: ... tokens/s | ...`` give
each ``Label: value`` as a metric of that label; the ``Generating rollouts`` progress bar just
before gives the rollout's elapsed time (``rollout_progress/elapsed_s``, 1 s resolution).

A ``--bench`` result (``{"config": ..., "metrics": {"step_time": {"mean", "std", "min", "max"}}}``)
is a trainer-only summary over several steps, not per-step data: it becomes one row per file
(step = the file's position, run id = file name) and the report says so. Failed benchmarks are skipped with their error.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePath

from rltune.profile.adapters._text import ParsedLog, clean_line, flatten, hms_seconds, json_object, to_number
from rltune.profile.report import ParseReport

NAME = "prime-rl"
_CONSOLE = re.compile(r"(?:^|\s)(?:SUCCESS|INFO)\s+Step (\d+) \| (.*)$")
_ROLLOUT_BAR = re.compile(r"Generating rollouts[^:]*:\s+\d+%\|[^|]*\|\s*\d+/\d+\s+\[((?:\d+:)?\d+:\d+)<")
_TRAINER_KEYS = ("time/forward_backward", "time/wait_for_batch", "time/broadcast_weights", "perf/mfu")


def _metrics_row(line: str) -> dict | None:
    obj = json_object(line)
    if obj is None or "step" in obj and "data" in obj:  # verl's file logger, not prime-rl
        return None
    if isinstance(obj.get("step"), int) and any("/" in k for k in obj):
        return obj
    return None


def _bench_doc(text: str) -> dict | None:
    stripped = text.lstrip()
    if not stripped.startswith("{") or '"step_time"' not in text:
        return None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(doc, dict) and isinstance(doc.get("config"), dict) and isinstance(doc.get("metrics"), dict):
        return doc
    return None


def claims(text: str) -> int:
    if _bench_doc(text) is not None:
        return 1
    count = 0
    for raw in text.splitlines():
        line = clean_line(raw)
        if _CONSOLE.search(line) and "Time:" in line or _metrics_row(line) is not None:
            count += 1
    return count


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    bench_rows = 0
    for name, text in sources:
        bench = _bench_doc(text)
        if bench is not None:
            report.lines_total += text.count("\n") + 1
            bench_rows += _parse_bench(parsed, name, bench, bench_rows)
            continue
        rollout_elapsed: float | None = None
        for raw in text.splitlines():
            report.lines_total += 1
            line = clean_line(raw)
            bar = _ROLLOUT_BAR.search(line)
            if bar is not None:
                rollout_elapsed = float(hms_seconds(bar.group(1)))
                continue
            match = _CONSOLE.search(line)
            if match is not None and "Time:" in line:
                metrics = _console_pairs(match.group(2))
                if metrics is None:
                    report.skip("truncated or malformed 'Label: value' field in a Step line")
                    continue
                if rollout_elapsed is not None:
                    metrics["rollout_progress/elapsed_s"] = rollout_elapsed
                    rollout_elapsed = None
                parsed.add(int(match.group(1)), metrics)
                report.lines_used += 1
                continue
            if line.lstrip().startswith("{"):
                row = _metrics_row(line)
                if row is None:
                    report.skip("truncated or malformed JSON row")
                    continue
                step = row.pop("step")
                metrics = flatten(row)
                if not any(k in metrics for k in _TRAINER_KEYS):
                    metrics = {f"orchestrator/{k}": v for k, v in metrics.items()}
                parsed.add(step, metrics)
                report.lines_used += 1
    return parsed


def _console_pairs(body: str) -> dict[str, float] | None:
    metrics: dict[str, float] = {}
    for field in body.split(" | "):
        label, sep, value = field.partition(":")
        if not sep:
            return None
        number = to_number(value.strip().split()[0]) if value.strip() else None
        if number is None:
            return None
        metrics[label.strip()] = number
    return metrics


def _parse_bench(parsed: ParsedLog, name: str, doc: dict, rows_so_far: int) -> int:
    report = parsed.report
    config = doc["config"]
    if not config.get("success", True):
        reason = str(config.get("error_reason") or "unknown error").strip().splitlines()[-1][:120]
        report.skip(f"failed benchmark ({PurePath(name).name}): {reason}")
        return 0
    metrics = flatten(doc["metrics"])
    if "step_time/mean" not in metrics:
        report.skip(f"benchmark without metrics.step_time.mean ({PurePath(name).name})")
        return 0
    for key in ("num_gpus", "seq_len", "micro_batches", "lora_rank"):
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[f"config/{key}"] = float(value)
    step = rows_so_far  # one row per benchmark file, kept apart by run id
    parsed.add(step, metrics)
    parsed.run_ids[step] = PurePath(name).stem
    report.lines_used += 1
    report.note("prime-rl --bench results are trainer-only summaries (mean over the benchmark's steps): "
                "one row per file, step_s = training_s = metrics.step_time.mean")
    return 1
