"""Build a stage table from a framework's logs: read, detect the format, parse, map to core columns.

Public API: :func:`stage_table_from_logs` (path, format='auto', run_id=None) -> (table, ParseReport).

Every row is checked where it is built (:func:`rltune.contracts.stages.check_stage_row`): a negative,
infinite or absurd (> 1e7 s) core time is refused naming the log, the step and the column. A NaN
time is refused in the rltune format (which leaves unmeasured values out) and elsewhere reported
and left null, never diagnosed.
``path`` may be one file or a directory (every regular file under it, in name order — e.g. a
prime-rl output folder with trainer/ and orchestrator/ metrics, or a folder of benchmark results).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rltune.errors import LogFormatError
from rltune.profile.adapters import ADAPTERS
from rltune.profile.report import ParseReport
from rltune.profile.stage_map import map_metrics

if TYPE_CHECKING:
    import pyarrow as pa

MAX_LOG_BYTES = 2 * 1024**3  # refuse to slurp more than this; a bigger log should be cut to the steps of interest
# A few stray lines of another format (a printed dict in a verl log) are not a mix; this share is.
MIXED_FORMAT_SHARE = 0.2
# Formats that leave an unmeasured value out: a NaN time there is a broken measurement, refused.
# Elsewhere (verl's console, TRL's dicts) NaN is how a step without that timer is printed.
NAN_IS_REFUSED = frozenset({"rltune"})


def _read_sources(path: Path) -> list[tuple[str, str]]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise LogFormatError(f"{path}: the directory holds no files; point --from-logs at a log file")
    elif path.is_file():
        files = [path]
    else:
        raise LogFormatError(f"{path}: no such file or directory; check the --from-logs path")
    total = sum(os.path.getsize(p) for p in files)
    if total > MAX_LOG_BYTES:
        raise LogFormatError(f"{path}: {total / 1e9:.1f} GB of logs; cut them to the steps you need (e.g. with tail)")
    return [(str(p), p.read_text(encoding="utf-8", errors="replace")) for p in files]


def detect_format(sources: list[tuple[str, str]], path: str = "") -> tuple[str, list[tuple[str, str]], list[str]]:
    """(format, the sources in it, names of sources of no known format). Raises on no format or a mix."""
    per_source: list[tuple[str, dict[str, int]]] = []
    totals: dict[str, int] = {}
    for name, text in sources:
        counts = {fmt: n for fmt, adapter in ADAPTERS.items() if (n := adapter.claims(text)) > 0}
        per_source.append((name, counts))
        for fmt, n in counts.items():
            totals[fmt] = totals.get(fmt, 0) + n
    if not totals:
        raise LogFormatError(f"{path}: no recognisable step in any line of a known format "
                             f"({', '.join(ADAPTERS)}); pass --format if you know it, or check the file")
    best = max(totals, key=totals.get)
    others = {fmt: n for fmt, n in totals.items() if fmt != best and n >= MIXED_FORMAT_SHARE * totals[best]}
    if others:
        mix = ", ".join(f"{fmt} ({n} lines)" for fmt, n in [(best, totals[best]), *others.items()])
        raise LogFormatError(f"{path}: mixed formats: {mix}; split the log per format or pass --format")
    chosen = [(name, text) for (name, text), (_, counts) in zip(sources, per_source, strict=True) if best in counts]
    unknown = [name for (name, _), (_, counts) in zip(sources, per_source, strict=True) if not counts]
    return best, chosen, unknown


def stage_table_from_logs(path: str | os.PathLike, format: str = "auto", run_id: str | None = None,
                          warmup_steps: int = 0) -> tuple[pa.Table, ParseReport]:
    """Parse logs at ``path`` into a stage table; ``warmup_steps`` first steps are marked warm-up."""
    from rltune.contracts.stages import check_stage_row, rows_to_table

    path = Path(path)
    sources = _read_sources(path)
    if format == "auto":
        fmt, chosen, unknown = detect_format(sources, str(path))
    elif format in ADAPTERS:
        fmt, chosen, unknown = format, sources, []
    else:
        raise LogFormatError(f"unknown log format {format!r}; expected auto or one of {', '.join(ADAPTERS)}")
    report = ParseReport(format=fmt, path=str(path))
    for name in unknown:
        report.note(f"ignored {Path(name).name}: no known log format")
    parsed = ADAPTERS[fmt].parse(chosen, report)
    if not parsed.records:
        reasons = "; ".join(report.warnings) or "no line matched"
        raise LogFormatError(f"{path}: no recognisable {fmt} step in {report.lines_total} lines ({reasons}); "
                             f"check --format (auto detects {', '.join(ADAPTERS)})")
    base_id = run_id or path.stem
    rows = []
    nonfinite_core: dict[str, list[tuple[int, float, str]]] = {}
    nonfinite_extra: list[tuple[int, str]] = []
    for index, step in enumerate(sorted(parsed.records)):
        metrics = parsed.records[step]
        core, used = map_metrics(fmt, metrics)
        for column, rule in used.items():
            report.derived.setdefault(column, rule)
            if math.isnan(core[column]) and fmt not in NAN_IS_REFUSED:
                # Where a log writes a value it did not measure as NaN, the column is null and the
                # report says so; the value is never diagnosed.
                nonfinite_core.setdefault(column, []).append((int(step), core[column], rule))
                core[column] = None
        row: dict = {}
        for key, value in metrics.items():
            if key in core or key == "warmup":
                continue
            if isinstance(value, float) and not math.isfinite(value):
                nonfinite_extra.append((int(step), key))
                value = None
            row[key] = value
        row.update(core)
        row["run_id"] = parsed.run_ids.get(step, base_id) if run_id is None else run_id
        row["step"] = int(step)
        row["warmup"] = bool(metrics.get("warmup", 0.0)) or index < warmup_steps
        check_stage_row(row, str(path), used)  # a negative, infinite or absurd time: file, step, column
        rows.append(row)
    for column, cases in nonfinite_core.items():
        step, value, rule = cases[0]
        report.note(f"{column} is {value} in the log at {len(cases)} step{'s' if len(cases) != 1 else ''} "
                    f"(e.g. step {step}, from {rule}): left null there, not used in medians")
    if nonfinite_extra:
        step, key = nonfinite_extra[0]
        many = len(nonfinite_extra) != 1
        report.note(f"{len(nonfinite_extra)} source value{'s are' if many else ' is'} NaN or infinite in the log "
                    f"(e.g. step {step} '{key}'): null in the table")
    report.steps = len(rows)
    if report.derived.get("step_s", "").startswith("sum("):
        report.note(f"step_s is derived: {report.derived['step_s']} (this log has no step timer)")
    if not any(c in report.derived for c in ("step_s", "rollout_s", "training_s", "weight_sync_s")):
        report.note("no step or stage time in this log: the table cannot be diagnosed")
    return rows_to_table(rows, source=fmt), report
