"""``rltune reward-check``: does the tuned setup learn like the untuned one over a long run?"""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Run the tuned and the untuned setup for many steps and compare their reward curves.

Every run goes through the untuned job's launch (UNTUNED.yaml), the tuned one with the knobs
TUNED.yaml sets differently, for --steps steps on the same task order (the job's task_seed knob).
The untuned setup runs --seeds times (its 'seed' knob = seed, seed+1, ...); the tuned setup runs
once with the first seed. Runs go one after another.

Rule, fixed before the runs: smooth each run's reward with a trailing --window-step moving average
(default a tenth of the steps); at each step the untuned seeds' averages give a centre and a
standard deviation, pooled over the steps and never below what one run's average moves from its
own step-to-step noise: sd. The band's half-width is h = 3 x sd x sqrt(1 + 1/K) for K seeds. The
tuned setup passes when its moving average stays within centre +- h at every step and its
final-window mean is not below the untuned one by more than h. A failing
check re-runs the tuned setup with each change undone in turn (the kept changes of --journal, an
'rltune auto' journal.jsonl, else one knob at a time) and names the change(s) to blame; a blamed
change of several knobs is then undone one knob at a time.

Writes OUT/reward_check.yaml and OUT/runs/<run>/ (stages.parquet with reward, gap and sample age
per step). A run already finished in OUT with the same knobs is reused.

Exit code: 0 pass, 3 fail, 4 a job failed (crashed, timed out or reported no reward), 2 bad input.

Example:

\b
  rltune reward-check runs/demo/tuned/tiny-math-cpu.yaml --against presets/cpu-math-learn.yaml --steps 300
"""


def register(app: typer.Typer) -> None:
    @app.command(name="reward-check", help=HELP)
    def reward_check_cmd(
        tuned: Path = typer.Argument(..., help="tuned job.yaml (e.g. the preset 'rltune auto' wrote)"),
        against: Path = typer.Option(..., "--against", help="untuned job.yaml; every run goes through its launch"),
        steps: int = typer.Option(..., "--steps", help="steps of every run, 1 to 1000000"),
        seeds: int = typer.Option(2, "--seeds", help="untuned seeds the band is measured from (at least 2)"),
        window: int = typer.Option(None, "--window", help="moving-average window in steps (default steps / 10, at least 2)"),
        out: Path = typer.Option(None, "--out", help="output directory (default runs/reward-check/<time>-<tuned name>)"),
        journal: Path = typer.Option(None, "--journal", help="'rltune auto' journal.jsonl: undo its kept changes on a failure"),
        as_json: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json

        from rltune.cli.options import check_steps
        from rltune.contracts.identity import check_same_job
        from rltune.contracts.job import load_job
        from rltune.contracts.outputs import check_output
        from rltune.tune.reward_check import (
            RewardCheckInputError,
            kept_changes,
            plan_reward_check,
            run_reward_check,
        )

        check_steps(steps)
        if out is not None:
            check_output(out, inputs=[tuned, against, journal], expect="dir", writes=("reward_check.yaml",))
        journal_state = None
        if journal is not None:  # read before anything else: a journal rltune cannot read is the first thing to say
            from rltune.tune.journal import read_state

            if not journal.is_file():
                raise RewardCheckInputError(f"{journal}: no such file; give the journal.jsonl of an 'rltune auto' "
                                            f"--workdir, or leave --journal out to undo one knob at a time")
            journal_state = read_state(journal)
        plan = plan_reward_check(against, steps, seeds, window)
        tuned_job = load_job(tuned)
        check_same_job(str(tuned), tuned_job.name, plan.job, str(against))  # a tuned preset keeps its untuned job's name
        changes = None if journal_state is None else kept_changes(journal_state, plan.job.knobs, tuned_job.knobs)
        if out is None:
            from rltune.launch import new_run_id

            out = Path("runs") / "reward-check" / new_run_id(tuned_job.name)
        console = _console()

        def on_run(run_id: str, state: str, detail: str) -> None:
            if state == "start":
                console.print(f"running {run_id} ({detail})", markup=False, highlight=False)
            elif state == "reused":
                console.print(f"{run_id}: finished earlier, reused", markup=False, highlight=False)
            else:
                console.print(f"{run_id}: {detail}", markup=False, highlight=False)

        outcome = run_reward_check(tuned, plan, out, changes=changes, on_run=on_run)
        check = outcome.check
        _show(console, check)
        if as_json:
            print(json.dumps({"reward_check": str(outcome.path), "decision": check.decision, "reason": check.reason,
                              "half_width": check.band.half_width if check.band else None,
                              "rise_in_bands": check.band.rise_in_bands if check.band else None,
                              "checks": {c.name: c.passed for c in check.checks}, "blamed": check.blamed,
                              "wall_s": check.wall_s}))
        else:
            typer.echo(str(outcome.path))
        if outcome.exit_code:
            raise typer.Exit(outcome.exit_code)


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _show(console, check) -> None:
    def fmt(value) -> str:
        return "-" if value is None else f"{value:.3g}"

    console.print(f"reward check: {check.decision.upper()} - {check.reason}", markup=False, highlight=False)
    for run in check.runs:  # one line each: run ids of undone changes are long, a table would cut them
        console.print(f"  {run.run_id}: {run.status}, first window {fmt(run.first_window_mean)}, final window "
                      f"{fmt(run.final_window_mean)}, max deviation {fmt(run.max_deviation)}, gap {fmt(run.gap_mean)}, "
                      f"sample age {fmt(run.sample_age_mean)}, step {fmt(run.step_s_mean)} s", markup=False,
                      highlight=False)
    if check.band is not None:
        b = check.band
        rise = "" if b.rise_in_bands is None else f" ({b.rise_in_bands:.2g} half-widths)"
        console.print(f"band: half-width {b.half_width:.4g} (z {b.z:g} x sd {b.sd:.4g}: seeds {b.seed_sd:.4g}, step noise "
                      f"{b.step_noise_sd:.4g}); untuned rose "
                      f"{b.centre_first:.4g} -> {b.centre_final:.4g}{rise}, step 0: {b.step0_mean:.4g}", markup=False, highlight=False)
    for item in check.attribution:
        state = "n/a" if item.passed is None else "passes" if item.passed else "still fails"
        console.print(f"without {item.change}: {state}", markup=False, highlight=False)
    for note in check.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
