"""``rltune propose``: compose candidate setups that fix the bottleneck (and the next one) from the knowledge base."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Compose candidate setups that fix the bottleneck (and the next one) from the knowledge base.

Every setup fixes each problem found in the limiting stage and in the stage that would limit next;
fixes that conflict or stop applying once combined are never put together. The baseline's knobs
are read from the run directory's resolved job.yaml when there is one.

Example:

\b
  rltune propose runs/base/diagnosis.yaml --job job.yaml --out candidates.yaml
"""


def register(app: typer.Typer) -> None:
    @app.command(name="propose", help=HELP)
    def propose_cmd(
        diagnosis: Path = typer.Argument(..., help="diagnosis.yaml of the baseline run"),
        job: Path = typer.Option(..., "--job", help="job.yaml the candidates are for"),
        out: Path = typer.Option(None, "--out", help="where to write candidates.yaml (default: beside the diagnosis)"),
        knowledge: Path = typer.Option(None, "--knowledge", help="knowledge base (default presets/knowledge.yaml)"),
        untuned: Path = typer.Option(None, "--untuned", help="run directory of the untuned baseline (default: this baseline)"),
        max_candidates: int = typer.Option(12, "--max", help="keep at most this many setups (at least 1)"),
        allow_needs: bool = typer.Option(False, "--allow-needs", help="also propose fixes that need hardware beyond the budget"),
        as_json: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json

        from rltune.cli.options import check_at_least
        from rltune.contracts.candidates import save_candidates
        from rltune.contracts.diagnosis import load_diagnosis
        from rltune.contracts.job import load_job
        from rltune.contracts.outputs import check_output
        from rltune.contracts.rundir import RunDir
        from rltune.errors import RltuneError
        from rltune.tune.knowledge import load_default_knowledge
        from rltune.tune.propose import propose

        check_at_least(max_candidates, 1, "--max", "the number of setups to keep")
        run_dir = diagnosis.resolve().parent
        target = check_output(out or run_dir / "candidates.yaml", inputs=[diagnosis, job, knowledge, untuned])
        if untuned is not None and not RunDir(untuned).has_stages():
            raise RltuneError(f"--untuned {untuned}: not a run directory with a stages.parquet; give the run directory "
                              f"'rltune profile' wrote for the untuned job")
        spec = load_job(job)
        found = load_diagnosis(diagnosis)
        knobs = dict(spec.knobs)
        if (run_dir / "job.yaml").exists():
            knobs.update(load_job(run_dir / "job.yaml").knobs)
        result = propose(found, spec, load_default_knowledge(knowledge), knobs=knobs, job_path=str(job),
                         max_candidates=max_candidates, allow_needs=allow_needs, baseline_dir=str(run_dir),
                         untuned_dir=str(untuned.resolve()) if untuned else None, diagnosis_file=str(diagnosis))
        save_candidates(result, target)
        _show(result)
        if as_json:
            print(json.dumps({"candidates_file": str(target), "limiting_stage": result.limiting_stage,
                              "next_stage": result.next_stage, "unfixed": result.unfixed,
                              "candidates": [{"id": c.id, "fixes": c.fixes, "overrides": c.overrides} for c in result.candidates]}))
        else:
            typer.echo(str(target))


def _show(result) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"candidates: bottleneck {result.limiting_stage}, next {result.next_stage}")
    for name in ("id", "fixes", "overrides", "needs"):
        table.add_column(name)
    for c in result.candidates:
        table.add_row(c.id, ", ".join(c.fixes), ", ".join(f"{k}={v}" for k, v in c.overrides.items()), ", ".join(c.needs))
    console = Console(stderr=True)
    console.print(table)
    if result.unfixed:
        console.print(f"no applicable fix for: {', '.join(result.unfixed)}")
