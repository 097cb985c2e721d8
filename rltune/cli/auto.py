"""``rltune auto``: profile, propose, predict and trial round after round; resumable."""

from __future__ import annotations

from pathlib import Path

import typer

HELP = """Profile, propose, predict and trial round after round; resumable.

The untuned job runs limits.baseline_runs times (their spread is the measured noise); then each
round tries the candidates worth a trial: forecast limits.min_forecast_gain_pct faster, or with a
forecast range that reaches that gate and relieves the stage that limits the step -- by its forecast,
or, for a setting the forecast cannot estimate, by what its fixes move (ranked by the range's
optimistic end while the evidence is thin). Stops when no candidate is worth a trial, the
trial budget is spent or the rounds run out, then writes the tuned preset, the savings by technique
and report.html. A kept change that alters what is learned per fresh sample (batch reuse, generating
several steps at once, a higher sample age, a new RL mode: knowledge.yaml 'risks: [reward]') is
checked with 'rltune reward-check' for --reward-check steps before the preset is written; without
the flag the preset is written marked "learning unchecked". A failed check names the change to blame
and the tuner stops proposing it for this job (the case library's learning-checks.yaml). The report
and --json give what tuning cost: the device-seconds of every run (GPUs x wall time; a CPU job's
host counts as one device) and the tuned steps after which it has paid for itself. Every decision goes to
WORKDIR/journal.jsonl: after a crash or kill -9, run the same command again (from any directory)
and it goes on where it stopped: runs still on a SLURM or Ray cluster are followed again, a local
run left over is cancelled and run again. --parallel K runs up to K candidates of a round at once.

Example:

\b
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
        steps: int = typer.Option(None, "--steps", help="steps per run, 1 to 1000000 (default limits.steps)"),
        library: Path = typer.Option(None, "--library", help="case library (default WORKDIR/cases)"),
        knowledge: Path = typer.Option(None, "--knowledge", help="knowledge base (default presets/knowledge.yaml)"),
        tuned_dir: Path = typer.Option(Path("presets/tuned"), "--tuned-dir", help="where the tuned preset is written"),
        allow_needs: bool = typer.Option(False, "--allow-needs", help="also try fixes that need hardware beyond the budget"),
        parallel: int = typer.Option(1, "--parallel", min=1, help="run up to this many trials of a round at once (each its own run or allocation)"),
        reward_check: int = typer.Option(None, "--reward-check", help="steps of the reward check run before the tuned preset is written when a kept change alters learning (exit 3 if it fails); without it such a preset is marked 'learning unchecked'"),
        reward_against: Path = typer.Option(None, "--reward-against", help="untuned job the reward check runs on (default JOB; it needs seed and task_seed knobs)"),
        live: bool = typer.Option(True, "--live/--no-live", help="live view on stderr"),
        as_json: bool = typer.Option(False, "--json", help="print a machine-readable summary on stdout"),
    ) -> None:
        import json

        from rltune.cli.options import check_steps
        from rltune.contracts.job import load_job
        from rltune.contracts.outputs import check_output
        from rltune.tune.auto import AutoLoop

        check_steps(steps)
        check_steps(reward_check, "--reward-check")
        inputs = [job, knowledge, reward_against]
        check_output(workdir, inputs=inputs, expect="dir", flag="--workdir", workdir_ok=True)
        check_output(tuned_dir, inputs=inputs, expect="dir", flag="--tuned-dir")
        if library is not None:
            check_output(library, inputs=inputs, expect="dir", flag="--library")
        plan = None
        if reward_check is not None:  # checked before the loop: bad input must not wait for the tuning to end
            from rltune.tune.reward_check import plan_reward_check

            plan = plan_reward_check(reward_against or job, reward_check)
            plan.require_mapped(load_job(job).launch.knob_map, f"{job} (a knob the tuner may move)")
        view = _LiveView(live, trials)
        loop = AutoLoop(job, workdir, rounds=rounds, trial_budget=trials, max_trials_per_round=per_round, steps=steps,
                        library=library, knowledge=knowledge, tuned_dir=tuned_dir, allow_needs=allow_needs,
                        parallel=parallel, on_event=view.update, reward_check=plan)
        view.workdir = loop.workdir
        with view:
            result = loop.run()
        view.summary(result)
        if as_json:
            print(json.dumps({"report": str(result.report), "tuned_preset": str(result.tuned_preset),
                              "reason": result.reason, "untuned_step_s": result.untuned_step_s,
                              "best_step_s": result.best_step_s, "speedup": result.speedup, "trials": result.trials,
                              "best_knobs": result.best_knobs, "learning": result.learning,
                              "learning_changes": result.learning_changes or [],
                              "tuning_cost": result.cost.as_dict() if result.cost is not None else None}))
        else:
            typer.echo(f"report: {result.report}")
        if plan is not None:
            from rltune.tune.journal import replay
            from rltune.tune.reward_check import exit_code_of, last_reward_check

            checked = last_reward_check(replay(loop.journal.events()))
            view.console.print(f"reward check: {checked.decision} - {checked.reason}" if checked else
                               "reward check: not run (no kept change alters what is learned)", markup=False,
                               highlight=False)
            if checked and exit_code_of(checked.decision):
                raise typer.Exit(exit_code_of(checked.decision))


class _LiveView:
    """Round, bottleneck, the running run's progress, candidates with forecast ranges, trials: 80 columns."""

    WIDTH = 80

    def __init__(self, enabled: bool, budget: int):
        import time

        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.clock = time.monotonic
        self.budget = budget
        self.workdir = None
        self.state = {"round": 0, "bottleneck": "-", "candidates": [], "trials": [], "running": None, "steps": None,
                      "metrics": None, "best": None, "untuned": None, "started": None, "role": "", "what": ""}
        self.progress = _StepCounter()
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
            s["running"], s["started"], s["steps"] = event["run_id"], self.clock(), event.get("steps")
            s["metrics"] = event.get("metrics_path")
            s["what"] = (f"baseline run {event.get('repeat', 1)} of {event.get('of', 1)}" if event["role"] == "baseline"
                         else f"trial {event.get('trial', len(s['trials']) + 1)} of {event.get('of', self.budget)}")
            self.progress.reset()
        elif kind == "run":
            s["running"] = event["run_id"] if event["state"] == "start" else None
            s["started"] = self.clock()
            self.progress.reset()
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
            return f"baseline {event['run_id']}: mean step {event['step_s']:.3g} s, limited by {event['limiting_stage']}"
        if kind == "proposed":
            picked = f"; trying {event['picked']}" if event.get("picked") else "; none worth a trial"
            return (f"round {event['round']}: {len(event['candidates'])} candidates for {event['limiting_stage']}"
                    + picked)
        if kind == "run_start":
            return f"running {event['run_id']} ({event.get('steps')} steps)"
        if kind == "trial":
            step = "n/a" if event["step_s"] is None else f"{event['step_s']:.3g} s"
            return f"trial {event['run_id']}: {event['decision']} ({step}) - {event['reason']}"
        if kind in ("round_end", "finish", "run_abandoned", "resume", "reward_check"):
            return f"{kind}: " + ", ".join(f"{k}={v}" for k, v in event.items()
                                           if k not in ("event", "time", "best_knobs", "savings"))
        return ""

    def _running_line(self) -> str:
        s = self.state
        if not s["running"]:
            return "running: -"
        elapsed = self.clock() - s["started"]
        done = self.progress.count(self.workdir, s["metrics"])
        total = s["steps"]
        eta = ""
        if done and total and done < total:
            eta = f", ETA {elapsed / done * (total - done):.0f} s"
        steps = f"step {done} of {total}" if total else f"{done} steps"
        return f"{s['what']}: {s['running']}, {steps}, {elapsed:.0f} s{eta}"

    def _render(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        s = self.state
        best = "-" if s["best"] is None else f"{s['best']:.3g} s"
        speedup = f" ({s['untuned'] / s['best']:.2f}x)" if s["best"] and s["untuned"] else ""
        head = Text(f"round {s['round']} | limited by {s['bottleneck']} | best {best}{speedup} | "
                    f"trials {len(s['trials'])}/{self.budget}", no_wrap=True, overflow="ellipsis")
        running = Text(self._running_line(), no_wrap=True, overflow="ellipsis")
        cands = Table(title="candidates (forecast)", width=self.WIDTH, title_justify="left")
        for name, width in (("id", 7), ("fixes", 32), ("step s", 7), ("range s", 13), ("gain%", 6), ("worth", 5)):
            cands.add_column(name, max_width=width, no_wrap=True, overflow="ellipsis")
        for c in s["candidates"][:6]:
            lo, hi = c.get("range_s") or (c["step_s"], c["step_s"])
            cands.add_row(c["id"], ", ".join(c["fixes"]), f"{c['step_s']:.3g}", f"{lo:.3g}-{hi:.3g}",
                          f"{c['gain_pct']:.1f}", c.get("worth", ""))
        trials = Table(title="trials", width=self.WIDTH, title_justify="left")
        for name, width in (("run", 16), ("decision", 8), ("step s", 7), ("forecast", 13), ("reason", 28)):
            trials.add_column(name, max_width=width, no_wrap=True, overflow="ellipsis")
        for t in s["trials"][-6:]:
            fc = t.get("forecast_range_s")
            forecast = f"{fc[0]:.3g}-{fc[1]:.3g}" if fc else "-"
            trials.add_row(t["run_id"], t["decision"], "n/a" if t["step_s"] is None else f"{t['step_s']:.3g}", forecast,
                           t["reason"])
        return Group(head, running, cands, trials)

    def summary(self, result) -> None:
        from rltune.tune.cost import describe

        speed = f"{result.speedup:.2f}x" if result.speedup else "n/a"
        untuned = "n/a" if result.untuned_step_s is None else f"{result.untuned_step_s:.3g} s"
        best = "n/a" if result.best_step_s is None else f"{result.best_step_s:.3g} s"
        self.console.print(f"stopped: {result.reason}. untuned {untuned} -> best {best} (mean step, {speed}) in "
                           f"{result.trials} trials; tuned preset {result.tuned_preset}", markup=False, highlight=False)
        if result.learning == "unchecked":
            self.console.print(f"learning unchecked: {'; '.join(result.learning_changes or [])} alter what is learned "
                               "per fresh sample; run 'rltune reward-check' on the preset, or auto with --reward-check",
                               markup=False, highlight=False)
        if result.cost is not None:
            self.console.print(f"tuning cost: {describe(result.cost)}", markup=False, highlight=False)


class _StepCounter:
    """How many steps the running run has written, read from its metrics file at most every 2 s."""

    EVERY_S = 2.0

    def __init__(self):
        import time

        self.clock = time.monotonic
        self.reset()

    def reset(self) -> None:
        self.last, self.value = -1e9, 0

    def count(self, workdir, metrics: str | None) -> int:
        if not metrics or self.clock() - self.last < self.EVERY_S:
            return self.value
        from pathlib import Path

        self.last = self.clock()
        path = Path(metrics)
        if not path.is_absolute() and workdir is not None:
            path = Path(workdir) / path
        try:
            with open(path, "rb") as handle:
                self.value = sum(1 for line in handle if line.strip().startswith(b"{"))
        except OSError:
            pass
        return self.value
