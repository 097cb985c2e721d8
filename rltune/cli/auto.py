"""``rltune auto``: profile, propose, predict and trial round after round; resumable."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Profile, propose, predict and trial round after round; resumable.

Stops when no candidate is forecast limits.min_forecast_gain_pct faster, the trial budget is spent
or the rounds run out, then writes the tuned preset, the savings by technique and report.html.
Every decision goes to WORKDIR/journal.jsonl: after a crash or kill -9, run the same command again
and it goes on where it stopped.

Example:

  rltune auto job.yaml --rounds 4 --workdir runs/tune
"""


def register(app: typer.Typer) -> None:
    @app.command(name="auto", help=HELP)
    def auto_cmd(
        job: Path = typer.Argument(..., help="job.yaml to tune"),
        workdir: Path = typer.Option(Path("runs/tune"), "--workdir", help="journal, runs, rounds and report go here"),
        rounds: int = typer.Option(4, "--rounds", min=1, help="most rounds (a round ends when a setup is kept)"),
        trials: int = typer.Option(12, "--trials", min=1, help="trial budget over all rounds"),
        per_round: int = typer.Option(3, "--per-round", min=1, help="most trials in one round"),
        steps: int = typer.Option(None, "--steps", help="steps per run (default limits.steps)"),
        library: Path = typer.Option(None, "--library", help="case library (default WORKDIR/cases)"),
        knowledge: Path = typer.Option(None, "--knowledge", help="knowledge base (default presets/knowledge.yaml)"),
        tuned_dir: Path = typer.Option(Path("presets/tuned"), "--tuned-dir", help="where the tuned preset is written"),
        allow_needs: bool = typer.Option(False, "--allow-needs", help="also try fixes that need hardware beyond the budget"),
        live: bool = typer.Option(True, "--live/--no-live", help="live view on stderr"),
        as_json: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json

        from rltune.tune.auto import AutoLoop

        view = _LiveView(live)
        loop = AutoLoop(job, workdir, rounds=rounds, trial_budget=trials, max_trials_per_round=per_round, steps=steps,
                        library=library, knowledge=knowledge, tuned_dir=tuned_dir, allow_needs=allow_needs,
                        on_event=view.update)
        with view:
            result = loop.run()
        view.summary(result)
        if as_json:
            print(json.dumps({"report": str(result.report), "tuned_preset": str(result.tuned_preset),
                              "reason": result.reason, "untuned_step_s": result.untuned_step_s,
                              "best_step_s": result.best_step_s, "speedup": result.speedup, "trials": result.trials,
                              "best_knobs": result.best_knobs}))
        else:
            typer.echo(f"report: {result.report}")


class _LiveView:
    """Round, bottleneck, candidates with forecasts, trial progress and best step, redrawn on each event."""

    def __init__(self, enabled: bool):
        import time

        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.clock = time.monotonic
        self.state = {"round": 0, "bottleneck": "-", "candidates": [], "trials": [], "running": None,
                      "best": None, "untuned": None, "started": None}
        self.live = None

    def __enter__(self):
        if self.enabled:
            from rich.live import Live

            self.live = Live(self._render(), console=self.console, refresh_per_second=2, transient=False,
                             get_renderable=self._render)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)
        return False

    def update(self, event: dict) -> None:
        kind, s = event["event"], self.state
        if kind == "baseline":
            s["untuned"] = s["untuned"] or event["step_s"]
            s["best"] = s["best"] or event["step_s"]
            s["bottleneck"] = event.get("limiting_stage", "-")
        elif kind == "proposed":
            s["round"], s["bottleneck"], s["candidates"] = event["round"], event["limiting_stage"], event["candidates"]
        elif kind == "run_start":
            s["running"], s["started"] = event["run_id"], self.clock()
        elif kind == "run":
            s["running"] = event["run_id"] if event["state"] == "start" else None
            s["started"] = self.clock()
        elif kind == "trial":
            s["trials"].append(event)
            s["running"] = None
            if event["decision"] == "keep":
                s["best"] = event["step_s"]
        if not self.enabled:
            line = self._line(event)
            if line:
                self.console.print(line, markup=False, highlight=False)

    @staticmethod
    def _line(event: dict) -> str:
        kind = event["event"]
        if kind == "baseline":
            return f"baseline {event['run_id']}: step {event['step_s']:.3g} s, limited by {event['limiting_stage']}"
        if kind == "proposed":
            return (f"round {event['round']}: {len(event['candidates'])} candidates for {event['limiting_stage']}; "
                    + ", ".join(f"{c['id']} {c['step_s']:.3g}s" for c in event["candidates"][:4]))
        if kind == "run_start":
            return f"running {event['run_id']}"
        if kind == "trial":
            step = "n/a" if event["step_s"] is None else f"{event['step_s']:.3g} s"
            return f"trial {event['run_id']}: {event['decision']} ({step}) - {event['reason']}"
        if kind in ("round_end", "finish", "run_abandoned", "resume"):
            return f"{kind}: " + ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "time", "best_knobs"))
        return ""

    def _render(self):
        from rich.console import Group
        from rich.table import Table

        s = self.state
        head = Table.grid(padding=(0, 2))
        best = "-" if s["best"] is None else f"{s['best']:.3g} s"
        speedup = f" ({s['untuned'] / s['best']:.2f}x)" if s["best"] and s["untuned"] else ""
        running = "-"
        if s["running"]:
            running = f"{s['running']} ({self.clock() - s['started']:.0f} s)"
        head.add_row(f"round {s['round']}", f"bottleneck: {s['bottleneck']}", f"best step: {best}{speedup}",
                     f"trials: {len(s['trials'])}", f"running: {running}")
        cands = Table(title="candidates (forecast)")
        for name in ("id", "fixes", "step s", "gain %", "limited by"):
            cands.add_column(name)
        for c in s["candidates"][:8]:
            cands.add_row(c["id"], ", ".join(c["fixes"]), f"{c['step_s']:.3g}", f"{c['gain_pct']:.1f}", c["limiting_stage"])
        trials = Table(title="trials")
        for name in ("run", "decision", "step s", "forecast s", "reason"):
            trials.add_column(name)
        for t in s["trials"][-6:]:
            trials.add_row(t["run_id"], t["decision"], "n/a" if t["step_s"] is None else f"{t['step_s']:.3g}",
                           f"{t['forecast_step_s']:.3g}" if t.get("forecast_step_s") else "-", t["reason"][:60])
        return Group(head, cands, trials)

    def summary(self, result) -> None:
        speed = f"{result.speedup:.2f}x" if result.speedup else "n/a"
        self.console.print(f"stopped: {result.reason}. untuned {result.untuned_step_s:.3g} s -> best {result.best_step_s:.3g} s "
                           f"({speed}) in {result.trials} trials; tuned preset {result.tuned_preset}",
                           markup=False, highlight=False)
