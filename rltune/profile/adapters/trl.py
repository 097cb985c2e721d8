"""TRL: the Trainer's console dict lines ``{'loss': ..., 'reward': ..., 'epoch': ...}``.

TRL prints one Python dict per logging step with no step number; rows are numbered 1, 2, ... in
order (the trainer's ``logging_steps`` is not in the line). Stage times exist only when the trainer
records its profiling metrics (``profiling/Time taken: GRPOTrainer.<part>``); a log without them
gives rows with rewards but no times, and the report says so. The end-of-training summary
(``train_runtime``, ...) is not a step and is skipped.
"""

from __future__ import annotations

from rltune.profile.adapters._text import ParsedLog, clean_line, flatten, literal_dict
from rltune.profile.report import ParseReport

NAME = "trl"
# Keys that mark a dict as a TRL training log rather than any other printed dict.
_MARKERS = ("loss", "grad_norm", "learning_rate", "epoch", "reward", "train_runtime")


def _looks_like_trl(line: str) -> bool:
    return line.startswith("{'") and line.rstrip().endswith("}") and any(f"'{m}'" in line for m in _MARKERS)


def claims(text: str) -> int:
    return sum(1 for raw in text.splitlines() if _looks_like_trl(clean_line(raw).strip()))


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    row = 0
    for _, text in sources:
        for raw in text.splitlines():
            report.lines_total += 1
            line = clean_line(raw).strip()
            if not line.startswith("{'"):
                continue
            value = literal_dict(line)
            if value is None:
                report.skip("truncated or malformed dict line")
                continue
            if "train_runtime" in value:
                report.skip("end-of-training summary, not a step")
                continue
            row += 1
            parsed.add(row, flatten(value))
            report.lines_used += 1
    if parsed.records and not any(k.startswith("profiling/") or k == "step_time"
                                  for rec in parsed.records.values() for k in rec):
        report.note("the log has no step or stage times (TRL logs them as 'profiling/Time taken: ...'); "
                    "rows carry rewards and losses only")
    return parsed
