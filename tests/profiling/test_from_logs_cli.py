"""`rltune profile --from-logs` end to end: what the command writes and prints for a real sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltune.cli.main import main
from rltune.contracts.diagnosis import load_diagnosis
from rltune.contracts.stages import read_stages

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_stages_warmup_column_follows_the_warmup_option(tmp_path, warmup):
    out = tmp_path / "run"
    rc = main(["profile", "--from-logs", str(DATA / "verl_timing_s_qwen2-7b_grpo_fsdp_steps12.log"),
               "--warmup", str(warmup), "--out", str(out)])
    assert rc == 0
    table = read_stages(out / "stages.parquet")
    assert table.column("warmup").to_pylist() == [i < warmup for i in range(table.num_rows)]
    # the diagnosis leaves out the same steps the table marks
    assert load_diagnosis(out / "diagnosis.yaml").steps_used == table.column("step").to_pylist()[warmup:]


def test_warnings_quoting_log_text_are_printed_verbatim(tmp_path, capsys):
    rc = main(["profile", "--from-logs", str(DATA / "verl_qwen2-7b_grpo_fsdp_head20k.log"),
               "--out", str(tmp_path / "run")])
    assert rc == 0
    assert "trainer.logger=[console]" in " ".join(capsys.readouterr().err.split())


def test_a_sample_with_skipped_timer_lines_says_so_on_stderr_and_in_the_report(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["profile", "--from-logs", str(DATA / "skyrl_gsm8k_timers_yottalabs_docs.log"), "--out", str(out),
               "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    summary = json.loads(captured.out)
    assert summary["report"]["format"] == "skyrl" and summary["report"]["lines_skipped"] == 2
    assert any(w.startswith("skipped 2 lines: timer lines of a step the log ends inside") for w in summary["warnings"])
    assert "skipped 2 lines" in captured.err


def test_nothing_usable_left_exits_2_naming_the_file(tmp_path, capsys):
    path = tmp_path / "cut.log"
    path.write_text("(TaskRunner pid=1) step:1 - timing_s/gen:4.2 - timing_s/upd\n")
    assert main(["profile", "--from-logs", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "skipped 1 line: truncated" in err
