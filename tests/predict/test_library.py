"""The case library: atomic, exactly-once appends; corrupt or half-written files reported and skipped.

Cases here are hand-made (see predict_casekit); they test the file behaviour, not timings.
"""

from __future__ import annotations

import os
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from predict_casekit import make_case

from rltune.contracts.cases import CASES_SCHEMA_VERSION, describe_columns, read_case_file, record_to_table
from rltune.contracts.stages import rows_to_table
from rltune.errors import ArtifactError, MalformedFileError, WrongTypeError
from rltune.predict.library import (
    INDEX_NAME,
    CaseDataError,
    CaseLibrary,
    CorruptCaseError,
    CorruptCaseWarning,
    DuplicateCaseError,
    case_file_name,
    case_from_run,
)


def test_append_then_load_round_trips_every_field(tmp_path):
    lib = CaseLibrary(tmp_path / "cases")
    case = make_case("r/1 weird:id", rollout=1.5, training=2.0, weight_sync=0.25, knobs={"packing": True, "rl_mode": "one_step_async"},
                     forecast={"step_s": 2.3, "low_s": 2.0, "high_s": 2.6, "method": "anchor"})
    assert lib.append(case) is True
    assert lib.has("r/1 weird:id") and not lib.has("r/2")
    [back] = lib.load()
    assert back == case
    assert back.knobs["packing"] is True and back.knobs["micro_batch_size"] == 8 and back.knobs["rl_mode"] == "one_step_async"
    assert [p.name for p in (tmp_path / "cases").iterdir() if not p.name.startswith("_")] == [case_file_name("r/1 weird:id")]


def test_same_run_twice_is_idempotent_and_a_different_one_is_refused(tmp_path):
    lib = CaseLibrary(tmp_path)
    case = make_case("r1", rollout=1, training=2, weight_sync=0.1)
    assert lib.append(case) is True
    assert lib.append(make_case("r1", rollout=1, training=2, weight_sync=0.1)) is False
    with pytest.raises(DuplicateCaseError, match="r1"):
        lib.append(make_case("r1", rollout=1, training=3, weight_sync=0.1))
    assert len(lib.load()) == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "two_rows", "no_version", "bad_knob_json", "wrong_type"])
def test_a_corrupt_case_file_refuses_the_library_naming_it(tmp_path, damage):
    lib = CaseLibrary(tmp_path)
    lib.append(make_case("good", rollout=1, training=2, weight_sync=0.1))
    bad = tmp_path / case_file_name("bad")
    table = record_to_table(make_case("bad", rollout=1, training=2, weight_sync=0.1))
    if damage in ("truncated", "garbage", "empty"):
        pq.write_table(table, bad)
        data = bad.read_bytes()
        bad.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"PAR1" + os.urandom(64), "empty": b""}[damage])
    elif damage == "two_rows":
        pq.write_table(pa.concat_tables([table, table]), bad)
    elif damage == "no_version":
        pq.write_table(table.replace_schema_metadata({}), bad)
    elif damage == "bad_knob_json":
        i = table.column_names.index("knob.packing")
        pq.write_table(table.set_column(i, "knob.packing", pa.array(["{not json"])), bad)
    else:
        i = table.column_names.index("measured.step_s")
        pq.write_table(table.set_column(i, "measured.step_s", pa.array(["fast"])), bad)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith("_")}
    with pytest.raises(CorruptCaseError, match=f"{bad.name}.*move it out of the library"):
        lib.load()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith("_")} == before
    bad.unlink()                                          # moved out, as the message says: the library loads again
    assert [c.run_id for c in lib.load()] == ["good"]


def test_interrupted_append_leaves_only_a_hidden_temp_file_that_is_never_read(tmp_path):
    lib = CaseLibrary(tmp_path)
    lib.append(make_case("a", rollout=1, training=2, weight_sync=0.1))
    (tmp_path / f".{case_file_name('b')}.x.tmp").write_bytes(b"PAR1 half written")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [c.run_id for c in lib.load()] == ["a"]
    assert not lib.has("b")


def test_load_before_keeps_runs_finished_by_then_oldest_first(tmp_path):
    lib = CaseLibrary(tmp_path)
    for name, t in (("late", 500.0), ("early", 0.0), ("mid", 200.0)):
        lib.append(make_case(name, rollout=1, training=2, weight_sync=0.1, t=t))  # finished_at = t + 60
    assert [c.run_id for c in lib.load()] == ["early", "mid", "late"]
    assert [c.run_id for c in lib.load(before=260.0)] == ["early", "mid"]
    assert [c.run_id for c in lib.load(before=259.9)] == ["early"]
    assert lib.load(before=0.0) == []


