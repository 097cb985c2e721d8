"""``rltune auto``: profile -> propose -> predict -> trial -> update, round after round, resumable.

One round starts from the current baseline (the untuned job, then each kept setup): its diagnosis
feeds ``propose``, the case library and theory feed the forecast, and the most promising setup
forecast at least ``limits.min_forecast_gain_pct`` faster runs for real. A kept setup becomes the
next round's baseline; a rejected one is recorded and the next candidate is tried, with forecasts
that now include its result. Knob values seen only in runs that crashed or hung are not tried again. The loop stops when no candidate is forecast fast enough, the trial
budget is spent, or the rounds run out; then it writes the tuned preset, the savings by technique
and the HTML report.

Everything the loop decides is an event in ``WORKDIR/journal.jsonl`` (append-only, fsynced). Run
again with the same arguments after a crash or ``kill -9`` and it replays the journal and goes on:
a run whose case reached the library is taken from its directory (verdict.yaml, stages.parquet,
diagnosis.yaml); a run that did not finish is run again under a new id. The library therefore holds
every finished run exactly once.

Work directory layout::

    journal.jsonl          the events
    cases/                 the case library (unless --library says otherwise)
    runs/<run id>/         each real run: launch.log, metrics, stages.parquet, diagnosis.yaml, verdict.yaml
    rounds/r<N>/           candidates.yaml and forecast-a<K>.yaml of each attempt
    report.html            written at the end (and by 'rltune report')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltune.contracts.job import JobSpec, KnobValue, load_job
from rltune.errors import RltuneError
from rltune.tune.journal import Journal, JournalError
from rltune.tune.trial import MeasuredRun, measure_run, record_case, run_trial

Event = dict[str, Any]


class AutoError(RltuneError):
    """The loop cannot go on (e.g. the untuned baseline itself fails)."""


@dataclass
class AutoResult:
    workdir: Path
    reason: str
    untuned_step_s: float | None
    best_step_s: float | None
    best_knobs: dict[str, KnobValue]
    trials: int
    tuned_preset: Path | None
    report: Path | None

    @property
    def speedup(self) -> float | None:
        return self.untuned_step_s / self.best_step_s if self.untuned_step_s and self.best_step_s else None


@dataclass
class _Baseline:
    run_id: str
    run_dirs: list[Path]
    knobs: dict[str, KnobValue]
    step_s: float
    rows: list[dict]
    diagnosis: Any


def _load_run(run_dirs: list[Path], run_id: str, knobs: dict[str, KnobValue], step_s: float) -> _Baseline:
    """A finished run as a baseline, read back from its directories (stage tables and diagnosis)."""
    from rltune.contracts.diagnosis import load_diagnosis
    from rltune.contracts.stages import read_stages

    rows = [r for d in run_dirs for r in read_stages(Path(d) / "stages.parquet").to_pylist()]
    diagnosis = load_diagnosis(Path(run_dirs[0]) / "diagnosis.yaml")
    return _Baseline(run_id, [Path(d) for d in run_dirs], dict(knobs), step_s, rows, diagnosis)


def holds_a_failed_set(baseline_knobs: dict, overrides: dict, failed: list[set]) -> bool:
    """True if the setup holds every value of some crashed run's set (see ``AutoLoop._failed_settings``)."""
    setup = set({**baseline_knobs, **overrides}.items())
    return any(f <= setup for f in failed)


def crash_aware_order(forecasts: list, baseline_knobs: dict, failed: list[set]) -> list:
    """Forecasts fastest first, except that setups sharing fewer values with crashed runs go first:
    after a crash of a setup that changed several knobs, the culprit is one of them."""
    suspect = set().union(*failed) if failed else set()
    return sorted(forecasts, key=lambda f: (len(suspect & set({**baseline_knobs, **f.overrides}.items())), f.step_s))


