"""``rltune auto``: profile -> propose -> predict -> trial -> update, round after round, resumable.

The untuned job runs ``limits.baseline_runs`` times first (default 2): their spread is the measured
run-to-run noise every later trial must beat (:func:`rltune.tune.limits.measured_noise`). One round
starts from the current baseline (the untuned job, then each kept setup): its diagnosis feeds
``propose``, the case library and theory feed the forecast, and the next candidate by the shared
pick (:func:`rltune.tune.pick.pick`) runs for real. A candidate is worth a trial when its forecast
reaches ``limits.min_forecast_gain_pct`` -- or when only its range does and it relieves the
limiting stage, by its forecast or, for a setting the forecast cannot estimate, by what the
knowledge base says its fixes move (ranked by the range's optimistic end while the evidence is
thin): the loop explores while it is unsure. Each trial joins the library, so the next forecast refits the theory to it. A
kept setup becomes the next round's baseline; a rejected one is recorded and the next candidate is
tried. Knob values seen only in runs that crashed or hung are not tried again, nor are those seen only
in runs that broke a numerical limit (gap, sample age, trial shares) against runs that held it, nor what two
different such runs share. The loop stops when
no candidate is worth a trial (by its forecast, or by its range while relieving the limiting
stage), the trial budget is spent, or the rounds run out; then it writes the tuned preset, the
savings by technique and the HTML report.

Learning is checked before the preset is written (:mod:`rltune.tune.learning`): when a kept change
alters what is learned per fresh sample (a fix with ``risks: [reward]``, or one the knowledge base
does not hold), the best setup is written as a candidate under ``reward-check/candidate/`` and
reward-checked (``reward_check``, the plan ``--reward-check STEPS`` made); the preset then says
pass or fail in its header, and a failure's blamed change goes to the case library's
learning-checks.yaml, which this loop reads with its limit-breaking settings: no later ``auto`` of
the job on that library runs a setup holding it. Without a plan such a preset is written marked
"learning unchecked". What the tuning cost (:mod:`rltune.tune.cost`) comes with the result.

Everything the loop decides is an event in ``WORKDIR/journal.jsonl`` (append-only, fsynced), with
paths relative to the work directory, so the same command resumes from any working directory.
Run again after a crash or ``kill -9`` and it replays the journal and goes on: a run whose case
reached the library is taken from its directory (verdict.yaml, stages.parquet, diagnosis.yaml); a
run that did not finish is run again under a new id. The library therefore holds every finished
run exactly once.

Work directory layout::

    journal.jsonl          the events
    cases/                 the case library (unless --library says otherwise)
    runs/<run id>/         each real run: launch.log, metrics, stages.parquet, diagnosis.yaml, verdict.yaml
    rounds/r<N>/           candidates.yaml and forecast-a<K>.yaml of each attempt
    report.html            written at the end (and by 'rltune report')
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltune.contracts.job import JobSpec, KnobValue, load_job
from rltune.contracts.journal import (
    JOURNAL_SCHEMA_VERSION,
    BaselineEvent,
    RunStartEvent,
    event_as_data,
)
from rltune.contracts.rundir import RunDir
from rltune.errors import RltuneError
from rltune.launch.job import check_launch, check_steps, metrics_path_of, run_steps
from rltune.tune.journal import Journal, JournalError, JournalState, check_recorded_runs, make_event, replay
from rltune.tune.pick import failed_settings, holds_a_failed_set, limit_breaking_settings, pick
from rltune.tune.trial import Baseline, measure_run, record_case, run_trial

Event = Any  # one of rltune.contracts.journal's event types


class AutoError(RltuneError):
    """The loop cannot go on as asked (bad options)."""


class BaselineFailedError(AutoError):
    """The untuned job itself crashed, hung or measured nothing: the job's failure (exit 4), not bad input."""

    exit_code = 4


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
    learning: str | None = None           # unchanged | unchecked | pass | fail (see FinishEvent.learning)
    learning_changes: list[str] | None = None
    cost: Any = None                      # rltune.tune.cost.TuningCost

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
    dirs = [RunDir(d) for d in run_dirs]
    rows = [r for d in dirs for r in d.rows()]
    return _Baseline(run_id, [d.path for d in dirs], dict(knobs), step_s, rows, dirs[0].diagnosis())


