"""Every public log sample parses into a stage table whose step times are the log's own values.

Samples are copies of shared/data/real-logs (long ones cut to their first steps) and excerpts of
public logs (data/README.md says where each comes from). Expected values are read from the raw
text here with independent regexes, so a parser bug cannot hide in both.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rltune.profile import NotDiagnosableError, diagnose, infer_rl_mode, stage_table_from_logs

DATA = Path(__file__).parent / "data"


def column(table, name):
    return table.column(name).to_pylist()


def test_verl_current_generation_step_times_and_stages_are_the_logs_own():
    path = DATA / "verl_timing_s_qwen2-7b_grpo_fsdp_steps12.log"
    text = path.read_text()
    expected_steps = [float(v) for v in re.findall(r"timing_s/step:([\d.]+)", text)]
    table, report = stage_table_from_logs(path)
    assert report.format == "verl"
    assert column(table, "step") == list(range(1, 12))
    assert column(table, "step_s") == expected_steps
    assert column(table, "step_s")[0] == 252.485
    # step 1: rollout = gen - reshard + reward, weight sync = reshard (inside gen in verl's hybrid engine)
    row = table.slice(0, 1).to_pylist()[0]
    assert row["rollout_s"] == pytest.approx(74.891 - 4.391 + 1.479)
    assert row["weight_sync_s"] == 4.391
    assert row["old_logprob_s"] == 35.029
    assert row["training_s"] == pytest.approx(140.568 + 0.215)
    assert row["perf/mfu/actor"] == 0.277 and row["timing_s/generate_sequences"] == 59.778
    assert report.skipped == {"step with no timing keys (validation-only line)": 1}
    testing = [int(s) for s in re.findall(r"step:(\d+) - [^\n]*timing_s/testing:", text)]
    assert testing == [5, 10]
    assert any(f"(timing_s/testing) at step {testing[0]}, {testing[1]}:" in n for n in report.notes)


def test_verl_oldest_generation_has_no_step_timer_so_step_is_the_sum_of_its_phases():
    path = DATA / "verl_v0.1_timing_prefix_qwen2.5-0.5b_ppo_steps10.log"
    lines = path.read_text().splitlines()
    expected = [sum(float(v) for v in re.findall(r" - timing/\w+:([\d.]+)", line)) for line in lines]
    table, report = stage_table_from_logs(path)
    assert report.format == "verl"
    assert column(table, "step") == list(range(10))
    assert column(table, "step_s") == pytest.approx(expected)
    assert report.derived["step_s"] == "sum(timing/)"
    assert any("derived" in n for n in report.notes)
    assert column(table, "rollout_s")[0] == 18.859 and column(table, "old_logprob_s")[0] == 5.501
    assert column(table, "weight_sync_s") == [None] * 10


def test_verl_log_without_metric_lines_takes_step_times_from_the_progress_bar():
    path = DATA / "verl_qwen2-7b_grpo_fsdp_head20k.log"
    elapsed = {}
    for n, t in re.findall(r"Training Progress:.*?\| (\d+)/210 \[([\d:]+)<", path.read_text()):
        parts = [int(p) for p in t.split(":")]
        elapsed.setdefault(int(n), sum(p * 60 ** i for i, p in enumerate(reversed(parts))))
    expected = [elapsed[n] - elapsed[n - 1] for n in sorted(elapsed) if n - 1 in elapsed]
    table, report = stage_table_from_logs(path)
    assert report.format == "verl"
    assert column(table, "step_s") == expected
    assert column(table, "step_s")[:3] == [254.0, 238.0, 236.0]  # 04:14, 08:12, 12:08
    assert table.num_rows == 39
    assert any("Training Progress" in n for n in report.notes)
    diagnosis = diagnose(table, "sync", warmup_steps=1)
    assert diagnosis.limiting_stage == "unknown" and diagnosis.problems == []


def test_prime_rl_orchestrator_console_times_and_inferred_mode():
    path = DATA / "prime-rl_orchestrator_console_pr1318.log"
    table, report = stage_table_from_logs(path)
    assert report.format == "prime-rl"
    assert column(table, "step") == [28, 29, 30, 31]
    assert column(table, "step_s") == [73.77, 72.73, 79.39, 79.28]
    assert column(table, "rollout_s") == [73.0, 72.0, 79.0, 78.0]  # the 'Generating rollouts' bar, 01:13 ...
    assert column(table, "reward") == [0.3887, 0.4018, 0.3743, 0.4052]
    assert column(table, "Throughput")[0] == 2408.9
    assert infer_rl_mode(table) == ("one_step_async", "the log's 'Async Level' is 1")
    diagnosis = diagnose(table, "one_step_async", warmup_steps=1)
    assert diagnosis.limiting_stage == "rollout"
    assert diagnosis.step_median_s == pytest.approx(79.28)


def test_trl_console_dict_has_rewards_but_no_times_and_says_so():
    path = DATA / "trl_grpo_console_memgen_pr33.log"
    table, report = stage_table_from_logs(path)
    assert report.format == "trl"
    assert table.num_rows == 1
    assert column(table, "reward") == [0.375] and column(table, "step_s") == [None]
    assert column(table, "completions/mean_length") == [163.0]
    assert any("no step or stage times" in n for n in report.notes)
    with pytest.raises(NotDiagnosableError, match="no step or stage time"):
        diagnose(table, "sync")


def test_vllm_metrics_snapshot_reads_gauges_counters_and_histogram_quantiles():
    path = DATA / "vllm_metrics_endpoint_excerpt_design_doc.prom"
    table, report = stage_table_from_logs(path)
    assert report.format == "vllm"
    row = table.to_pylist()[0]
    assert row["vllm:num_requests_running"] == 8.0
    assert row["gen_tokens"] == 27453.0
    assert row["vllm:request_success_total"] == 131.0  # two finished-reason series summed
    assert row["vllm:time_to_first_token_seconds/count"] == 140.0
    # median rank 70 lies in the (0.02, 0.04] bucket holding ranks 13..97
    assert row["vllm:time_to_first_token_seconds/p50"] == pytest.approx(0.02 + 0.02 * (70 - 13) / (97 - 13))
    assert row["vllm:time_to_first_token_seconds/p90"] == pytest.approx(0.06 + 0.02 * (126 - 123) / (138 - 123))
    assert row["step_s"] is None


def test_prime_rl_bench_results_give_one_row_per_successful_benchmark():
    folder = DATA / "prime-rl-bench"
    expected = {}
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc["config"]["success"]:
            expected[path.stem] = doc["metrics"]["step_time"]["mean"]
    table, report = stage_table_from_logs(folder)
    assert report.format == "prime-rl"
    assert dict(zip(column(table, "run_id"), column(table, "step_s"), strict=True)) == expected
    assert column(table, "training_s") == column(table, "step_s")
    assert len(expected) == 3
    assert sum(n for r, n in report.skipped.items() if r.startswith("failed benchmark")) == 1
    assert any("OutOfMemoryError" in r for r in report.skipped)
    assert any("BENCHMARKS.md" in n for n in report.notes)


@pytest.mark.parametrize(("name", "fmt"), [
    ("verl_timing_s_qwen2-7b_grpo_fsdp_steps12.log", "verl"),
    ("verl_v0.1_timing_prefix_qwen2.5-0.5b_ppo_steps10.log", "verl"),
    ("verl_qwen2-7b_grpo_fsdp_head20k.log", "verl"),
    ("prime-rl_orchestrator_console_pr1318.log", "prime-rl"),
    ("trl_grpo_console_memgen_pr33.log", "trl"),
    ("vllm_metrics_endpoint_excerpt_design_doc.prom", "vllm"),
    ("prime-rl-bench", "prime-rl"),
    ("skyrl_gsm8k_timers_yottalabs_docs.log", "skyrl"),
    ("nemo_rl_async_grpo_timing_pr1052.log", "nemo-rl"),
    ("ms_swift_grpo_logging_issue9261.jsonl", "ms-swift"),
    ("ms_swift_sft_logging_onevl_issue6.jsonl", "ms-swift"),
    ("verl_wrapped_record_rllm_issue54.log", "verl"),
])
def test_auto_picks_the_right_parser_and_matches_the_explicit_format(name, fmt):
    auto, report = stage_table_from_logs(DATA / name)
    assert report.format == fmt
    explicit, _ = stage_table_from_logs(DATA / name, format=fmt)
    assert explicit.equals(auto)


def test_verl_record_wrapped_by_the_terminal_is_joined_back():
    """rllm-org/rllm#54: a record pasted from a terminal that broke it at column 991, inside a pair."""
    path = DATA / "verl_wrapped_record_rllm_issue54.log"
    text = path.read_text()
    first, second = text.splitlines()
    assert len(first) == 991 and first.endswith("prompt_length/max") and second.startswith(":448.000")
    timing = {k: float(v) for k, v in re.findall(r"timing_s/(\w+):([\d.]+)", text)}
    table, report = stage_table_from_logs(path)
    assert report.format == "verl" and report.lines_used == 2 and report.skipped == {}
    row = table.to_pylist()[0]
    assert row["step"] == 7 and row["step_s"] == timing["step"] == 122.367
    assert row["rollout_s"] == timing["gen"]
    assert row["old_logprob_s"] == pytest.approx(timing["old_log_prob"] + timing["ref"])
    assert row["training_s"] == pytest.approx(timing["update_actor"] + timing["adv"])
    assert row["prompt_length/max"] == 448.0 and row["mfu/actor"] == 0.401  # the pair cut in two
    assert any("1 continuation line joined" in n for n in report.notes)