class AutoLoop:
    """The state of one ``auto`` run, rebuilt from its journal; :meth:`run` goes on from there."""

    def __init__(self, job_path: str | Path, workdir: str | Path, *, rounds: int = 4, trial_budget: int = 12,
                 max_trials_per_round: int = 3, steps: int | None = None, library: str | Path | None = None,
                 knowledge: str | Path | None = None, tuned_dir: str | Path = "presets/tuned",
                 allow_needs: bool = False, on_event: Callable[[Event], None] | None = None):
        self.job_path = Path(job_path)
        self.job: JobSpec = load_job(job_path)
        self.workdir = Path(workdir)
        self.rounds = rounds
        self.trial_budget = trial_budget
        self.max_trials_per_round = max_trials_per_round
        self.steps = steps
        self.library_path = Path(library) if library else self.workdir / "cases"
        self.knowledge_path = knowledge
        self.tuned_dir = Path(tuned_dir)
        self.allow_needs = allow_needs
        self.on_event = on_event or (lambda event: None)
        self.journal = Journal(self.workdir / "journal.jsonl")

    # -- journal --------------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> Event:
        event = self.journal.append(kind, **fields)
        self.on_event(event)
        return event

    def _note(self, kind: str, **fields: Any) -> None:
        """A live-view event that is not journalled (nothing is decided by it)."""
        self.on_event({"event": kind, **fields})

    def _new_run_id(self, stem: str, events: list[Event]) -> str:
        """``stem``, or ``stem-x<N>`` when earlier attempts under that stem never finished."""
        used = {e["run_id"] for e in events if e["event"] == "run_start"}
        if stem not in used:
            return stem
        n = 2
        while f"{stem}-x{n}" in used:
            n += 1
        return f"{stem}-x{n}"

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> AutoResult:
        from rltune.predict.library import CaseLibrary
        from rltune.tune.knowledge import load_default_knowledge

        knowledge = load_default_knowledge(self.knowledge_path)
        library = CaseLibrary(self.library_path)
        events = self.journal.events()
        start = next((e for e in events if e["event"] == "start"), None)
        if start is None:
            self._emit("start", job=str(self.job_path), job_name=self.job.name, gpus=self.job.gpus.count,
                       device=self.job.gpus.device, rl_mode=self.job.rl_mode, rounds=self.rounds,
                       trial_budget=self.trial_budget, library=str(self.library_path))
        elif start.get("job_name") != self.job.name:
            raise JournalError(f"{self.journal.path}: belongs to job {start.get('job_name')!r}, not {self.job.name!r}; "
                               f"use another --workdir")
        else:
            self._note("resume", events=len(events))
        finish = next((e for e in reversed(events) if e["event"] == "finish"), None)
        if finish is not None:
            return self._result_from(finish, events)

        self._settle_unfinished(library)
        events = self.journal.events()
        untuned = self._untuned(library, events)
        events = self.journal.events()
        baseline = self._current_baseline(untuned, events)
        trials = [e for e in events if e["event"] == "trial"]
        tried = [dict(untuned.knobs)] + [e["knobs"] for e in trials]
        round_no = 1 + sum(1 for e in events if e["event"] == "round_end")
        reason = ""
        while True:
            if round_no > self.rounds:
                reason = f"ran the {self.rounds} rounds asked for"
                break
            if len(trials) >= self.trial_budget:
                reason = f"spent the trial budget ({self.trial_budget})"
                break
            outcome, baseline, round_trials = self._round(round_no, baseline, untuned, tried, knowledge, library)
            trials += round_trials
            if outcome in ("no_candidates", "none_forecast"):
                reason = ("no applicable fix for what limits the step" if outcome == "no_candidates"
                          else f"no candidate forecast >= {self.job.limits.min_forecast_gain_pct:g}% faster")
                break
            round_no += 1
        return self._finish(reason, untuned, baseline)

    def _settle_unfinished(self, library: Any) -> None:
        """A run started but not journalled as done: take it from disk if recorded, else drop it."""
        events = self.journal.events()
        done = {e["run_id"] for e in events if e["event"] in ("baseline", "trial", "run_abandoned")}
        for start in [e for e in events if e["event"] == "run_start" and e["run_id"] not in done]:
            run_id = start["run_id"]
            if library.has(run_id) and start["role"] == "trial":
                from rltune.contracts.verdict import load_verdict

                verdict = load_verdict(Path(start["run_dir"]) / "verdict.yaml")
                self._emit("trial", **self._trial_fields(start, verdict))
                if verdict.kept:
                    self._emit("round_end", round=start["round"], outcome="kept", baseline_run=run_id)
            elif library.has(run_id) and start["role"] == "baseline":
                base = _load_run([Path(start["run_dir"])], run_id, start["knobs"], 0.0)
                self._emit_baseline(start["round"], run_id, Path(start["run_dir"]), start["knobs"], base.rows,
                                    base.diagnosis)
            else:
                self._emit("run_abandoned", run_id=run_id, reason="interrupted before its case was recorded; run again")

    def _untuned(self, library: Any, events: list[Event]) -> _Baseline:
        recorded = next((e for e in events if e["event"] == "baseline" and e["round"] == 0), None)
        if recorded is None:
            run_id = self._new_run_id("r0-untuned", events)
            run_dir = self.workdir / "runs" / run_id
            knobs = dict(self.job.knobs)
            self._emit("run_start", run_id=run_id, run_dir=str(run_dir), role="baseline", round=0, knobs=knobs)
            run = measure_run(self.job, self.job_path, run_dir, run_id, knobs, self.steps)
            record_case(library, self.job, run, None)
            if not run.ok:
                self._emit("run_abandoned", run_id=run_id, reason=f"untuned baseline {run.status}: {run.error}")
                raise AutoError(f"the untuned baseline {run.status.replace('_', ' ')} ({run.error}); fix the job first. "
                                f"Log tail:\n{run.log_tail}")
            recorded = self._emit_baseline(0, run_id, run_dir, knobs, run.rows, run.diagnosis)
        return _load_run([Path(recorded["run_dir"])], recorded["run_id"], recorded["knobs"], recorded["step_s"])

    def _emit_baseline(self, round_no: int, run_id: str, run_dir: Path, knobs: dict, rows: list[dict], diagnosis: Any) -> Event:
        probe = MeasuredRun(run_id=run_id, run_dir=run_dir, knobs=knobs, status="ok", rows=rows)
        return self._emit("baseline", round=round_no, run_id=run_id, run_dir=str(run_dir), knobs=knobs,
                          step_s=probe.median_step_s(), stages_s=probe.stage_medians(),
                          limiting_stage=diagnosis.limiting_stage, problems=[p.id for p in diagnosis.problems])

    def _current_baseline(self, untuned: _Baseline, events: list[Event]) -> _Baseline:
        kept = [e for e in events if e["event"] == "trial" and e["decision"] == "keep"]
        if not kept:
            return untuned
        last = kept[-1]
        return _load_run([Path(d) for d in last["run_dirs"]], last["run_id"], last["knobs"], last["step_s"])

    def _round(self, round_no: int, baseline: _Baseline, untuned: _Baseline, tried: list[dict], knowledge: Any,
               library: Any) -> tuple[str, _Baseline, list[Event]]:
        from rltune.contracts.candidates import save_candidates
        from rltune.contracts.forecast import save_forecast
        from rltune.predict import forecast_candidates
        from rltune.tune.propose import propose

        round_dir = self.workdir / "rounds" / f"r{round_no}"
        round_trials: list[Event] = []
        limits = self.job.limits
        for attempt in range(1, self.max_trials_per_round + 1):
            if len(tried) - 1 >= self.trial_budget:
                break
            candidates = propose(baseline.diagnosis, self.job, knowledge, knobs=baseline.knobs, job_path=str(self.job_path),
                                 round_tag=f"r{round_no}", tried=tried, allow_needs=self.allow_needs,
                                 baseline_dir=str(baseline.run_dirs[0]), untuned_dir=str(untuned.run_dirs[0]))
            failed = self._failed_settings()
            candidates.candidates = [c for c in candidates.candidates if not holds_a_failed_set(baseline.knobs, c.overrides, failed)]
            save_candidates(candidates, round_dir / "candidates.yaml")
            if not candidates.candidates:
                self._emit("round_end", round=round_no, outcome="no_candidates", unfixed=candidates.unfixed)
                return "no_candidates", baseline, round_trials
            forecast = forecast_candidates(self.job, candidates, library, baseline_knobs=baseline.knobs)
            forecast_path = round_dir / f"forecast-a{attempt}.yaml"
            save_forecast(forecast, forecast_path)
            ranked = crash_aware_order(forecast.forecasts, baseline.knobs, failed)
            by_id = {c.id: c for c in candidates.candidates}
            self._emit("proposed", round=round_no, attempt=attempt, baseline_run=baseline.run_id,
                       baseline_step_s=baseline.step_s, limiting_stage=candidates.limiting_stage,
                       next_stage=candidates.next_stage, candidates_file=str(round_dir / "candidates.yaml"),
                       forecast_file=str(forecast_path),
                       candidates=[{"id": f.candidate, "fixes": by_id[f.candidate].fixes if f.candidate in by_id else [],
                                    "step_s": f.step_s, "gain_pct": f.gain_pct, "limiting_stage": f.limiting_stage,
                                    "method": f.method} for f in ranked])
            pick = next((f for f in ranked if f.candidate in by_id and f.gain_pct >= limits.min_forecast_gain_pct), None)
            if pick is None:
                self._emit("round_end", round=round_no, outcome="none_forecast")
                return "none_forecast", baseline, round_trials
            candidate = by_id[pick.candidate]
            events = self.journal.events()
            run_id = self._new_run_id(f"r{round_no}-{candidate.id.split('-', 1)[-1]}-a{attempt}", events)
            run_dir = self.workdir / "runs" / run_id
            knobs = {**baseline.knobs, **pick.overrides}
            start = self._emit("run_start", run_id=run_id, run_dir=str(run_dir), role="trial", round=round_no,
                               candidate=candidate.id, fixes=candidate.fixes, knobs=knobs,
                               baseline_run=baseline.run_id, baseline_step_s=baseline.step_s,
                               group=knowledge.fix(candidate.fixes[0]).group)
            outcome = run_trial(self.job, self.job_path, pick, baseline_knobs=baseline.knobs, baseline_run=baseline.run_id,
                                baseline_rows=baseline.rows, untuned_run=untuned.run_id, untuned_rows=untuned.rows,
                                library=library, run_root=self.workdir / "runs", run_id=run_id, steps=self.steps,
                                on_run=lambda rid, state: self._note("run", run_id=rid, state=state))
            event = self._emit("trial", **self._trial_fields(start, outcome.verdict))
            round_trials.append(event)
            tried.append(knobs)
            if outcome.kept:
                new = _load_run([Path(d) for d in outcome.verdict.run_dirs], run_id, knobs, outcome.verdict.step_s)
                self._emit("round_end", round=round_no, outcome="kept", baseline_run=run_id)
                return "kept", new, round_trials
        self._emit("round_end", round=round_no, outcome="none_kept")
        return "none_kept", baseline, round_trials

    def _failed_settings(self) -> list[set[tuple[str, Any]]]:
        """Per run that crashed or hung, the knob values it tried that never ran fine anywhere.

        A setup holding all the values of one such set is not tried again. A set of one value bans
        that value; a set of several bans only their combination, since the culprit is unknown,
        and setups sharing fewer of them are tried first (see ``_round``).
        """
        events = self.journal.events()
        ran_fine = {item for e in events if e["event"] in ("baseline", "trial") and e.get("decision", "ok") != "failed"
                    for item in e["knobs"].items()}
        failed = [set(e["knobs"].items()) - ran_fine for e in events if e["event"] == "trial" and e["decision"] == "failed"]
        return [f for f in failed if f]

    @staticmethod
    def _trial_fields(start: Event, verdict: Any) -> dict[str, Any]:
        return dict(round=start["round"], run_id=start["run_id"], run_dirs=verdict.run_dirs, candidate=start["candidate"],
                    fixes=start["fixes"], group=start["group"], knobs=start["knobs"], decision=verdict.decision,
                    reason=verdict.reason, step_s=verdict.step_s, baseline_step_s=verdict.baseline_step_s,
                    gain_pct=verdict.gain_pct, forecast_step_s=verdict.forecast_step_s,
                    forecast_range_s=verdict.forecast_range_s, within_forecast_range=verdict.within_forecast_range,
                    stages_s=verdict.stages_s, remeasured=verdict.remeasured,
                    failed_limits=[c.name for c in verdict.limits if not c.passed],
                    verdict=str(Path(start["run_dir"]) / "verdict.yaml"))

    def _finish(self, reason: str, untuned: _Baseline, best: _Baseline) -> AutoResult:
        from rltune.tune.preset import write_tuned_preset
        from rltune.tune.report import build_report
        from rltune.tune.savings import shares_by_group

        events = self.journal.events()
        trials = [e for e in events if e["event"] == "trial"]
        kept = [(e["group"], (e["baseline_step_s"] or 0.0) - (e["step_s"] or 0.0)) for e in trials if e["decision"] == "keep"]
        provenance = {"untuned_step_s": round(untuned.step_s, 4), "tuned_step_s": round(best.step_s, 4),
                      "speedup": round(untuned.step_s / best.step_s, 3) if best.step_s else None,
                      "trials": len(trials), "best_run": best.run_id, "journal": str(self.journal.path)}
        preset = write_tuned_preset(self.job, self.job_path, best.knobs, self.tuned_dir, provenance)
        finish = self._emit("finish", reason=reason, untuned_run=untuned.run_id, untuned_step_s=untuned.step_s,
                            best_run=best.run_id, best_step_s=best.step_s, best_knobs=best.knobs, trials=len(trials),
                            savings=shares_by_group(kept), tuned_preset=str(preset))
        report = build_report(self.workdir)
        return self._result_from(finish, events, report)

    def _result_from(self, finish: Event, events: list[Event], report: Path | None = None) -> AutoResult:
        if report is None:
            from rltune.tune.report import build_report

            report = build_report(self.workdir)
        return AutoResult(workdir=self.workdir, reason=finish["reason"], untuned_step_s=finish["untuned_step_s"],
                          best_step_s=finish["best_step_s"], best_knobs=finish["best_knobs"], trials=finish["trials"],
                          tuned_preset=Path(finish["tuned_preset"]), report=report)


def auto(job_path: str | Path, workdir: str | Path, **options: Any) -> AutoResult:
    """Run (or resume) the tuning loop; see :class:`AutoLoop` for the options."""
    return AutoLoop(job_path, workdir, **options).run()
