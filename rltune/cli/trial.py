"""``rltune trial``: run a forecast candidate for real and keep it only if it beats noise within the limits."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Run a forecast candidate for real and keep it only if it beats noise within the limits.

The candidate runs through the job's launcher for limits.steps steps (or --steps), is timed on the
same steps as the baseline of its candidates.yaml, and its mean step must be faster by more than
the noise -- the baseline's measured spread, at least limits.noise_pct (a smaller gain is measured
again first) -- with the trainer-rollout gap, sample age and trial shares within their limits.
verdict.yaml lands in the run directory and the run joins the case library with the forecast
made before it. Without --candidate it runs the one 'rltune auto' would: the first worth a trial
in the forecast's order that the library has not measured and that holds no setting that crashed
or broke a numerical limit in the library's runs of the job.

Exit code: 0 kept, 3 rejected (a limit failed), 4 the job failed (crashed, timed out or measured
nothing), 2 bad input.

Example:

\b
  rltune trial forecast.yaml --job job.yaml --candidate r1-c2
"""


def register(app: typer.Typer) -> None:
    @app.command(name="trial", help=HELP)
    def trial_cmd(
        forecast: Path = typer.Argument(..., help="forecast.yaml from 'rltune predict'"),
        job: Path = typer.Option(..., "--job", help="job.yaml to run"),
        candidate: str = typer.Option(None, "--candidate", help="candidate id (default: the fastest forecast worth a trial)"),
        steps: int = typer.Option(None, "--steps", help="steps to run, 1 to 1000000 (default limits.steps)"),
        runs_root: Path = typer.Option(Path("runs"), "--runs-root", help="where the run directory is made"),
        library: Path = typer.Option(None, "--library", help="case library (default: the one the forecast used)"),
        no_remeasure: bool = typer.Option(False, "--no-remeasure", help="decide on one run even when the gain is small"),
        as_json: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json

        from rltune.cli.options import check_steps
        from rltune.contracts.candidates import load_candidates
        from rltune.contracts.forecast import load_forecast
        from rltune.contracts.identity import check_same_job
        from rltune.contracts.job import check_knob_overrides, load_job
        from rltune.contracts.outputs import check_output
        from rltune.contracts.rundir import VERDICT_NAME, RunDir
        from rltune.errors import RltuneError
        from rltune.launch import new_run_id
        from rltune.predict.library import CaseLibrary
        from rltune.tune.limits import measured_noise
        from rltune.tune.trial import Baseline, run_trial

        check_steps(steps)
        check_output(runs_root, inputs=[forecast, job], expect="dir", flag="--runs-root")
        if library is not None:
            check_output(library, inputs=[forecast, job], expect="dir", flag="--library")
        spec = load_job(job)
        predicted = load_forecast(forecast)
        candidates_path = _beside(forecast, predicted.candidates_file)
        if not candidates_path.is_file():
            raise RltuneError(f"{forecast}: candidates_file: {predicted.candidates_file} does not exist (nor beside the "
                              f"forecast); make the forecast again with 'rltune predict', or put the candidates.yaml back")
        candidates = load_candidates(candidates_path)
        check_same_job(str(forecast), predicted.job_name, spec, str(job))
        check_same_job(str(candidates_path), candidates.job_name, spec, str(job))
        if not candidates.baseline_dir:
            raise RltuneError(f"{predicted.candidates_file}: baseline_dir: not set; run 'rltune propose' on the "
                              f"diagnosis.yaml inside the baseline's run directory")
        lib = CaseLibrary(library or predicted.library)
        lib.load()  # a library that cannot be read is refused here, before the trial runs and appends to it
        if candidate is None:
            pick_fc = _pick(spec, predicted, candidates, lib)
            if pick_fc is None:
                raise RltuneError(f"{forecast}: no candidate worth a trial is left (none reaches the "
                                  f"{spec.limits.min_forecast_gain_pct:g}% gate, even at the low end of its range, "
                                  f"or the library measured it); name one with --candidate to run it anyway")
        else:
            pick_fc = next((f for f in predicted.forecasts if f.candidate == candidate), None)
            if pick_fc is None:
                known = ", ".join(f.candidate for f in predicted.forecasts)
                raise RltuneError(f"{forecast}: no candidate {candidate!r}; the file has {known}")
        baseline_dir = RunDir(candidates.baseline_dir)
        untuned_dir = RunDir(candidates.untuned_dir or candidates.baseline_dir)
        untuned_rows = untuned_dir.rows()
        baseline = Baseline(run_id=candidates.baseline_run, rows=baseline_dir.rows(),
                            untuned_run=untuned_dir.name, untuned_rows=untuned_rows,
                            untuned_noise_pct=measured_noise(spec.limits, untuned_rows).measured_pct)
        check_knob_overrides(spec, pick_fc.overrides, f"{forecast}: candidate {pick_fc.candidate}: overrides")
        run_id = new_run_id(f"{spec.name}-{pick_fc.candidate}")
        outcome = run_trial(spec, job, pick_fc, baseline_knobs=candidates.baseline_knobs, baseline=baseline,
                            library=lib, run_root=runs_root, run_id=run_id, steps=steps, remeasure=not no_remeasure)
        verdict = outcome.verdict
        path = Path(runs_root) / run_id / VERDICT_NAME
        _show(verdict, path)
        if as_json:
            print(json.dumps({"verdict": str(path), "decision": verdict.decision, "step_s": verdict.step_s,
                              "median_s": verdict.median_s, "baseline_step_s": verdict.baseline_step_s,
                              "gain_pct": verdict.gain_pct, "noise_pct": verdict.noise_pct,
                              "failed_limits": [c.name for c in verdict.limits if c.passed is False],
                              "unmeasured_limits": [c.name for c in verdict.limits if c.passed is None]}))
        else:
            typer.echo(str(path))
        if outcome.exit_code:
            raise typer.Exit(outcome.exit_code)


def _beside(forecast: Path, named: str) -> Path:
    """A file a forecast names: as written, else beside the forecast file."""
    direct = Path(named)
    if direct.is_absolute() or direct.exists():
        return direct
    beside = forecast.parent / direct.name
    return beside if beside.exists() else direct


def _pick(spec, predicted, candidates, lib):
    """The candidate 'rltune auto' would run next, with what the library measured of this job."""
    from rltune.tune.pick import failed_settings, limit_breaking_settings, pick
    from rltune.tune.trial import library_outcomes

    measured = library_outcomes(spec, lib.load() if lib.path.is_dir() else [])
    return pick(predicted, candidates.baseline_knobs, failed=failed_settings((k, d) for k, d, _ in measured),
                broke_limits=limit_breaking_settings(measured),
                tried=[candidates.baseline_knobs, *[knobs for knobs, _, _ in measured]])


def _show(verdict, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    # the decision, its reason and the path on plain lines: in a table title rich would wrap them mid-word
    console.print(f"{verdict.candidate}: {verdict.decision.upper()} - {verdict.reason}", markup=False,
                  highlight=False, soft_wrap=True)
    console.print(f"verdict: {path}", markup=False, highlight=False, soft_wrap=True)
    table = Table()
    for name in ("limit", "value", "threshold", "pass"):
        table.add_column(name)
    for check in verdict.limits:
        table.add_row(check.name, "n/a" if check.value is None else f"{check.value:.4g}",
                      "n/a" if check.threshold is None else f"{check.threshold:.4g}",
                      "not measured" if check.passed is None else "yes" if check.passed else "NO")
    if verdict.limits:  # a job that failed has no limit to show
        console.print(table)
    if verdict.log_tail:
        console.print(verdict.log_tail, markup=False, highlight=False)
