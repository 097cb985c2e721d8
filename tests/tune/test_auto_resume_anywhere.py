"""``rltune auto`` resumes from any working directory: the journal's paths are relative to the work directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from rltune.cli.main import main
from rltune.predict.library import CaseLibrary

from .helpers import DEMO


def _events(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "journal.jsonl").read_text().splitlines() if line.strip()]


def test_an_interrupted_auto_resumes_from_another_directory(tmp_path, monkeypatch, capsys):
    data = yaml.safe_load(DEMO.read_text())
    data["launch"]["workdir"] = str(DEMO.parent.parent)
    data["limits"].update(baseline_runs=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    job = tmp_path / "a" / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))

    monkeypatch.chdir(tmp_path / "a")
    argv = ["auto", "job.yaml", "--workdir", "tune", "--trials", "1", "--steps", "3", "--tuned-dir", "tuned", "--no-live"]
    assert main(argv) == 0
    workdir = tmp_path / "a" / "tune"
    events = _events(workdir)
    for e in events:
        for key in ("run_dir", "run_dirs", "candidates_file", "forecast_file", "verdict", "metrics_path", "library"):
            for value in (e.get(key) if isinstance(e.get(key), list) else [e.get(key)]):
                assert value is None or not os.path.isabs(value), (e["event"], key, value)
    # as if killed after the trial was journalled: drop the round's end and the finish
    cut = next(i for i, e in enumerate(events) if e["event"] == "trial") + 1
    (workdir / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events[:cut]))

    monkeypatch.chdir(tmp_path / "b")
    again = ["auto", str(job), "--workdir", str(workdir), "--trials", "1", "--steps", "3", "--tuned-dir", "tuned",
             "--no-live", "--json"]
    capsys.readouterr()
    assert main(again) == 0
    summary = json.loads(capsys.readouterr().out)
    resumed = _events(workdir)
    assert [e["event"] for e in resumed].count("start") == 1
    assert [e["event"] for e in resumed].count("run_start") == [e["event"] for e in events].count("run_start")
    assert resumed[-1]["event"] == "finish" and summary["trials"] == 1
    assert Path(summary["tuned_preset"]).exists() and (workdir / "report.html").exists()
    ids = [r.run_id for r in CaseLibrary(workdir / "cases").load()]
    assert len(ids) == len(set(ids)) and "r0-untuned" in ids
