"""stages.parquet: one row per (run, step) with the step's time and its stages.

The core columns are fixed (below). A source with finer or other measurements keeps them as extra
columns: numeric extras are float64, named as the source named them (``/`` kept). The Parquet
file's key-value metadata carries ``rltune.schema_version`` and ``rltune.source`` (the log format).

Times are seconds. A value the source does not have is null, never 0.

Validation (:func:`stage_value_problem`, applied where rows are built from a log and again by
:func:`read_stages`): a core time (a ``*_s`` column) is finite, at least 0 and at most
:data:`MAX_STAGE_S`; a count, age, gap or fraction (``gen_tokens``, ``trials_*``, ``sample_age_*``,
``gap``, ``*_frac``, ...) is finite and at least 0. ``reward`` and the extra columns are the source's
own and may be negative. A value that breaks a rule is refused naming the file, the step and the
column; only a log format where a missing value is written as NaN has it reported and left null
(never diagnosed).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.contracts.schema import check_parquet_version
from rltune.errors import MalformedFileError, MeasurementError, MissingFieldError, WrongTypeError

if TYPE_CHECKING:  # pyarrow is imported lazily: the CLI's start-up must not pay for it
    import pyarrow as pa

STAGES_SCHEMA_VERSION = 1
META_VERSION = b"rltune.schema_version"
META_SOURCE = b"rltune.source"

# (name, arrow type, doc). Order is the column order on disk.
CORE_COLUMNS: list[tuple[str, str, str]] = [
    ("run_id", "string", "run this row belongs to"),
    ("step", "int64", "training step as the source numbers it"),
    ("warmup", "bool", "true for warm-up steps: kept, but left out of medians"),
    ("step_s", "float64", "wall time of the whole step"),
    ("rollout_s", "float64", "generating the batch's trials (engines + environments)"),
    ("training_s", "float64", "policy update: forward, backward, optimizer"),
    ("weight_sync_s", "float64", "publishing new weights and the engines taking them"),
    ("old_logprob_s", "float64", "separate pass recomputing old (and reference) log-probs"),
    ("wait_s", "float64", "time the trainer waited for a batch"),
    ("engine_queue_s", "float64", "mean time a request waited before reaching the GPU"),
    ("engine_prefill_s", "float64", "mean prefill time per request"),
    ("engine_decode_s", "float64", "mean decode time per request"),
    ("engine_preemptions", "float64", "requests preempted during the step"),
    ("kv_cache_usage", "float64", "peak KV-cache usage fraction"),
    ("gen_tokens", "float64", "tokens generated in the step"),
    ("sandbox_setup_s", "float64", "mean sandbox setup time per trial"),
    ("sandbox_exec_s", "float64", "mean sandbox execution time per trial"),
    ("trainer_busy_frac", "float64", "fraction of training time the trainer's device was busy"),
    ("padding_frac", "float64", "fraction of trained tokens that were padding"),
    ("gap", "float64", "trainer-rollout gap: mean |logp_train - logp_rollout| over generated tokens"),
    ("sample_age_mean", "float64", "mean age of the batch's samples, in weight versions"),
    ("sample_age_max", "float64", "oldest sample of the batch, in weight versions"),
    ("trials_total", "float64", "trials in the batch"),
    ("trials_cut_off", "float64", "trials cut off at the time-out"),
    ("trials_failed", "float64", "trials that failed"),
    ("reward", "float64", "mean reward of the batch"),
]
CORE_NAMES = [name for name, _, _ in CORE_COLUMNS]
STAGE_COLUMNS = ("rollout_s", "training_s", "weight_sync_s")
# Core columns holding seconds, and those holding counts, ages, gaps and fractions: never negative.
TIME_COLUMNS = tuple(name for name, kind, _ in CORE_COLUMNS if kind == "float64" and name.endswith("_s"))
NONNEGATIVE_COLUMNS = tuple(name for name, kind, _ in CORE_COLUMNS
                            if kind == "float64" and not name.endswith("_s") and name != "reward")
# A step or stage longer than this (about 116 days) is a unit or logging error, not a measurement.
MAX_STAGE_S = 1e7


def stage_value_problem(column: str, value: Any) -> str | None:
    """What is wrong with ``value`` in core column ``column`` (None: nothing, or not a checked column).

    A NaN is reported as such; whether it is refused or read as a missing value is the caller's
    choice (see the module docstring).
    """
    if column not in TIME_COLUMNS and column not in NONNEGATIVE_COLUMNS:
        return None
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if math.isnan(value):
        return "is NaN; a measured value is a number (leave the key out where the job did not measure it)"
    unit = " s" if column in TIME_COLUMNS else ""
    if math.isinf(value):
        return f"is {'' if value > 0 else 'minus '}infinity; a measured value is finite: check how the job computes it"
    if value < 0:
        return (f"is {value:g}{unit}, negative; a {'time' if unit else 'count, age or fraction'} is never negative: "
                "check how the job measures it")
    if column in TIME_COLUMNS and value > MAX_STAGE_S:
        return (f"is {value:g} s, more than {MAX_STAGE_S:g} s (116 days); check the unit the job logs it in "
                "(milliseconds, nanoseconds?)")
    return None


def check_stage_row(row: dict[str, Any], file: str, rules: dict[str, str] | None = None) -> None:
    """Refuse a row whose core values break :func:`stage_value_problem`; ``rules`` says how a derived
    column was computed (column -> stage-map rule), for the message."""
    for column in (*TIME_COLUMNS, *NONNEGATIVE_COLUMNS):
        problem = stage_value_problem(column, row.get(column))
        if problem is not None:
            rule = (rules or {}).get(column)
            if rule and rule != column:
                problem = problem.replace("; ", f" (from {rule}); ", 1)
            raise MeasurementError(file, row.get("step"), column, problem)


def _arrow_type(name: str) -> pa.DataType:
    import pyarrow as pa

    return {"string": pa.string(), "int64": pa.int64(), "bool": pa.bool_(), "float64": pa.float64()}[name]


def stages_schema(extra_columns: list[str] = ()) -> pa.Schema:
    """The Arrow schema of a stage table with the given extra (float64) columns."""
    import pyarrow as pa

    fields = [pa.field(name, _arrow_type(kind), nullable=name not in ("run_id", "step", "warmup"))
              for name, kind, _ in CORE_COLUMNS]
    fields += [pa.field(name, pa.float64()) for name in extra_columns if name not in CORE_NAMES]
    return pa.schema(fields)


def rows_to_table(rows: list[dict[str, Any]], source: str) -> pa.Table:
    """Build a stage table from row dicts. Missing core values become null; unknown numeric keys extras."""
    import pyarrow as pa

    extras: list[str] = []
    for row in rows:
        for key, value in row.items():
            if key not in CORE_NAMES and key not in extras and _is_number(value):
                extras.append(key)
    schema = stages_schema(extras)
    columns = {}
    for f in schema:
        values = [row.get(f.name) for row in rows]
        if f.name not in ("run_id", "step", "warmup"):
            values = [None if v is None or not _is_number(v) else float(v) for v in values]
        columns[f.name] = pa.array(values, type=f.type)
    table = pa.table(columns, schema=schema)
    return table.replace_schema_metadata({META_VERSION: str(STAGES_SCHEMA_VERSION).encode(), META_SOURCE: source.encode()})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def write_stages(table: pa.Table, path: str | os.PathLike) -> None:
    """Write a stage table atomically (temp file + rename)."""
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_stages(path: str | os.PathLike) -> pa.Table:
    """Read and validate a stage table: version, core columns present with their types."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise MalformedFileError(path, "", "no such file; check the path") from None
    except (pa.ArrowException, OSError) as exc:
        raise MalformedFileError(path, "", f"not a readable Parquet file ({exc}); re-create it with 'rltune profile'") from None
    check_parquet_version(table.schema.metadata, path, STAGES_SCHEMA_VERSION, "write it with rltune")
    for name, kind, _ in CORE_COLUMNS:
        if name not in table.column_names:
            raise MissingFieldError(path, name, f"missing column ({kind})")
        if table.schema.field(name).type != _arrow_type(kind):
            raise WrongTypeError(path, name, f"expected column type {kind}, found {table.schema.field(name).type}")
    _check_values(table, path)
    return table


