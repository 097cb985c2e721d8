"""``rltune predict``: forecast each candidate's stage and step times from the case library and the theory model."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Forecast each candidate's stage and step times from the case library and the theory model.

Each candidate is forecast from an anchor (a measured run of the same job with a similar setup),
else from similar runs scaled by the theory model, else from theory alone. The baseline's own
run is recorded in the library first (from the candidates' baseline_dir), so gains are against
its measured step. Candidates are ranked in the order to try them; those forecast at least
limits.min_forecast_gain_pct (5 %) faster, or whose range reaches that gate while the evidence is
thin, are marked worth a trial. The ranked table (25 rows) goes to stderr, every forecast to
forecast.yaml (--out) and to --json. The library must exist (rltune profile --library or rltune
auto make one); --new-library starts one.

Example:

\b
  rltune predict candidates.yaml --library cases/ --out forecast.yaml
"""


def _resolve_job(candidates_path: Path, named: str) -> Path:
    from rltune.errors import RltuneError

    direct = Path(named)
    if direct.exists():
        return direct
    beside = candidates_path.parent / named
    if beside.exists():
        return beside
    raise RltuneError(f"{candidates_path}: job: {named} does not exist (nor beside the file); pass --job job.yaml")


def register(app: typer.Typer) -> None:
    @app.command(name="predict", help=HELP)
    def predict_cmd(
        candidates: Path = typer.Argument(..., help="candidates.yaml from 'rltune propose'"),
        library: Path = typer.Option(Path("cases"), "--library", help="case library directory"),
        job: Path = typer.Option(None, "--job", help="job.yaml (default: the one the candidates file names)"),
        out: Path = typer.Option(None, "--out", help="write forecast.yaml here"),
        new_library: bool = typer.Option(False, "--new-library", help="create --library if it does not exist"),
        json_out: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json
        import sys
        import warnings

        from rltune.contracts.candidates import load_candidates
        from rltune.contracts.forecast import save_forecast
        from rltune.contracts.identity import check_same_job
        from rltune.contracts.job import check_knob_overrides, load_job
        from rltune.contracts.outputs import check_output
        from rltune.errors import RltuneError
        from rltune.predict.forecast import forecast_candidates
        from rltune.predict.library import (
            CaseLibrary,
            CorruptCaseWarning,
            LibraryMissingError,
            record_baseline,
        )

        check_output(library, inputs=[candidates, job], expect="dir", flag="--library")
        if out is not None:
            check_output(out, inputs=[candidates, job, library])
        cands = load_candidates(candidates)
        job_path = job or _resolve_job(candidates, cands.job)
        job_spec = load_job(job_path)
        # before the baseline is recorded as this job's case: the file is this job's, its knobs the job's kinds
        check_same_job(str(candidates), cands.job_name, job_spec, str(job_path))
        check_knob_overrides(job_spec, cands.baseline_knobs, f"{candidates}: baseline_knobs")
        for number, cand in enumerate(cands.candidates):
            check_knob_overrides(job_spec, cand.overrides, f"{candidates}: candidates[{number}].overrides")
        if cands.baseline_dir and not Path(cands.baseline_dir).is_dir():
            raise RltuneError(f"{candidates}: baseline_dir: {cands.baseline_dir} is not a directory; run 'rltune propose' "
                              f"again on the diagnosis.yaml inside the baseline's run directory")
        if out is not None:
            check_output(out, inputs=[job_path])
        if not library.is_dir():
            if not new_library:
                raise LibraryMissingError(f"--library {library}: no such case library; point it at the one 'rltune profile "
                                          "--library' or 'rltune auto' wrote, or pass --new-library to start one")
            library.mkdir(parents=True)
        lib = CaseLibrary(library)
        recorded = record_baseline(lib, cands, job_spec)
        with warnings.catch_warnings():  # every skipped case is told (rltune.cli.main formats the lines)
            warnings.simplefilter("always", CorruptCaseWarning)
            result = forecast_candidates(job_spec, cands, lib, job_path=str(job_path), candidates_file=str(candidates),
                                         library_path=str(library))
        if recorded:
            print(f"rltune: recorded the baseline run {cands.baseline_run} as a case in {library}", file=sys.stderr)
        if out is not None:
            save_forecast(result, out)
        _print_table(result, job_spec.limits.min_forecast_gain_pct)
        if json_out:
            print(json.dumps({
                "baseline_step_s": result.baseline_step_s, "baseline_run": result.baseline_run,
                "baseline_method": result.baseline_method, "out": str(out) if out else None, "skipped_cases": len(lib.skipped),
                "forecasts": [{"candidate": f.candidate, "step_s": f.step_s, "range_s": f.range_s, "gain_pct": f.gain_pct,
                               "worth_trial": f.worth_trial, "worth": f.worth, "method": f.method,
                               "limiting_stage": f.limiting_stage}
                              for f in result.forecasts],
            }))


TABLE_ROWS = 25  # rendering a rich table costs ~5 ms a row; the files hold every forecast


def _print_table(result, min_gain: float) -> None:
    from rich.console import Console
    from rich.table import Table

    hidden = max(len(result.forecasts) - TABLE_ROWS, 0)
    more = f"; {hidden} slower ones not shown" if hidden else ""
    console = Console(stderr=True)
    # on plain lines, not a table title: rich would wrap the baseline's run id inside the title
    console.print(f"forecast against baseline {result.baseline_run or ''} {result.baseline_step_s:.3f} s "
                  f"({result.baseline_method}); worth a trial: >= {min_gain:g} % faster (*) or its range reaches it "
                  f"(~){more}", markup=False, highlight=False, soft_wrap=True)
    table = Table()
    for col in ("", "candidate", "step s", "range s", "gain %", "limited by", "method", "uncertain"):
        table.add_column(col)
    for f in result.forecasts[:TABLE_ROWS]:
        mark = {"point": "*", "range": "~"}.get(f.worth, "")
        table.add_row(mark, f.candidate, f"{f.step_s:.3f}", f"{f.range_s[0]:.3f}-{f.range_s[1]:.3f}",
                      f"{f.gain_pct:+.1f}", f.limiting_stage, f.method, ", ".join(f.uncertain))
    console.print(table)
    public = sorted({c.run_id for f in result.forecasts[:TABLE_ROWS] for c in f.cases if c.run_id.startswith("public/")})
    if public:  # the library had no runs near: these forecasts stand on measurements other projects published
        console.print(f"forecasts above lean on {len(public)} public runs (forecast.yaml names them with their weights): "
                      f"{', '.join(public[:5])}{' ...' if len(public) > 5 else ''}", markup=False, highlight=False, soft_wrap=True)