def test_skyrl_timer_lines_give_the_step_and_its_stages():
    """yottalabsai/docs tutorials/page-1.md: the log starts inside step 1 (after its generation)."""
    path = DATA / "skyrl_gsm8k_timers_yottalabs_docs.log"
    text = path.read_text()
    step1 = dict(re.findall(r"Finished: '(\w+)', time cost: ([\d.]+)s", text.split("Finished: 'step'")[0]))
    table, report = stage_table_from_logs(path)
    assert report.format == "skyrl"
    row = table.to_pylist()
    assert [r["step"] for r in row] == [1]  # from the 'Training Batches Processed ... 1/7' bar
    row = row[0]
    assert row["step_s"] == 1331.13
    assert row["old_logprob_s"] == float(step1["fwd_logprobs_values_reward"]) == 377.36
    assert row["training_s"] == pytest.approx(float(step1["train_critic_and_policy"])
                                              + float(step1["compute_advantages_and_returns"]))
    assert row["weight_sync_s"] == float(step1["sync_weights"]) == 7.04
    assert row["rollout_s"] is None  # step 1's 'generate' lies before the excerpt
    assert row["timer/policy_train"] == 866.49 and row["policy_loss"] == -0.0001400031556840986
    assert row["reward"] == 0.13398437201976776
    # step 2 is cut after its generation: its two timer lines are counted, not silently lost
    assert report.skipped == {"timer lines of a step the log ends inside (no \"Finished: 'step'\")": 2}