class AutoLoop:
    """The state of one ``auto`` run, rebuilt from its journal; :meth:`run` goes on from there."""

    def __init__(self, job_path: str | Path, workdir: str | Path, *, rounds: int = 4, trial_budget: int = 12,
                 max_trials_per_round: int = 3, steps: int | None = None, library: str | Path | None = None,
                 knowledge: str | Path | None = None, tuned_dir: str | Path = "presets/tuned",
                 allow_needs: bool = False, parallel: int = 1, on_event: Callable[[Event], None] | None = None,
                 on_output: Callable[[str], None] | None = None, reward_check: Any = None):
        self.job_path = Path(job_path).resolve()
        self.job: JobSpec = load_job(self.job_path)
        self.workdir = Path(workdir).resolve()
        self.rounds = rounds
        self.trial_budget = trial_budget
        self.max_trials_per_round = max_trials_per_round
        self.steps = run_steps(self.job, steps)
        self.library_path = Path(library).resolve() if library else self.workdir / "cases"
        self.knowledge_path = knowledge
        self.tuned_dir = Path(tuned_dir)
        self.allow_needs = allow_needs
        if parallel < 1:
            raise AutoError(f"--parallel {parallel}: run at least one trial at a time")
        check_steps(steps)
        self.parallel = parallel
        self._lock = threading.Lock()
        self.on_event = on_event or (lambda event: None)
        self.on_output = on_output
        self.journal = Journal(self.workdir / "journal.jsonl")
        # A rltune.tune.reward_check.RewardCheckPlan: check the tuned preset's reward before finishing.
        self.reward_check = reward_check

    # -- journal --------------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> Event:
        with self._lock:  # trials run in parallel journal their submissions from their own threads
            event = self.journal.append(make_event(kind, time.time(), **fields))
            self.on_event(event_as_data(event))
        return event

    def _state(self) -> JournalState:
        return replay(self.journal.events())

    def _note(self, kind: str, **fields: Any) -> None:
        """A live-view event that is not journalled (nothing is decided by it)."""
        self.on_event({"event": kind, **fields})

    def _rel(self, path: str | Path) -> str:
        """A path as the journal stores it: relative to the work directory when inside it."""
        path = Path(path).resolve()
        try:
            return str(path.relative_to(self.workdir))
        except ValueError:
            return str(path)

    def _abs(self, text: str) -> Path:
        """A path read from the journal. Journals written before paths were relative to the work
        directory hold paths relative to the directory 'auto' ran in; such a path is taken as it is."""
        path = Path(text)
        if path.is_absolute():
            return path
        inside = self.workdir / path
        return inside if inside.exists() or not path.exists() else path.resolve()

    def _new_run_id(self, stem: str, state: JournalState) -> str:
        """``stem``, or ``stem-x<N>`` when that id is taken: by an earlier attempt that never finished, by a
        case another work dir recorded in a shared library, or by a run directory left on disk."""
        used = state.run_ids()

        def taken(run_id: str) -> bool:
            return (run_id in used or self._library_has(run_id)
                    or (self.workdir / "runs" / run_id).exists() or (self.workdir / "runs" / f"{run_id}-again").exists())

        if not taken(stem):
            return stem
        n = 2
        while taken(f"{stem}-x{n}"):
            n += 1
        return f"{stem}-x{n}"

    def _library_has(self, run_id: str) -> bool:
        from rltune.predict.library import CaseLibrary

        return CaseLibrary(self.library_path).has(run_id) or CaseLibrary(self.library_path).has(f"{run_id}-again")

    def _start_run(self, run_id: str, role: str, round_no: int, knobs: dict, **fields: Any) -> Event:
        from rltune.tune.trial import trial_steps

        run_dir = self.workdir / "runs" / run_id
        if run_dir.exists() and any(run_dir.iterdir()):
            raise JournalError(f"{run_dir}: a run directory the journal does not know; it would be overwritten. "
                               f"Restore {self.journal.path}, or use a fresh --workdir")
        steps = trial_steps(self.job, knobs, self.steps) if role == "trial" else self.steps
        return self._emit("run_start", run_id=run_id, run_dir=self._rel(run_dir), role=role, round=round_no,
                          knobs=knobs, steps=steps, metrics_path=self._rel(metrics_path_of(self.job, self.job_path, run_dir)),
                          **fields)

    # -- the loop -------------------------------------------------------------------------------
    def _check_workdir(self, state: JournalState) -> None:
        """Refuse a work dir whose journal does not account for what is on disk, before anything runs.

        A journal that is missing or empty beside runs or rounds means the record of them was lost:
        starting over would launch the untuned runs again into their directories.
        """
        if self.workdir.exists() and not self.workdir.is_dir():
            raise AutoError(f"--workdir {self.workdir}: is a file, not a directory; give a directory")
        if state.events and state.start is None:
            raise JournalError(f"{self.journal.path}: line 1: the first event is {state.events[0].event!r}, not "
                               f"'start'; the journal was cut at its head? restore it, or use a fresh --workdir")
        if state.start is None:
            left = [d for d in ("runs", "rounds") if (self.workdir / d).is_dir() and any((self.workdir / d).iterdir())]
            if left:
                raise JournalError(f"{self.journal.path}: {'empty' if self.journal.path.exists() else 'missing'}, but "
                                   f"{self.workdir} holds {' and '.join(d + '/' for d in left)} of an earlier run; "
                                   f"restore the journal to resume it, or use a fresh --workdir")
            return
        if state.start.job_name != self.job.name:
            raise JournalError(f"{self.journal.path}: belongs to job {state.start.job_name!r}, not {self.job.name!r}; "
                               f"use another --workdir")
        if state.start.schema_version > JOURNAL_SCHEMA_VERSION:
            raise JournalError(f"{self.journal.path}: line 1: schema_version: written by a newer rltune (version "
                               f"{state.start.schema_version}; this one reads up to {JOURNAL_SCHEMA_VERSION}); upgrade rltune")
        check_recorded_runs(state, self._abs)

    def run(self) -> AutoResult:
        from rltune.predict.library import CaseLibrary
        from rltune.tune.knowledge import load_default_knowledge
        from rltune.workload.jobcheck import check_workload_job

        state = self._state()
        self._check_workdir(state)
        library = CaseLibrary(self.library_path)
        library.load()  # a library that cannot be read is refused here, before anything runs or is rewritten
        if state.finish is not None:
            return self._result_from(state.finish)
        # the job as written must start: a reference-workload job the workload (or vLLM) refuses is one line
        # here, not a crashed baseline (a candidate vLLM refuses later is a failed trial, and the loop goes on)
        check_workload_job(self.job, self.job_path, None, self.steps)
        check_launch(self.job, self.job_path, None, self.steps)
        knowledge = load_default_knowledge(self.knowledge_path)
        if state.start is None:
            self._emit("start", job=str(self.job_path), job_name=self.job.name, gpus=self.job.gpus.count,
                       device=self.job.gpus.device, rl_mode=self.job.rl_mode, rounds=self.rounds,
                       trial_budget=self.trial_budget, steps=self.steps, baseline_runs=self.job.limits.baseline_runs,
                       library=self._rel(self.library_path), schema_version=JOURNAL_SCHEMA_VERSION)
        else:
            self._note("resume", events=len(state.events))

        self._settle_unfinished(library)
        untuned, untuned_noise = self._untuned(library)
        self._resume_trials(library, untuned, untuned_noise)
        state = self._state()
        baseline = self._current_baseline(untuned, state)
        trials = list(state.trials)
        tried = [dict(untuned.knobs)] + [t.knobs for t in trials]
        round_no = 1 + len(state.round_ends)
        reason = ""
        while True:
            if round_no > self.rounds:
                reason = f"ran the {self.rounds} rounds asked for"
                break
            if len(trials) >= self.trial_budget:
                reason = f"spent the trial budget ({self.trial_budget})"
                break
            outcome, baseline, round_trials = self._round(round_no, baseline, untuned, untuned_noise, tried, knowledge,
                                                          library, len(trials))
            trials += round_trials
            if outcome in ("no_candidates", "none_worth"):
                gate = self.job.limits.min_forecast_gain_pct
                banned = self._state().round_ends[-1].banned or []
                reason = ("no applicable fix for what limits the step" if outcome == "no_candidates"
                          else f"no candidate is worth a trial: none is forecast {gate:g}% faster, and none whose "
                               f"range reaches {gate:g}% relieves the limiting stage"
                               + (f", except {len(banned)} holding settings that crashed, broke a limit or "
                                  f"failed a reward check" if banned else ""))
                break
            round_no += 1
        return self._finish(reason, untuned, baseline)

    def _settle_unfinished(self, library: Any) -> None:
        """Runs started but not journalled as done, after a crash or ``kill -9`` of rltune.

        The rule: a run whose case reached the library is taken from disk. A run on a scheduler
        (slurm, ray) lives on without rltune: it is followed again (:meth:`_resume_trials` and the
        untuned baseline reattach to it). A local run died with rltune's session or is an orphan:
        what is left of it is cancelled and it is run again under a new id.
        """
        state = self._state()
        identities = state.identities
        for start in state.unfinished():
            run_id = start.run_id
            if library.has(run_id) and start.role == "trial":
                verdict = RunDir(self._abs(start.run_dir)).verdict()
                self._emit("trial", **self._trial_fields(start, verdict))
            elif library.has(run_id) and start.role == "baseline":
                run = _load_run([self._abs(start.run_dir)], run_id, start.knobs, 0.0)
                from rltune.profile.stats import mean_over

                self._emit("baseline_run", run_id=run_id, run_dir=start.run_dir, step_s=mean_over(run.rows, "step_s"))
            elif run_id in identities and identities[run_id].get("launcher") in REATTACHABLE:
                self._note("reattach", run_id=run_id, job_id=identities[run_id].get("job_id"),
                           launcher=identities[run_id].get("launcher"))
            else:
                for rid in (run_id, f"{run_id}-again"):
                    if rid in identities:
                        _cancel_leftover(identities[rid])
                self._emit("run_abandoned", run_id=run_id, reason="interrupted before its case was recorded; run again")
        self._close_rounds()

    def _close_rounds(self) -> None:
        """A round whose trials all finished with a keep but that has no round_end: end it with the fastest."""
        state = self._state()
        ended = {e.round for e in state.round_ends}
        pending = {e.round for e in state.unfinished() if e.role == "trial"}
        for round_no in sorted({t.round for t in state.trials} - ended - pending):
            kept = [t for t in state.trials_in(round_no) if t.decision == "keep"]
            if kept:
                best = min(kept, key=lambda t: t.step_s)
                self._emit("round_end", round=round_no, outcome="kept", baseline_run=best.run_id)

    def _resume_trials(self, library: Any, untuned: _Baseline, untuned_noise: float | None) -> None:
        """Follow again the trials an earlier process left running on a scheduler, and journal them."""
        from rltune.contracts.forecast import CandidateForecast
        from rltune.contracts.schema import from_data

        state = self._state()
        identities = state.identities
        starts = [e for e in state.unfinished() if e.role == "trial" and e.run_id in identities]
        if not starts:
            return
        baseline = self._current_baseline(untuned, state)

        def finish(start: RunStartEvent) -> None:
            forecast = from_data(CandidateForecast, start.forecast, self.journal.path, "run_start.forecast")
            resume = {rid: identities[rid] for rid in (start.run_id, f"{start.run_id}-again") if rid in identities}
            outcome = self._run_trial(start, forecast, baseline, untuned, untuned_noise, library, resume)
            self._emit("trial", **self._trial_fields(start, outcome.verdict))

        with ThreadPoolExecutor(max_workers=max(1, len(starts))) as pool:
            for future in [pool.submit(finish, start) for start in starts]:
                future.result()
        self._close_rounds()

    def _untuned(self, library: Any) -> tuple[_Baseline, float | None]:
        """The untuned baseline (its ``limits.baseline_runs`` runs pooled) and its measured noise in %."""
        from rltune.tune.limits import measured_noise

        state = self._state()
        recorded = state.untuned
        if recorded is None:
            knobs = dict(self.job.knobs)
            finished = list(state.baseline_runs)
            identities = state.identities
            waiting = [e for e in state.unfinished() if e.role == "baseline" and e.run_id in identities]
            for repeat in range(len(finished), self.job.limits.baseline_runs):
                if waiting:  # submitted by a process that died; its job lives on on the scheduler
                    start = waiting.pop(0)
                    run_id, resume = start.run_id, identities[start.run_id]
                else:
                    run_id = self._new_run_id("r0-untuned" if repeat == 0 else f"r0-untuned-{repeat + 1}",
                                              self._state())
                    start, resume = self._start_run(run_id, "baseline", 0, knobs, repeat=repeat + 1,
                                                    of=self.job.limits.baseline_runs), None
                run = measure_run(self.job, self.job_path, self._abs(start.run_dir), run_id, knobs, self.steps,
                                  self.on_output, on_submit=self._journal_submission(run_id), resume=resume)
                record_case(library, self.job, run, None)
                if not run.ok:
                    self._emit("run_abandoned", run_id=run_id, reason=f"untuned baseline {run.status}: {run.error}")
                    raise BaselineFailedError(f"the untuned baseline {run.status.replace('_', ' ')} ({run.error}); fix "
                                              f"the job first. Log tail:\n{run.log_tail}")
                finished.append(self._emit("baseline_run", run_id=run_id, run_dir=start.run_dir, step_s=run.step_s()))
            run_dirs = [self._abs(e.run_dir) for e in finished]
            probe = _load_run(run_dirs, finished[0].run_id, knobs, 0.0)
            noise = measured_noise(self.job.limits, probe.rows)
            recorded = self._emit_baseline(0, [e.run_id for e in finished], run_dirs, knobs, probe.rows,
                                           probe.diagnosis, noise_pct=noise.measured_pct, noise=noise.detail)
        run_dirs = [self._abs(d) for d in recorded.all_run_dirs]
        return _load_run(run_dirs, recorded.run_id, recorded.knobs, recorded.step_s), recorded.noise_pct

    def _emit_baseline(self, round_no: int, run_ids: list[str], run_dirs: list[Path], knobs: dict, rows: list[dict],
                       diagnosis: Any, **fields: Any) -> BaselineEvent:
        from rltune.profile.run import STAGE_COLUMNS
        from rltune.profile.stats import mean_over, median_over

        stages = {name: value for name in STAGE_COLUMNS for value in [mean_over(rows, f"{name}_s")] if value is not None}
        return self._emit("baseline", round=round_no, run_id=run_ids[0], run_ids=run_ids, run_dir=self._rel(run_dirs[0]),
                          run_dirs=[self._rel(d) for d in run_dirs], knobs=knobs, step_s=mean_over(rows, "step_s"),
                          step_median_s=median_over(rows, "step_s"), stages_s=stages,
                          limiting_stage=diagnosis.limiting_stage, problems=[p.id for p in diagnosis.problems], **fields)

    def _current_baseline(self, untuned: _Baseline, state: JournalState) -> _Baseline:
        """The untuned run, or the trial the last round that kept one made its baseline."""
        kept = state.kept_rounds
        if not kept:
            return untuned
        last = state.trial(kept[-1].baseline_run)
        return _load_run([self._abs(d) for d in last.run_dirs], last.run_id, last.knobs, last.step_s)

    def _journal_submission(self, run_id: str) -> Callable[[dict], None]:
        return lambda identity: self._emit("run_submitted", run_id=run_id, identity=identity)

    def _run_trial(self, start: RunStartEvent, forecast: Any, baseline: _Baseline, untuned: _Baseline,
                   untuned_noise: float | None, library: Any, resume: dict[str, dict] | None = None) -> Any:
        compared = Baseline(run_id=baseline.run_id, rows=baseline.rows, untuned_run=untuned.run_id,
                            untuned_rows=untuned.rows, untuned_noise_pct=untuned_noise)
        return run_trial(self.job, self.job_path, forecast, baseline_knobs=baseline.knobs, baseline=compared,
                         library=library, run_root=self.workdir / "runs", run_id=start.run_id, steps=self.steps,
                         on_run=lambda rid, state: self._note("run", run_id=rid, state=state), on_output=self.on_output,
                         on_submit=lambda rid, identity: self._emit("run_submitted", run_id=rid, identity=identity),
                         resume=resume)

    def _round(self, round_no: int, baseline: _Baseline, untuned: _Baseline, untuned_noise: float | None,
               tried: list[dict], knowledge: Any, library: Any, trials_so_far: int) -> tuple[str, _Baseline, list[Event]]:
        """One round from ``baseline``: attempts of up to ``parallel`` trials each, until one is kept.

        Each attempt proposes and forecasts again (earlier attempts' runs are in the library by then),
        picks the next candidates worth a trial -- several at once with ``parallel`` > 1, each its
        own run (allocation on a scheduler) -- and decides from all of them: the fastest kept one
        becomes the next round's baseline.
        """
        from rltune.contracts.candidates import save_candidates
        from rltune.contracts.forecast import save_forecast
        from rltune.contracts.schema import to_data
        from rltune.predict import forecast_candidates
        from rltune.tune.propose import propose

        round_dir = self.workdir / "rounds" / f"r{round_no}"
        round_trials: list[Event] = []
        # A round resumed after an interruption keeps the trials it had already run.
        state = self._state()
        done = len(state.trials_in(round_no))
        attempt = state.attempts_in(round_no)
        while done + len(round_trials) < self.max_trials_per_round:
            room = min(self.parallel, self.trial_budget - trials_so_far - len(round_trials),
                       self.max_trials_per_round - done - len(round_trials))
            if room <= 0:
                break
            attempt += 1
            failed, broke_limits = self._failed_settings(), self._limit_breaking_settings()
            candidates = propose(baseline.diagnosis, self.job, knowledge, knobs=baseline.knobs, job_path=str(self.job_path),
                                 round_tag=f"r{round_no}", tried=tried, allow_needs=self.allow_needs,
                                 baseline_dir=str(baseline.run_dirs[0]), untuned_dir=str(untuned.run_dirs[0]))
            save_candidates(candidates, round_dir / "candidates.yaml")
            if not candidates.candidates:
                self._emit("round_end", round=round_no, outcome="no_candidates", unfixed=candidates.unfixed)
                return "no_candidates", baseline, round_trials
            forecast = forecast_candidates(self.job, candidates, library, baseline_knobs=baseline.knobs,
                                           job_path=str(self.job_path), candidates_file=str(round_dir / "candidates.yaml"),
                                           library_path=str(self.library_path))
            forecast_path = round_dir / f"forecast-a{attempt}.yaml"
            save_forecast(forecast, forecast_path)
            by_id = {c.id: c for c in candidates.candidates}
            chosen = []
            while len(chosen) < room:
                fc = pick(forecast, baseline.knobs, failed=failed, broke_limits=broke_limits,
                          tried=[*tried, *({**baseline.knobs, **c.overrides} for c in chosen)])
                if fc is None:
                    break
                chosen.append(fc)
            self._emit("proposed", round=round_no, attempt=attempt, baseline_run=baseline.run_id,
                       baseline_step_s=baseline.step_s, forecast_baseline_s=forecast.baseline_step_s,
                       limiting_stage=candidates.limiting_stage, next_stage=candidates.next_stage,
                       candidates_file=self._rel(round_dir / "candidates.yaml"), forecast_file=self._rel(forecast_path),
                       picked=chosen[0].candidate if chosen else None, picks=[fc.candidate for fc in chosen],
                       candidates=[{"id": f.candidate, "fixes": by_id[f.candidate].fixes if f.candidate in by_id else [],
                                    "step_s": f.step_s, "range_s": f.range_s, "gain_pct": f.gain_pct,
                                    "worth": f.worth, "limiting_stage": f.limiting_stage, "method": f.method}
                                   for f in forecast.forecasts])
            if not chosen:
                banned = [f.candidate for f in forecast.forecasts if f.worth_trial
                          and holds_a_failed_set(baseline.knobs, f.overrides, [*failed, *broke_limits])]
                self._emit("round_end", round=round_no, outcome="none_worth", banned=banned)
                return "none_worth", baseline, round_trials
            starts = []
            for fc in chosen:
                candidate = by_id[fc.candidate]
                run_id = self._new_run_id(f"r{round_no}-{candidate.id.split('-', 1)[-1]}-a{attempt}", self._state())
                starts.append(self._start_run(
                    run_id, "trial", round_no, {**baseline.knobs, **fc.overrides}, candidate=candidate.id,
                    fixes=candidate.fixes, baseline_run=baseline.run_id, baseline_step_s=baseline.step_s, worth=fc.worth,
                    group=knowledge.fix(candidate.fixes[0]).group, forecast=to_data(fc),
                    trial=trials_so_far + len(round_trials) + len(starts) + 1, of=self.trial_budget))
            if len(chosen) == 1:
                outcomes = [self._run_trial(starts[0], chosen[0], baseline, untuned, untuned_noise, library)]
            else:
                with ThreadPoolExecutor(max_workers=len(chosen)) as pool:
                    futures = [pool.submit(self._run_trial, start, fc, baseline, untuned, untuned_noise, library)
                               for start, fc in zip(starts, chosen, strict=True)]
                    outcomes = _results_or_stop(futures)
            kept = []
            for start, outcome in zip(starts, outcomes, strict=True):
                round_trials.append(self._emit("trial", **self._trial_fields(start, outcome.verdict)))
                tried.append(start.knobs)
                if outcome.kept:
                    kept.append((start, outcome))
            if kept:
                start, outcome = min(kept, key=lambda pair: pair[1].verdict.step_s)
                new = _load_run([Path(d) for d in outcome.verdict.run_dirs], start.run_id, start.knobs,
                                outcome.verdict.step_s)
                self._emit("round_end", round=round_no, outcome="kept", baseline_run=start.run_id)
                return "kept", new, round_trials
        self._emit("round_end", round=round_no, outcome="none_kept")
        return "none_kept", baseline, round_trials

    def _outcomes(self) -> list[tuple[dict, str, list[str]]]:
        """(knobs, decision, failed limits) of the untuned baseline and every trial, as journalled."""
        state = self._state()
        return ([(b.knobs, "ok", []) for b in state.baselines]
                + [(t.knobs, t.decision, t.failed_limits) for t in state.trials])

    def _failed_settings(self) -> list[set[tuple[str, Any]]]:
        """Knob values of runs that crashed or hung that never ran fine (see :func:`rltune.tune.pick.failed_settings`)."""
        return failed_settings((knobs, decision) for knobs, decision, _ in self._outcomes())

    def _limit_breaking_settings(self) -> list[set[tuple[str, Any]]]:
        """Knob values of runs that broke a numerical limit that no run holding it had
        (see :func:`rltune.tune.pick.limit_breaking_settings`), and those a failed reward check of
        this job banned (the case library's learning-checks.yaml)."""
        return limit_breaking_settings(self._outcomes()) + self._learning_bans()

    def _learning_bans(self) -> list[set[tuple[str, Any]]]:
        from rltune.contracts.learning import banned_for, load_learning_checks
        from rltune.tune.learning import banned_settings

        return banned_settings(banned_for(load_learning_checks(self.library_path), self.job.name))

    def _trial_fields(self, start: RunStartEvent, verdict: Any) -> dict[str, Any]:
        return dict(round=start.round, run_id=start.run_id, run_dirs=[self._rel(d) for d in verdict.run_dirs],
                    candidate=start.candidate, fixes=start.fixes, group=start.group, knobs=start.knobs,
                    worth=start.worth or "", decision=verdict.decision, reason=verdict.reason, step_s=verdict.step_s,
                    median_s=verdict.median_s, baseline_step_s=verdict.baseline_step_s, gain_pct=verdict.gain_pct,
                    noise_pct=verdict.noise_pct, forecast_step_s=verdict.forecast_step_s,
                    forecast_range_s=verdict.forecast_range_s, within_forecast_range=verdict.within_forecast_range,
                    stages_s=verdict.stages_s, remeasured=verdict.remeasured,
                    failed_limits=[c.name for c in verdict.limits if c.passed is False],
                    unmeasured_limits=[c.name for c in verdict.limits if c.passed is None],
                    verdict=self._rel(RunDir(self._abs(start.run_dir)).verdict_path))

    def _finish(self, reason: str, untuned: _Baseline, best: _Baseline) -> AutoResult:
        from rltune.tune.knowledge import load_default_knowledge
        from rltune.tune.learning import learning_changes
        from rltune.tune.preset import write_tuned_preset
        from rltune.tune.report import build_report
        from rltune.tune.savings import shares_by_group

        state = self._state()
        trials = state.trials
        made_baseline = state.made_baseline
        kept = [(t.group, (t.baseline_step_s or 0.0) - (t.step_s or 0.0)) for t in trials
                if t.decision == "keep" and t.run_id in made_baseline]
        baseline_event = state.untuned
        provenance = {"untuned_step_s": round(untuned.step_s, 4), "tuned_step_s": round(best.step_s, 4),
                      "speedup": round(untuned.step_s / best.step_s, 3) if best.step_s else None,
                      "step": "mean over the measured steps", "noise_pct": baseline_event.noise_pct,
                      "trials": len(trials), "best_run": best.run_id, "journal": str(self.journal.path)}
        changes = (learning_changes(state, load_default_knowledge(self.knowledge_path), untuned.knobs, best.knobs)
                   if best.run_id != untuned.run_id else [])
        labels = [c.label for c in changes]
        if not changes:
            learning = "unchanged"
            provenance["learning"] = "not altered (no kept change alters what is learned per fresh sample)"
        elif self.reward_check is None:
            learning = "unchecked"
            provenance["learning"] = (f"UNCHECKED: {'; '.join(labels)} alter what is learned per fresh sample; "
                                      f"check it: rltune reward-check THIS_FILE --against {self.job_path} --steps N")
        else:
            # Before the preset and 'finish', so a kill during the long runs resumes into the check (its
            # finished runs reused); a check already journalled is not run again.
            event = state.reward_check or self._check_learning(untuned, best, state, provenance)
            self._record_learning(event, best, state, changes)
            learning = event.decision if event.decision in ("pass", "fail") else "unchecked"
            provenance["learning"] = self._learning_line(event)
        preset = write_tuned_preset(self.job, self.job_path, best.knobs, self.tuned_dir, provenance)
        finish = self._emit("finish", reason=reason, untuned_run=untuned.run_id, untuned_step_s=untuned.step_s,
                            best_run=best.run_id, best_step_s=best.step_s, best_knobs=best.knobs, trials=len(trials),
                            savings=shares_by_group(kept), tuned_preset=str(preset.resolve()), learning=learning,
                            learning_changes=labels or None)
        report = build_report(self.workdir)
        return self._result_from(finish, report)

    def _learning_line(self, event: Any) -> str:
        """The tuned preset's header line about its reward check."""
        if event.decision not in ("pass", "fail"):
            return f"UNCHECKED: the reward check's runs failed ({event.reason})"
        line = f"{event.decision.upper()} (reward-check over {event.steps} steps, {self._abs(event.verdict)})"
        if event.decision == "pass":
            return line
        if event.blamed:
            return line + f": to blame {', '.join(event.blamed)}; the tuner no longer proposes it for this job"
        return line + ": no single change to blame; their combination is no longer proposed for this job"

    def _check_learning(self, untuned: _Baseline, best: _Baseline, state: JournalState, provenance: dict) -> Any:
        """Run the reward check of the best setup (written as a candidate preset in the work directory) and
        journal its event."""
        from rltune.tune.preset import write_tuned_preset
        from rltune.tune.reward_check import check_after_tuning

        candidate = write_tuned_preset(self.job, self.job_path, best.knobs, self.workdir / "reward-check" / "candidate",
                                       {**provenance, "learning": "being checked (not yet a tuned preset)"})
        check_after_tuning(self.reward_check, candidate, self.workdir, state, untuned.knobs, best.knobs,
                           emit=self._emit, note=self._note, rel=self._rel, on_output=self.on_output)
        return self._state().reward_check

    def _record_learning(self, event: Any, best: _Baseline, state: JournalState, changes: list) -> None:
        """Put the check's verdict, and what a failed one bans, in the case library's learning-checks.yaml (once)."""
        from rltune.contracts.learning import LearningCheckRecord, load_learning_checks, record_learning_check
        from rltune.contracts.reward_check import load_reward_check
        from rltune.tune.learning import bans_of
        from rltune.tune.reward_check import kept_changes

        if event.decision not in ("pass", "fail"):
            return  # a run of the check failed: it says nothing about learning
        # Relative to the library, so a work directory moved with its library keeps the link.
        verdict_path = self._abs(event.verdict).resolve()
        verdict = os.path.relpath(verdict_path, self.library_path)
        recorded = load_learning_checks(self.library_path)
        if any(r.verdict == verdict and r.job_name == self.job.name for r in recorded.learning_checks):
            return
        check = load_reward_check(verdict_path)
        bans = bans_of(check, kept_changes(state, state.untuned.knobs, best.knobs), best.knobs, changes)
        record_learning_check(self.library_path, LearningCheckRecord(
            job_name=self.job.name, decision=event.decision, reason=event.reason, verdict=verdict, steps=event.steps,
            tuned_knobs=dict(best.knobs), time=time.time(), banned=bans))

    def _result_from(self, finish: Any, report: Path | None = None) -> AutoResult:
        from rltune.tune.cost import tuning_cost

        if report is None:
            from rltune.tune.report import build_report

            report = build_report(self.workdir)
        return AutoResult(workdir=self.workdir, reason=finish.reason, untuned_step_s=finish.untuned_step_s,
                          best_step_s=finish.best_step_s, best_knobs=finish.best_knobs, trials=finish.trials,
                          tuned_preset=Path(finish.tuned_preset), report=report, learning=finish.learning,
                          learning_changes=finish.learning_changes,
                          cost=tuning_cost(self.workdir, self.job.gpus.count, finish.untuned_step_s, finish.best_step_s))


# Launchers whose jobs outlive the process that submitted them: after a restart, rltune follows them again.
REATTACHABLE = ("slurm", "ray")


def _cancel_leftover(identity: dict) -> None:
    """Stop what is left of a run an earlier process started (a local orphan), best effort."""
    from rltune.launch import reattach

    try:
        reattach(identity).cancel()
    except RltuneError:
        pass  # gone already, or the scheduler does not know it: nothing left to stop


def _results_or_stop(futures: list) -> list:
    """Every future's result; on Ctrl-C or a failure, every running job is asked to stop first."""
    from rltune.launch import request_stop

    try:
        return [f.result() for f in futures]
    except BaseException:
        request_stop()
        for f in futures:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - each follower cancels its own job and re-raises
                pass
        raise


def auto(job_path: str | Path, workdir: str | Path, **options: Any) -> AutoResult:
    """Run (or resume) the tuning loop; see :class:`AutoLoop` for the options."""
    return AutoLoop(job_path, workdir, **options).run()
