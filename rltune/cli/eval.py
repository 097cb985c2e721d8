"""``rltune eval``: forecast accuracy over a case library, rltune's own runs or imported public ones."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Forecast accuracy over a case library.

Each case is forecast from other cases only and compared with what it measured. For rltune's own
runs the others are the runs that finished before it started, as when it was planned (rule
before_start); for imported public runs (rltune library import) it is leave-one-out: every other
case, but of its own source only those of the same release or an earlier one (same_or_earlier),
or of the same release only (same). The report gives, per source and per measure (the step, each
stage the case measured, tokens/s/GPU where a source publishes only that), the median |error|, the
share within 10 %, range coverage and range sharpness (the median of high / low). For rltune's own
runs it also gives the step's error per workload and method, and the library's noise (the spread
of setups run more than once, and what a forecast without error of its own would score against
it). Forecasts of GPU jobs lean on the public runs rltune ships, as a user's do (--no-prior: not);
an imported library is never given them (its runs would forecast themselves). --out DIR gets
eval.json (every forecast) and eval.png (predicted against measured, with the +-10 % band).

Example:

\b
  rltune eval --library cases/ --out runs/eval
  rltune eval --library cases-public/ --rule same
"""


def register(app: typer.Typer) -> None:
    @app.command(name="eval", help=HELP)
    def eval_cmd(
        library: Path = typer.Option(Path("cases"), "--library", help="case library directory"),
        out: Path = typer.Option(None, "--out", help="directory for eval.json and eval.png"),
        rule: str = typer.Option(None, "--rule", help="which cases may forecast a case: before_start, same_or_earlier, same "
                                                      "(default: same_or_earlier for public runs, before_start for rltune's)"),
        no_prior: bool = typer.Option(False, "--no-prior", help="forecast GPU jobs without the public runs rltune ships"),
        json_out: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json
        import warnings

        from rltune.contracts.outputs import check_output
        from rltune.errors import RltuneError
        from rltune.predict.evaluate import RULES, evaluate, evaluate_library, plot
        from rltune.predict.library import CaseLibrary, CorruptCaseWarning

        if not library.is_dir():
            raise RltuneError(f"{library}: no case library there; pass --library DIR (a directory of case files)")
        if rule is not None and rule not in RULES:
            raise RltuneError(f"--rule {rule!r}: expected one of {', '.join(RULES)}")
        if out is not None:
            check_output(out, inputs=[library], expect="dir", writes=("eval.json", "eval.png"))
        with warnings.catch_warnings():  # every skipped case is told (rltune.cli.main formats the lines)
            warnings.simplefilter("always", CorruptCaseWarning)
            lib = CaseLibrary(library)
            cases = lib.load()
            public = any(c.public for c in cases)
            chosen = rule or ("same_or_earlier" if public else "before_start")
            # an imported library holds the very runs rltune ships: never forecast them from themselves
            prior = None if (public or no_prior) else "shipped"
            report = evaluate(cases, prior=prior) if chosen == "before_start" and not public else None
            if report is not None:
                report.skipped_files = [f"{path}: {reason}" for path, reason in lib.skipped]
            scores = report.scores if report is not None else evaluate_library(cases, rule=chosen, prior=prior)
            scores.library = str(library)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            body = report.to_dict() if report is not None else {"scores": scores.to_dict()}
            (out / "eval.json").write_text(json.dumps(body, indent=1), encoding="utf-8")
            if report is not None:
                plot(report, out / "eval.png")
            else:
                plot_scores(scores, out / "eval.png")
        if report is not None:
            _print_summary(report)
        _print_scores(scores)
        if json_out:
            print(json.dumps(report.summary() if report is not None else {"scores": scores.summary()}))


def plot_scores(scores, path: Path) -> Path:
    """Predicted against measured, per measure, with the +-10 % band (log axes: public jobs span 1 s to hours)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5.0), dpi=120)
    values = [v for r in scores.rows for v in (r.predicted, r.measured) if v > 0] or [1.0]
    lo, hi = min(values) * 0.7, max(values) * 1.4
    xs = [lo, hi]
    ax.fill_between(xs, [x * 0.9 for x in xs], [x * 1.1 for x in xs], color="tab:blue", alpha=0.15, label="within 10 %")
    ax.plot(xs, xs, color="tab:blue", lw=1)
    for measure in sorted({r.measure for r in scores.rows}):
        rows = [r for r in scores.rows if r.measure == measure]
        ax.errorbar([r.measured for r in rows], [r.predicted for r in rows],
                    yerr=[[max(r.predicted - r.low, 0) for r in rows], [max(r.high - r.predicted, 0) for r in rows]],
                    fmt="o", ms=3, lw=0.5, alpha=0.7, label=f"{measure} ({len(rows)})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured")
    ax.set_ylabel("forecast")
    ax.set_title(f"{scores.evaluated} cases, rule {scores.rule}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} %"


def _print_scores(scores) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"forecasts of {scores.evaluated} of {scores.runs} cases, each from the others the rule "
                        f"'{scores.rule}' allows{' (public runs behind GPU jobs)' if scores.prior else ''}")
    for col in ("source", "measure", "n", "median |error|", "within 10 %", "range coverage", "median high/low"):
        table.add_column(col)
    for source, measures in scores.scores.items():
        for measure, s in measures.items():
            table.add_row(source, measure, str(s.count), _pct(s.median_abs_error_pct),
                          "-" if s.within_10pct is None else f"{s.within_10pct_count} ({100 * s.within_10pct:.0f} %)",
                          "-" if s.range_coverage is None else f"{100 * s.range_coverage:.0f} %",
                          "-" if s.range_sharpness is None else f"{s.range_sharpness:.2f} x")
    console = Console(stderr=True)
    console.print(table)
    if scores.left_out:
        console.print(f"left out: {len(scores.left_out)} cases (failed runs, contradicting numbers, nothing to score or to "
                      "forecast from); eval.json lists them", markup=False, highlight=False, soft_wrap=True)


def _print_summary(report) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"retrospective forecasts: {report.evaluated} of {report.runs} runs (first runs had no history)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("median |step error|", _pct(report.median_abs_error_pct))
    table.add_row("within 10 %", "-" if report.within_10pct is None else f"{report.within_10pct_count} ({100 * report.within_10pct:.0f} %)")
    table.add_row("median |training error|", _pct(report.training_median_abs_error_pct))
    table.add_row("range coverage", "-" if report.range_coverage is None else f"{100 * report.range_coverage:.0f} %")
    if report.repeat_groups:
        table.add_row(f"repeat noise ({report.repeat_groups} setups run again)", _pct(report.repeat_noise_pct))
        table.add_row("  a perfect forecast: median |error|", _pct(report.perfect_forecast_median_abs_error_pct))
        table.add_row("  a perfect forecast: within 10 %", f"{100 * report.perfect_forecast_within_10pct:.0f} %")
    for workload, err in report.by_workload.items():
        table.add_row(f"  {workload}", _pct(err))
    for method, m in report.by_method.items():
        table.add_row(f"  {method} ({m['count']})", f"{_pct(m['median_abs_error_pct'])}, coverage {100 * m['range_coverage']:.0f} %")
    Console(stderr=True).print(table)
