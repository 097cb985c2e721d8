"""stages.parquet reads back with pyarrow and pandas, and a newer version is refused."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltune.contracts.stages import (
    CORE_NAMES,
    STAGES_SCHEMA_VERSION,
    read_stages,
    rows_to_table,
    source_of,
    write_stages,
)
from rltune.errors import MalformedFileError, MissingFieldError, SchemaVersionError, WrongTypeError


def rows():
    return [
        {"run_id": "r1", "step": 1, "warmup": True, "step_s": 10.0, "rollout_s": 6.0, "training_s": 3.0,
         "weight_sync_s": 1.0, "timing_s/reshard": 0.25},
        {"run_id": "r1", "step": 2, "warmup": False, "step_s": 9.5, "rollout_s": 5.5, "training_s": 3.0,
         "weight_sync_s": 1.0, "timing_s/reshard": 0.5, "note": "text values are dropped"},
    ]


def test_written_table_reads_back_with_pyarrow_and_pandas(tmp_path):
    path = tmp_path / "stages.parquet"
    write_stages(rows_to_table(rows(), source="verl"), path)
    table = read_stages(path)
    assert table.column_names[: len(CORE_NAMES)] == CORE_NAMES
    assert table.column_names[len(CORE_NAMES):] == ["timing_s/reshard"]
    assert table.schema.metadata[b"rltune.schema_version"] == str(STAGES_SCHEMA_VERSION).encode()
    assert source_of(table) == "verl"
    frame = pq.read_table(path).to_pandas()
    assert frame["step_s"].tolist() == [10.0, 9.5]
    assert frame["timing_s/reshard"].tolist() == [0.25, 0.5]
    assert frame["gap"].isna().all()  # absent means null, never 0


def test_newer_version_is_refused(tmp_path):
    table = rows_to_table(rows(), source="rltune")
    table = table.replace_schema_metadata({b"rltune.schema_version": b"99", b"rltune.source": b"rltune"})
    path = tmp_path / "stages.parquet"
    pq.write_table(table, path)
    with pytest.raises(SchemaVersionError, match="newer rltune"):
        read_stages(path)


def test_missing_core_column_is_named(tmp_path):
    table = rows_to_table(rows(), source="rltune").drop(["rollout_s"])
    path = tmp_path / "s.parquet"
    pq.write_table(table, path)
    with pytest.raises(MissingFieldError, match="rollout_s: missing column"):
        read_stages(path)


def test_wrong_column_type_is_named(tmp_path):
    table = rows_to_table(rows(), source="rltune")
    i = table.column_names.index("step")
    table = table.set_column(i, pa.field("step", pa.string()), pa.array(["1", "2"]))
    path = tmp_path / "s.parquet"
    pq.write_table(table, path)
    with pytest.raises(WrongTypeError, match="step: expected column type int64"):
        read_stages(path)


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "stages.parquet"
    write_stages(rows_to_table(rows(), source="rltune"), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MalformedFileError, match="not a readable Parquet file"):
        read_stages(path)


def test_unversioned_parquet_is_refused(tmp_path):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"step": [1]}), path)
    with pytest.raises(MissingFieldError, match="schema_version"):
        read_stages(path)