def test_index_is_a_cache_rebuilt_when_files_change_or_it_is_corrupt(tmp_path):
    lib = CaseLibrary(tmp_path)
    for i in range(5):
        lib.append(make_case(f"r{i}", rollout=1, training=2 + i, weight_sync=0.1, t=i))
    first = lib.load()
    assert (tmp_path / INDEX_NAME).exists()
    assert lib.load() == first
    lib.append(make_case("r9", rollout=1, training=9, weight_sync=0.1, t=9))
    assert [c.run_id for c in lib.load()] == [c.run_id for c in first] + ["r9"]
    (tmp_path / INDEX_NAME).write_bytes(b"junk")
    with pytest.warns(CorruptCaseWarning, match="index"):
        assert len(lib.load()) == 6
    os.unlink(tmp_path / case_file_name("r0"))
    assert [c.run_id for c in lib.load()] == ["r1", "r2", "r3", "r4", "r9"]


def test_renamed_case_file_is_refused(tmp_path):
    lib = CaseLibrary(tmp_path)
    lib.append(make_case("a", rollout=1, training=2, weight_sync=0.1))
    os.rename(tmp_path / case_file_name("a"), tmp_path / "copy.parquet")
    with pytest.raises(CorruptCaseError, match="copy.parquet: holds run 'a'.*renamed by hand"):
        lib.load()


def test_read_case_file_rejects_a_newer_schema(tmp_path):
    table = record_to_table(make_case("a", rollout=1, training=2, weight_sync=0.1))
    meta = dict(table.schema.metadata)
    meta[b"rltune.schema_version"] = str(CASES_SCHEMA_VERSION + 1).encode()
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "a.parquet")
    with pytest.raises(ArtifactError, match="newer rltune"):
        read_case_file(tmp_path / "a.parquet")


def test_ok_case_needs_every_stage_median():
    case = make_case("a", rollout=1, training=2, weight_sync=0.1)
    del case.measured["weight_sync_s"]
    with pytest.raises(ArtifactError, match="measured.weight_sync_s"):
        case.validate("a")
    failed = make_case("b", rollout=1, training=2, weight_sync=0.1, status="failed")
    failed.measured = {}
    failed.validate("b")


def test_case_from_run_takes_means_over_the_same_non_warmup_steps_and_the_median_beside(tmp_path):
    from rltune.contracts.job import load_job

    job = load_job("presets/cpu-demo.yaml")
    rows = [{"run_id": "r", "step": s, "warmup": s == 0, "step_s": st, "rollout_s": ro, "training_s": tr, "weight_sync_s": ws,
             "gen_tokens": g} for s, st, ro, tr, ws, g in [(0, 99.0, 90.0, 9.0, 1.0, 5.0), (1, 3.0, 1.0, 1.8, 0.2, 10.0),
                                                           (2, 3.2, 1.2, 1.8, 0.2, 12.0), (3, 2.9, 0.9, 1.8, 0.2, 11.0)]]
    table = rows_to_table(rows, "rltune")
    case = case_from_run(job, {"micro_batch_size": 4}, table, "r", 10.0, 20.0, "ok", None, warmup_steps=1)
    assert case.measured["step_s"] == pytest.approx(9.1 / 3) and case.measured["step_median_s"] == 3.0
    assert case.measured["rollout_s"] == pytest.approx(3.1 / 3) and case.measured["gen_tokens"] == 11.0
    assert case.statistic == "mean" and case.measured_steps == 3 and case.knobs["micro_batch_size"] == 4 and case.knobs["rl_mode"] == "sync"
    assert "engine_queue_s" not in case.measured  # null column: absent, never 0
    assert case.facts["tasks_per_batch"] == 8.0 and case.source == "rltune"
    with pytest.raises(CaseDataError, match="no measured steps"):
        case_from_run(job, {}, table, "r", 10.0, 20.0, "ok", None, warmup_steps=4)
    holes = rows_to_table([{**rows[1], "rollout_s": None}, rows[2]], "rltune")
    with pytest.raises(CaseDataError, match="rollout_s"):
        case_from_run(job, {}, holes, "r", 10.0, 20.0, "ok", None, warmup_steps=0)


def test_describe_columns_documents_each_family():
    text = describe_columns()
    for name in ("`run_id`", "`knob.<name>`", "`measured.<column>`", "`forecast.step_s`", "`fact.active_params`"):
        assert name in text


def test_unknown_status_is_a_located_error():
    case = make_case("a", rollout=1, training=2, weight_sync=0.1)
    case.status = "done"
    with pytest.raises(WrongTypeError, match="status"):
        case.validate("a.parquet")
    assert issubclass(MalformedFileError, ArtifactError)
