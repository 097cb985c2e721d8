"""Knob effects learned from measured pairs: earlier runs that measured one change.

Two ok cases of the same job (equal identity, see :meth:`Setup.identity`) whose settings differ in
exactly one setting form a *pair*; it measured that setting's effect on every stage and on the
step. Repeats of one setup are averaged first (in log space), so noise shrinks as runs repeat.

:func:`knob_effects` builds a :class:`KnobEffects` table; ``lookup(setting, a, b, identity)``
returns the log-ratios for the change a -> b (same job preferred, then any job), and
``elasticity(setting, identity)`` the median d log(time) / d log(value) of a numeric setting, for
values no pair measured. :attr:`KnobEffects.repeat_noise` is the pooled run-to-run spread of the
step (log space) from repeated setups, the noise floor of every forecast range.

A public run whose source published only some stages (often the step alone) measured the change
of those: a stage neither side of a pair published moves with the step the pair measured.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rltune.predict.setup import Setup, setup_from_case
from rltune.predict.theory import case_step, known_stages

if TYPE_CHECKING:
    from rltune.contracts.cases import CaseRecord

MEASURES = ("rollout", "training", "weight_sync", "step")
EPS_S = 1e-3
DEFAULT_REPEAT_NOISE = 0.03
MIN_REPEAT_NOISE = 0.005
NOISE_PRIOR_DOF = 2


@dataclass
class Effect:
    """Measured change a -> b: mean log-ratio per measure, its spread and how many pairs."""

    log_ratio: dict[str, float]
    spread: float
    pairs: int
    same_job: bool
    contexts: frozenset[str] = frozenset()  # Setup.key() of each setup the change was measured from


@dataclass
class KnobEffects:
    by_job: dict[tuple, list[dict[str, float]]] = field(default_factory=lambda: defaultdict(list))
    by_setting: dict[tuple, list[dict[str, float]]] = field(default_factory=lambda: defaultdict(list))
    slopes: dict[tuple, list[dict[str, float]]] = field(default_factory=lambda: defaultdict(list))
    repeat_noise: float = DEFAULT_REPEAT_NOISE
    repeat_groups: int = 0
    # identity -> (sum of squared log deviations, degrees of freedom) of that job's repeated setups
    job_noise: dict[tuple, tuple[float, int]] = field(default_factory=dict)
    _memo: dict = field(default_factory=dict)

    def lookup(self, setting: str, a: Any, b: Any, identity: tuple | None = None) -> Effect | None:
        key = (setting, _key(a), _key(b))
        memo_key = (identity, *key)
        if memo_key not in self._memo:
            found = None
            if identity is not None and self.by_job.get((identity, *key)):
                found = _summarise(self.by_job[(identity, *key)], True, self.repeat_noise)
            elif self.by_setting.get(key):
                found = _summarise(self.by_setting[key], False, self.repeat_noise)
            self._memo[memo_key] = found
        return self._memo[memo_key]

    def noise_for(self, identity: tuple | None) -> float:
        """Run-to-run noise of the step (log space) for one job.

        Jobs differ (multi-turn tool use varies more than single-turn math), so a job's own repeats
        count, shrunk towards the pooled figure by :data:`NOISE_PRIOR_DOF` degrees of freedom -- two
        repeats alone are too few to trust.
        """
        found = self.job_noise.get(identity) if identity is not None else None
        if not found:
            return self.repeat_noise
        squares, dof = found
        return max(math.sqrt((squares + NOISE_PRIOR_DOF * self.repeat_noise ** 2) / (dof + NOISE_PRIOR_DOF)), MIN_REPEAT_NOISE)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON form (tuple keys as lists), for the cache beside the library."""
        return {
            "by_job": [[list(k[0]), *k[1:], v] for k, v in self.by_job.items()],
            "by_setting": [[*k, v] for k, v in self.by_setting.items()],
            "slopes": [[None if k[0] is None else list(k[0]), k[1], v] for k, v in self.slopes.items()],
            "repeat_noise": self.repeat_noise, "repeat_groups": self.repeat_groups,
            "job_noise": [[list(k), v[0], v[1]] for k, v in self.job_noise.items()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KnobEffects:
        out = cls(repeat_noise=float(data["repeat_noise"]), repeat_groups=int(data["repeat_groups"]))
        for identity, name, a, b, samples in data["by_job"]:
            out.by_job[(tuple(identity), name, a, b)] = samples
        for name, a, b, samples in data["by_setting"]:
            out.by_setting[(name, a, b)] = samples
        for identity, name, samples in data["slopes"]:
            out.slopes[(None if identity is None else tuple(identity), name)] = samples
        for identity, squares, dof in data["job_noise"]:
            out.job_noise[tuple(identity)] = (float(squares), int(dof))
        return out

    def elasticity(self, setting: str, identity: tuple | None = None) -> dict[str, float] | None:
        """Median d log(time) / d log(value) per measure over pairs of a numeric setting."""
        samples = self.slopes.get((identity, setting)) or self.slopes.get((None, setting))
        if not samples:
            return None
        return {m: statistics.median(s[m] for s in samples) for m in MEASURES}


def _key(value: Any) -> str:
    # repr keeps True apart from 1 and "1" apart from 1, and is much cheaper than JSON on 1,000 cases
    return repr(value)


def _summarise(samples: list[dict[str, float]], same_job: bool, noise: float) -> Effect:
    mean = {m: statistics.fmean(s[m] for s in samples) for m in MEASURES}
    step = [s["step"] for s in samples]
    spread = statistics.stdev(step) if len(step) > 1 else 0.0
    # Each side of a pair carries run-to-run noise; more pairs average it down.
    spread = math.sqrt(spread ** 2 + 2 * noise ** 2 / len(samples))
    if not same_job:
        spread = math.sqrt(spread ** 2 + 0.05 ** 2)  # another job's change transfers only roughly
    return Effect(mean, spread, len(samples), same_job, frozenset(str(s["from"]) for s in samples if "from" in s))


def knob_effects(cases: Sequence[CaseRecord], *, setups: Sequence[Setup] | None = None) -> KnobEffects:
    """Learn single-setting effects from every pair of ok cases that differ in one setting.

    ``setups`` (``setup_from_case`` of each case, in order) saves rebuilding them when the caller has them.
    """
    groups: dict[tuple, list[CaseRecord]] = defaultdict(list)
    settings_of: dict[tuple, dict[str, Any]] = {}
    context_of: dict[tuple, str] = {}
    for index, case in enumerate(cases):
        if not case.usable or case_step(case) is None:
            continue
        setup = setups[index] if setups is not None else setup_from_case(case)
        settings = setup.settings()
        full = (setup.identity(), tuple(sorted((k, _key(v)) for k, v in settings.items())))
        groups[full].append(case)
        settings_of[full] = settings
        context_of[full] = setup.key()
    effects = KnobEffects()
    # Repeats: identical setups, averaged in log space; their spread is the run-to-run noise.
    means: dict[tuple, dict[str, float]] = {}
    deviations: list[float] = []
    for full, members in groups.items():
        values = [{**known_stages(c), "step": case_step(c)} for c in members]
        logs = {m: [math.log(v[m] + EPS_S) for v in values if v[m] is not None] for m in MEASURES}
        means[full] = {m: statistics.fmean(v) if len(v) == len(values) else None for m, v in logs.items()}
        if len(members) > 1:
            step = logs["step"]
            centre = statistics.fmean(step)
            deviations += [(x - centre) ** 2 * len(step) / (len(step) - 1) for x in step]
            effects.repeat_groups += 1
            squares, dof = effects.job_noise.get(full[0], (0.0, 0))
            effects.job_noise[full[0]] = (squares + sum((x - centre) ** 2 for x in step), dof + len(step) - 1)
    if deviations:
        effects.repeat_noise = max(math.sqrt(statistics.fmean(deviations)), MIN_REPEAT_NOISE)
    # Pairs differing in exactly one setting: bucket by identity + settings minus one key.
    buckets: dict[tuple, list[tuple]] = defaultdict(list)
    for full in means:
        identity, items = full
        for i, (name, _) in enumerate(items):
            buckets[(identity, name, items[:i] + items[i + 1:])].append(full)
    for (identity, name, _rest), members in buckets.items():
        for i, x in enumerate(members):
            for y in members[i + 1:]:
                a, b = settings_of[x].get(name), settings_of[y].get(name)
                diff: dict[str, Any] = {m: means[y][m] - means[x][m] if means[y][m] is not None and means[x][m] is not None
                                        else means[y]["step"] - means[x]["step"] for m in MEASURES}
                back: dict[str, Any] = {m: -v for m, v in diff.items()}
                diff["from"], back["from"] = context_of[x], context_of[y]
                for job_key, sample in (((identity, name, _key(a), _key(b)), diff), ((identity, name, _key(b), _key(a)), back)):
                    effects.by_job[job_key].append(sample)
                    effects.by_setting[job_key[1:]].append(sample)
                if _positive(a) and _positive(b) and a != b:
                    span = math.log(float(b) / float(a))
                    slope: dict[str, Any] = {m: diff[m] / span for m in MEASURES}
                    effects.slopes[(identity, name)].append(slope)
                    effects.slopes[(None, name)].append(slope)
    return effects


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


__all__ = ["Effect", "KnobEffects", "knob_effects"]
