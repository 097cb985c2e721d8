"""Formats without a public sample, read from hand-written fixtures in each framework's exact line shape
(see data/handwritten/README.md), and bad input that must fail loudly or count what it skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.errors import LogFormatError
from rltune.profile import STAGE_MAP, describe_stage_map, stage_table_from_logs
from rltune.profile.adapters import ADAPTERS
from rltune.profile.stage_map import apply_rule, parse_rule

HAND = Path(__file__).parent / "data" / "handwritten"


def rows(path, fmt="auto"):
    table, report = stage_table_from_logs(path, format=fmt)
    return table.to_pylist(), report


def test_slime_perf_lines_map_each_timer_and_count_the_truncated_last_line():
    out, report = rows(HAND / "slime.log")
    assert report.format == "slime"
    assert [r["step"] for r in out] == [0, 1]
    assert [r["step_s"] for r in out] == [88.0, 84.5]
    first = out[0]
    assert (first["rollout_s"], first["training_s"], first["weight_sync_s"], first["wait_s"]) == (41.5, 30.1, 3.3, 0.4)
    assert first["old_logprob_s"] == pytest.approx(6.2 + 5.9)
    assert out[1]["perf/tokens_per_gpu_per_sec"] is None  # nan in the log is null, never a number
    assert report.skipped == {"truncated or malformed 'perf N: {...}' line": 1}


def test_openrlhf_global_step_dicts():
    out, report = rows(HAND / "openrlhf.log")
    assert report.format == "openrlhf"
    assert [(r["step"], r["step_s"], r["rollout_s"], r["old_logprob_s"], r["training_s"], r["weight_sync_s"])
            for r in out] == [(1, 62.3, 31.2, 9.8, 18.1, 2.4), (2, 61.0, 30.4, 9.5, 17.9, 2.5)]
    assert [r["reward"] for r in out] == [0.44, 0.47]


def test_nemo_rl_timing_blocks_and_a_block_cut_mid_step():
    out, report = rows(HAND / "nemo_rl.log")
    assert report.format == "nemo-rl"
    assert [r["step_s"] for r in out] == [94.87, 90.01]
    first = out[0]
    assert first["rollout_s"] == pytest.approx(44.62 + 0.88)
    assert first["training_s"] == pytest.approx(30.21 + 1.02)
    assert (first["weight_sync_s"], first["old_logprob_s"], first["reward"]) == (4.33, 12.10, 0.1016)
    assert first["Mean Generation Length"] == 1145.2969
    assert report.skipped == {"step block without 'Total step time' (log cut mid-step?)": 1}


def test_verl_file_logger_jsonl_skips_the_validation_only_record():
    out, report = rows(HAND / "verl_file_logger.jsonl")
    assert report.format == "verl"
    assert [r["step_s"] for r in out] == [226.5, 220.0]
    assert out[0]["rollout_s"] == pytest.approx(70.0 - 4.0 + 1.0)
    assert out[0]["old_logprob_s"] == 35.0
    assert report.skipped == {"step with no timing keys (validation-only record)": 1}


def test_verl_middle_generation_keys():
    out, report = rows(HAND / "verl_middle_generation.log")
    assert report.format == "verl"
    assert [r["step_s"] for r in out] == [102.65, 101.09]
    assert out[0]["mfu/actor"] == 0.312 and out[0]["Tokens/Sec/GPU"] == 1874.33
    assert out[0]["rollout_s"] == 48.12 and out[0]["weight_sync_s"] is None


def test_prime_rl_trainer_and_orchestrator_metrics_merge_by_step():
    out, report = rows(HAND / "prime-rl-run")
    assert report.format == "prime-rl"
    assert len(out) == 2
    first = out[0]
    assert first["step_s"] == 41.2  # the trainer's time/step
    assert first["orchestrator/time/step"] == 40.9
    assert first["rollout_s"] == 36.4 and first["training_s"] == 24.1 and first["wait_s"] == 12.5
    assert first["weight_sync_s"] == pytest.approx(2.2 + 1.3)
    assert first["reward"] == 0.39 and first["sample_age_max"] == 1.0


def test_rltune_metrics_map_one_to_one_and_keep_extras():
    table, report = stage_table_from_logs(HAND / "rltune_metrics.jsonl", run_id="r1", warmup_steps=1)
    out = table.to_pylist()
    assert report.format == "rltune"
    assert [r["warmup"] for r in out] == [True, False, False]
    assert [r["run_id"] for r in out] == ["r1"] * 3
    assert [r["step_s"] for r in out] == [3.5, 2.9, 3.0] and out[1]["loss"] == 0.4


def test_trl_profiling_metrics_give_stage_times_and_the_summary_is_skipped():
    out, report = rows(HAND / "trl_with_profiling.log")
    assert report.format == "trl"
    assert [(r["step"], r["step_s"], r["rollout_s"], r["weight_sync_s"]) for r in out] == [
        (1, 20.0, 12.25, 1.5), (2, 19.0, 11.75, 1.4)]
    assert out[1]["grad_norm"] is None
    assert report.skipped == {"end-of-training summary, not a step": 1}


def test_verl_numpy2_reprs_wrapped_and_one_key_per_line_records():
    """Records as verl's console logger prints them under numpy 2, one wrapped by a terminal at 120
    columns, one printed one key per line, a NaN step timer, an unreadable value and a cut last record."""
    out, report = rows(HAND / "verl_numpy2_console.log")
    assert report.format == "verl"
    assert [r["step"] for r in out] == [1, 2, 3, 4]
    assert [r["step_s"] for r in out] == [118.0, 114.75, 114.5, None]  # step 4 logged nan: reported, null
    assert [r["rollout_s"] for r in out] == [40.25 + 0.75, 38.5 + 0.5, 39.0 + 0.5, 37.0 + 0.5]
    assert [r["weight_sync_s"] for r in out] == [2.25, 2.0, 2.5, 2.0]  # timing_s/update_weights
    assert out[1]["training_s"] == pytest.approx(54.5 + 0.25)
    assert out[1]["perf/throughput"] == 1220.4159109515201  # np.float64(...) read
    assert out[2]["training/global_step"] == 3.0  # np.int64(3), on a line of its own
    assert out[3]["actor/lr"] is None and out[0]["actor/lr"] == 1e-06
    assert report.skipped == {"truncated or malformed 'key:value' pair": 1}
    assert any("continuation lines joined" in n for n in report.notes)
    assert any("'actor/lr': '<unavailable>'" in n for n in report.notes)
    assert any(n.startswith("step_s is nan in the log at 1 step (e.g. step 4") for n in report.notes)


def test_verl_file_logger_as_orjson_writes_it_null_timings_and_a_cut_line_are_counted():
    out, report = rows(HAND / "verl_file_logger_orjson.jsonl")
    assert report.format == "verl"
    assert [r["step_s"] for r in out] == [118.0, 114.75]
    assert [r["weight_sync_s"] for r in out] == [2.25, None]
    assert out[1]["actor/grad_norm"] is None
    assert report.skipped == {"step with no timing keys (validation-only record)": 1,
                              "truncated or malformed file-logger JSON line": 1}
    assert any("1 timing value is null in the file logger (e.g. step 2 'timing_s/update_weights'" in n
               for n in report.notes)


def test_nemo_rl_sync_grpo_weight_sync_is_the_outer_prepare_for_generation_timer():
    out, report = rows(HAND / "nemo_rl_sync_grpo.log")
    assert report.format == "nemo-rl"
    assert [(r["step"], r["step_s"]) for r in out] == [(1, 41.25), (2, 34.0)]
    assert [r["weight_sync_s"] for r in out] == [2.5, 2.25]  # not + transfer_and_update_weights (inside it)
    assert [r["rollout_s"] for r in out] == [10.75 + 0.25, 10.25 + 0.25]
    assert out[0]["old_logprob_s"] == 4.0 + 1.0 and out[0]["wait_s"] is None
    assert out[0]["E2E (Samples/sec/gpu)"] == 3.10  # a '-' sub-bullet: a label, never a timing
    assert not any(k.startswith("timing/e2e") for k in out[0])


def test_skyrl_console_tracker_dict_sums_repeated_timers_and_keeps_timers_outside_steps_apart():
    out, report = rows(HAND / "skyrl_console_tracker.log")
    assert report.format == "skyrl"
    assert len(out) == 1 and out[0]["step"] == 1
    row = out[0]
    assert row["timer/generate"] == 60.25 + 20.25 == row["timing/generate"]  # dynamic sampling ran it twice
    assert (row["step_s"], row["rollout_s"], row["old_logprob_s"]) == (184.25, 80.5 + 0.25, 30.0)
    assert (row["training_s"], row["weight_sync_s"]) == (70.0 + 0.5, 3.0)
    assert row["timer/eval"] == 30.0  # after the step, logged with it by SkyRL's tracker
    assert any("2 timer lines before the first step" in n for n in report.notes)
    assert report.skipped == {}


def test_areal_stats_tables_sum_their_phases_into_the_step():
    out, report = rows(HAND / "areal_stats.log")
    assert report.format == "areal"
    assert [r["step"] for r in out] == [1, 2]
    first = out[0]
    assert first["step_s"] == pytest.approx(88.992 + 6.5 + 5.25 + 0.125 + 31.464 + 4.75 + 0.25)
    assert (first["rollout_s"], first["weight_sync_s"]) == (88.992, 4.75)
    assert first["old_logprob_s"] == 6.5 + 5.25 and first["training_s"] == pytest.approx(31.464 + 0.125)
    assert first["reward"] == 0.26204 and out[1]["ppo_actor/update/grad_norm"] is None
    assert report.derived["step_s"] == "sum(timeperf/)"
    assert report.skipped == {"stats table cut off by the end of the log": 3}


def test_a_nan_printed_in_a_dict_line_is_counted():
    out, report = rows(HAND / "slime.log")
    assert any("1 value printed as nan (e.g. step 1 'perf/tokens_per_gpu_per_sec')" in n for n in report.notes)


# --- bad input ---------------------------------------------------------------------------------

def test_a_log_with_no_recognisable_step_is_an_error_naming_the_formats(tmp_path):
    path = tmp_path / "noise.log"
    path.write_text("loading model\nwarming up\n{'not': 'a training dict'}\n")
    with pytest.raises(LogFormatError, match=r"no recognisable step.*verl"):
        stage_table_from_logs(path)


def test_an_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.log"
    path.write_text("")
    with pytest.raises(LogFormatError, match="no recognisable step"):
        stage_table_from_logs(path)


def test_a_forced_format_that_matches_nothing_is_an_error_not_an_empty_table():
    with pytest.raises(LogFormatError, match=r"no recognisable slime step in 3 lines"):
        stage_table_from_logs(HAND / "openrlhf.log", format="slime")


def test_mixed_formats_are_refused(tmp_path):
    path = tmp_path / "mixed.log"
    path.write_text((HAND / "openrlhf.log").read_text() + (HAND / "verl_middle_generation.log").read_text())
    with pytest.raises(LogFormatError, match=r"mixed formats: .*openrlhf.*verl|mixed formats: .*verl.*openrlhf"):
        stage_table_from_logs(path)


def test_a_truncated_verl_line_is_skipped_and_counted(tmp_path):
    text = (HAND / "verl_middle_generation.log").read_text()
    path = tmp_path / "cut.log"
    path.write_text(text + text.splitlines()[0].replace("step:1", "step:3")[:140] + "\n")
    table, report = stage_table_from_logs(path)
    assert table.num_rows == 2
    assert report.skipped == {"truncated or malformed 'key:value' pair": 1}
    assert report.warnings[0] == "skipped 1 line: truncated or malformed 'key:value' pair"


def test_a_truncated_json_line_is_skipped_and_counted(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text((HAND / "rltune_metrics.jsonl").read_text() + '{"step": 3, "step_s": 2.')
    table, report = stage_table_from_logs(path)
    assert table.num_rows == 3 and report.skipped == {"truncated or malformed JSON line": 1}


def test_a_log_whose_every_timing_line_is_unreadable_is_an_error_with_the_counts(tmp_path):
    text = (HAND / "verl_middle_generation.log").read_text()
    path = tmp_path / "cut.log"
    path.write_text("".join(line[:line.index("update_actor") + 6] + "\n" for line in text.splitlines()))
    with pytest.raises(LogFormatError, match=r"no recognisable verl step.*skipped 2 lines: truncated"):
        stage_table_from_logs(path)


def test_missing_path_and_unknown_format_are_clear_errors(tmp_path):
    with pytest.raises(LogFormatError, match="no such file"):
        stage_table_from_logs(tmp_path / "nope.log")
    with pytest.raises(LogFormatError, match="unknown log format 'megatron'"):
        stage_table_from_logs(HAND / "slime.log", format="megatron")


# --- the stage map -----------------------------------------------------------------------------

def test_every_adapter_has_a_stage_map_and_the_docs_table_names_every_rule():
    assert set(ADAPTERS) == set(STAGE_MAP)
    doc = describe_stage_map()
    for fmt, columns in STAGE_MAP.items():
        if fmt == "rltune":
            continue
        for column, rules in columns.items():
            assert f"| {fmt} | `{column}` |" in doc
            for rule in rules:
                assert f"`{rule}`" in doc


def test_rules_need_their_first_metric_and_treat_later_ones_as_optional():
    assert parse_rule("a - b + c/d") == [(1, "a"), (-1, "b"), (1, "c/d")]
    assert apply_rule("a - b + c", {"a": 10.0, "c": 1.0}) == 11.0
    assert apply_rule("a - b", {"b": 1.0}) is None
    assert apply_rule("sum(timing/)", {"timing/x": 1.0, "timing/y": 2.5, "other": 9.0}) == 3.5
    assert apply_rule("sum(timing/)", {"other": 9.0}) is None
