"""A setup to forecast or a measured one, as the predictor sees it, and the distance between two.

A :class:`Setup` is a job's identity (job name, model, workload, device, GPU count), its facts
(parameters, batch, answer cap, ...) and its knobs (``rl_mode`` among them). Targets come from
``job.yaml`` + overrides (:func:`setup_from_job`), cases from the library (:func:`setup_from_case`).

Similarity follows the seed: every setting that differs adds its weight to a distance --
a categorical mismatch adds ``weight`` (an MTP mismatch 0.8), a numeric one adds
``weight x |log2(a / b)|`` (so a batch of 384 against 256 adds 0.5 x 0.585). The score of a case
is ``exp(-distance / 2)``. :data:`SETTING_WEIGHTS` holds the weights; settings not listed use
:data:`DEFAULT_CATEGORICAL_WEIGHT` / :data:`DEFAULT_NUMERIC_WEIGHT`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rltune.predict.library import job_facts

if TYPE_CHECKING:
    from rltune.contracts.cases import CaseRecord
    from rltune.contracts.job import JobSpec

# Setting -> (kind, weight). 'num' weights are per doubling. Identity settings first.
SETTING_WEIGHTS: dict[str, tuple[str, float]] = {
    # identity and facts
    "model": ("cat", 2.0),
    "workload": ("cat", 3.0),
    "device": ("cat", 2.0),
    "gpus": ("num", 0.6),
    "active_params": ("num", 0.6),
    "total_params": ("num", 0.3),
    "batch": ("num", 0.5),
    "trials_per_task": ("num", 0.2),
    "answer_cap_tokens": ("num", 0.5),
    "context_limit_tokens": ("num", 0.2),
    "model_dtype": ("cat", 0.5),
    # knobs of the reference workload
    "rl_mode": ("cat", 1.0),
    "max_sample_age": ("num", 0.1),
    "micro_batch_size": ("num", 0.3),
    "packing": ("cat", 0.3),
    "grad_checkpointing": ("cat", 0.3),
    "reuse_rollout_logprobs": ("cat", 0.3),
    "engine_max_concurrency": ("num", 0.3),
    "engine_batching": ("cat", 0.4),
    "num_engines": ("num", 0.4),
    "engine_compile": ("cat", 0.3),
    "sandbox_pool_size": ("num", 0.3),
    "prebuilt_image": ("cat", 0.3),
    "sync_transport": ("cat", 0.3),
    # knobs of large real jobs
    "trainer_gpus": ("num", 0.6),
    "rollout_gpus": ("num", 0.6),
    "trainer_tp": ("num", 0.3),
    "engine_tp": ("num", 0.3),
    "kv_cache_dtype": ("cat", 0.3),
    "weight_dtype": ("cat", 0.6),
    "chunked_prefill": ("cat", 0.2),
    "pd_disaggregation": ("cat", 0.6),
    "mtp": ("cat", 0.8),
    "sandbox_hosts": ("num", 0.3),
    "session_server_workers": ("num", 0.2),
    "dynamic_batching": ("cat", 0.3),
    # the layout and software of large jobs (imported public runs name them)
    "trainer_pp": ("num", 0.3),
    "trainer_cp": ("num", 0.3),
    "trainer_ep": ("num", 0.3),
    "trainer_dp": ("num", 0.3),
    "colocated": ("cat", 0.6),
    "train_dtype": ("cat", 0.6),
    "train_batch_samples": ("num", 0.3),
    "tokens_per_step": ("num", 0.5),
    "lora_rank": ("cat", 0.5),
    "activation_checkpointing": ("cat", 0.3),
    "attention_kernel": ("cat", 0.3),
    "objective": ("cat", 0.6),
    "algorithm": ("cat", 1.0),
    "release": ("cat", 0.5),
}
DEFAULT_CATEGORICAL_WEIGHT = 0.5
DEFAULT_NUMERIC_WEIGHT = 0.3
IDENTITY = ("job", "model", "workload", "device", "gpus", "batch", "trials_per_task", "answer_cap_tokens")


@dataclass
class Setup:
    """What the predictor compares: identity, facts and knobs of one (planned or measured) run."""

    job: str
    model: str
    workload: str
    device: str
    gpus: int
    facts: dict[str, Any] = field(default_factory=dict)
    knobs: dict[str, Any] = field(default_factory=dict)
    # settings() is asked for thousands of times per forecast; a Setup is not changed after it is
    # made (with_knobs / with_setting return copies), so the dict is built once and shared.
    _settings: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    _identity: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _key: str | None = field(default=None, init=False, repr=False, compare=False)
    _moves: dict | None = field(default=None, init=False, repr=False, compare=False)  # with_setting results, reused

    @property
    def rl_mode(self) -> str:
        return str(self.knobs.get("rl_mode", "sync"))

    def settings(self) -> dict[str, Any]:
        """Every comparable setting: identity, facts (batch = tasks x trials) and knobs. Read-only (shared)."""
        if self._settings is not None:
            return self._settings
        facts = self.facts
        out: dict[str, Any] = {"model": self.model, "workload": self.workload, "device": self.device, "gpus": self.gpus}
        if "tasks_per_batch" in facts and "trials_per_task" in facts:
            out["batch"] = facts["tasks_per_batch"] * facts["trials_per_task"]
        elif "samples_per_step" in facts:
            out["batch"] = facts["samples_per_step"]
        # a source's measured mean sequence length (``sequence_tokens``) is a fact the theory reads, not a setting: it moves a
        # little from run to run, and as a setting it would keep two releases of one setup from forming a measured pair
        for name in ("trials_per_task", "answer_cap_tokens", "context_limit_tokens", "active_params", "total_params", "model_dtype",
                     "tokens_per_step"):
            if name in facts:
                out[name] = facts[name]
        for name, value in self.knobs.items():
            out[name] = value
        self._settings = out
        return out

    def key(self) -> str:
        """A text equal for two setups exactly when all their settings are equal (a memo key)."""
        if self._key is None:
            self._key = repr(sorted(self.settings().items(), key=lambda kv: kv[0]))
        return self._key

    def identity(self) -> tuple:
        """Runs with equal identity and RL mode are 'the same job' and may anchor each other."""
        if self._identity is None:
            s = self.settings()
            self._identity = (self.job, *(s.get(k) for k in IDENTITY[1:]))
        return self._identity

    def with_knobs(self, **changes: Any) -> Setup:
        return Setup(self.job, self.model, self.workload, self.device, self.gpus, dict(self.facts), {**self.knobs, **changes})

    def with_setting(self, name: str, value: Any) -> Setup:
        """A copy with one setting changed (a knob, or a fact such as 'batch'); the same change gives the same copy."""
        if self._moves is None:
            self._moves = {}
        move = (name, repr(value))
        if move not in self._moves:
            self._moves[move] = self._with_setting(name, value)
        return self._moves[move]

    def _with_setting(self, name: str, value: Any) -> Setup:
        if name in self.knobs or name not in ("model", "workload", "device", "gpus", "batch", *self.facts):
            return self.with_knobs(**{name: value})
        new = Setup(self.job, self.model, self.workload, self.device, self.gpus, dict(self.facts), dict(self.knobs))
        if name == "batch" and "samples_per_step" in new.facts and "trials_per_task" not in new.facts:
            new.facts["samples_per_step"] = value
        elif name == "batch":
            new.facts["tasks_per_batch"] = value / new.facts.get("trials_per_task", 1)
        elif name in ("model", "workload", "device", "gpus"):
            setattr(new, name, value)
        else:
            new.facts[name] = value
        return new


def setup_from_job(job: JobSpec, knobs: dict[str, Any] | None = None) -> Setup:
    return Setup(job.name, job.model.name, job.workload.kind, job.gpus.device, job.gpus.count,
                 job_facts(job), {**job.knobs, **(knobs or {})})


def setup_from_case(case: CaseRecord) -> Setup:
    """The case's setup; an imported public run's release is one of its settings (runs of two releases differ in it)."""
    knobs = {**case.knobs, "rl_mode": case.rl_mode}
    if case.release is not None:
        knobs["release"] = case.release
    return Setup(case.job, case.model, case.workload, case.device, case.gpus, dict(case.facts), knobs)


def setting_weight(name: str, value: Any) -> tuple[str, float]:
    if name in SETTING_WEIGHTS:
        return SETTING_WEIGHTS[name]
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ("num", DEFAULT_NUMERIC_WEIGHT) if numeric else ("cat", DEFAULT_CATEGORICAL_WEIGHT)


def setting_distance(name: str, a: Any, b: Any) -> float:
    """What one setting adds to the distance (0 when equal)."""
    if a == b:
        return 0.0
    kind, weight = setting_weight(name, a if a is not None else b)
    if a is None or b is None:
        return weight if kind == "cat" else weight * 2.0  # one side unknown: count as a clear difference
    if kind == "num" and _positive(a) and _positive(b):
        return weight * abs(math.log2(float(a) / float(b)))
    return weight


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def differences(target: Setup, case: Setup) -> dict[str, tuple[Any, Any]]:
    """Settings whose values differ: name -> (case value, target value)."""
    t, c = target.settings(), case.settings()
    return {k: (c.get(k), t.get(k)) for k in sorted(set(t) | set(c)) if t.get(k) != c.get(k)}


def distance(target: Setup, case: Setup) -> float:
    return sum(setting_distance(k, a, b) for k, (a, b) in differences(target, case).items())


def score(d: float) -> float:
    """The seed's similarity score: 1 for an identical run, lower the more it differs."""
    return math.exp(-d / 2.0)


__all__ = ["SETTING_WEIGHTS", "Setup", "differences", "distance", "score", "setting_distance", "setup_from_case", "setup_from_job"]
