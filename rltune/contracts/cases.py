"""cases/: the case library, a Parquet dataset with one file per real run.

Each file holds exactly one row: who the run was (job, model, workload, RL mode, GPU budget and
the model/workload facts the theory model reads), every knob flattened into its own column, the
measured stage medians over the run's non-warm-up steps, and the forecast that was made *before*
the run started, so that evaluation and calibration can compare the two.

Column families (the Parquet schema is the union of these):

- fixed identity/timing columns (table below);
- ``fact.<name>`` -- model and workload facts, float64 (``fact.model_dtype`` is a string);
- ``knob.<name>`` -- one string column per knob holding the value as JSON (``4``, ``true``,
  ``"sync"``), so that a knob keeps one column type across files written years apart;
- ``measured.<column>`` -- mean over the measured steps of each stage-table column
  (``measured.step_s``, ``measured.rollout_s``, ... and whatever finer columns the source had),
  and ``measured.step_median_s``; the fixed column ``statistic`` says 'mean' (older cases, with
  ``statistic`` null, hold medians);
- ``forecast.<field>`` -- the forecast made before the run (null when none was made).

Imported public runs (``origin: public``, :mod:`rltune.predict.public`) are cases too: the setup
their source published, the times and throughput it published (what it lacks stays absent), and
where it was published (``provenance``); a failed or self-contradicting one is kept with the
reason in ``excluded`` and never used to fit or forecast.

The file's key-value metadata carries ``rltune.schema_version`` and ``rltune.artifact=case``.
:func:`read_case_file` validates all of this and raises a located
:class:`~rltune.errors.ArtifactError`; the library reports and skips such a file, never uses it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rltune.contracts.schema import check_parquet_version
from rltune.errors import MalformedFileError, MissingFieldError, WrongTypeError

if TYPE_CHECKING:  # pyarrow loads lazily
    import pyarrow as pa

CASES_SCHEMA_VERSION = 1
META_VERSION = b"rltune.schema_version"
META_ARTIFACT = b"rltune.artifact"
ARTIFACT_NAME = b"case"
STATUSES = ("ok", "failed", "timed_out")

# (name, arrow type, nullable, doc) of the fixed columns, in on-disk order.
FIXED_COLUMNS: list[tuple[str, str, bool, str]] = [
    ("run_id", "string", False, "unique id of the run (one file, one run)"),
    ("job", "string", False, "job name from job.yaml"),
    ("model", "string", False, "model name"),
    ("workload", "string", False, "workload kind (math, coding, tool_use)"),
    ("rl_mode", "string", False, "RL mode the run used (sync | one_step_async | fully_async)"),
    ("gpus", "int64", False, "GPU budget (0: CPU only)"),
    ("device", "string", False, "accelerator kind, e.g. 'H200' or 'cpu'"),
    ("status", "string", False, "ok | failed | timed_out; only 'ok' runs are used to forecast"),
    ("started_at", "float64", False, "unix time the run started"),
    ("finished_at", "float64", False, "unix time the run finished"),
    ("warmup_steps", "int64", False, "first steps left out of the medians"),
    ("measured_steps", "int64", False, "steps the medians are taken over"),
    ("step_noise_frac", "float64", True, "robust relative spread of step_s over the measured steps (1.4826 MAD / median)"),
    ("source", "string", True, "log format the metrics came from"),
    ("statistic", "string", True, "how measured.* summarise the measured steps: 'mean' (null: 'median', cases written before means)"),
    ("origin", "string", True, "where the measurement comes from: 'public' (imported from a public-runs CSV; started_at and "
                               "finished_at are the measurement's time where the source gives one, else 0), null: a run rltune recorded"),
    ("release", "string", True, "software release or commit the measurement belongs to (public runs; forecasts in an evaluation "
                                "use only the same release or earlier ones)"),
    ("provenance", "string", True, "JSON object: where an imported measurement was published (file, row, source, commit, "
                                   "the row's settings and notes as published)"),
    ("excluded", "string", True, "why the case is left out of fits and forecasts (a failed run, numbers that contradict each "
                                 "other); null: the case is used"),
]
FIXED_NAMES = [c[0] for c in FIXED_COLUMNS]
OPTIONAL_COLUMNS = ("step_noise_frac", "source", "statistic", "origin", "release", "provenance", "excluded")  # absent from files written before they existed

# Facts the theory model and the similarity distance read (name, kind, doc).
FACT_COLUMNS: list[tuple[str, str, str]] = [
    ("total_params", "float64", "model total parameters"),
    ("active_params", "float64", "parameters active per token"),
    ("layers", "float64", "transformer layers"),
    ("hidden", "float64", "hidden size"),
    ("kv_heads", "float64", "key/value heads"),
    ("head_dim", "float64", "attention head dimension"),
    ("model_dtype", "string", "weight dtype the engines serve by default"),
    ("moe", "float64", "1 for a mixture-of-experts model"),
    ("tasks_per_batch", "float64", "tasks in one batch"),
    ("trials_per_task", "float64", "trials per task"),
    ("answer_cap_tokens", "float64", "max generated tokens per model turn"),
    ("context_limit_tokens", "float64", "max tokens of a whole trial"),
    ("trainer_gpus", "float64", "GPUs of the trainer in the job's baseline"),
    ("rollout_gpus", "float64", "GPUs of the rollout engines in the job's baseline"),
    ("sequence_tokens", "float64", "mean tokens of one training sequence (prompt + response; a packed sequence where samples "
                                   "are packed), where the source states it"),
    ("tokens_per_step", "float64", "tokens one step trains, where the source states it"),
    ("samples_per_step", "float64", "samples one step generates and trains, where the source gives the total but not "
                                    "tasks x trials"),
]
FACT_KINDS = {name: kind for name, kind, _ in FACT_COLUMNS}

FORECAST_FIELDS: list[tuple[str, str, str]] = [
    ("step_s", "float64", "forecast step time"),
    ("low_s", "float64", "low end of the forecast range"),
    ("high_s", "float64", "high end of the forecast range"),
    ("rollout_s", "float64", "forecast rollout time"),
    ("training_s", "float64", "forecast training time"),
    ("weight_sync_s", "float64", "forecast weight-sync time"),
    ("method", "string", "anchor | similar | theory"),
    ("limiting_stage", "string", "stage forecast to limit the step"),
]
FORECAST_KINDS = {name: kind for name, kind, _ in FORECAST_FIELDS}
REQUIRED_MEASURED = ("step_s", "rollout_s", "training_s", "weight_sync_s")
# An imported public run publishes what its source measured: at least one of these (the rest stays unknown).
PUBLIC_MEASURES = ("step_s", "rollout_s", "training_s", "weight_sync_s", "tokens_per_s_per_gpu", "tokens_per_s_all_gpus")
ORIGINS = ("public",)


@dataclass
class CaseRecord:
    """One real run as the library stores it. ``measured`` values are medians in seconds."""

    run_id: str
    job: str
    model: str
    workload: str
    rl_mode: str
    gpus: int
    device: str
    status: str
    started_at: float
    finished_at: float
    warmup_steps: int
    measured_steps: int
    facts: dict[str, Any] = field(default_factory=dict)
    knobs: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    forecast: dict[str, Any] | None = None
    step_noise_frac: float | None = None
    source: str | None = None
    statistic: str | None = None
    origin: str | None = None
    release: str | None = None
    provenance: dict[str, Any] | None = None
    excluded: str | None = None

    @property
    def step_s(self) -> float:
        return float(self.measured["step_s"])

    @property
    def public(self) -> bool:
        """Imported from a public-runs CSV (another project's measurement), not a run rltune recorded."""
        return self.origin == "public"

    @property
    def usable(self) -> bool:
        """An ok run that is not left out (``excluded``): the cases fits and forecasts use."""
        return self.status == "ok" and not self.excluded

    def validate(self, where: str = "<case>") -> None:
        """Check the record's own rules; raise a located ArtifactError."""
        if not self.run_id:
            raise MissingFieldError(where, "run_id", "empty; every case needs a unique run id")
        if self.status not in STATUSES:
            raise WrongTypeError(where, "status", f"expected one of {', '.join(STATUSES)}, found {self.status!r}")
        if not (math.isfinite(self.started_at) and math.isfinite(self.finished_at)) or self.finished_at < self.started_at:
            raise WrongTypeError(where, "finished_at", f"must be a finite time not before started_at ({self.started_at}), found {self.finished_at}")
        if self.knobs.get("rl_mode", self.rl_mode) != self.rl_mode:
            raise WrongTypeError(where, "knob.rl_mode", f"disagrees with rl_mode ({self.rl_mode!r})")
        for name, value in self.facts.items():
            if name not in FACT_KINDS:
                raise WrongTypeError(where, f"fact.{name}", f"unknown fact; expected one of {', '.join(FACT_KINDS)}")
            if FACT_KINDS[name] == "float64" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise WrongTypeError(where, f"fact.{name}", f"expected a number, found {value!r}")
        for name, value in self.knobs.items():
            if not isinstance(value, (bool, int, float, str)):
                raise WrongTypeError(where, f"knob.{name}", f"expected a number, string or bool, found {type(value).__name__}")
        for name, value in self.measured.items():
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise WrongTypeError(where, f"measured.{name}", f"expected a finite number, found {value!r}")
        if self.origin is not None and self.origin not in ORIGINS:
            raise WrongTypeError(where, "origin", f"expected null or one of {', '.join(ORIGINS)}, found {self.origin!r}")
        if self.provenance is not None and not isinstance(self.provenance, dict):
            raise WrongTypeError(where, "provenance", f"expected a JSON object, found {type(self.provenance).__name__}")
        if self.excluded is not None and not (isinstance(self.excluded, str) and self.excluded.strip()):
            raise WrongTypeError(where, "excluded", "expected the reason the case is left out (a non-empty text) or null")
        if self.status == "ok" and self.public:
            published = [name for name in PUBLIC_MEASURES if self.measured.get(name) is not None]
            if not published:
                raise MissingFieldError(where, "measured", f"an 'ok' public run needs one of {', '.join(PUBLIC_MEASURES)}")
            for name in published:
                if self.measured[name] < 0:
                    raise WrongTypeError(where, f"measured.{name}", f"must not be negative, found {self.measured[name]}")
            if "step_s" in published and self.measured["step_s"] <= 0:
                raise WrongTypeError(where, "measured.step_s", "must be positive for an 'ok' run")
        elif self.status == "ok":
            for name in REQUIRED_MEASURED:
                value = self.measured.get(name)
                if value is None or value < 0:
                    raise MissingFieldError(where, f"measured.{name}", "an 'ok' run needs a non-negative median of every stage")
            if self.measured["step_s"] <= 0:
                raise WrongTypeError(where, "measured.step_s", "must be positive for an 'ok' run")
        if self.forecast is not None:
            for name in self.forecast:
                if name not in FORECAST_KINDS:
                    raise WrongTypeError(where, f"forecast.{name}", f"unknown field; expected one of {', '.join(FORECAST_KINDS)}")


def record_to_row(record: CaseRecord) -> dict[str, Any]:
    """Flatten a record into one row of column -> value (knobs as JSON strings)."""
    row: dict[str, Any] = {name: getattr(record, name) for name in FIXED_NAMES}
    row["provenance"] = None if record.provenance is None else json.dumps(record.provenance, sort_keys=True)
    for name, value in record.facts.items():
        row[f"fact.{name}"] = value if FACT_KINDS.get(name) == "string" else float(value)
    for name, value in record.knobs.items():
        row[f"knob.{name}"] = json.dumps(value)
    for name, value in record.measured.items():
        row[f"measured.{name}"] = None if value is None else float(value)
    for name, value in (record.forecast or {}).items():
        row[f"forecast.{name}"] = value
    return row


def row_to_record(row: dict[str, Any], where: str, *, json_memo: dict[str, Any] | None = None) -> CaseRecord:
    """Rebuild and validate a record from a flat row; nulls in family columns mean 'absent'.

    ``json_memo`` (text -> decoded value) is shared across the rows of one library load: knob
    values repeat, and each distinct text is decoded once. Only immutable values are memoised.
    """
    for name, _, nullable, _ in FIXED_COLUMNS:
        if row.get(name) is None and not nullable:
            raise MissingFieldError(where, name, "missing value")
    facts, knobs, measured, forecast = {}, {}, {}, {}
    for column, value in row.items():
        if value is None or "." not in column:
            continue
        family, name = column.split(".", 1)
        if family == "fact":
            facts[name] = value
        elif family == "knob":
            if json_memo is not None and value in json_memo:
                knobs[name] = json_memo[value]
                continue
            try:
                decoded = json.loads(value)
            except (TypeError, ValueError):
                raise WrongTypeError(where, column, f"expected a JSON value, found {value!r}") from None
            knobs[name] = decoded
            if json_memo is not None and isinstance(decoded, (str, int, float, bool)):
                json_memo[value] = decoded
        elif family == "measured":
            measured[name] = float(value)
        elif family == "forecast":
            forecast[name] = value
        else:
            raise WrongTypeError(where, column, "unknown column family; expected fact., knob., measured. or forecast.")
    fixed = {name: row.get(name) for name in FIXED_NAMES}
    if fixed["provenance"] is not None:
        try:
            fixed["provenance"] = json.loads(fixed["provenance"])
        except (TypeError, ValueError):
            raise WrongTypeError(where, "provenance", f"expected a JSON object, found {fixed['provenance']!r}") from None
    record = CaseRecord(**fixed, facts=facts, knobs=knobs, measured=measured, forecast=forecast or None)
    record.validate(where)
    return record


def _arrow_type(kind: str) -> pa.DataType:
    import pyarrow as pa

    return {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64()}[kind]


def column_type(column: str) -> str:
    """The arrow kind ('string', 'int64', 'float64') a column must have."""
    for name, kind, _, _ in FIXED_COLUMNS:
        if name == column:
            return kind
    family, _, name = column.partition(".")
    if family == "fact":
        return FACT_KINDS.get(name, "float64")
    if family == "knob":
        return "string"
    if family == "measured":
        return "float64"
    if family == "forecast":
        return FORECAST_KINDS.get(name, "string")
    return "string"


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Arrow table of flat rows; the schema is the union of the rows' columns, in family order."""
    import pyarrow as pa

    columns = list(FIXED_NAMES)
    for row in rows:
        for column in row:
            if column not in columns:
                columns.append(column)
    order = {"fact": 1, "knob": 2, "measured": 3, "forecast": 4}
    columns = FIXED_NAMES + sorted((c for c in columns if c not in FIXED_NAMES),
                                   key=lambda c: (order.get(c.split(".", 1)[0], 9), c))
    arrays = {c: pa.array([row.get(c) for row in rows], type=_arrow_type(column_type(c))) for c in columns}
    table = pa.table(arrays)
    return table.replace_schema_metadata({META_VERSION: str(CASES_SCHEMA_VERSION).encode(), META_ARTIFACT: ARTIFACT_NAME})


def record_to_table(record: CaseRecord) -> pa.Table:
    record.validate(record.run_id)
    return rows_to_table([record_to_row(record)])


def validate_table(table: pa.Table, where: str, *, one_row: bool = True) -> None:
    """Check metadata, row count and column types of a case table."""
    meta = table.schema.metadata or {}
    check_parquet_version(meta, where, CASES_SCHEMA_VERSION, "write cases with CaseLibrary.append")
    if meta.get(META_ARTIFACT) != ARTIFACT_NAME:
        raise WrongTypeError(where, "artifact", f"not a case file (rltune.artifact={meta.get(META_ARTIFACT)!r})")
    if one_row and table.num_rows != 1:
        raise MalformedFileError(where, "", f"a case file holds exactly one run, found {table.num_rows} rows")
    for column in table.column_names:
        expected = _arrow_type(column_type(column))
        if table.schema.field(column).type != expected:
            raise WrongTypeError(where, column, f"expected column type {expected}, found {table.schema.field(column).type}")
    for name, kind, _, _ in FIXED_COLUMNS:
        if name not in table.column_names and name not in OPTIONAL_COLUMNS:
            raise MissingFieldError(where, name, f"missing column ({kind})")


def read_case_file(path: str | os.PathLike) -> CaseRecord:
    """Read and validate one case file; raise a located ArtifactError if it is unusable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = str(path)
    try:
        with pq.ParquetFile(where) as handle:  # not pq.read_table: that imports pyarrow.dataset and pandas (~1 s)
            table = handle.read()
    except FileNotFoundError:
        raise MalformedFileError(where, "", "no such file; check the path") from None
    except (pa.ArrowException, OSError) as exc:
        raise MalformedFileError(where, "", f"not a readable Parquet file ({exc}); delete it and record the run again") from None
    validate_table(table, where)
    return row_to_record(table.to_pylist()[0], where)


def describe_columns() -> str:
    """Markdown table of the case columns, for docs/artifacts.md."""
    lines = ["| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{n}` | {k}{'' if nullable else ', required'} | {d} |" for n, k, nullable, d in FIXED_COLUMNS]
    lines += [f"| `fact.{n}` | {k} | {d} |" for n, k, d in FACT_COLUMNS]
    lines.append("| `knob.<name>` | string (JSON) | value of each abstract knob, e.g. `4`, `true`, `\"sync\"` |")
    lines.append("| `measured.<column>` | float64 | mean over the measured steps of each stage-table column (median in cases whose `statistic` is null), and `step_median_s` (`step_s`, `rollout_s`, `training_s`, `weight_sync_s` required for ok runs); an imported public run holds what its source published and nothing else: at least one of `step_s`, `rollout_s`, `training_s`, `weight_sync_s`, `tokens_per_s_per_gpu`, `tokens_per_s_all_gpus` |")
    lines += [f"| `forecast.{n}` | {k} | {d} (made before the run; null if none) |" for n, k, d in FORECAST_FIELDS]
    return "\n".join(lines)


__all__ = [
    "CASES_SCHEMA_VERSION",
    "FACT_COLUMNS",
    "CaseRecord",
    "STATUSES",
    "describe_columns",
    "read_case_file",
    "record_to_row",
    "record_to_table",
    "row_to_record",
    "rows_to_table",
    "validate_table",
]
