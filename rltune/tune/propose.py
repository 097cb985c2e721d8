"""Compose complete candidate setups from a diagnosis and the knowledge base (the seed's step 2).

Three rules, applied to every setup:

1. **Fix the bottleneck.** Each problem found in the limiting stage gets one of its fixes.
2. **Fix what becomes the next bottleneck.** Each problem in the stage that would limit the step
   once the bottleneck is relieved (the next-largest stage) also gets one of its fixes.
3. **Skip combinations that cannot work.** Two fixes that declare a conflict, that set one knob to
   different values, or where one fix's conditions stop holding once the others are applied (a
   chunked-prefill fix needs a single mixed engine; a prefill/decode split removes it) never meet.

Problems in other stages (and step-level ones such as ``stages_serialized``) are optional: setups
are composed with and without them, and the forecast decides. When no problem of the limiting
stage has an applicable fix, fixes that move the limiting stage's theory term stand in for it.
Where rollout and training overlap on shared devices (a job without GPUs in an async mode), the
other overlapped stage's work slows the limiting one for as long as both run: when none of its
problems has a fix, fixes that move its time stand in, optionally, and the forecast (whose theory
prices that contention) decides whether they pay.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from rltune.contracts.candidates import Candidate, Candidates
from rltune.contracts.diagnosis import Diagnosis, Problem
from rltune.contracts.identity import check_same_job
from rltune.contracts.job import JobSpec, KnobValue
from rltune.contracts.knowledge import Fix, Knowledge, moves_group
from rltune.tune.knowledge import ApplicableFix, applicable_fix, condition_holds, job_facts

# Enumerating the product of every slot's options is cheap per combination but grows fast; past
# this many combinations the rest are left out (the ranking keeps the most severe coverage first).
MAX_COMBINATIONS = 20000


@dataclass
class _Slot:
    """One problem to fix and the fixes that could fix it."""

    problem: Problem
    options: list[ApplicableFix]
    required: bool
    role: str  # 'bottleneck', 'next', 'also'


def stage_group(stage: str, rl_mode: str) -> str:
    """The step-time group a stage belongs to under ``rl_mode`` (fully async sums training and sync)."""
    if rl_mode == "fully_async" and stage in ("training", "weight_sync", "training+weight_sync"):
        return "training+weight_sync"
    return stage


def group_seconds(diagnosis: Diagnosis) -> dict[str, float]:
    """Median seconds of each step-time group in the diagnosis."""
    def median(name: str) -> float:
        for key in (f"{name}_s", name):
            if key in diagnosis.stages:
                return diagnosis.stages[key].median_s
        return 0.0

    rollout, training, sync = median("rollout"), median("training"), median("weight_sync")
    if diagnosis.rl_mode == "fully_async":
        return {"rollout": rollout, "training+weight_sync": training + sync}
    return {"rollout": rollout, "training": training, "weight_sync": sync}


def overlap_partner(limiting: str, rl_mode: str, job: JobSpec) -> str | None:
    """The group that overlaps ``limiting`` on the same devices, or None (sync mode, or stages on their own GPUs)."""
    if rl_mode == "sync" or job.gpus.count > 0:
        return None
    pair = ("rollout", stage_group("training", rl_mode))
    return pair[1] if limiting == pair[0] else pair[0] if limiting == pair[1] else None


def structural_problems(diagnosis: Diagnosis) -> list[Problem]:
    """Problems the RL mode itself implies: in sync mode rollout and training never overlap."""
    if diagnosis.rl_mode != "sync" or any(p.id == "stages_serialized" for p in diagnosis.problems):
        return []
    seconds = group_seconds(diagnosis)
    hidden = min(seconds.get("rollout", 0.0), seconds.get("training", 0.0))
    if hidden <= 0:
        return []
    return [Problem(id="stages_serialized", stage="step", component="orchestrator",
                    summary=f"rollout and training run one after the other; overlap could hide up to {hidden:.3g} s",
                    severity=hidden, evidence={"rl_mode": "sync", **{f"{k}_s": v for k, v in seconds.items()}})]


def _combination_works(chosen: list[ApplicableFix], baseline: dict[str, KnobValue], facts: dict) -> dict[str, KnobValue] | None:
    """The combined overrides, or None when the fixes cannot be combined."""
    ids = {a.fix.id for a in chosen}
    for a in chosen:
        if any(other in ids for other in a.fix.conflicts):
            return None
    combined: dict[str, KnobValue] = {}
    for a in chosen:
        for knob, value in a.values.items():
            if knob in combined and combined[knob] != value:
                return None
            combined[knob] = value
    for a in chosen:
        # A fix's conditions must still hold once the others are applied; its own knobs are judged
        # at their baseline values (it sets them itself).
        seen = dict(baseline)
        seen.update({k: v for k, v in combined.items() if k not in a.fix.overrides})
        if not all(condition_holds(c, seen, facts) for c in a.fix.conditions()):
            return None
    return {k: v for k, v in combined.items() if baseline.get(k) != v}


def propose(diagnosis: Diagnosis, job: JobSpec, knowledge: Knowledge, *, knobs: dict[str, KnobValue] | None = None,
            job_path: str = "", round_tag: str = "r1", max_candidates: int = 12,
            tried: list[dict[str, KnobValue]] = (), allow_needs: bool = True,
            baseline_dir: str | None = None, untuned_dir: str | None = None,
            diagnosis_file: str = "") -> Candidates:
    """Compose candidate setups for the run ``diagnosis`` describes, at baseline ``knobs``.

    ``tried`` holds full knob sets already measured; a setup that would repeat one is left out.
    ``allow_needs=False`` leaves out fixes that need resources beyond the budget. A diagnosis of
    another job's run is refused (``diagnosis_file`` names it in the message).
    """
    check_same_job(diagnosis_file or "diagnosis", diagnosis.job_name, job, job_path or None)
    baseline = dict(job.knobs if knobs is None else knobs)
    baseline.setdefault("rl_mode", diagnosis.rl_mode)
    facts = job_facts(job)
    rl_mode = diagnosis.rl_mode
    seconds = group_seconds(diagnosis)
    limiting = stage_group(diagnosis.limiting_stage, rl_mode)
    others = sorted((g for g in seconds if g != limiting), key=lambda g: -seconds[g])
    next_group = others[0] if others and seconds[others[0]] > 0 else None

    def applicable(fixes: Iterable[Fix]) -> list[ApplicableFix]:
        return [a for f in fixes for a in [applicable_fix(f, job, baseline, knowledge, facts)]
                if a is not None and (allow_needs or not f.needs)]

    slots: list[_Slot] = []
    unfixed: list[str] = []
    for problem in list(diagnosis.problems) + structural_problems(diagnosis):
        options = applicable(f for f in knowledge.fixes if problem.id in f.problems)
        group = stage_group(problem.stage, rl_mode)
        role = "bottleneck" if group == limiting else "next" if group == next_group else "also"
        if not options:
            unfixed.append(problem.id)
            continue
        slots.append(_Slot(problem, options, required=role in ("bottleneck", "next"), role=role))

    if not any(s.required and s.role == "bottleneck" for s in slots):
        # Nothing found in the limiting stage has a fix: let fixes that move its time stand in.
        stand_ins = applicable(f for f in knowledge.fixes if moves_group(f.moves, limiting))
        if stand_ins:
            placeholder = Problem(id=f"{limiting}_limits_step", stage="step", component="orchestrator",
                                  summary=f"{limiting} limits the step", severity=seconds.get(limiting, 0.0))
            slots.insert(0, _Slot(placeholder, stand_ins, required=True, role="bottleneck"))
    partner = overlap_partner(limiting, rl_mode, job)
    if partner is not None and not any(stage_group(s.problem.stage, rl_mode) == partner for s in slots):
        stand_ins = applicable(f for f in knowledge.fixes if moves_group(f.moves, partner) and not moves_group(f.moves, limiting))
        if stand_ins:
            placeholder = Problem(id=f"{partner}_shares_cores", stage="step", component="orchestrator",
                                  summary=f"{partner} runs beside {limiting} on the same devices and slows it",
                                  severity=min(seconds.get(partner, 0.0), seconds.get(limiting, 0.0)))
            slots.append(_Slot(placeholder, stand_ins, required=False, role="next" if partner == next_group else "also"))
    slots.sort(key=lambda s: ({"bottleneck": 0, "next": 1, "also": 2}[s.role], -s.problem.severity))

    choices = [s.options if s.required else [None, *s.options] for s in slots]
    tried_sets = [dict(t) for t in tried]
    composed: dict[tuple, tuple[float, list[ApplicableFix], dict[str, KnobValue], list[_Slot]]] = {}
    for combo in itertools.islice(itertools.product(*choices), MAX_COMBINATIONS):
        chosen: list[ApplicableFix] = []
        for a in combo:
            if a is not None and all(a.fix.id != c.fix.id for c in chosen):
                chosen.append(a)
        if not chosen:
            continue
        overrides = _combination_works(chosen, baseline, facts)
        if not overrides:
            continue
        if {**baseline, **overrides} in tried_sets:
            continue
        fixed = [s for s, a in zip(slots, combo, strict=True) if a is not None]
        # A fix chosen for one problem may also fix another slot's problem.
        fixed_ids = {a.fix.id for a in chosen}
        fixed = [s for s in slots if s in fixed or any(o.fix.id in fixed_ids for o in s.options)]
        coverage = sum(s.problem.severity for s in fixed)
        key = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
        if key not in composed or coverage > composed[key][0]:
            composed[key] = (coverage, chosen, overrides, fixed)

    ranked = sorted(composed.values(), key=lambda item: (
        -item[0], sum(bool(a.fix.needs) for a in item[1]), len(item[1]), [a.fix.id for a in item[1]]))
    candidates = [
        _candidate(f"{round_tag}-c{i + 1}", chosen, overrides, fixed, limiting, next_group)
        for i, (_, chosen, overrides, fixed) in enumerate(ranked[:max_candidates])
    ]
    return Candidates(
        schema_version=1, job=job_path, baseline_run=diagnosis.run_id, baseline_knobs=baseline,
        limiting_stage=limiting, candidates=candidates, next_stage=next_group,
        baseline_dir=baseline_dir, untuned_dir=untuned_dir, unfixed=sorted(set(unfixed)), job_name=job.name,
    )


def _candidate(cid: str, chosen: list[ApplicableFix], overrides: dict[str, KnobValue], fixed: list[_Slot],
               limiting: str, next_group: str | None) -> Candidate:
    by_role: dict[str, list[str]] = {"bottleneck": [], "next": [], "also": []}
    for slot in fixed:
        names = [a.fix.id for a in chosen if slot.problem.id in a.fix.problems or a in slot.options]
        by_role[slot.role].append(f"{'/'.join(names) or '?'} for {slot.problem.id}")
    parts = [f"fixes the bottleneck ({limiting}): " + "; ".join(by_role["bottleneck"])] if by_role["bottleneck"] else []
    if by_role["next"]:
        parts.append(f"fixes the next bottleneck ({next_group}): " + "; ".join(by_role["next"]))
    if by_role["also"]:
        parts.append("also: " + "; ".join(by_role["also"]))
    needs = sorted({n for a in chosen for n in a.fix.needs})
    if needs:
        parts.append("needs " + ", ".join(needs))
    risks = sorted({r for a in chosen for r in a.fix.risks})
    moves = sorted({m for a in chosen for m in a.fix.moves})
    return Candidate(id=cid, fixes=[a.fix.id for a in chosen], overrides=overrides, rationale=". ".join(parts),
                     needs=needs, targets=[s.problem.id for s in fixed], risks=risks, moves=moves)
