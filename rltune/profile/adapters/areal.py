"""AReaL: the ``StatsLogger`` console tables, one per training step.

AReaL's ``StatsLogger.commit`` logs (prefixed ``(AReaL) <YYYYmmdd-HH:MM:SS.mmm> StatsLogger INFO:``;
older versions lack the ``(AReaL)``)::

    StatsLogger INFO: Epoch 1/10 Step 3/934 Train step 3/9340 done.
    StatsLogger INFO: Stats (1/1):
    StatsLogger INFO:
    ╒══════════════════════════╤════════════╤═════════════════════════╤════════════╕
    │ ppo_actor/task_reward/avg │ 2.6204e-01 │ timeperf/rollout        │ 8.8992e+01 │
    ├──────────────────────────┼────────────┼─────────────────────────┼────────────┤
    │ timeperf/train_step       │ 3.1464e+01 │ timeperf/update_weights │ 1.0329e+02 │
    ╘══════════════════════════╧════════════╧═════════════════════════╧════════════╛

(``tabulate`` ``fancy_grid``, four key/value pairs a row, values ``.4e``). The step is the
``Train step G/T`` number; a commit of several stats dicts (``Stats (i/n)``) gives steps G .. G+n-1,
as AReaL's own log step does. Every ``key | value`` pair is kept under its name.

Timings are ``timeperf/<phase>`` (``stats_tracker.record_timing``): ``rollout`` (the trainer's wait
in ``prepare_batch`` for a full batch), ``critic_values``, ``recompute_logp``, ``ref_logp``,
``teacher_logp``, ``compute_advantage``, ``train_step``, ``critic_train_step``, ``update_weights``,
``save``, ``checkpoint_for_recover``, ``eval``, ``clear_batches`` and the engines' on/offload. The
trainer runs them one after another and has no step timer, so the step is their sum (marked
derived). A table cut off by the end of the log is skipped and counted; a value that is not a
number is counted and left out.

No public AReaL console log was found; tests/profiling/data/handwritten/areal_stats.log is made in
this exact shape from AReaL's source (areal/utils/stats_logger.py, areal/utils/printing.py).
"""

from __future__ import annotations

import re

from rltune.profile.adapters._text import ParsedLog, clean_line, to_number
from rltune.profile.report import ParseReport

NAME = "areal"
_DONE = re.compile(r"StatsLogger INFO: Epoch \d+/\d+ Step \d+/\d+ Train step (\d+)/(\d+) done\.")
_STATS = re.compile(r"StatsLogger INFO: Stats \((\d+)/(\d+)\):")
_TABLE_TOP = "╒"
_TABLE_BOTTOM = "╘"
_ROW = "│"


def claims(text: str) -> int:
    count = 0
    for raw in text.splitlines():
        line = clean_line(raw)
        if _DONE.search(line) or (line.lstrip().startswith(_ROW) and "timeperf/" in line):
            count += 1
    return count


def _pairs(line: str) -> list[tuple[str, str]]:
    cells = [c.strip() for c in line.strip().strip(_ROW).split(_ROW)]
    return [(cells[i], cells[i + 1]) for i in range(0, len(cells) - 1, 2) if cells[i]]


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    unreadable: list[tuple[int, str, str]] = []
    for _, text in sources:
        train_step: int | None = None
        stats_index = 1
        table: dict[str, float] | None = None
        table_lines = 0
        for raw in text.splitlines():
            report.lines_total += 1
            line = clean_line(raw)
            done = _DONE.search(line)
            if done is not None:
                train_step, stats_index = int(done.group(1)), 1
                continue
            stats = _STATS.search(line)
            if stats is not None:
                stats_index = int(stats.group(1))
                continue
            stripped = line.strip()
            if stripped.startswith(_TABLE_TOP):
                table, table_lines = {}, 1
                continue
            if table is None:
                continue
            table_lines += 1
            if stripped.startswith(_TABLE_BOTTOM):
                if train_step is None:
                    report.skip("stats table without a 'Train step N/M done.' line before it", table_lines)
                else:
                    parsed.add(train_step + stats_index - 1, table)
                    report.lines_used += table_lines
                table = None
            elif stripped.startswith(_ROW):
                step = (train_step or 0) + stats_index - 1
                for key, shown in _pairs(stripped):
                    value = to_number(shown)
                    if value is None:
                        unreadable.append((step, key, shown))
                    else:
                        table[key] = value
        if table is not None:
            report.skip("stats table cut off by the end of the log", table_lines)
    if unreadable:
        step, key, shown = unreadable[0]
        report.note(f"{len(unreadable)} table value{'s' if len(unreadable) != 1 else ''} could not be read "
                    f"as numbers and are not in the table (e.g. step {step} '{key}': {shown!r})")
    return parsed