def test_nemo_rl_async_timing_block_maps_exposed_generation_to_the_wait_not_the_rollout():
    """NVIDIA-NeMo/RL#1052: an async-GRPO block pasted without its 'Step N/M' header."""
    path = DATA / "nemo_rl_async_grpo_timing_pr1052.log"
    timing = {k: float(v) for k, v in re.findall(r"• ([\w/ ]+): ([\d.]+)s", path.read_text())}
    table, report = stage_table_from_logs(path)
    assert report.format == "nemo-rl"
    row = table.to_pylist()[0]
    assert row["step"] == 1 and any("without a 'Step N/M' header" in n for n in report.notes)
    assert row["step_s"] == timing["Total step time"] == 66.55
    assert row["wait_s"] == timing["exposed_generation"] == 32.52
    assert row["rollout_s"] is None
    assert row["training_s"] == pytest.approx(timing["policy_training"] + timing["training_prep"])
    assert row["old_logprob_s"] == pytest.approx(timing["policy_and_reference_logprobs"]
                                                 + timing["logprob_inference_prep"])
    assert row["weight_sync_s"] == timing["weight_sync"] == 0.13
    assert row["timing/buffer_sampling"] == 1.38
    assert (row["reward"], row["sample_age_mean"]) == (0.3486, 1.0)


