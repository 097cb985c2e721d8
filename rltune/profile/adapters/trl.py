"""TRL: the Trainer's ``trainer_state.json`` log history and its console dict lines.

Two sources, one record per logging step:

- ``trainer_state.json`` (written at checkpoints, by ``save_state()`` and at every log by
  :class:`rltune.integrations.trl.TrlStageTimers`): ``log_history`` holds one dict per log with its
  ``step`` and full-precision numbers. Evaluation entries merge into their step's row; the
  end-of-training summary (``train_runtime``, ...) is not a step and is skipped.
- the console: one Python dict per log, ``{'loss': ..., 'reward': ..., 'epoch': ...}``, with no
  step number, so rows are numbered 1, 2, ... in order (right for ``logging_steps: 1``). Under
  transformers 5 every float is printed as a quoted string rounded to 4 significant digits
  (``{'loss': '0.06496', 'step_time': '0.1134'}``), and the dict often follows a tqdm bar on the
  same line; both shapes are read. When a ``trainer_state.json`` is among the sources its steps
  win and console lines are skipped (same steps, more digits, real step numbers).

Stage times exist only where something logged them: TRL's own ``step_time`` (the micro-steps'
``training_step`` time: no optimizer step, data loading or logging) and, with the rltune
callback, TRL's profiling timers (``profiling/Time taken: GRPOTrainer.<part>``) plus the
``rltune/`` stage times and sample age derived from them. A log without them gives rows with
rewards and losses only, and the report says so.
"""

from __future__ import annotations

import json
import re

from rltune.profile.adapters._text import ParsedLog, clean_line, flatten, literal_dict
from rltune.profile.report import ParseReport

NAME = "trl"
# Keys that mark a dict as a TRL training log rather than any other printed dict.
_MARKERS = ("loss", "grad_norm", "learning_rate", "epoch", "reward", "train_runtime")
# A quoted number as transformers 5 prints it: f"{v:.4g}" of a float ('0.06496', '1e-06', 'nan', '-inf').
_QUOTED_NUMBER = re.compile(r"^[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|nan|inf)$")
# What may precede the dict on its line: nothing, or tqdm bars (' 20%|██        | 1/5 [00:00<00:00,  7.05it/s]').
_BAR_PREFIX = re.compile(r"^\s*(?:.*\d+%\|.*\]\s*)?$")
_STATE_FILE = "trainer_state.json"
_SUMMARY_KEY = "train_runtime"


def _dict_text(line: str) -> str | None:
    """The dict literal of a console line (after any tqdm bar), or None."""
    start = line.find("{'")
    if start < 0 or not _BAR_PREFIX.match(line[:start]):
        return None
    text = line[start:].rstrip()
    return text if text.endswith("}") else None


def _looks_like_trl(text: str | None) -> bool:
    return text is not None and any(f"'{m}'" in text for m in _MARKERS)


def _numbers(value: dict) -> dict:
    """Quoted numbers -> floats ('nan' -> None, so it counts as missing); other values as they are."""
    out = {}
    for key, item in value.items():
        if isinstance(item, str) and _QUOTED_NUMBER.match(item.strip()):
            number = float(item)
            out[key] = None if number != number else number
        elif isinstance(item, dict):
            out[key] = _numbers(item)
        else:
            out[key] = item
    return out


def _state_history(text: str) -> list | None:
    """``log_history`` of a trainer_state.json text, or None if the text is not one."""
    head = text.lstrip()[:1]
    if head != "{" or '"log_history"' not in text:
        return None
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    history = doc.get("log_history") if isinstance(doc, dict) else None
    return history if isinstance(history, list) else None


def claims(text: str) -> int:
    history = _state_history(text)
    if history is not None:
        return sum(1 for entry in history if isinstance(entry, dict) and isinstance(entry.get("step"), int))
    return sum(1 for raw in text.splitlines() if _looks_like_trl(_dict_text(clean_line(raw))))


def _parse_state(history: list, parsed: ParsedLog, report: ParseReport) -> None:
    for entry in history:
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int) or isinstance(entry["step"], bool):
            report.skip("log_history entry without an integer step")
            continue
        if _SUMMARY_KEY in entry:
            report.skip("end-of-training summary, not a step")
            continue
        metrics = flatten({k: v for k, v in entry.items() if k != "step"})
        parsed.add(entry["step"], metrics)
        report.lines_used += 1


def _parse_console(text: str, row: int, parsed: ParsedLog, report: ParseReport, superseded: bool) -> int:
    for raw in text.splitlines():
        report.lines_total += 1
        dict_text = _dict_text(clean_line(raw))
        if dict_text is None:
            continue
        value = literal_dict(dict_text)
        if value is None:
            if _looks_like_trl(dict_text):
                report.skip("truncated or malformed dict line")
            continue
        if not any(m in value for m in _MARKERS):
            continue
        if superseded:
            report.skip(f"console line; {_STATE_FILE} holds the same steps in full precision")
            continue
        if _SUMMARY_KEY in value:
            report.skip("end-of-training summary, not a step")
            continue
        if all(k.startswith("eval_") or k == "epoch" for k in value):
            report.skip("evaluation line: the console gives it no step")
            continue
        row += 1
        parsed.add(row, flatten(_numbers(value)))
        report.lines_used += 1
    return row


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    histories = [(name, history) for name, text in sources if (history := _state_history(text)) is not None]
    for _, history in histories:
        report.lines_total += len(history)
        _parse_state(history, parsed, report)
    row = 0
    for _, text in sources:
        if _state_history(text) is None:
            row = _parse_console(text, row, parsed, report, superseded=bool(histories))
    if not parsed.records:
        return parsed
    keys = {k for rec in parsed.records.values() for k in rec}
    if not any(k.startswith(("profiling/", "rltune/")) or k == "step_time" for k in keys):
        report.note("the log has no step or stage times (TRL logs them only to trackers; attach "
                    "rltune.integrations.trl.TrlStageTimers to put them in the log); rows carry rewards and losses only")
    elif "rltune/step_s" not in keys and "step_time" in keys:
        report.note("step_s is TRL's step_time: the micro-steps' training_step time, without the optimizer step, "
                    "data loading or logging; rollout and training are not split (attach "
                    "rltune.integrations.trl.TrlStageTimers for both)")
    if not histories and row > 1:
        report.note("console rows are numbered 1, 2, ... in order: the lines carry no step number "
                    "(right for logging_steps 1; read trainer_state.json for real step numbers)")
    return parsed
