"""The journal survives torn writes; savings shares add to 100; the tuned preset and report are valid."""

from __future__ import annotations

import base64
import re

import pytest

from rltune.contracts.job import load_job
from rltune.tune.journal import Journal, JournalError
from rltune.tune.preset import write_tuned_preset
from rltune.tune.report import ReportError, build_report
from rltune.tune.savings import savings_matrix, shares_by_group

from .helpers import DEMO, add_event


def test_journal_replays_in_order_and_skips_a_torn_last_line(tmp_path):
    journal = Journal(tmp_path / "journal.jsonl")
    add_event(journal, "start", job="a.yaml")
    add_event(journal, "trial", run_id="r1-c1", step_s=1.5)
    with open(journal.path, "ab") as handle:           # a writer killed mid-line
        handle.write(b'{"event": "trial", "run_id": "r1-')
    assert [e.event for e in journal.events()] == ["start", "trial"]
    add_event(journal, "finish", reason="budget")      # the next append cuts the torn line and starts a fresh one
    events = journal.events()
    assert [e.event for e in events] == ["start", "trial", "finish"]
    assert events[1].step_s == 1.5 and events[2].reason == "budget"
    assert b"r1-\n" not in journal.path.read_bytes() and journal.path.read_bytes().count(b"\n") == 3


def test_a_complete_last_event_without_its_newline_is_kept_and_the_next_append_ends_it(tmp_path):
    """An editor saves the file without a final newline: the event is whole, so it is read and kept."""
    journal = Journal(tmp_path / "journal.jsonl")
    add_event(journal, "start", job="a.yaml")
    add_event(journal, "baseline", run_id="r0-untuned", step_s=2.0)
    journal.path.write_bytes(journal.path.read_bytes().rstrip(b"\n"))
    assert [e.event for e in journal.events()] == ["start", "baseline"]
    add_event(journal, "trial", run_id="r1-c1")
    events = journal.events()
    assert [e.event for e in events] == ["start", "baseline", "trial"] and events[1].step_s == 2.0
    assert journal.path.read_bytes().endswith(b"\n") and journal.path.read_bytes().count(b"\n") == 3


@pytest.mark.parametrize("tail, problem", [
    (b'{"event": "baseline", "round": 0}', "time: missing required field"),     # whole JSON, not a whole event
    (b"\xff\xfe\x00garbage", "not text"),                                       # not UTF-8
    (b"hello", "not a JSON object"),                                            # not the start of an event
    (b'{"event": "banana", "time": 1.0}', "event: expected one of start"),       # an unknown kind
])
def test_a_last_line_that_is_not_a_torn_event_is_refused_and_kept(tmp_path, tail, problem):
    """Only a line a killed writer leaves (an unparsable prefix of an object) is ever cut."""
    journal = Journal(tmp_path / "journal.jsonl")
    add_event(journal, "start", job="a.yaml")
    with open(journal.path, "ab") as handle:
        handle.write(tail)
    before = journal.path.read_bytes()
    with pytest.raises(JournalError, match=f"line 2.*{problem}"):
        journal.events()
    with pytest.raises(JournalError, match=problem):
        add_event(journal, "finish")
    assert journal.path.read_bytes() == before


