"""Is learning checked before a tuned preset is written? Which kept changes alter it, and what a failed check bans.

A kept change *alters what is learned per fresh sample* when one of its fixes says so in the
knowledge base (``risks: [reward]``: an RL mode that trains on older samples, a higher sample age,
batch reuse, generating several steps at once) or is not in the knowledge base at all (nothing
says it does not). Such a preset is checked with the reward check before ``rltune auto`` writes it
(``--reward-check STEPS``), or is written marked "learning unchecked".

A check that fails bans, for the job, the knob values of the change it blamed
(:func:`bans_of`): a single knob of a bundle when undoing that knob alone made the tuned setup
pass, else the whole change; when no single change was to blame, every learning change together.
The bans go to the case library's ``learning-checks.yaml`` (:mod:`rltune.contracts.learning`), which
every ``auto`` of that job on that library reads before it picks a candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rltune.contracts.job import KnobValue
from rltune.contracts.learning import LearningBan

if TYPE_CHECKING:
    from rltune.contracts.knowledge import Knowledge
    from rltune.contracts.reward_check import RewardCheck
    from rltune.tune.journal import JournalState
    from rltune.tune.reward_check import KeptChange

LEARNING_RISK = "reward"


def alters_learning(fixes: list[str], knowledge: Knowledge) -> bool:
    """Whether a change made of these fixes alters what is learned per fresh sample (see the module docstring)."""
    known = {f.id: f for f in knowledge.fixes}
    return any(fix not in known or LEARNING_RISK in known[fix].risks for fix in fixes)


@dataclass
class LearningChange:
    """A kept change that alters learning: its label (as the reward check names it) and the knob values it set."""

    label: str
    fixes: list[str]
    knobs: dict[str, KnobValue]


def learning_changes(state: JournalState, knowledge: Knowledge, untuned_knobs: dict[str, KnobValue],
                     best_knobs: dict[str, KnobValue]) -> list[LearningChange]:
    """The kept changes of the journal (those the best setup still holds) that alter learning, in order."""
    from rltune.tune.reward_check import kept_changes

    by_label = {}
    for trial in state.trials:
        by_label[f"{trial.run_id} ({'+'.join(trial.fixes) or trial.candidate})"] = trial
    out = []
    for change in kept_changes(state, untuned_knobs, best_knobs):
        trial = by_label.get(change.label)
        fixes = list(trial.fixes) if trial is not None else []
        if alters_learning(fixes, knowledge):
            out.append(LearningChange(change.label, fixes, {k: best_knobs[k] for k in change.reverted}))
    return out


def bans_of(check: RewardCheck, changes: list[KeptChange], tuned_knobs: dict[str, KnobValue],
            learning: list[LearningChange]) -> list[LearningBan]:
    """What a failed check bans (see the module docstring); nothing for a check that passed."""
    if check.decision != "fail":
        return []
    bans: list[LearningBan] = []
    blamed = set(check.blamed)
    for change in changes:
        knob_blamed = [k for k in change.reverted if f"{change.label}: {k}" in blamed]
        if knob_blamed:
            bans += [LearningBan(f"{change.label}: {k}", {k: tuned_knobs[k]}) for k in knob_blamed]
        elif change.label in blamed:
            bans.append(LearningBan(change.label, {k: tuned_knobs[k] for k in change.reverted}))
    if not bans and learning:
        together = {k: v for c in learning for k, v in c.knobs.items()}
        bans.append(LearningBan(" + ".join(c.label for c in learning) + " (together)", together))
    return bans


def banned_settings(bans: list[dict[str, Any]]) -> list[set[tuple[str, Any]]]:
    """Bans as the sets of knob values :func:`rltune.tune.pick.pick` refuses."""
    return [set(b.items()) for b in bans if b]


__all__ = ["LEARNING_RISK", "LearningChange", "alters_learning", "banned_settings", "bans_of", "learning_changes"]
