"""Reading the knowledge base against one job: which fixes apply, and what values they set.

A fix applies to a job at given knob values when every knob it sets is one the job can move (it has
a baseline value under job.yaml ``knobs`` and a ``launch.knob_map`` entry saying which of the job's
own keys sets it), its ``applies_when`` conditions hold, and it changes at least one value (a fix
already in effect is not proposed again).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltune.contracts.job import JobSpec, KnobValue
from rltune.contracts.knowledge import (
    SHIPPED_KNOWLEDGE,
    Condition,
    Fix,
    Knowledge,
    load_knowledge,
    parse_relative,
)
from rltune.errors import RltuneError

DEFAULT_KNOWLEDGE = SHIPPED_KNOWLEDGE


class KnowledgeError(RltuneError):
    """A fix cannot be applied to a job as written (e.g. a relative change of a text knob)."""


def load_default_knowledge(path: str | Path | None = None) -> Knowledge:
    """The knowledge base at ``path``, or the one shipped in presets/knowledge.yaml."""
    return load_knowledge(path or DEFAULT_KNOWLEDGE)


def job_facts(job: JobSpec) -> dict[str, Any]:
    """Dotted job facts conditions may name (``workload.kind``, ``model.moe``, ``gpus.count`` ...)."""
    facts: dict[str, Any] = {}
    for section in ("model", "workload", "gpus"):
        for key, value in vars(getattr(job, section)).items():
            facts[f"{section}.{key}"] = value
    return facts


def condition_holds(condition: Condition, knobs: dict[str, KnobValue], facts: dict[str, Any]) -> bool:
    """Evaluate one condition; a name the job does not have makes it false."""
    source = facts if "." in condition.name else knobs
    if condition.name not in source:
        return False
    actual = source[condition.name]
    expected = condition.value
    if condition.op == "==":
        return actual == expected
    if condition.op == "!=":
        return actual != expected
    if condition.op == "in":
        return actual in expected
    if isinstance(actual, bool) or not isinstance(actual, (int, float)):
        return False
    return {"<": actual < expected, "<=": actual <= expected, ">": actual > expected, ">=": actual >= expected}[condition.op]


def resolve_overrides(fix: Fix, knobs: dict[str, KnobValue], knowledge: Knowledge) -> dict[str, KnobValue]:
    """The absolute values ``fix`` sets, starting from ``knobs`` (relative changes clamped to min/max)."""
    resolved: dict[str, KnobValue] = {}
    for knob, value in fix.overrides.items():
        relative = parse_relative(value)
        if relative is None:
            resolved[knob] = value
            continue
        current = knobs.get(knob)
        if isinstance(current, bool) or not isinstance(current, (int, float)):
            raise KnowledgeError(f"fix {fix.id!r} changes knob {knob!r} by {value!r} but its value is {current!r}; "
                                 f"give the knob a numeric baseline in job.yaml 'knobs'")
        op, amount = relative
        new = {"*": current * amount, "/": current / amount, "+": current + amount, "-": current - amount}[op]
        info = knowledge.knobs[knob]
        if info.min is not None:
            new = max(new, info.min)
        if info.max is not None:
            new = min(new, info.max)
        resolved[knob] = int(round(new)) if info.type == "int" else float(new)
    return resolved


@dataclass(frozen=True)
class ApplicableFix:
    """A fix that applies at given knob values, with the values it would set."""

    fix: Fix
    values: dict[str, KnobValue]


def applicable_fix(fix: Fix, job: JobSpec, knobs: dict[str, KnobValue], knowledge: Knowledge,
                   facts: dict[str, Any] | None = None) -> ApplicableFix | None:
    """``fix`` resolved at ``knobs``, or None when it does not apply (see the module docstring)."""
    if any(knob not in knobs or knob not in job.launch.knob_map for knob in fix.overrides):
        return None
    facts = job_facts(job) if facts is None else facts
    if not all(condition_holds(c, knobs, facts) for c in fix.conditions()):
        return None
    values = resolve_overrides(fix, knobs, knowledge)
    if all(knobs.get(k) == v for k, v in values.items()):
        return None
    return ApplicableFix(fix, values)


def expressible_fixes(job: JobSpec, knowledge: Knowledge) -> list[Fix]:
    """Fixes whose every knob the job can move (ignoring conditions): what tuning can ever try."""
    return [f for f in knowledge.fixes if all(k in job.knobs and k in job.launch.knob_map for k in f.overrides)]
