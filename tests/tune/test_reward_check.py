"""The reward check: its rule on hand-computed curves, bad input refused before anything runs, and
real runs of the learning tiny math job in which a broken advantage fails and a neutral change passes.

The real runs are short (16 steps of presets/workload/tiny-math-learn.yaml: 16 tasks x 8 trials,
two-token answers) and their untuned seeds are run once and reused by the later tests, which is
also how a check interrupted by a kill goes on.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import yaml

from rltune.cli.main import main
from rltune.contracts.learning import load_learning_checks
from rltune.contracts.reward_check import REWARD_CHECK_NAME, RewardCheck, load_reward_check, save_reward_check
from rltune.contracts.stages import read_stages
from rltune.errors import ArtifactError
from rltune.tune.auto import AutoLoop
from rltune.tune.reward_check import (
    BAND_Z,
    RewardCheckInputError,
    judge_curve,
    kept_changes,
    last_reward_check,
    moving_average,
    plan_reward_check,
    run_reward_check,
    seed_band,
)

from .helpers import DEMO, REPO, add_event

LEARN = REPO / "presets" / "cpu-math-learn.yaml"
STEPS, WINDOW = 16, 4


# -- the rule on hand-computed values ----------------------------------------------------------------

def test_moving_average_is_trailing_over_full_windows_only():
    assert moving_average([1, 2, 3, 4, 5], 2) == [1.5, 2.5, 3.5, 4.5]
    assert moving_average([1, 2, 3, 4, 5], 5) == [3.0]
    assert moving_average([1, 2, 3, 4, 5], 6) == []
    assert moving_average([0.25, 0.5], 1) == [0.25, 0.5]


def test_band_is_z_pooled_seed_sd_times_the_spread_of_one_more_run():
    # Moving averages (window 2): seed A 0, 0, 0; seed B 1, 1, 1 -> centre 0.5, per-step variance 0.5.
    band = seed_band([[0, 0, 0, 0], [0, 2, 0, 2]], window=2)
    assert band.centre == [0.5, 0.5, 0.5] and band.first_step == 1
    assert band.seed_sd == pytest.approx(math.sqrt(0.5))
    assert band.half_width == pytest.approx(BAND_Z * math.sqrt(0.5) * math.sqrt(1 + 1 / 2))


def test_two_seeds_that_agree_still_leave_a_band_as_wide_as_one_runs_step_noise():
    # Identical seeds (seed sd 0) whose rewards alternate 0, 1: each step's variance is 1/4 (mean squared
    # step-to-step difference 1, halved, is 1/2 -- the variance were steps independent -- a little over);
    # a 4-step average of such steps moves by sqrt(1/2) / 2.
    rewards = [0, 1] * 6
    band = seed_band([rewards, rewards], window=4)
    assert band.seed_sd == 0 and band.step_noise_sd == pytest.approx(math.sqrt(0.5) / 2)
    assert band.half_width == pytest.approx(BAND_Z * math.sqrt(0.5) / 2 * math.sqrt(1.5))
    assert judge_curve([0.25, 1] * 6, band).passed  # averages 0.125 above: inside a 0.65 half-width


def test_pooling_keeps_a_band_where_two_seeds_cross():
    # The seeds' averages cross at the middle step (sd 0 there); the pooled band is not 0 at that step.
    band = seed_band([[0, 1, 2, 3], [3, 2, 1, 0]], window=1)
    assert band.centre == [1.5] * 4 and band.half_width > 0
    assert judge_curve([1.5, 1.5, 1.5, 1.5], band).passed


def test_a_curve_outside_the_band_fails_within_band_and_one_below_also_fails_final_window():
    band = seed_band([[0, 0, 0, 0], [0, 2, 0, 2]], window=2)  # centre 0.5, half-width 2.598
    inside = judge_curve([0, 4, 0, 4], band)                    # averages 2.0: 1.5 above
    assert inside.passed and inside.max_deviation == pytest.approx(1.5)
    above = judge_curve([0, 8, 0, 8], band)                     # averages 4.0: 3.5 above
    assert [r.passed for r in above.rules] == [False, True]     # learning differently fails; the end is not lower
    below = judge_curve([0, -6, 0, -6], band)                   # averages -3.0: 3.5 below
    assert [r.passed for r in below.rules] == [False, False]
    assert below.final_delta == pytest.approx(-3.5) and below.max_deviation_step == 1


def test_rewards_follow_the_runs_own_step_numbers_and_reused_batches_carry_their_reward():
    from rltune.tune.reward_check import _rewards

    # The reference workload counts steps from 0, TRL from 1: either is the run's first step.
    assert _rewards([{"step": s, "reward": 0.1 * s} for s in range(3)], 3) == ([0.0, 0.1, 0.2], [], 0)
    assert _rewards([{"step": s, "reward": 0.1 * s} for s in (1, 2, 3)], 3)[0] == pytest.approx([0.1, 0.2, 0.3])
    # Batch reuse 2: only the generating steps report a reward; the steps between train that batch.
    rows = [{"step": 1, "reward": 0.5}, {"step": 2, "reward": None}, {"step": 3, "reward": 0.7}, {"step": 4, "reward": None}]
    assert _rewards(rows, 4) == ([0.5, 0.5, 0.7, 0.7], [], 2)
    # A first step with no reward, or a step the run never reached, is missing, never made up.
    assert _rewards([{"step": 0, "reward": None}, {"step": 1, "reward": 0.2}], 2)[1] == [0]
    assert _rewards([{"step": 0, "reward": 0.3}], 3)[1] == [1, 2]
    assert _rewards([{"step": 0, "reward": float("nan")}, {"step": 1, "reward": 0.2}], 2)[1] == [0]


def test_kept_changes_follow_the_journal_and_a_later_change_owns_a_knob_it_moved_again(tmp_path):
    from rltune.tune.journal import Journal, replay

    untuned = {"a": 1, "b": 1, "c": 1}
    journal = Journal(tmp_path / "journal.jsonl")
    add_event(journal, "start")
    add_event(journal, "trial", decision="keep", run_id="r1-x", fixes=["fa"], knobs={"a": 2, "b": 1, "c": 1})
    add_event(journal, "round_end", round=1, outcome="kept", baseline_run="r1-x")
    add_event(journal, "trial", decision="reject", run_id="r2-y", fixes=["fc"], knobs={"a": 2, "b": 1, "c": 5})
    # kept in a parallel round, but the round went on from r2-z: not a change of the best setup
    add_event(journal, "trial", decision="keep", run_id="r2-w", fixes=["fc"], knobs={"a": 2, "b": 1, "c": 7})
    add_event(journal, "trial", decision="keep", run_id="r2-z", fixes=["fa", "fb"], knobs={"a": 3, "b": 2, "c": 1})
    add_event(journal, "round_end", round=2, outcome="kept", baseline_run="r2-z")
    changes = kept_changes(replay(journal.events()), untuned, {"a": 3, "b": 2, "c": 1})
    # r1-x only moved a, which r2-z moved again: nothing of it is left to undo.
    assert [(c.label, c.reverted) for c in changes] == [("r2-z (fa+fb)", {"a": 2, "b": 1})]


def test_a_check_file_that_breaks_its_own_rule_is_refused(tmp_path):
    common = dict(schema_version=1, reason="r", tuned_job="t.yaml", untuned_job="u.yaml", tuned_overrides={},
                  window=3, seeds=[0, 1], task_seed=0, rule="rule")
    path = tmp_path / REWARD_CHECK_NAME
    save_reward_check(RewardCheck(decision="fail", steps=10, **common), path)
    assert load_reward_check(path).decision == "fail"
    save_reward_check(RewardCheck(decision="fail", steps=5, **common), path)
    with pytest.raises(ArtifactError, match="window: steps \\(5\\) must be at least 2 x window"):
        load_reward_check(path)


# -- bad input: one line, exit 2, nothing runs ---------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--steps", "5", "--window", "3"], "--steps: 5 is too few for a 3-step window"),
    (["--steps", "10", "--seeds", "1"], "--seeds: 1; the band is the untuned setup's seed-to-seed spread"),
])
def test_steps_too_few_for_the_window_or_one_seed_is_bad_input(args, says, tmp_path, capsys):
    assert main(["reward-check", str(LEARN), "--against", str(LEARN), "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_a_job_without_seed_knobs_is_refused_with_the_fix(tmp_path, capsys):
    assert main(["reward-check", str(DEMO), "--against", str(DEMO), "--steps", "20", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rltune: {DEMO}: knobs.seed: the reward check needs a 'seed' knob")
    assert "seed: orchestrator.seed" in err


def test_a_tuned_knob_the_untuned_job_cannot_pass_is_refused(tmp_path):
    data = yaml.safe_load(LEARN.read_text())
    data["knobs"]["trainer_gpus"] = 2
    data["launch"]["knob_map"]["trainer_gpus"] = "placement.trainer_gpus"
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text(yaml.safe_dump(data))
    plan = plan_reward_check(LEARN, 20)
    with pytest.raises(RewardCheckInputError, match="no entry for 'trainer_gpus', which .*tuned.yaml sets"):
        run_reward_check(tuned, plan, tmp_path / "out")
    assert not (tmp_path / "out" / "runs").exists()


def test_a_missing_job_file_is_bad_input(tmp_path, capsys):
    assert main(["reward-check", str(tmp_path / "nope.yaml"), "--against", str(LEARN), "--steps", "20"]) == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err


# -- real runs -----------------------------------------------------------------------------------------

def _job(folder: Path, name: str, **knobs) -> Path:
    """The learning job with the diagnostic advantage_sign mapped, launched from the repository; its
    command carries a fixed lr of 1e-3 (twice the preset's) so that 16 steps learn enough to tell."""
    data = yaml.safe_load(LEARN.read_text())
    data["launch"]["workdir"] = str(REPO)
    data["launch"]["command"] = [*data["launch"]["command"], "trainer.lr=1e-3"]
    data["knobs"]["advantage_sign"] = 1
    data["launch"]["knob_map"]["advantage_sign"] = "trainer.advantage_sign"
    data["knobs"].update(knobs)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """A check of the setup whose advantages are flipped: the untuned seeds' runs are reused later."""
    folder = tmp_path_factory.mktemp("reward")
    against = _job(folder, "against")
    tuned = _job(folder, "broken", advantage_sign=-1)
    out = folder / "broken-check"
    code = main(["reward-check", str(tuned), "--against", str(against), "--steps", str(STEPS), "--window",
                 str(WINDOW), "--out", str(out)])
    return folder, against, out, code


def _reuse_untuned(broken_out: Path, out: Path) -> None:
    for run in ("untuned-s0", "untuned-s1"):
        shutil.copytree(broken_out / "runs" / run, out / "runs" / run)


def test_a_broken_advantage_fails_the_check_and_the_change_is_blamed(broken):
    _, _, out, code = broken
    check = load_reward_check(out / REWARD_CHECK_NAME)
    assert code == 3 and check.decision == "fail"
    assert {c.name: c.passed for c in check.checks} == {"within_band": False, "final_window": False}
    band = check.band
    untuned = [r for r in check.runs if r.role == "untuned"]
    tuned = next(r for r in check.runs if r.role == "tuned")
    assert [r.seed for r in untuned] == [0, 1] and tuned.seed == 0 and check.task_seed == 0
    # The untuned setup learns within these steps; the flipped advantages un-learn, lower by more than the band.
    assert band.centre_final > band.centre_first and band.half_width > 0
    assert tuned.final_window_mean < tuned.first_window_mean
    assert tuned.final_window_mean < band.centre_final - band.half_width
    assert check.tuned_overrides == {"advantage_sign": -1}
    # Undoing the one change leaves the untuned setup, whose first seed passes: it is to blame.
    assert [(a.change, a.reverted, a.passed) for a in check.attribution] == [("advantage_sign", {"advantage_sign": 1}, True)]
    assert check.blamed == ["advantage_sign"]
    # The job's knob rendering passed the seeds: each run's resolved workload config holds its seed and the task order.
    for run in check.runs:
        config = yaml.safe_load((out / run.run_dir / "config.yaml").read_text())
        assert config["orchestrator"]["seed"] == run.seed and config["env"]["seed"] == 0
        assert config["trainer"]["advantage_sign"] == (-1 if run.role == "tuned" else 1)
    # Every run directory holds reward, gap and sample age for every step.
    for run in check.runs:
        rows = read_stages(out / run.run_dir / "stages.parquet").to_pylist()
        assert sorted(r["step"] for r in rows) == list(range(STEPS))
        assert all(r["reward"] is not None and r["gap"] is not None and r["sample_age_mean"] == 0 for r in rows)


def test_a_neutral_change_passes_and_finished_runs_are_reused(broken, capsys):
    folder, against, broken_out, _ = broken
    tuned = _job(folder, "neutral", sync_transport="inprocess")  # the same weights reach the engines another way
    out = folder / "neutral-check"
    _reuse_untuned(broken_out, out)
    capsys.readouterr()
    code = main(["reward-check", str(tuned), "--against", str(against), "--steps", str(STEPS), "--window",
                 str(WINDOW), "--out", str(out)])
    err = capsys.readouterr().err
    check = load_reward_check(out / REWARD_CHECK_NAME)
    assert code == 0 and check.decision == "pass", check.reason
    assert "untuned-s0: finished earlier, reused" in err and "running untuned-s0" not in err
    assert "running tuned-s0" in err
    assert check.band.half_width == pytest.approx(load_reward_check(broken_out / REWARD_CHECK_NAME).band.half_width)
    assert check.attribution == [] and check.blamed == []


def test_a_tuned_job_that_crashes_is_exit_4_with_its_log(broken):
    folder, against, broken_out, _ = broken
    tuned = _job(folder, "crash", advantage_sign=2)  # rltune passes it on; the workload refuses it: the job exits 2
    out = folder / "crash-check"
    _reuse_untuned(broken_out, out)
    code = main(["reward-check", str(tuned), "--against", str(against), "--steps", str(STEPS), "--out", str(out)])
    check = load_reward_check(out / REWARD_CHECK_NAME)
    assert code == 4 and check.decision == "failed" and check.band is None
    assert check.reason.startswith("run tuned-s0 failed")
    assert "trainer.advantage_sign" in next(r for r in check.runs if r.role == "tuned").error


def test_auto_checks_its_tuned_preset_blames_the_knob_of_a_bundle_and_the_report_draws_the_band(broken, tmp_path):
    """The loop's end with --reward-check, on the journal of a finished tuning whose one kept change is
    a bundle: the broken advantage with the neutral sync transport (resumed to its finish)."""
    from rltune.tune.journal import Journal, replay

    folder, against, broken_out, _ = broken
    work = tmp_path / "tune"
    runs = work / "reward-check" / "runs"
    _reuse_untuned(broken_out, work / "reward-check")
    # Undoing the sync transport alone leaves the broken advantage: the broken check's tuned run is that run.
    shutil.copytree(broken_out / "runs" / "tuned-s0", runs / "without-1-sync_transport-s0")
    untuned_dir, trial_dir = broken_out / "runs" / "untuned-s0", broken_out / "runs" / "tuned-s0"
    journal = Journal(work / "journal.jsonl")
    base = yaml.safe_load(against.read_text())["knobs"]
    knobs = {**base, "advantage_sign": -1, "sync_transport": "inprocess"}
    add_event(journal, "start", job=str(against), job_name="tiny-math-learn-cpu", gpus=0, device="cpu", rl_mode="sync",
                   rounds=1, trial_budget=1, steps=STEPS, baseline_runs=1, library="cases")
    add_event(journal, "baseline", round=0, run_id="r0-untuned", run_ids=["r0-untuned"], run_dir=str(untuned_dir),
                   run_dirs=[str(untuned_dir)], knobs=base, step_s=1.0, step_median_s=1.0, stages_s={},
                   limiting_stage="rollout", problems=[], noise_pct=5.0, noise="")
    add_event(journal, "trial", round=1, run_id="r1-bundle-a1", run_dirs=[str(trial_dir)], candidate="r1-c1",
                   fixes=["flip_advantage", "inprocess_sync"], group="trainer", knobs=knobs, decision="keep",
                   reason="faster", step_s=0.5, median_s=0.5, baseline_step_s=1.0, gain_pct=50.0, noise_pct=5.0)
    add_event(journal, "round_end", round=1, outcome="kept", baseline_run="r1-bundle-a1")
    reused = {p: p.read_text() for p in runs.glob("*/launch.json")}
    code = main(["auto", str(against), "--workdir", str(work), "--rounds", "1", "--trials", "1", "--tuned-dir",
                 str(tmp_path / "tuned"), "--reward-check", str(STEPS), "--no-live", "--json"])
    assert code == 3
    event = last_reward_check(replay(journal.events()))
    bundle = "r1-bundle-a1 (flip_advantage+inprocess_sync)"
    assert event.decision == "fail" and event.blamed == [bundle, f"{bundle}: advantage_sign"]
    assert [e.event for e in journal.events()][-2:] == ["reward_check", "finish"]
    check = load_reward_check(work / event.verdict)
    # The check ran on a candidate in the work directory, before the tuned preset was written.
    assert check.tuned_job == str(work / "reward-check" / "candidate" / "tiny-math-learn-cpu.yaml")
    preset = (tmp_path / "tuned" / "tiny-math-learn-cpu.yaml").read_text()
    assert f"# learning: FAIL (reward-check over {STEPS} steps" in preset
    assert f"to blame {bundle}, {bundle}: advantage_sign; the tuner no longer proposes it" in preset
    finish = replay(journal.events()).finish
    assert (finish.learning, finish.learning_changes) == ("fail", [bundle])  # flip_advantage: no fix the knowledge base knows
    # The ban went to the case library: only the knob whose undoing alone passed.
    recorded = load_learning_checks(work / "cases").learning_checks
    assert [(r.job_name, r.decision, [(b.change, b.knobs) for b in r.banned]) for r in recorded] == [
        ("tiny-math-learn-cpu", "fail", [(f"{bundle}: advantage_sign", {"advantage_sign": -1})])]
    # A later tuning of the job on that library (a fresh work directory) never proposes it again.
    later = AutoLoop(against, tmp_path / "later", library=work / "cases")
    assert {("advantage_sign", -1)} in later._limit_breaking_settings()
    assert check.window == 2  # the default: a tenth of the steps, at least 2
    assert [(a.change, a.run_id, a.passed) for a in check.attribution] == [
        (bundle, "untuned-s0", True),                                        # undone: the untuned setup
        (f"{bundle}: sync_transport", "without-1-sync_transport-s0", False),  # the broken advantage alone fails
        (f"{bundle}: advantage_sign", "without-1-advantage_sign-s0", True)]  # the neutral transport alone passes
    # The runs found finished were reused, not run again.
    assert {p: p.read_text() for p in reused} == reused and len(reused) == 3
    page = (work / "report.html").read_text()
    section = page[page.index("<h2>Reward check</h2>"):]
    assert "FAIL" in section[:400] and 'src="data:image/png;base64,' in section
    assert "flip_advantage" in section and "To blame" in section


def test_auto_without_a_reward_check_marks_a_learning_change_unchecked_and_counts_what_tuning_cost(broken, tmp_path,
                                                                                                     capsys):
    """A finished tuning whose one kept change is fully async (knowledge.yaml: risks reward), resumed to its
    finish with no --reward-check: the preset says learning unchecked, the report says so, and --json and the
    report give the device-seconds of every run in the work directory."""
    import json
    import os

    from rltune.tune.journal import Journal, replay

    _, against, broken_out, _ = broken
    work = tmp_path / "tune"
    for name, run in (("r0-untuned", "untuned-s0"), ("r1-c1-a1", "tuned-s0")):
        shutil.copytree(broken_out / "runs" / run, work / "runs" / name)
    # A run cut off by a kill: its launch record holds only its submission; it counts to its last write.
    cut = work / "runs" / "r1-c2-a1"
    cut.mkdir()
    (cut / "launch.json").write_text(json.dumps({"version": 1, "submitted_at": 1000.0}))
    (cut / "launch.log").write_text("step 0\n")
    for f in cut.iterdir():
        os.utime(f, (1042.5, 1042.5))
    walls = [json.loads((work / "runs" / n / "launch.json").read_text())["wall_s"] for n in ("r0-untuned", "r1-c1-a1")]
    journal = Journal(work / "journal.jsonl")
    base = yaml.safe_load(against.read_text())["knobs"]
    knobs = {**base, "rl_mode": "fully_async"}
    add_event(journal, "start", job=str(against), job_name="tiny-math-learn-cpu", gpus=0, device="cpu", rl_mode="sync",
              rounds=1, trial_budget=1, steps=STEPS, baseline_runs=1, library="cases")
    add_event(journal, "baseline", round=0, run_id="r0-untuned", run_ids=["r0-untuned"], run_dir="runs/r0-untuned",
              run_dirs=["runs/r0-untuned"], knobs=base, step_s=1.0, step_median_s=1.0, stages_s={},
              limiting_stage="rollout", problems=[], noise_pct=5.0, noise="")
    add_event(journal, "trial", round=1, run_id="r1-c1-a1", run_dirs=["runs/r1-c1-a1"], candidate="r1-c1",
              fixes=["fully_async"], group="async", knobs=knobs, decision="keep", reason="faster", step_s=0.5,
              median_s=0.5, baseline_step_s=1.0, gain_pct=50.0, noise_pct=5.0)
    add_event(journal, "round_end", round=1, outcome="kept", baseline_run="r1-c1-a1")
    capsys.readouterr()
    code = main(["auto", str(against), "--workdir", str(work), "--rounds", "1", "--trials", "1", "--tuned-dir",
                 str(tmp_path / "tuned"), "--no-live", "--json"])
    out = capsys.readouterr()
    assert code == 0
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["learning"] == "unchecked" and summary["learning_changes"] == ["r1-c1-a1 (fully_async)"]
    assert "learning unchecked: r1-c1-a1 (fully_async)" in out.err
    cost = summary["tuning_cost"]
    assert (cost["runs"], cost["unfinished"], cost["devices"], cost["device"]) == (3, 1, 1, "CPU host")
    assert cost["wall_s"] == pytest.approx(sum(walls) + 42.5) and cost["device_s"] == pytest.approx(cost["wall_s"])
    assert cost["saving_s_per_step"] == pytest.approx(0.5) and cost["payback_steps"] == pytest.approx(cost["wall_s"] / 0.5)
    preset = (tmp_path / "tuned" / "tiny-math-learn-cpu.yaml").read_text()
    assert "# learning: UNCHECKED: r1-c1-a1 (fully_async) alter what is learned per fresh sample" in preset
    assert replay(journal.events()).reward_check is None  # nothing ran
    page = (work / "report.html").read_text()
    assert "UNCHECKED" in page and "What tuning cost" in page and "paid back after" in page
    assert not (work / "cases" / "learning-checks.yaml").exists()


def test_which_kept_changes_alter_what_is_learned():
    from rltune.tune.knowledge import load_default_knowledge
    from rltune.tune.learning import alters_learning

    knowledge = load_default_knowledge()
    for fix in ("fully_async", "one_step_async", "longer_sample_age", "reuse_each_batch_twice",
                "generate_two_steps_at_once"):
        assert alters_learning([fix], knowledge), fix
    for fix in ("sequence_packing", "larger_micro_batch", "engine_compile", "sandbox_host_on_spare_cores",
                "prebuilt_image", "inprocess_sync"):
        assert not alters_learning([fix], knowledge), fix
    assert alters_learning(["sequence_packing", "fully_async"], knowledge)  # a bundle with one
    assert alters_learning(["a_fix_no_knowledge_base_holds"], knowledge)  # nothing says it does not