def test_ms_swift_grpo_logging_jsonl_step_time_is_the_step():
    """modelscope/ms-swift#9261: two logging.jsonl rows; step 2 trains without generating."""
    path = DATA / "ms_swift_grpo_logging_issue9261.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    table, report = stage_table_from_logs(path)
    assert report.format == "ms-swift"
    assert column(table, "step") == [int(r["global_step/max_steps"].split("/")[0]) for r in rows] == [1, 2]
    assert column(table, "step_s") == [r["step_time"] for r in rows] == [17.67188024, 1.57797493]
    assert column(table, "reward") == [0.0, None]
    assert column(table, "elapsed_s") == [36.0, 39.0]
    assert column(table, "rollout_s") == [None, None] and report.derived["step_s"] == "step_time"
    assert any("no stage timers" in n for n in report.notes)


def test_ms_swift_log_without_step_time_derives_it_from_elapsed_time():
    """xiaomi-research/onevl#6: logging.jsonl rows every 5 steps, elapsed_time in whole seconds."""
    path = DATA / "ms_swift_sft_logging_onevl_issue6.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]

    def seconds(text):
        return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+)([hms])", text))

    elapsed = [seconds(r["elapsed_time"]) for r in rows]
    steps = [int(r["global_step/max_steps"].split("/")[0]) for r in rows]
    expected = [None] + [(elapsed[i] - elapsed[i - 1]) / (steps[i] - steps[i - 1]) for i in range(1, len(rows))]
    table, report = stage_table_from_logs(path)
    assert column(table, "step") == steps == [1665, 1670, 1675, 1680]
    assert column(table, "step_s") == expected == [None, 15.4, 14.0, 15.4]
    assert report.derived["step_s"] == "elapsed/step_s"
    assert any("derived from elapsed_time" in n for n in report.notes)


# Lines that carry a timing key, found with patterns of their own (not the adapters').
_TIMING_LINE = {
    "verl": re.compile(r"timing(?:_s)?/\w+:"),
    "prime-rl": re.compile(r"\bTime: "),
    "skyrl": re.compile(r"time cost: "),
    "nemo-rl": re.compile(r"• [\w/ ]+: [\d.]+s"),
    "ms-swift": re.compile(r'"step_time"|"elapsed_time"'),
}


@pytest.mark.parametrize(("name", "fmt"), [
    ("verl_timing_s_qwen2-7b_grpo_fsdp_steps12.log", "verl"),
    ("verl_v0.1_timing_prefix_qwen2.5-0.5b_ppo_steps10.log", "verl"),
    ("verl_wrapped_record_rllm_issue54.log", "verl"),
    ("prime-rl_orchestrator_console_pr1318.log", "prime-rl"),
    ("skyrl_gsm8k_timers_yottalabs_docs.log", "skyrl"),
    ("nemo_rl_async_grpo_timing_pr1052.log", "nemo-rl"),
    ("ms_swift_grpo_logging_issue9261.jsonl", "ms-swift"),
    ("ms_swift_sft_logging_onevl_issue6.jsonl", "ms-swift"),
])
def test_no_line_with_a_timing_key_is_dropped_silently(name, fmt):
    path = DATA / name
    timing_lines = sum(1 for line in path.read_text().splitlines() if _TIMING_LINE[fmt].search(line))
    assert timing_lines > 0, "the pattern found no timing line: the test would pass vacuously"
    _, report = stage_table_from_logs(path)
    assert timing_lines <= report.lines_used + report.lines_skipped