def _check_values(table: pa.Table, path: str) -> None:
    """Refuse a stored table whose core values break :func:`stage_value_problem` (a NaN too: rltune
    writes a missing value as null)."""
    import pyarrow.compute as pc

    for column in (*TIME_COLUMNS, *NONNEGATIVE_COLUMNS):
        values = table.column(column)
        bad = pc.or_(pc.or_(pc.is_nan(values), pc.is_inf(values)), pc.less(values, 0.0))
        if column in TIME_COLUMNS:
            bad = pc.or_(bad, pc.greater(values, MAX_STAGE_S))
        if not pc.any(bad).as_py():
            continue
        index = pc.index(bad, True).as_py()
        step = table.column("step")[index].as_py()
        raise MeasurementError(path, step, column, stage_value_problem(column, values[index].as_py()))


def source_of(table: pa.Table) -> str:
    return (table.schema.metadata or {}).get(META_SOURCE, b"unknown").decode()


def describe_columns() -> str:
    """Markdown table of the core columns, for docs/artifacts.md."""
    lines = ["| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{n}` | {k} | {d} |" for n, k, d in CORE_COLUMNS]
    return "\n".join(lines)


__all__ = [
    "CORE_COLUMNS",
    "CORE_NAMES",
    "STAGES_SCHEMA_VERSION",
    "MAX_STAGE_S",
    "NONNEGATIVE_COLUMNS",
    "STAGE_COLUMNS",
    "TIME_COLUMNS",
    "check_stage_row",
    "describe_columns",
    "read_stages",
    "rows_to_table",
    "source_of",
    "stage_value_problem",
    "stages_schema",
    "write_stages",
]