def test_journal_refuses_a_corrupt_line_in_the_middle(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    add_event(journal, "start")
    with open(path, "ab") as handle:
        handle.write(b"not json\n")
    add_event(journal, "finish")
    with pytest.raises(JournalError, match="line 2: not a JSON object"):
        Journal(path).events()


@pytest.mark.parametrize("field, value, problem", [
    ("step_s", -0.5, "expected a value >= 0"),
    ("step_s", "fast", "expected a number"),
    ("decision", "maybe", "expected one of 'keep', 'reject', 'failed'"),
    ("color", "red", "unknown key"),
])
def test_journal_refuses_an_event_of_the_wrong_shape_naming_line_and_field(tmp_path, field, value, problem):
    import json

    journal = Journal(tmp_path / "journal.jsonl")
    add_event(journal, "start")
    event = add_event(journal, "trial", run_id="r1-c1")
    from rltune.contracts.journal import event_as_data

    data = {**event_as_data(event), field: value}
    journal.path.write_bytes(journal.path.read_bytes() + json.dumps(data).encode() + b"\n")
    with pytest.raises(JournalError, match=f"line 3 \\(trial\\).{field}: {problem}"):
        journal.events()


def test_a_nan_is_never_written_to_the_journal(tmp_path):
    journal = Journal(tmp_path / "journal.jsonl")
    add_event(journal, "start")
    before = journal.path.read_bytes()
    with pytest.raises(JournalError, match="finite"):
        add_event(journal, "trial", step_s=float("nan"))
    assert journal.path.read_bytes() == before


def test_every_journal_the_project_recorded_replays_under_the_schemas():
    """The real journals of earlier tuning runs (bench/results) read whole: the schemas fit what auto wrote."""
    from rltune.tune.journal import replay

    paths = sorted((DEMO.parent.parent / "bench" / "results").glob("*/journal.jsonl"))
    assert len(paths) >= 10
    for path in paths:
        state = replay(Journal(path).events())
        assert state.start is not None and state.untuned is not None, path
        assert all(state.trial(rid) for rid in state.made_baseline)


def test_savings_shares_follow_the_seed_example():
    # Qwen3.8-27B math: 145.0 -> 39.7 s; the GPU split with log-prob reuse saved 64.2 s of 105.3 s.
    shares = shares_by_group([("gpu_split", 64.2), ("mtp", 30.0), ("trainer", 11.1)])
    assert round(shares["gpu_split"]) == 61
    assert sum(shares.values()) == pytest.approx(100.0)
    assert list(shares) == ["gpu_split", "mtp", "trainer"]


def test_savings_matrix_rows_add_to_100_and_bundles_count_once():
    groups, rows = savings_matrix({"math": [("trainer", 3.0), ("trainer", 1.0)], "code": [("async", 2.0), ("pd", 2.0)],
                                   "none": []})
    assert groups == ["trainer", "async", "pd"]
    assert rows["math"] == {"trainer": 100.0, "async": 0.0, "pd": 0.0}
    assert rows["code"]["async"] == pytest.approx(50.0)
    assert sum(rows["none"].values()) == 0.0


def test_tuned_preset_keeps_the_launch_directory_and_loads(tmp_path):
    job = load_job(DEMO)
    path = write_tuned_preset(job, DEMO, {**job.knobs, "rl_mode": "one_step_async"}, tmp_path / "tuned",
                              {"untuned_step_s": 2.0, "tuned_step_s": 1.0})
    tuned = load_job(path)
    assert tuned.knobs["rl_mode"] == "one_step_async"
    assert (path.parent / tuned.launch.workdir).resolve() == (DEMO.parent / job.launch.workdir).resolve()
    assert path.read_text().startswith("# Tuned by 'rltune auto'")


def journal_of_a_tuning_run(workdir):
    """The events 'auto' writes, with the fields the report reads (numbers only exercise the rendering)."""
    j = Journal(workdir / "journal.jsonl")
    add_event(j, "start", job="job.yaml", job_name="tiny", gpus=1, device="H200", rl_mode="sync")
    add_event(j, "baseline", round=0, run_id="base", step_s=10.0,
              stages_s={"rollout": 6.0, "training": 3.5, "weight_sync": 0.5})
    add_event(j, "trial", round=1, run_id="r1-c1", candidate="r1-c1", fixes=["one_step_async"], group="async",
              decision="keep", reason="all limits pass", step_s=7.0, baseline_step_s=10.0, gain_pct=30.0,
              forecast_step_s=6.5, forecast_range_s=[6.0, 7.5],
              stages_s={"rollout": 6.0, "training": 3.5, "weight_sync": 0.5})
    add_event(j, "trial", round=2, run_id="r2-c1", candidate="r2-c1", fixes=["larger_micro_batch"], group="trainer",
              decision="reject", reason="speed: 1% <= 4% noise", step_s=6.9, baseline_step_s=7.0, gain_pct=1.0,
              forecast_step_s=6.0, forecast_range_s=[5.5, 6.5], stages_s={})
    add_event(j, "trial", round=2, run_id="r2-c2", candidate="r2-c2", fixes=["packing"], group="trainer",
              decision="failed", reason="exit 1", step_s=None, baseline_step_s=7.0, gain_pct=None,
              forecast_step_s=6.2, forecast_range_s=[5.9, 6.8], stages_s={})
    add_event(j, "finish", reason="no candidate forecast >= 5% faster", tuned_preset="presets/tuned/tiny.yaml")


def test_report_is_one_self_contained_page_with_embedded_plots(tmp_path):
    journal_of_a_tuning_run(tmp_path)
    path = build_report(tmp_path)
    page = path.read_text()
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page and "<link" not in page
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 4                               # step, stages, forecast vs measured, GPU-seconds
    assert all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    assert re.findall(r"<img", page) and len(re.findall(r"<img", page)) == len(images)
    assert "1.43x" in page                                # 10.0 / 7.0
    assert "<td>async</td>" not in page and "<th>async</th>" in page and "<td>100</td>" in page
    assert "failed" in page and "exit 1" in page


def test_report_of_a_directory_without_a_journal_says_what_to_do(tmp_path):
    with pytest.raises(ReportError, match="rltune auto"):
        build_report(tmp_path)
