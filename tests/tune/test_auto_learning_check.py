"""The learning check inside a real 'rltune auto': a faster change that breaks learning is kept by the
speed trial, caught by the reward check before the preset is written, blamed, and never proposed again.

The job is the learning tiny math job (presets/cpu-math-learn.yaml at lr 1e-3, as the reward-check
tests run it) with two knobs only, and a knowledge base holding one more fix: a quarter of the batch
with flipped advantages. Four times less work a step is kept beyond any noise of this machine; the
flipped advantages un-learn, which the 16-step check sees. A second tuning of the job on the same
case library finds its one candidate banned. About 5 minutes on the loaded 2-core machine (eight runs).
"""

from __future__ import annotations

import json

import pytest
import yaml

from rltune.cli.main import main
from rltune.contracts.learning import load_learning_checks
from rltune.contracts.reward_check import load_reward_check
from rltune.tune.journal import read_state

from .helpers import REPO

pytestmark = pytest.mark.slow
STEPS = 16


def _job_and_knowledge(folder):
    data = yaml.safe_load((REPO / "presets" / "cpu-math-learn.yaml").read_text())
    data["launch"]["workdir"] = str(REPO)
    data["launch"]["command"] = [*data["launch"]["command"], "trainer.lr=1e-3"]
    # rl_mode is the job's fact for the forecast; unmapped, no fix can move it
    data["knobs"] = {"rl_mode": "sync", "tasks_per_batch": 16, "advantage_sign": 1, "seed": 0, "task_seed": 0}
    data["launch"]["knob_map"] = {"tasks_per_batch": "orchestrator.tasks_per_batch",
                                  "advantage_sign": "trainer.advantage_sign", "seed": "orchestrator.seed",
                                  "task_seed": "env.seed"}
    data["limits"].update(baseline_runs=1, steps=6, warmup_steps=2, noise_pct=10)
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    kb = yaml.safe_load((REPO / "presets" / "knowledge.yaml").read_text())
    kb["knobs"]["tasks_per_batch"] = {"description": "tasks per batch", "type": "int", "min": 1, "max": 1024}
    kb["knobs"]["advantage_sign"] = {"description": "-1 flips every advantage", "type": "int", "min": -1, "max": 1}
    kb["fixes"].append({"id": "quarter_batch_flipped", "title": "a quarter of the batch, advantages flipped",
                        "problems": ["stages_serialized"], "overrides": {"tasks_per_batch": 4, "advantage_sign": -1},
                        "group": "trainer", "moves": ["rollout", "training"], "risks": ["reward"], "source": "test"})
    knowledge = folder / "knowledge.yaml"
    knowledge.write_text(yaml.safe_dump(kb, sort_keys=False))
    return job, knowledge


def test_auto_keeps_a_faster_change_the_reward_check_catches_and_bans_for_the_job(tmp_path, capsys):
    job, knowledge = _job_and_knowledge(tmp_path)
    work = tmp_path / "work"
    code = main(["auto", str(job), "--workdir", str(work), "--knowledge", str(knowledge), "--rounds", "1",
                 "--trials", "1", "--tuned-dir", str(tmp_path / "tuned"), "--reward-check", str(STEPS), "--no-live",
                 "--json"])
    out = capsys.readouterr()
    assert out.out.strip(), out.err[-2000:]
    summary = json.loads(out.out.strip().splitlines()[-1])
    state = read_state(work / "journal.jsonl")
    assert code == 3  # the check failed
    (trial,) = state.trials
    assert trial.decision == "keep" and trial.knobs["advantage_sign"] == -1
    label = f"{trial.run_id} (quarter_batch_flipped)"
    assert summary["learning"] == "fail" and summary["learning_changes"] == [label]
    check = load_reward_check(work / state.reward_check.verdict)
    assert check.decision == "fail" and label in check.blamed
    assert check.tuned_job == str(work / "reward-check" / "candidate" / "tiny-math-learn-cpu.yaml")
    assert "# learning: FAIL" in (tmp_path / "tuned" / "tiny-math-learn-cpu.yaml").read_text()
    # Every run counted: the baseline, the trial, the check's two seeds, its tuned run and its reverted runs.
    cost = summary["tuning_cost"]
    assert len(check.runs) >= 4 and cost["runs"] == len(list((work / "runs").iterdir())) + len(check.runs)
    assert cost["payback_steps"] == pytest.approx(cost["wall_s"] / cost["saving_s_per_step"])
    (record,) = load_learning_checks(work / "cases").learning_checks
    assert record.decision == "fail" and record.banned
    banned = [b.knobs for b in record.banned]
    assert all(set(b.items()) <= {("tasks_per_batch", 4), ("advantage_sign", -1)} for b in banned)

    # A later tuning of the same job on the same library: its one candidate holds the ban and is not run.
    later = tmp_path / "later"
    code = main(["auto", str(job), "--workdir", str(later), "--library", str(work / "cases"), "--knowledge",
                 str(knowledge), "--rounds", "1", "--trials", "1", "--tuned-dir", str(tmp_path / "tuned2"), "--no-live",
                 "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["trials"] == 0 and "failed a reward check" in summary["reason"]
    assert read_state(later / "journal.jsonl").round_ends[-1].banned
