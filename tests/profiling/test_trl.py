"""TRL's two routes into the stage table: trainer_state.json and the console's quoted-number dicts.

Samples: data/trl-1.16_grpo_cpu_gen32/ (a real TRL 1.16 GRPO run of presets/trl-grpo-cpu.yaml with
generation_batch_size 32, its README says how it was made) and data/trl_grpo_console_memgen_pr33.log
(a public console line without stage times). Expected values come from the JSON itself (the state
file) or from independent regexes over the raw text (the console), never from the adapter.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from rltune.profile import diagnose, stage_table_from_logs
from rltune.profile.adapters import trl as trl_adapter
from rltune.profile.report import ParseReport

DATA = Path(__file__).parent / "data"
RUN = DATA / "trl-1.16_grpo_cpu_gen32"
STATE = RUN / "trainer_state.json"
CONSOLE = RUN / "console.log"
CALLBACK_STAGES = {"step_s": "rltune/step_s", "rollout_s": "rltune/rollout_s", "training_s": "rltune/training_s",
                   "weight_sync_s": "rltune/weight_sync_s", "old_logprob_s": "rltune/old_logprob_s",
                   "sample_age_mean": "rltune/sample_age_mean", "sample_age_max": "rltune/sample_age_max"}


def history():
    return [e for e in json.loads(STATE.read_text())["log_history"] if "train_runtime" not in e]


def column(table, name):
    return table.column(name).to_pylist()


def test_trainer_state_rows_are_its_log_history_steps_with_the_callbacks_stage_times():
    table, report = stage_table_from_logs(STATE)
    entries = history()
    assert report.format == "trl" and report.steps == 6
    assert column(table, "step") == [e["step"] for e in entries] == [1, 2, 3, 4, 5, 6]
    for core, key in CALLBACK_STAGES.items():
        assert column(table, core) == [e[key] for e in entries], core
    assert report.skipped == {"end-of-training summary, not a step": 1}
    # Generation every second step: the buffered steps have no rollout and samples one version old.
    assert column(table, "sample_age_max") == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert column(table, "rltune/generations") == [1.0, 0.0] * 3
    rollout = column(table, "rollout_s")
    assert max(rollout[1::2]) < 0.01 * min(rollout[0::2])  # handing out a buffered micro-batch: microseconds
    assert [r > 0 for r in column(table, "old_logprob_s")] == [True, False] * 3
    # TRL logs its reward only on a step that scored completions; nothing is made up for the others.
    assert column(table, "reward") == [e.get("reward") for e in entries]
    assert column(table, "reward")[1] is None
    # No vLLM: nothing is synced, and no gap can be measured, so none is reported.
    assert column(table, "weight_sync_s") == [0.0] * 6 and column(table, "gap") == [None] * 6


def test_console_quoted_numbers_after_tqdm_bars_read_as_the_runs_own_numbers():
    raw = CONSOLE.read_bytes().decode()
    assert "\r" in raw and "'rltune/step_s': '" in raw  # the real shape: bars, carriage returns, quoted floats
    expected = [float(v) for v in re.findall(r"'rltune/step_s': '([^']+)'", raw)]
    table, report = stage_table_from_logs(CONSOLE)
    assert report.format == "trl" and report.steps == 6
    assert column(table, "step_s") == expected and len(expected) == 6
    assert column(table, "step") == [1, 2, 3, 4, 5, 6]
    # The same run's state file holds the unrounded numbers: the console's are them to 4 digits.
    for core, key in CALLBACK_STAGES.items():
        for printed, exact in zip(column(table, core), [e[key] for e in history()], strict=True):
            assert printed == float(f"{exact:.4g}"), (core, printed, exact)
    assert report.skipped == {"end-of-training summary, not a step": 1}
    assert any("numbered 1, 2, ..." in n for n in report.notes)


def test_a_folder_with_both_takes_the_state_file_and_skips_the_console(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "launch.log").write_bytes(CONSOLE.read_bytes())
    (folder / "trainer_state.json").write_bytes(STATE.read_bytes())
    table, report = stage_table_from_logs(folder)
    assert report.format == "trl"
    assert column(table, "step_s") == [e["rltune/step_s"] for e in history()]
    assert report.skipped["console line; trainer_state.json holds the same steps in full precision"] == 7


def test_the_real_run_diagnoses_its_old_logprob_pass_under_the_sync_rule():
    table, _ = stage_table_from_logs(STATE, warmup_steps=2)
    diagnosis = diagnose(table, "sync", warmup_steps=2)
    rows = [r for r in table.to_pylist() if r["step"] > 2]
    assert diagnosis.steps_used == [3, 4, 5, 6]
    assert diagnosis.stage_medians_s["rollout"] == pytest.approx(statistics.median(r["rollout_s"] for r in rows), rel=1e-5)
    trainer = statistics.median(r["training_s"] + r["old_logprob_s"] for r in rows)
    assert diagnosis.stage_medians_s["training"] == pytest.approx(trainer, rel=1e-5)
    # The recorded run recomputes old log-probs on each generation step (TRL does when a generation serves
    # two optimizer steps): 18 % of the trainer stage, over the detector's 15 %.
    old = statistics.median(r["old_logprob_s"] for r in rows)
    assert old / trainer > 0.15
    assert "old_logprob_pass_costly" in [p.id for p in diagnosis.problems]


def test_quoted_numbers_nan_and_plain_numbers_are_read_alike():
    text = ("{'loss': '0.06496', 'grad_norm': 'nan', 'learning_rate': '1e-06', 'step_time': '0.1134', "
            "'epoch': '0.01'}\n"
            "{'loss': 0.05, 'grad_norm': 1.5, 'learning_rate': 1e-06, 'step_time': 0.2, 'epoch': 0.02}\n"
            "{'eval_loss': '0.3', 'epoch': '0.02'}\n")
    report = ParseReport(format="trl", path="x")
    parsed = trl_adapter.parse([("x", text)], report)
    assert parsed.records[1] == {"loss": 0.06496, "learning_rate": 1e-06, "step_time": 0.1134, "epoch": 0.01}
    assert parsed.records[2] == {"loss": 0.05, "grad_norm": 1.5, "learning_rate": 1e-06, "step_time": 0.2, "epoch": 0.02}
    assert sorted(parsed.records) == [1, 2]
    assert report.skipped == {"evaluation line: the console gives it no step": 1}
    assert any("TRL's step_time" in n for n in report.notes)


def test_only_a_bar_may_precede_the_dict_so_other_formats_printed_dicts_are_not_claimed():
    bar = " 20%|██        | 1/5 [00:00<00:00,  7.05it/s]                    {'loss': '0.1', 'epoch': '0.2'}"
    assert trl_adapter.claims(bar) == 1
    assert trl_adapter.claims("Global step 3: {'loss': 0.1, 'reward': 0.2}") == 0
    assert trl_adapter.claims("step 3 {'loss': 0.1}") == 0
    assert trl_adapter.claims("{'not': 'a training dict'}") == 0


def test_the_public_console_line_without_timers_gives_rewards_and_says_what_to_attach():
    table, report = stage_table_from_logs(DATA / "trl_grpo_console_memgen_pr33.log")
    assert column(table, "reward") == [0.375] and column(table, "step_s") == [None]
    assert any("TrlStageTimers" in n for n in report.notes)
