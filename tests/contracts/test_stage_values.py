"""Impossible measurements are refused where stage rows are built and where they are read back.

A negative, infinite or absurd (> 1e7 s) time, or a negative count, is refused naming the file,
the step and the column; a NaN is refused in the rltune format (which leaves an unmeasured value
out) and, in a log that prints an unmeasured timer as NaN, reported and left null.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from rltune.cli.main import main
from rltune.contracts.stages import MAX_STAGE_S, read_stages, rows_to_table, write_stages
from rltune.errors import MeasurementError
from rltune.profile import stage_table_from_logs

from .conftest import VERL_LOG

GOOD = {"step_s": 1.0, "rollout_s": 0.5, "training_s": 0.3, "weight_sync_s": 0.2, "old_logprob_s": 0.1,
        "trials_total": 32.0, "reward": -0.25}


def metrics_file(tmp_path, column, value, step=2):
    """Four steps of the rltune format (the reference workload's metrics.jsonl); ``column`` holds
    ``value`` at ``step``. JSON written by Python, so NaN and Infinity appear as Python writes them."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": i, **GOOD, **({column: value} if i == step else {})} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BAD_TIMES = [-0.5, -1e-9, math.inf, -math.inf, 2e7, 1e300, math.nan]
TIME_COLUMNS = ["step_s", "rollout_s", "training_s", "weight_sync_s", "old_logprob_s", "wait_s", "engine_decode_s",
                "sandbox_setup_s"]


def expected_problem(value, unit=" s"):
    if math.isnan(value):
        return "is NaN; a measured value is a number (leave the key out where the job did not measure it)"
    if math.isinf(value):
        return f"is {'' if value > 0 else 'minus '}infinity; a measured value is finite: check how the job computes it"
    if value < 0:
        kind = "time" if unit else "count, age or fraction"
        return f"is {value:g}{unit}, negative; a {kind} is never negative: check how the job measures it"
    return (f"is {value:g} s, more than {MAX_STAGE_S:g} s (116 days); check the unit the job logs it in "
            "(milliseconds, nanoseconds?)")


@pytest.mark.parametrize("column", TIME_COLUMNS)
@pytest.mark.parametrize("value", BAD_TIMES, ids=repr)
def test_a_bad_time_in_a_log_is_refused_with_file_step_and_column(tmp_path, column, value):
    path = metrics_file(tmp_path, column, value)
    with pytest.raises(MeasurementError) as err:
        stage_table_from_logs(path, "rltune")
    assert str(err.value) == f"{path}: step 2: {column}: {expected_problem(value)}"
    assert (err.value.step, err.value.field) == (2, column)


@pytest.mark.parametrize("column", ["trials_failed", "trials_cut_off", "gen_tokens", "sample_age_max", "gap",
                                    "kv_cache_usage", "padding_frac"])
def test_a_negative_count_age_gap_or_fraction_is_refused(tmp_path, column):
    path = metrics_file(tmp_path, column, -1.0)
    with pytest.raises(MeasurementError) as err:
        stage_table_from_logs(path, "rltune")
    assert str(err.value) == f"{path}: step 2: {column}: {expected_problem(-1.0, unit='')}"


@pytest.mark.parametrize(("column", "value"), [("reward", -3.5), ("step_s", 0.0), ("rollout_s", MAX_STAGE_S),
                                               ("trials_failed", 0.0), ("actor/pg_loss", -0.03)])
def test_values_at_the_edges_and_negative_rewards_are_kept(tmp_path, column, value):
    table, _ = stage_table_from_logs(metrics_file(tmp_path, column, value), "rltune")
    assert table.column(column).to_pylist()[2] == value


def test_a_log_that_prints_an_unmeasured_timer_as_nan_has_it_reported_and_null(tmp_path):
    """The real verl log with step 3's step timer printed as nan, as verl's console logger does."""
    text = VERL_LOG.read_text()
    lines = text.splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if "step:3 " in line)
    lines[index] = re.sub(r"timing_s/step:[0-9.]+", "timing_s/step:nan", lines[index])
    path = tmp_path / "verl.log"
    path.write_text("".join(lines))
    table, report = stage_table_from_logs(path, "verl")
    steps = table.column("step").to_pylist()
    assert table.column("step_s").to_pylist()[steps.index(3)] is None
    assert any(n.startswith("step_s is nan in the log at 1 step (e.g. step 3, from timing_s/step)") for n in report.notes)


def test_a_negative_time_a_rule_derives_names_the_rule(tmp_path):
    """The real verl log with step 2's weight hand-over longer than its generation: rollout = gen -
    reshard + reward comes out negative, and the message says how it was computed."""
    lines = VERL_LOG.read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if "step:2 " in line)
    lines[index] = re.sub(r"timing_s/reshard:[0-9.]+", "timing_s/reshard:500.0", lines[index])
    path = tmp_path / "verl.log"
    path.write_text("".join(lines))
    with pytest.raises(MeasurementError) as err:
        stage_table_from_logs(path, "verl")
    message = str(err.value)
    assert message.startswith(f"{path}: step 2: rollout_s: is -")
    assert message.endswith(" s, negative (from timing_s/gen - timing_s/reshard + timing_s/reward); a time is never "
                            "negative: check how the job measures it")


STORED = [(column, value) for column in ("step_s", "weight_sync_s", "trials_failed")
          for value in (-0.5, math.nan, math.inf, -math.inf, 2e7) if not (column == "trials_failed" and value == 2e7)]


@pytest.mark.parametrize(("column", "value"), STORED, ids=[f"{c}={v!r}" for c, v in STORED])
def test_a_stored_stage_table_with_a_bad_value_is_refused_when_read_back(tmp_path, column, value):
    rows = [{"run_id": "r", "step": i, "warmup": False, **GOOD} for i in range(4)]
    rows[3][column] = value
    path = tmp_path / "stages.parquet"
    write_stages(rows_to_table(rows, "rltune"), path)
    with pytest.raises(MeasurementError) as err:
        read_stages(path)
    unit = " s" if column.endswith("_s") else ""
    assert str(err.value) == f"{path}: step 3: {column}: {expected_problem(value, unit)}"


def test_the_real_chain_stage_table_reads_back(chain):
    assert read_stages(chain.stages).num_rows == 11


def test_profile_from_logs_refuses_a_negative_time_in_one_line(tmp_path, capsys):
    path = metrics_file(tmp_path, "weight_sync_s", -2.0)
    code = main(["profile", "--from-logs", str(path), "--format", "rltune", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"rltune: {path}: step 2: weight_sync_s: {expected_problem(-2.0)}\n"
    assert not (tmp_path / "run" / "diagnosis.yaml").exists()


def test_a_step_read_from_old_logprob_alone_is_not_diagnosed_when_the_step_timer_is_nan(tmp_path, capsys):
    """The issue's case: every step_s NaN, only old_logprob_s measured. It was diagnosed as a 1 s step."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i, "step_s": math.nan, "old_logprob_s": 1.0}) + "\n" for i in range(3)))
    code = main(["profile", "--from-logs", str(path), "--format", "rltune", "--out", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err == f"rltune: {path}: step 0: step_s: {expected_problem(math.nan)}\n"
